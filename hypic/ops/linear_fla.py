"""The CUDA backend of ``hypic.ops.linear``: flash-linear-attention 0.6.0 Triton kernels.

GDN runs at the WY level so the summary costs one extra state pass and nothing else: the
intra-chunk work (``w``, ``u``) is done once, the state pass from ``S_in`` gives the outputs and
final state, and a second state pass with ``u = 0`` from ``h0 = I`` gives ``T`` (every value
column evolves on its own, so a zero-value run from the identity is the span's transition).
KDA uses the public kernel with values ``[v | 0]`` and ``h0 = [S_in | I]``; scalar decay needs
no T pass (``T = exp(Σg)``, added by the caller). Imported only when a CUDA call needs it.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from hypic.ops.family import Family, expand_heads

# fla may reroute calls to other installed backends (FlashQLA, FlashKDA) whose numerics differ;
# hypic pins the stock Triton path.
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h  # noqa: E402
from fla.ops.common.chunk_o import chunk_fwd_o  # noqa: E402
from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra  # noqa: E402
from fla.ops.kda import chunk_kda  # noqa: E402
from fla.ops.simple_gla import chunk_simple_gla  # noqa: E402
from fla.ops.utils import chunk_local_cumsum  # noqa: E402
from fla.ops.utils.constant import RCP_LN2  # noqa: E402

CHUNK = 64


def _identity(n: int, heads: int, dim: int, device: torch.device) -> Tensor:
    return torch.eye(dim, dtype=torch.float32, device=device).expand(n, heads, dim, dim).contiguous()


def gdn_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu: Tensor, initial_state: Tensor | None,
                scale: float, with_transition: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """q, k [T, H, K], v [T, HV, V], g, beta [T, HV]; returns o, final [N, HV, K, V], T [N, HV, K, K]."""
    q, k, v, beta = (x[None].contiguous() for x in (q, k, v, beta))
    g = chunk_local_cumsum(g[None].float(), chunk_size=CHUNK, scale=RCP_LN2, cu_seqlens=cu)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, cu_seqlens=cu, chunk_size=CHUNK)
    h, v_new, final = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=initial_state,
                                                   output_final_state=True, cu_seqlens=cu, chunk_size=CHUNK)
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=cu, chunk_size=CHUNK)
    T = None
    if with_transition:
        K, HV, N = k.shape[-1], v.shape[2], len(cu) - 1
        _, _, T = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u.new_zeros(*u.shape[:-1], K), g=g,
                                               initial_state=_identity(N, HV, K, k.device), output_final_state=True,
                                               save_new_value=False, cu_seqlens=cu, chunk_size=CHUNK)
    return o[0], final, T


def kda_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu: Tensor, initial_state: Tensor | None,
                scale: float, with_transition: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    HV, K, V, N = v.shape[1], k.shape[2], v.shape[2], len(cu) - 1
    q, k = expand_heads(q, HV), expand_heads(k, HV)
    h0 = initial_state if initial_state is not None else v.new_zeros(N, HV, K, V, dtype=torch.float32)
    if with_transition:
        v = torch.cat([v, v.new_zeros(*v.shape[:-1], K)], dim=-1)
        h0 = torch.cat([h0, _identity(N, HV, K, v.device)], dim=-1)
    o, final = chunk_kda(q[None], k[None], v[None].contiguous(), g[None].float(), beta[None], scale=scale,
                         initial_state=h0.float().contiguous(), output_final_state=True, cu_seqlens=cu)
    if not with_transition:
        return o[0], final, None
    return o[0, ..., :V], final[..., :V], final[..., V:]


def scalar_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, cu: Tensor, initial_state: Tensor | None,
                   scale: float) -> tuple[Tensor, Tensor, None]:
    HV = v.shape[1]
    q, k = expand_heads(q, HV), expand_heads(k, HV)
    o, final = chunk_simple_gla(q[None], k[None], v[None], g=g[None].float(), scale=scale,
                                initial_state=initial_state, output_final_state=True, cu_seqlens=cu)
    return o[0], final, None


def fla_linear_attention(fam: Family, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None,
                         cu: Tensor, initial_state: Tensor | None, scale: float,
                         with_transition: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    if fam.name == "gdn":
        return gdn_forward(q, k, v, g, beta, cu, initial_state, scale, with_transition)
    if fam.name == "kda":
        return kda_forward(q, k, v, g, beta, cu, initial_state, scale, with_transition)
    return scalar_forward(q, k, v, g, cu, initial_state, scale)
