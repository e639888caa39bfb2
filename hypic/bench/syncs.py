"""Where a request makes the host wait for the GPU.

A host↔device sync in the middle of a forward (``.item()``, ``.tolist()``, a copy from pageable
memory, ``nonzero``) stops the host from queueing kernels ahead, so host and device time add up
instead of overlapping. CUDA's sync debug mode flags every such call; this collects them per
source line (the innermost hypic frame) for one request of each kind, and for decode steps with
each sampling feature (one read-back a step is the floor: the tokens).
"""

from __future__ import annotations

import collections
import contextlib
import traceback
import warnings
from collections.abc import Iterator

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


@contextlib.contextmanager
def recording() -> Iterator[collections.Counter]:
    """Count every synchronizing CUDA call made inside, by source line (CUDA's sync debug mode)."""
    counts: collections.Counter = collections.Counter()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            counts[_site()] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            yield counts
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = original


def sync_sites(engine: Engine, prompt: list[list[int]], modes: tuple[str, ...]) -> dict[str, collections.Counter]:
    """{mode: Counter(source line → syncs)} for one first-token request per mode (CUDA only)."""
    out: dict[str, collections.Counter] = {}
    for mode in modes:
        with recording() as counts:
            engine.generate([prompt], [SamplingParams(max_tokens=1)], mode=mode)
        out[mode] = counts
    return out


STEP_FEATURES = {  # what a decode step's rows may ask for, each alone and all together
    "greedy": SamplingParams(max_tokens=16, ignore_eos=True),
    "sampled": SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, top_p=0.9, top_k=50, seed=1),
    "penalties": SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.5,
                                repetition_penalty=1.1, logit_bias={3: 1.0}, min_tokens=8),
    "logprobs": SamplingParams(max_tokens=16, ignore_eos=True, logprobs=5),
}


def step_sync_sites(engine: Engine, prompts: list[list[list[int]]], steps: int = 3) -> dict[str, collections.Counter]:
    """{feature: Counter(source line → syncs)} over ``steps`` decode steps of ``prompts`` with each
    feature of STEP_FEATURES, and with the features mixed row by row ("mixed") (CUDA only)."""
    kinds = {name: [p] * len(prompts) for name, p in STEP_FEATURES.items()}
    kinds["mixed"] = [list(STEP_FEATURES.values())[i % len(STEP_FEATURES)] for i in range(len(prompts))]
    out: dict[str, collections.Counter] = {}
    for name, params in kinds.items():
        runs = engine.start(prompts, params)
        engine.step(runs)  # a first step captures or sizes what later steps reuse
        with recording() as counts:
            for _ in range(steps):
                engine.step(runs)
        engine.forget(runs)
        out[f"{name}, {steps} steps"] = counts
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
