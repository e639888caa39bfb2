"""The CUDA backend of ``hypic.ops.linear``: flash-linear-attention 0.6.0 Triton kernels.

GDN runs at the WY level so the summary costs one extra state pass and nothing else: the
intra-chunk work (``w``, ``u``) is done once, the state pass from ``S_in`` gives the outputs and
final state, and hypic's transition kernel (``triton_transition``) runs the same state recurrence
with zero values from ``h0 = I`` to give ``T`` (every value column evolves on its own, so a
zero-value run from the identity is the span's transition), overlapped on a side stream.
KDA uses the public kernel with values ``[v | 0]`` and ``h0 = [S_in | I]``; scalar decay needs
no T pass (``T = exp(Σg)``, added by the caller). Imported only when a CUDA call needs it.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from hypic.ops.family import Family, expand_heads

# fla may reroute calls to other installed backends (FlashQLA, FlashKDA) whose numerics differ;
# hypic pins the stock Triton path.
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h  # noqa: E402
from fla.ops.common.chunk_o import chunk_fwd_o  # noqa: E402
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule  # noqa: E402
from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra  # noqa: E402
from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: E402
from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla  # noqa: E402
from fla.ops.utils import chunk_local_cumsum  # noqa: E402
from fla.ops.utils.constant import RCP_LN2  # noqa: E402

from hypic.ops import kernels  # noqa: E402
from hypic.ops.transfer import device_cache, to_device  # noqa: E402
from hypic.ops.triton_transition import gdn_transition  # noqa: E402

CHUNK = 64
# How the GDN transition pass is scheduled: "stream" overlaps it with the output pass on a side
# stream (each pass alone fills few SMs when there are few sequences); "serial" runs it after.
GDN_T_SCHEDULE = os.environ.get("HYPIC_GDN_T_SCHEDULE", "stream")
_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device)
    return _side_streams[device]


class ChunkPlan(NamedTuple):
    """Where fla's chunks lie, made on the host and copied once, without a device sync (fla's own
    helpers copy from pageable memory, which synchronises the stream on every call)."""

    cu: Tensor  # [N + 1] sequence offsets
    indices: Tensor  # [NC, 2] (sequence, chunk within it) of every chunk
    offsets: Tensor  # [N + 1] first chunk of every sequence


@device_cache(maxsize=64)
def _chunk_plan(cu_key: tuple[int, ...], device: torch.device) -> ChunkPlan:
    cu = torch.tensor(cu_key, dtype=torch.long)
    counts = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    offsets = torch.cat([cu.new_zeros(1), counts.cumsum(0)])
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    within = torch.arange(int(offsets[-1])) - offsets[:-1][seq]
    dev = to_device(torch.cat([cu, torch.stack([seq, within], 1).reshape(-1), offsets]), device)
    n, nc = len(cu), len(seq)
    return ChunkPlan(dev[:n], dev[n : n + 2 * nc].view(nc, 2), dev[n + 2 * nc :])


def chunk_plan(cu_cpu: Tensor, device: torch.device) -> ChunkPlan:
    return _chunk_plan(tuple(cu_cpu.tolist()), device)


def _identity(n: int, heads: int, dim: int, device: torch.device) -> Tensor:
    return torch.eye(dim, dtype=torch.float32, device=device).expand(n, heads, dim, dim).contiguous()


def _transition_pass(k: Tensor, w: Tensor, g: Tensor, plan: ChunkPlan) -> Tensor:
    """T of every sequence: the state pass with zero values from h0 = I (hypic's own kernel)."""
    return gdn_transition(k[0], w[0], g[0], plan.cu, chunk_size=CHUNK)


def gdn_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, plan: ChunkPlan,
                initial_state: Tensor | None, scale: float,
                with_transition: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """q, k [T, H, K], v [T, HV, V], g, beta [T, HV]; returns o, final [N, HV, K, V], T [N, HV, K, K]."""
    q, k, v, beta = (x[None].contiguous() for x in (q, k, v, beta.to(k.dtype)))
    # The plan is passed everywhere so that fla never derives (and caches) one itself: a plan first
    # derived on the side stream would be read on the main stream unsynchronised.
    cu, chunks, offsets = plan
    g = chunk_local_cumsum(g[None].float(), chunk_size=CHUNK, scale=RCP_LN2, cu_seqlens=cu, chunk_indices=chunks)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, cu_seqlens=cu, chunk_size=CHUNK,
                                               chunk_indices=chunks)
    T = None
    if with_transition and GDN_T_SCHEDULE == "stream":
        main, side = torch.cuda.current_stream(k.device), _side_stream(k.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            T = _transition_pass(k, w, g, plan)
    h, v_new, final = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=initial_state,
                                                   output_final_state=True, cu_seqlens=cu, chunk_indices=chunks,
                                                   chunk_offsets=offsets, chunk_size=CHUNK)
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=cu, chunk_size=CHUNK, chunk_indices=chunks)
    if with_transition and GDN_T_SCHEDULE == "stream":
        main.wait_stream(side)
        for x in (k, w, g):  # made on main, read on side
            x.record_stream(side)
        T.record_stream(main)  # made on side, read on main
    elif with_transition:
        T = _transition_pass(k, w, g, plan)
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
    o, final = chunk_kda(q[None], k[None], v[None].contiguous(), g[None].float(), beta[None].to(k.dtype), scale=scale,
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


def decode_step(fam: Family, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None,
                initial_state: Tensor | None, scale: float) -> tuple[Tensor, Tensor, None]:
    """One token per sequence (a decode step): the sequences become the batch of fla's recurrent
    kernels, one launch instead of the chunked pipeline."""
    N, HV, K, V = v.shape[0], v.shape[1], k.shape[2], v.shape[2]
    h0 = initial_state if initial_state is not None else v.new_zeros(N, HV, K, V, dtype=torch.float32)
    h0 = h0.float().contiguous()
    if fam.name == "gdn":
        o, final = fused_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g=g[:, None].float(),
                                                    beta=beta[:, None].to(k.dtype), scale=scale, initial_state=h0,
                                                    output_final_state=True)
    elif fam.name == "kda":
        qx, kx = expand_heads(q, HV), expand_heads(k, HV)
        o, final = fused_recurrent_kda(qx[:, None], kx[:, None], v[:, None], g[:, None].float(),
                                       beta[:, None].to(k.dtype), scale=scale, initial_state=h0,
                                       output_final_state=True)
    else:
        qx, kx = expand_heads(q, HV), expand_heads(k, HV)
        o, final = fused_recurrent_simple_gla(qx[:, None], kx[:, None], v[:, None], g=g[:, None].float(), scale=scale,
                                              initial_state=h0, output_final_state=True)
    return o[:, 0], final, None


