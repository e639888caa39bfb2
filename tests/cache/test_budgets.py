"""Cache budgets: numbers pass through, None is unbounded, "auto" bounds a GPU engine's tiers by
what is free there and a CPU engine's device tier by the memory available (its host tier empty);
anything else is refused by name."""

import pytest
import torch

from hypic.cache import budgets
from hypic.cache.budgets import AUTO, available_memory_bytes, physical_memory_bytes, resolve, resolve_host_dtype


def test_numbers_none_and_auto_on_the_cpu(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert resolve(123, "device", cpu) == 123 and resolve(None, "host", cpu) is None
    available = available_memory_bytes()
    assert available is not None and 2**28 < available <= physical_memory_bytes()  # read off this Linux machine
    # half of what is available (read at each call: other processes move it a little between reads)
    assert abs(resolve(AUTO, "device", cpu) - budgets.DEVICE_FRACTION * available) < 2**28
    assert resolve(AUTO, "host", cpu) == 0  # the same memory: a demotion would keep the same bytes
    monkeypatch.setattr(budgets, "available_memory_bytes", lambda: 10 * 2**30)
    assert resolve(AUTO, "device", cpu) == int(budgets.DEVICE_FRACTION * 10 * 2**30)
    monkeypatch.setattr(budgets, "available_memory_bytes", lambda: None)  # not known: unbounded
    assert resolve(AUTO, "device", cpu) is None
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
    _, total = torch.cuda.mem_get_info(engine.device)  # not free: tests in other processes share the GPU
    device_budget = engine.store.budgets["device"]
    assert device_budget is not None and 0 < device_budget <= total // 2
    assert engine.store.budgets["host"] is not None
    assert engine.store.host_dtype is torch.bfloat16  # the host tier's summaries: "auto" on a GPU


def test_a_cpu_engine_on_auto_budgets_evicts_instead_of_growing(monkeypatch) -> None:
    """The CPU's auto device tier is a real bound: documents past it push the least recently used out
    (nothing demoted: the host tier holds nothing), and a document still held is served from the cache."""
    from hypic.bench.shapes import SHAPES
    from hypic.engine.engine import Engine
    from hypic.models.random_init import random_model

    loaded = random_model(SHAPES["tiny"], device="cpu", dtype=torch.float32)
    probe = Engine(loaded, seam=4, cache_device_bytes=None)
    probe.prewarm([list(range(30))])
    entry = probe.store.stats().bytes["device"]  # one 30-token document's entry
    monkeypatch.setattr(budgets, "available_memory_bytes", lambda: int(7 * entry))  # auto: room for three
    engine = Engine(loaded, seam=4)
    assert engine.store.budgets == {"device": int(3.5 * entry), "host": 0}
    docs = [[(7 * i + j) % 200 + 1 for j in range(30)] for i in range(6)]
    for doc in docs:  # one call each (a call's own entries are pinned while it runs)
        engine.prewarm([doc])
    stats = engine.store.stats()
    assert stats.bytes["device"] <= int(3.5 * entry) and stats.bytes["host"] == 0
    assert stats.evictions == 3 and stats.demotions == 0
    hits = stats.hits
    engine.prewarm(docs[-1:])  # the newest is still held
    assert engine.store.stats().hits == hits + 1
    assert engine.store.check_integrity()


def test_a_containers_memory_limit_bounds_what_is_available(tmp_path) -> None:
    """The CPU's auto budget reads what the container's limit leaves (cgroup v2 or v1), not only the
    machine's free memory: a container is killed at its limit."""
    from hypic.cache.budgets import cgroup_room_bytes

    def files(limit: str, usage: str) -> tuple[tuple[str, str], ...]:
        (tmp_path / "max").write_text(limit)
        (tmp_path / "current").write_text(usage)
        return ((str(tmp_path / "max"), str(tmp_path / "current")),)

    assert cgroup_room_bytes(files("1073741824\n", "268435456\n")) == 3 << 28
    assert cgroup_room_bytes(files("max\n", "268435456\n")) is None  # v2: no limit
    assert cgroup_room_bytes(files("9223372036854771712\n", "5\n")) is None  # v1: no limit
    assert cgroup_room_bytes(files("100\n", "200\n")) == 0
    assert cgroup_room_bytes(((str(tmp_path / "none"), str(tmp_path / "none")),)) is None
