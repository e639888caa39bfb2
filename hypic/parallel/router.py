"""Which worker prefills which cold segment.

A cold segment is self-contained (it starts from position 0 and a zero state), so any worker can
prefill it and the only question is balance: a request's cold work is done when its most loaded
worker is. Two policies, as the published router has them:

- ``lpt`` (longest processing time first): segments by cost, largest first, each to the worker
  with the least cost so far (ties → the lowest rank). Its makespan is within 4/3 of the optimum.
- ``round_robin``: segment i to worker i mod n, blind to cost (the comparison baseline).

Cost is the segment's token count: at document lengths (≤ a few thousand tokens) the standalone
prefill is dominated by per-token work (projections, MLPs, linear layers); attention's quadratic
term is a small share there. ``loads`` start each worker at a cost it carries before any segment:
the pool charges a remote worker, in tokens, the time its entries need after it finishes (the
transfer, and the engine's host preparing the combine pass), so that work lands on rank 0 until
the remote entries can arrive while rank 0 still computes (``pool.ColdPool.handicap``).
"""

from __future__ import annotations

POLICIES = ("lpt", "round_robin")


def assign(lengths: list[int], workers: int, policy: str = "lpt", loads: list[float] | None = None) -> list[int]:
    """The worker (0 … workers−1) of each segment, in input order; ``loads``: each worker's
    starting cost in tokens (LPT only)."""
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected a positive integer, got {workers!r}")
    if any(n < 0 for n in lengths):
        raise ValueError(f"lengths: expected token counts ≥ 0, got {lengths}")
    if loads is not None and (len(loads) != workers or any(not x >= 0 for x in loads)):
        raise ValueError(f"loads: expected {workers} starting costs ≥ 0, got {loads}")
    if policy == "round_robin":
        return [i % workers for i in range(len(lengths))]
    loads = [float(x) for x in loads] if loads is not None else [0.0] * workers
    owner = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):  # stable: equal lengths in input order
        w = min(range(workers), key=lambda r: (loads[r], r))
        owner[i] = w
        loads[w] += lengths[i]
    return owner


def makespan(lengths: list[int], owner: list[int], workers: int) -> int:
    """The largest per-worker token count of an assignment."""
    loads = [0] * workers
    for n, w in zip(lengths, owner, strict=True):
        loads[w] += n
    return max(loads)
