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
from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets  # noqa: E402

CHUNK = 64
# How the GDN transition pass is scheduled: "stream" overlaps it with the output pass on a side
# stream (each pass alone fills few SMs when there are few sequences); "serial" runs it after.
GDN_T_SCHEDULE = os.environ.get("HYPIC_GDN_T_SCHEDULE", "stream")
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    return _side_streams[device]


def _identity(n: int, heads: int, dim: int, device: torch.device) -> Tensor:
    return torch.eye(dim, dtype=torch.float32, device=device).expand(n, heads, dim, dim).contiguous()


def _transition_pass(k: Tensor, w: Tensor, g: Tensor, cu: Tensor, cu_cpu: Tensor, chunks: Tensor,
                     offsets: Tensor) -> Tensor:
    """T of every sequence: the state pass with zero values from h0 = I."""
    K, HV, N = k.shape[-1], w.shape[2], len(cu_cpu) - 1
    _, _, T = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=w.new_zeros(*w.shape[:-1], K), g=g,
                                           initial_state=_identity(N, HV, K, k.device), output_final_state=True,
                                           save_new_value=False, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                                           chunk_indices=chunks, chunk_offsets=offsets, chunk_size=CHUNK)
    return T


def gdn_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu: Tensor, cu_cpu: Tensor,
                initial_state: Tensor | None, scale: float,
                with_transition: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """q, k [T, H, K], v [T, HV, V], g, beta [T, HV]; returns o, final [N, HV, K, V], T [N, HV, K, K]."""
    q, k, v, beta = (x[None].contiguous() for x in (q, k, v, beta))
    # Every chunk plan is made here, on the main stream, before the side stream forks: fla caches
    # them, and a plan first computed on the side stream would be read on main unsynchronised.
    chunks = prepare_chunk_indices(cu, CHUNK, cu_seqlens_cpu=cu_cpu)
    offsets = prepare_chunk_offsets(cu, CHUNK)
    g = chunk_local_cumsum(g[None].float(), chunk_size=CHUNK, scale=RCP_LN2, cu_seqlens=cu, chunk_indices=chunks)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, cu_seqlens=cu, chunk_size=CHUNK,
                                               chunk_indices=chunks)
    T = None
    if with_transition and GDN_T_SCHEDULE == "stream":
        main, side = torch.cuda.current_stream(k.device), _side_stream(k.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            T = _transition_pass(k, w, g, cu, cu_cpu, chunks, offsets)
    h, v_new, final = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=initial_state,
                                                   output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                                                   chunk_indices=chunks, chunk_offsets=offsets, chunk_size=CHUNK)
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=cu, chunk_size=CHUNK, chunk_indices=chunks)
    if with_transition and GDN_T_SCHEDULE == "stream":
        main.wait_stream(side)
        for x in (k, w, g):  # made on main, read on side
            x.record_stream(side)
        T.record_stream(main)  # made on side, read on main
    elif with_transition:
        T = _transition_pass(k, w, g, cu, cu_cpu, chunks, offsets)
    return o[0], final, T


def kda_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu: Tensor, cu_cpu: Tensor,
                initial_state: Tensor | None,
                scale: float, with_transition: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    HV, K, V, N = v.shape[1], k.shape[2], v.shape[2], len(cu) - 1
    q, k = expand_heads(q, HV), expand_heads(k, HV)
    h0 = initial_state if initial_state is not None else v.new_zeros(N, HV, K, V, dtype=torch.float32)
    if with_transition:
        v = torch.cat([v, v.new_zeros(*v.shape[:-1], K)], dim=-1)
        h0 = torch.cat([h0, _identity(N, HV, K, v.device)], dim=-1)
    o, final = chunk_kda(q[None], k[None], v[None].contiguous(), g[None].float(), beta[None], scale=scale,
                         initial_state=h0.float().contiguous(), output_final_state=True, cu_seqlens=cu,
                         cu_seqlens_cpu=cu_cpu)
    if not with_transition:
        return o[0], final, None
    return o[0, ..., :V], final[..., :V], final[..., V:]


def scalar_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, cu: Tensor, cu_cpu: Tensor, initial_state: Tensor | None,
                   scale: float) -> tuple[Tensor, Tensor, None]:
    HV = v.shape[1]
    q, k = expand_heads(q, HV), expand_heads(k, HV)
    o, final = chunk_simple_gla(q[None], k[None], v[None], g=g[None].float(), scale=scale,
                                initial_state=initial_state, output_final_state=True, cu_seqlens=cu,
                                cu_seqlens_cpu=cu_cpu)
    return o[0], final, None


def fla_linear_attention(fam: Family, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None,
                         cu_cpu: Tensor, initial_state: Tensor | None, scale: float,
                         with_transition: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """cu_cpu: the sequence offsets on the host (no device sync is needed to plan chunks)."""
    cu = cu_cpu.to(k.device, non_blocking=True)
    if fam.name == "gdn":
        return gdn_forward(q, k, v, g, beta, cu, cu_cpu, initial_state, scale, with_transition)
    if fam.name == "kda":
        return kda_forward(q, k, v, g, beta, cu, cu_cpu, initial_state, scale, with_transition)
    return scalar_forward(q, k, v, g, cu, cu_cpu, initial_state, scale)
