"""Host work of a request, counted: aten ops per hypic source line.

A warm request on the GPU is host-bound (docs/benchmarks.md: 71 ms of device time in a 162 ms
TTFT on the 9B shape); every aten op costs the host a few microseconds whatever its size, so the
number of ops — independent of the model's width, countable on CPU — is the proxy for that cost.
Ops issued inside CPU-only fallbacks (the chunked torch linear attention, the torch conv and norm,
the scan's loop) are kept apart: on the GPU fla's kernels and hypic's Triton kernels replace them.
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from hypic.bench.sites import package_path

# (file, function) of the CPU-only fallbacks of *inference*; None: the whole file. (Training runs
# the chunked torch kernels of ops/chunk.py on the GPU too: count its steps without this filter.)
CPU_ONLY = {("ops/chunk.py", None), ("ops/recurrence.py", None), ("ops/scan.py", "chain_loop"),
            ("ops/scan.py", "chains_loop"),
            ("ops/conv.py", "_torch_conv"), ("ops/linear.py", "restart"),
            ("models/layers/norm.py", "rms"), ("models/layers/gdn.py", "_l2norm_torch")}
_PASS_THROUGH = ("bench/host_ops.py", "ops/family.py")  # helpers count where they are called from


class OpCounter(TorchDispatchMode):
    """Counts every aten op by the innermost hypic source line that issued it."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()
        self.cpu_only: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        site, cpu_only = "(outside hypic)", False
        for frame in reversed(traceback.extract_stack(limit=40)):
            path = package_path(frame.filename)
            if path is not None and path not in _PASS_THROUGH:
                site = f"{path}:{frame.lineno} {frame.line}"
                cpu_only = (path, None) in CPU_ONLY or (path, frame.name) in CPU_ONLY
                break
        self.sites[site] += 1
        if cpu_only:
            self.cpu_only.add(site)
        return func(*args, **(kwargs or {}))

    def gpu_relevant(self) -> collections.Counter[str]:
        """The sites that issue ops on the GPU too (CPU-only fallbacks left out)."""
        return collections.Counter({s: n for s, n in self.sites.items() if s not in self.cpu_only})


def count_ops(fn: Callable[[], Any]) -> OpCounter:
    counter = OpCounter()
    with counter:
        fn()
    return counter
