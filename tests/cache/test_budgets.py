"""Cache budgets: numbers pass through, None is unbounded, "auto" bounds a GPU engine's tiers by
what is free there and leaves a CPU engine's unbounded; anything else is refused by name."""

import pytest
import torch

from hypic.cache import budgets
from hypic.cache.budgets import AUTO, physical_memory_bytes, resolve, resolve_host_dtype


def test_numbers_none_and_auto_on_the_cpu() -> None:
    cpu = torch.device("cpu")
    assert resolve(123, "device", cpu) == 123 and resolve(None, "host", cpu) is None
    assert resolve(AUTO, "device", cpu) is None and resolve(AUTO, "host", cpu) is None  # as before "auto"
    for bad in ("lots", -1, 1.5, True):
        with pytest.raises(ValueError, match="cache_device_bytes"):
            resolve(bad, "device", cpu)


def test_auto_on_a_gpu_takes_a_share_of_what_is_free(monkeypatch) -> None:
    """The arithmetic alone (a GPU's free memory stubbed); the GPU test below checks it for real."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * 2**30, 140 * 2**30))
    cuda = torch.device("cuda", 0)
    assert resolve(AUTO, "device", cuda) == int(budgets.DEVICE_FRACTION * 80 * 2**30)
    ram = physical_memory_bytes()
    assert ram is not None and ram > 2**30  # a Linux machine reports its memory
    assert resolve(AUTO, "host", cuda) == int(budgets.HOST_FRACTION * ram)
    assert resolve(7, "device", cuda) == 7 and resolve(None, "device", cuda) is None


def test_the_host_tier_dtype_auto_is_bfloat16_on_a_gpu_and_float32_on_the_cpu() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # resolving reads only the device's type
    assert resolve_host_dtype(AUTO, cpu) is None and resolve_host_dtype(AUTO, cuda) is torch.bfloat16
    assert resolve_host_dtype(None, cuda) is None and resolve_host_dtype("float32", cuda) is torch.float32
    assert resolve_host_dtype("float16", cpu) is torch.float16
    for bad in ("int8", "bf16", 16, torch.bfloat16):
        with pytest.raises(ValueError, match="cache_host_dtype"):
            resolve_host_dtype(bad, cpu)


@pytest.mark.gpu
def test_an_engine_on_a_gpu_is_bounded_by_default() -> None:
    from hypic.bench.shapes import SHAPES
    from hypic.engine.engine import Engine
    from hypic.models.random_init import random_model

    engine = Engine(random_model(SHAPES["tiny"], device="cuda", dtype=torch.bfloat16))
    free, _ = torch.cuda.mem_get_info(engine.device)
    device_budget = engine.store.budgets["device"]
    assert device_budget is not None and 0 < device_budget <= free
    assert engine.store.budgets["host"] is not None
    assert engine.store.host_dtype is torch.bfloat16  # the host tier's summaries: "auto" on a GPU
