"""Shared test setup: GPU-marked tests run only where CUDA and flash-linear-attention exist."""

import importlib.util

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have_gpu = torch.cuda.is_available() and importlib.util.find_spec("fla") is not None
    skip = pytest.mark.skip(reason="needs CUDA and flash-linear-attention (scripts/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords and not have_gpu:
            item.add_marker(skip)
