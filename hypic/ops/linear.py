"""The one call site for linear-attention prefill: packed varlen sequences, one initial state each,
outputs, final states and, on request, each sequence's summary ``(T, S)`` from the same pass.

Two backends behind one signature: ``torch`` (chunked PyTorch, any device, every family) and
``fla`` (flash-linear-attention Triton kernels on CUDA: gdn, kda, scalar). ``auto`` picks fla
when the tensors are on CUDA and the family has a kernel there.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from hypic.ops.chunk import chunk_linear_attention
from hypic.ops.family import Family, check_inputs, check_state, expand_heads, get_family
from hypic.ops.kernels import kernel_device
from hypic.ops.recurrence import Summary, _apply_transition, transition_step
from hypic.ops.transfer import to_device

Backend = Literal["auto", "torch", "fla"]
FLA_FAMILIES = ("gdn", "kda", "scalar")
# What "auto" means in this context: training forces "torch" (fla's backward is unusable on the
# target machine's Triton, and hypic's fla path is forward-only).
_AUTO: ContextVar[str] = ContextVar("hypic_linear_backend", default="auto")


@contextlib.contextmanager
def backend_override(backend: Backend) -> Iterator[None]:
    """Within the block, ``backend="auto"`` calls use ``backend``."""
    token = _AUTO.set(backend)
    try:
        yield
    finally:
        _AUTO.reset(token)


@functools.lru_cache(maxsize=1)
def fla_installed() -> bool:
    """flash-linear-attention is an optional GPU dependency: without it CUDA runs the torch kernels."""
    return importlib.util.find_spec("fla") is not None


def triton_allowed(device: torch.device) -> bool:
    """Whether ``auto`` may use hypic's own forward-only Triton kernels here (CUDA, no torch override)."""
    return kernel_device(device) and _AUTO.get() != "torch"


def fla_allowed(device: torch.device) -> bool:
    """Whether ``auto`` may use an fla kernel here (CUDA, fla installed, no torch override)."""
    return kernel_device(device) and _AUTO.get() != "torch" and fla_installed()


class LinearOutput(NamedTuple):
    o: Tensor  # [T, HV, V], input dtype (fp32 or fp64 with input_map, until ``restart`` rounds it)
    final_state: Tensor  # [N, HV, K, V], fp32 (fp64 for fp64 inputs)
    summary: Summary | None  # per sequence: transition [N, ...], state [N, HV, K, V]
    input_map: Tensor | None = None  # [T, HV, K]: o_t moves by input_map_t · ΔS_in (output_input_map)


def check_cu_seqlens(cu_seqlens: Tensor | None, total: int) -> Tensor:
    """Validated host copy of the sequence offsets (one sequence of ``total`` tokens when None)."""
    if cu_seqlens is None:
        return torch.tensor([0, total], dtype=torch.long)
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or len(cu_seqlens) < 2:
        raise ValueError("cu_seqlens: expected a 1-D integer tensor [N + 1] of sequence offsets")
    if cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens: expected an integer dtype, got {cu_seqlens.dtype}")
    cu = cu_seqlens.cpu()  # a device sync when given on the GPU: callers pass host offsets
    xs = cu.tolist()  # checked in Python: tensor ops cost the host more, once per layer and call
    if xs[0] != 0 or xs[-1] != total or any(b < a for a, b in zip(xs, xs[1:], strict=False)):
        raise ValueError(f"cu_seqlens: must start at 0, be non-decreasing and end at the token count {total}")
    return cu if cu.dtype == torch.long else cu.to(torch.long)


