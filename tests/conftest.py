"""Shared test setup: GPU-marked tests run only where CUDA and flash-linear-attention exist; one tiny
trained checkpoint for the tests that need a real (if barely trained) model folder."""

import importlib.util

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have_gpu = torch.cuda.is_available() and importlib.util.find_spec("fla") is not None
    skip = pytest.mark.skip(reason="needs CUDA and flash-linear-attention (scripts/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords and not have_gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_trained_model(tmp_path_factory):
    """A real 4-layer training checkpoint (weights, Adam moments, state, tokenizer) after 3 CPU steps.
    Read-only for its users: tests that change a checkpoint write a copy."""
    from hypic.eval.tokenizer import corpus, train_tokenizer
    from hypic.train.loop import main as train

    root = tmp_path_factory.mktemp("tiny_model")
    tok = train_tokenizer(corpus(5, [-1], difficulties=(0.0,)), 512)
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    train(["--out", str(root / "model"), "--tokenizer", str(root / "tok"), "--preset", "tiny", "--device", "cpu",
           "--batch-tokens", "800", "--workers", "0", "--total-steps", "3", "--log-every", "1"])
    return root / "model"
