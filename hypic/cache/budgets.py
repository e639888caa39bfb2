"""Cache budgets when the user names none ("auto").

An unbounded tier grows with every new document until its memory runs out: on the H200 a
2 048-document pool of the 9B shape (≈ 105 MB an entry) ran the device out of memory
(docs/benchmarks.md). So on a GPU the defaults are bounded. The device tier takes half the memory
free once the model is loaded; the other half holds decode states, activations and the
allocator's slack (measured: a 60 GiB store beside the 9B model — half of what was free — peaked at
105.7 GiB of 140 while serving the trace). Opt-in cold graphs (``HYPIC_COLD_GRAPHS=1``) take their
pools out of that other half, so the engine lowers an auto device budget by half of what they hold
(``ColdPrefill._fit_cache_to_cold_graphs``): without it, 32 GiB of them ran the 9B trace out of memory.
The host tier takes a quarter of physical memory: on a
GPU machine its pages are pinned (asynchronous copies), and pinned pages cannot be swapped.

A CPU engine is bounded too (it was not, and a server left running grew with every new document
until the kernel killed it — a CPU process gets no out-of-memory error to shed on): its "device"
tier is host memory, and takes half the memory available once the model is loaded; its host tier
holds nothing, because a demotion there would keep the same bytes in the same memory.

The host tier's summaries default ("auto") to bfloat16 on a GPU: they are most of an entry (96 of
≈ 105 MiB at the 9B shape), so the tier holds nearly twice the entries; rounded once on the way
down, they changed no task score of the bundled model and left its first-token KL to `full` where
fp32 had it, while a 1 024-document trace went from ≈ 16–24 to 24 sustained QPS with 2.7–4.4× lower
p50 TTFT at 24 (docs/benchmarks.md, session 20). On the CPU nothing is demoted across a bus (both tiers
are host memory), so "auto" keeps fp32 there: exact, and what the CPU tests check.
"""

from __future__ import annotations

import os

import torch

from hypic.cache.layout import HOST_DTYPES

AUTO = "auto"
DEVICE_FRACTION = 0.5  # of the device memory free after the model is loaded (a CPU: memory available)
HOST_FRACTION = 0.25  # of physical memory

Budget = int | str | None  # bytes, "auto", or None (unbounded)


def resolve_host_dtype(value: str | None, device: torch.device) -> torch.dtype | None:
    """The host tier's summary dtype (None: fp32, as on the device) from a name, "auto" or None."""
    if value is None:
        return None
    if value == AUTO:
        return torch.bfloat16 if device.type == "cuda" else None
    if not isinstance(value, str) or value not in HOST_DTYPES:
        raise ValueError(f"cache_host_dtype: expected one of {list(HOST_DTYPES)}, 'auto' or None, got {value!r}")
    return HOST_DTYPES[value]


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no bound known
        return None


CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
                ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def cgroup_room_bytes(files: tuple[tuple[str, str], ...] = CGROUP_FILES) -> int | None:
    """What the container's memory limit leaves (limit − usage), or None with no limit: a container
    is killed at its limit whatever the machine has free."""
    for limit_file, usage_file in files:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes ~2⁶³ for no limit
            return max(0, limit - usage)
    return None


def available_memory_bytes() -> int | None:
    """Memory a process can still take without swapping: Linux's MemAvailable (free pages plus the
    page cache it can drop), else the free pages, else None (not known); never more than the
    container's memory limit leaves."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            pass
    room = cgroup_room_bytes()
    return room if available is None else available if room is None else min(available, room)


def resolve(value: Budget, tier: str, device: torch.device) -> int | None:
    """A tier's budget in bytes (None: unbounded) from what the user passed."""
    name = f"cache_{tier}_bytes"
    if value is None:
        return None
    if value == AUTO:
        if device.type != "cuda":
            if tier == "host":
                return 0
            available = available_memory_bytes()
            return None if available is None else int(DEVICE_FRACTION * available)
        if tier == "device":
            free, _ = torch.cuda.mem_get_info(device)
            return int(DEVICE_FRACTION * free)
        ram = physical_memory_bytes()
        return None if ram is None else int(HOST_FRACTION * ram)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}: expected a non-negative integer, 'auto' or None, got {value!r}")
    return value