def resolve_backend(backend: Backend, family: str, device: torch.device) -> Literal["torch", "fla"]:
    if backend not in ("auto", "torch", "fla"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'fla', got {backend!r}")
    if backend == "auto":
        backend = _AUTO.get()
    if backend == "auto":
        return "fla" if family in FLA_FAMILIES and fla_allowed(device) else "torch"
    if backend == "fla" and (not kernel_device(device) or family not in FLA_FAMILIES):
        raise ValueError(f"backend: 'fla' needs CUDA tensors and a family in {FLA_FAMILIES}; "
                         f"got {family!r} on {device.type}")
    return backend


def _one_token(fam: Family, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None,
               a: Tensor | None, b: Tensor | None, initial_state: Tensor | None, scale: float,
               ct: torch.dtype) -> tuple[Tensor, Tensor, None]:
    """A decode step on the torch backend: one token of each sequence, the recurrence applied once
    (``S = A_t·S + k·wᵀ``, ``o = scale·Sᵀq``), batched over the sequences. The chunked kernel pads
    each token to a 16-token chunk and solves its triangular system: 5 ms a layer on the bundled
    model's CPU decode, about half of a step."""
    HV, K, V = v.shape[1], k.shape[2], v.shape[2]
    out_dtype = v.dtype

    def f(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.to(ct)

    q, k, v, g, beta, a, b = (f(expand_heads(q, HV)), f(expand_heads(k, HV)), f(v), f(g), f(beta), f(a), f(b))
    S = initial_state if initial_state is not None else v.new_zeros(v.shape[0], HV, K, V)
    S = transition_step(fam, S, k, g, beta, a, b)
    write = v if not fam.beta else beta[..., None] * v
    S = S + k[..., None] * write[..., None, :]
    o = scale * torch.einsum("nhkv,nhk->nhv", S, q)
    return o.to(out_dtype), S, None


def linear_attention(family: str, q: Tensor, k: Tensor, v: Tensor, *, g: Tensor | None = None,
                     beta: Tensor | None = None, a: Tensor | None = None, b: Tensor | None = None,
                     cu_seqlens: Tensor | None = None, initial_state: Tensor | None = None,
                     scale: float | None = None, output_summary: bool = False,
                     output_input_map: bool = False, backend: Backend = "auto") -> LinearOutput:
    """Chunked prefill over packed sequences (q, k ``[T, H, K]``, v ``[T, HV, V]``, gates per family).

    With ``output_summary`` each sequence's summary is returned too: ``S`` is the state the span
    builds from zero, ``T`` its transition, so ``final_state = T·initial_state + S``.

    With ``output_input_map`` (torch backend only: ``input_map_supported``) each output's map from
    its sequence's initial state is returned too, and the summary: the outputs and final states
    are affine in the initial states, so ``restart`` gives them for initial states known only after
    the pass (one pass where two were run: ``hypic.engine.cold``, ``hypic.engine.combine``).
    """
    fam = get_family(family)
    dims = check_inputs(fam, q, k, v, g, beta, a, b)
    cu = check_cu_seqlens(cu_seqlens, dims.length)
    num_seqs = len(cu) - 1
    ct = torch.float64 if k.dtype == torch.float64 else torch.float32
    if initial_state is not None:
        check_state("initial_state", initial_state, dims, initial_state.dtype, batch=num_seqs)
        if not initial_state.is_floating_point():
            raise ValueError(f"initial_state: expected a floating dtype, got {initial_state.dtype}")
        initial_state = initial_state.to(ct)
    scale = dims.key_dim**-0.5 if scale is None else float(scale)
    matrix = output_summary and fam.transition == "matrix"
    output_summary = output_summary or output_input_map
    if resolve_backend(backend, fam.name, k.device) == "fla":
        if output_input_map:
            raise ValueError("output_input_map: the torch backend only (input_map_supported)")
        from hypic.ops.linear_fla import fla_linear_attention

        o, final, T = fla_linear_attention(fam, q, k, v, g, beta, cu, initial_state, scale, matrix)
    else:
        # The recurrence stays in fp32 even under autocast (training): bf16 products of transitions
        # would compound along the sequence.
        with torch.autocast(k.device.type, enabled=False):
            maps = None
            if (not matrix and not output_input_map and num_seqs == dims.length and num_seqs > 0
                    and bool((cu[1:] - cu[:-1] == 1).all())):
                o, final, T = _one_token(fam, q, k, v, g, beta, a, b, initial_state, scale, ct)
            else:
                o, final, T, maps = chunk_linear_attention(fam, q, k, v, g, beta, a, b, cu, initial_state, scale,
                                                           matrix, input_map=output_input_map)
    if not output_summary:
        return LinearOutput(o, final, None)
    if fam.transition == "none":  # widened for an input map only: the identity, named by nothing
        T = None
    if fam.transition in ("scalar", "diagonal"):  # closed form: Σg per sequence
        seq = to_device(torch.repeat_interleave(torch.arange(num_seqs), cu[1:] - cu[:-1]), k.device)
        T = g.to(ct).new_zeros(num_seqs, *g.shape[1:]).index_add_(0, seq, g.to(ct))
    state = final if initial_state is None else final - _apply_transition(fam, T, initial_state)
    return LinearOutput(o, final, Summary(T, state), maps if output_input_map else None)


def input_map_supported(family: str, device: torch.device) -> bool:
    """Whether callers should run one pass with ``output_input_map`` and ``restart`` it: on the CPU
    (the torch backend there), where a pass's fixed cost is what a second pass adds. On a GPU a
    second pass is launches of a constant count, ``restart`` a few ops per sequence, and fla's
    kernels have no input map."""
    return device.type == "cpu" and resolve_backend("auto", family, device) == "torch"


def restart(family: str, out: LinearOutput, cu_seqlens: Tensor, seqs: list[int], states: Tensor,
            dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The outputs and final states of a pass run with ``output_input_map``, as if sequences
    ``seqs`` had started from ``states`` [len(seqs), HV, K, V] more than they did (the rest
    unmoved): ``o_t += input_map_t · ΔS``, ``final += T·ΔS``. Outputs rounded to ``dtype`` once."""
    if out.input_map is None or out.summary is None:
        raise ValueError("restart: the pass must be run with output_input_map")
    fam = get_family(family)
    o, final = out.o, out.final_state
    if seqs:
        cu = cu_seqlens.tolist()
        o, final = o.clone(), final.clone()
        states = states.to(final.dtype)
        for i, s in zip(seqs, states, strict=True):  # [HV, L, K] @ [HV, K, V] per sequence (3× an einsum's speed)
            a, b = cu[i], cu[i + 1]
            if b > a:
                o[a:b].add_(torch.bmm(out.input_map[a:b].transpose(0, 1), s).transpose(0, 1))
        at = to_device(seqs, final.device)
        T = out.summary.transition
        final.index_add_(0, at, _apply_transition(fam, None if T is None else T.index_select(0, at), states))
    return o.to(dtype), final
