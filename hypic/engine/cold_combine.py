"""A cold request in one forward: the standalone prefill of its missing segments and the combine
pass over its recompute set, layer by layer.

The combine pass needs, at layer l, only layer l of each entry (summary, conv tail, body keys and
values) — exactly what the standalone prefill has just produced at layer l. So both token sets
travel through the model together: every mixer first runs the cold rows (``ColdContext`` fills the
entries' layer l), then the combine rows (``CombineContext`` reads them). Projections, norms and
MLPs run once over both sets, and the combine pass's small kernels and host work ride along with
the prefill's large ones instead of costing a second forward (on the H200's 9B shape the separate
combine forward was ~15% of a cold request).
"""

from __future__ import annotations

import torch
from torch import Tensor

from hypic.engine.cold import ColdContext
from hypic.engine.combine import CombineContext
from hypic.models.context import ForwardContext, LinearRun, RopeSpec


class ColdCombineContext(ForwardContext):
    def __init__(self, cold: ColdContext, combine: CombineContext) -> None:
        self.cold, self.combine = cold, combine
        self.split = len(cold.positions)
        self.input_ids = torch.cat([cold.input_ids, combine.input_ids])
        self.positions = torch.cat([cold.positions, combine.positions])
        self.cu_seqlens = torch.cat([cold.cu_seqlens, combine.cu_seqlens[1:] + self.split])

    def logits_rows(self) -> Tensor:
        return self.combine.logits_rows() + self.split

    def conv_tails(self, layer: int, raw: Tensor) -> Tensor | None:
        raise NotImplementedError("ColdCombineContext runs each token set's conv through its own context")

    def save_conv(self, layer: int, tails: Tensor) -> None:
        raise NotImplementedError("ColdCombineContext runs each token set's conv through its own context")

    def conv(self, layer: int, raw: Tensor, weight: Tensor) -> Tensor:
        n = self.split
        cold = self.cold.conv(layer, raw[:n], weight)  # first: the combine rows warm up from these tails
        return torch.cat([cold, self.combine.conv(layer, raw[n:], weight)])

    def linear(self, layer: int, family: str, run: LinearRun, rope: RopeSpec | None) -> Tensor:
        n = self.split
        cold = self.cold.linear(layer, family, run.restrict(slice(0, n)), rope)
        return torch.cat([cold, self.combine.linear(layer, family, run.restrict(slice(n, None)), rope)])

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: RopeSpec | None, scale: float) -> Tensor:
        n = self.split
        cold = self.cold.attend(layer, q[:n], k[:n], v[:n], rope, scale)
        return torch.cat([cold, self.combine.attend(layer, q[n:], k[n:], v[n:], rope, scale)])
