"""Which weights a model holds, as a short list of numbers.

Two places must know that entries were computed by these very weights, not just by a model of the
same configuration at the same path: a cold worker's model against the engine's
(``hypic.parallel``) and a cache saved to disk against the engine that loads it
(``hypic.cache.persist``) — a checkpoint retrained in place keeps its folder and configuration.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def weight_fingerprint(model: torch.nn.Module) -> list[float]:
    """Per parameter, the fp64 sum and 2-norm: equal weights give equal lists (the same
    reduction over the same numbers), and any changed tensor shows."""
    out: list[float] = []
    for _, p in sorted(model.named_parameters()):
        if p.dtype.itemsize == 1:  # 8-bit weights (hypic.models.layers.fp8): reductions want a wider type
            p = p.float()
        out += [torch.sum(p, dtype=torch.float64).item(), torch.linalg.vector_norm(p, dtype=torch.float64).item()]
    return out


def same_weights(a: list[float], b: list[float], rtol: float = 1e-9) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(1.0, abs(x), abs(y)) for x, y in zip(a, b, strict=True))
