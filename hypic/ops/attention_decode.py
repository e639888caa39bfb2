"""Attention of a decode step: one query token per sequence over a padded key/value arena.

The arena holds ``slots`` sequences of up to ``cap`` rows each, token-major ([slots, cap, Hkv, D]);
sequence i sees its first ``used[i]`` rows. Two kernels compute it:

- on a GPU (half precision, equal key and value head sizes ≤ 256): flash attention's varlen kernel
  with ``seqused_k``, which reads only each sequence's used rows and splits long ones across
  blocks. Measured on the H200 (scripts/decode_attention.py, 9B heads): 16 sequences in a 4 096-row
  arena 101 µs against SDPA's 346; one sequence in 16 384 rows 71 against 1 076 (SDPA's
  memory-efficient kernel gives a single query row too little parallelism and reads the padding).
- elsewhere (the CPU, fp32, MLA's unequal head sizes): SDPA with a boolean mask over the padded
  rows, on a head-major view of the same arena.

Both take only device tensors and read nothing back, so a step that calls them can be captured as
a CUDA graph (``hypic.models.step_graph``): the flash kernel's plan depends on the shapes alone.
``HYPIC_DECODE_FLASH=0`` keeps SDPA on the GPU too (for an A/B).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from hypic.ops.attention import SHORT_BACKENDS, flash_varlen_fits

FLASH = os.environ.get("HYPIC_DECODE_FLASH", "1") != "0"


@dataclass
class DecodeSpan:
    """Which arena rows each sequence of a step sees: shared by every attention layer of the step."""

    used: Tensor  # [slots] int32 on the device: rows visible to each sequence
    cap: int  # arena rows per sequence
    _cu: Tensor | None = field(default=None, repr=False)
    _visible: Tensor | None = field(default=None, repr=False)

    @property
    def cu_keys(self) -> Tensor:
        """[slots + 1] int32: where each sequence's rows start in the flattened arena."""
        if self._cu is None:
            n = self.used.shape[0]
            self._cu = torch.arange(0, (n + 1) * self.cap, self.cap, dtype=torch.int32, device=self.used.device)
        return self._cu

    @property
    def visible(self) -> Tensor:
        """[slots, 1, 1, cap] bool: SDPA's mask."""
        if self._visible is None:
            rows = torch.arange(self.cap, device=self.used.device)
            self._visible = (rows[None, :] < self.used[:, None]).view(-1, 1, 1, self.cap)
        return self._visible


def uses_flash(q: Tensor, keys: Tensor, values: Tensor) -> bool:
    return FLASH and flash_varlen_fits(q, keys, values)


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, span: DecodeSpan, scale: float) -> Tensor:
    """q [slots, Hq, D], keys [slots, cap, Hkv, D], values [slots, cap, Hkv, Dv] → [slots, Hq, Dv]."""
    n, hq, d = q.shape
    cap, hkv = keys.shape[1], keys.shape[2]
    if uses_flash(q, keys, values):
        out = torch.ops.aten._flash_attention_forward(
            q, keys.view(n * cap, hkv, d), values.view(n * cap, hkv, d),
            torch.arange(n + 1, dtype=torch.int32, device=q.device), span.cu_keys, 1, cap, 0.0, False, False,
            scale=scale, seqused_k=span.used)
        return out[0]
    # GQA without widening the keys: a group's query heads are the "query tokens" of its key head
    qg = q.view(n, hkv, hq // hkv, d)
    with sdpa_kernel(SHORT_BACKENDS):  # never cuDNN: it plans (and may sync) per shape
        o = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=span.visible, scale=scale)
    return o.reshape(n, hq, values.shape[-1])
