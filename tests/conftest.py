"""Shared test setup: GPU-marked tests run only where CUDA and flash-linear-attention exist; one tiny
trained checkpoint for the tests that need a real (if barely trained) model folder."""

import importlib.util
import os
import zlib

import pytest
import torch


def _shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``HYPIC_TEST_SHARD=k/n``: only the test files whose path hashes to k of n (a file whole, so its
    module-scoped fixtures are built once) — the GPU suite in calls that each fit the device's limit."""
    spec = os.environ.get("HYPIC_TEST_SHARD")
    if not spec:
        return
    try:
        k, n = (int(x) for x in spec.split("/"))
        assert 0 <= k < n
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"HYPIC_TEST_SHARD: expected k/n with 0 <= k < n, got {spec!r}") from None
    keep = [i for i in items if zlib.crc32(i.nodeid.split("::")[0].encode()) % n == k]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _shard(config, items)
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