def gdn_short_runs(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu: Tensor,
                   initial_state: Tensor | None, scale: float,
                   with_transition: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Every run at most ``kernels.RECURRENT_MAX`` tokens (a warm request's seams and query): fla's recurrent
    kernel, one launch, instead of the chunked pipeline's six plus the transition pass — a warm
    request is host-bound, and each launch costs host time whatever its size. The summary comes
    from the same launch: values ``[v | 0]`` from ``h0 = [S_in | I]`` leave ``[final | T]``."""
    N, HV, K, V = len(cu) - 1, v.shape[1], k.shape[2], v.shape[2]
    h0 = initial_state.float() if initial_state is not None else v.new_zeros(N, HV, K, V, dtype=torch.float32)
    if with_transition:
        v = torch.cat([v, v.new_zeros(*v.shape[:-1], K)], dim=-1)
        h0 = torch.cat([h0, _identity(N, HV, K, v.device)], dim=-1)
    o, final = fused_recurrent_gated_delta_rule(q[None], k[None], v[None], g=g[None].float(),
                                                beta=beta[None].to(k.dtype), scale=scale,
                                                initial_state=h0.contiguous(), output_final_state=True,
                                                cu_seqlens=cu)
    if not with_transition:
        return o[0], final, None
    return o[0, ..., :V], final[..., :V], final[..., V:]


def fla_linear_attention(fam: Family, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None,
                         cu_cpu: Tensor, initial_state: Tensor | None, scale: float,
                         with_transition: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """cu_cpu: the sequence offsets on the host (no device sync is needed to plan chunks)."""
    lengths = cu_cpu[1:] - cu_cpu[:-1]
    if not with_transition and bool((lengths == 1).all()):
        return decode_step(fam, q, k, v, g, beta, initial_state, scale)
    plan = chunk_plan(cu_cpu, k.device)
    cu = plan.cu
    if fam.name == "gdn" and len(lengths) and int(lengths.max()) <= kernels.RECURRENT_MAX:
        return gdn_short_runs(q, k, v, g, beta, cu, initial_state, scale, with_transition)
    if fam.name == "gdn":
        return gdn_forward(q, k, v, g, beta, plan, initial_state, scale, with_transition)
    if fam.name == "kda":
        return kda_forward(q, k, v, g, beta, cu, cu_cpu, initial_state, scale, with_transition)
    return scalar_forward(q, k, v, g, cu, cu_cpu, initial_state, scale)
