"""The dense SwiGLU feed-forward block: ``down(silu(gate(x)) · up(x))``."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from hypic.models.layers.fused import FusedLinears


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self._fused: FusedLinears | None = None

    def fuse(self) -> bool:
        """Inference: gate and up in one matmul (hypic.models.layers.fused)."""
        if self._fused is not None:
            return False
        self._fused = FusedLinears([self.gate_proj, self.up_proj])
        return True

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self._fused(x) if self._fused is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)
