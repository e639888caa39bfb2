"""Where a request makes the host wait for the GPU.

A host↔device sync in the middle of a forward (``.item()``, ``.tolist()``, a copy from pageable
memory, ``nonzero``) stops the host from queueing kernels ahead, so host and device time add up
instead of overlapping. CUDA's sync debug mode flags every such call; this collects them per
source line (the innermost hypic frame) for one request of each kind.
"""

from __future__ import annotations

import collections
import traceback
import warnings

import torch

from hypic.bench.sites import package_path
from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams


def _site() -> str:
    for f in reversed(traceback.extract_stack()[:-2]):  # this function and its caller left out
        path = package_path(f.filename)
        if path is not None and not path.startswith("bench/"):
            return f"{path}:{f.lineno} {f.line}"
    return "(outside hypic)"


def sync_sites(engine: Engine, prompt: list[list[int]], modes: tuple[str, ...]) -> dict[str, collections.Counter]:
    """{mode: Counter(source line → syncs)} for one first-token request per mode (CUDA only)."""
    out: dict[str, collections.Counter] = {}
    for mode in modes:
        counts: collections.Counter = collections.Counter()
        original = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None, counts=counts):
            if "synchroniz" in str(message):
                counts[_site()] += 1

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                engine.generate([prompt], [SamplingParams(max_tokens=1)], mode=mode)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = original
        out[mode] = counts
    return out


def format_sites(sites: dict[str, collections.Counter]) -> str:
    lines = []
    for mode, counts in sites.items():
        lines.append(f"## {mode}: {sum(counts.values())} syncs")
        lines += [f"{n:5d}  {site}" for site, n in counts.most_common()]
    return "\n".join(lines)


def profile_request(engine: Engine, prompt: list[list[int]], mode: str) -> str:
    """One first-token request under torch.profiler: ops by device time, then by host time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate([prompt], [SamplingParams(max_tokens=1)], mode=mode)
        torch.cuda.synchronize()
    avg = prof.key_averages()
    launches = sum(e.count for e in avg if e.device_type.name == "CUDA")
    return "\n".join([f"## {mode}: {launches} device events",
                      avg.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60),
                      avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)])
