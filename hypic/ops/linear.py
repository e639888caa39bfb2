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
    o: Tensor  # [T, HV, V], input dtype
    final_state: Tensor  # [N, HV, K, V], fp32 (fp64 for fp64 inputs)
    summary: Summary | None  # per sequence: transition [N, ...], state [N, HV, K, V]


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
                     backend: Backend = "auto") -> LinearOutput:
    """Chunked prefill over packed sequences (q, k ``[T, H, K]``, v ``[T, HV, V]``, gates per family).

    With ``output_summary`` each sequence's summary is returned too: ``S`` is the state the span
    builds from zero, ``T`` its transition, so ``final_state = T·initial_state + S``.
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
    if resolve_backend(backend, fam.name, k.device) == "fla":
        from hypic.ops.linear_fla import fla_linear_attention

        o, final, T = fla_linear_attention(fam, q, k, v, g, beta, cu, initial_state, scale, matrix)
    else:
        # The recurrence stays in fp32 even under autocast (training): bf16 products of transitions
        # would compound along the sequence.
        with torch.autocast(k.device.type, enabled=False):
            if not matrix and num_seqs == dims.length and num_seqs > 0 and bool((cu[1:] - cu[:-1] == 1).all()):
                o, final, T = _one_token(fam, q, k, v, g, beta, a, b, initial_state, scale, ct)
            else:
                o, final, T = chunk_linear_attention(fam, q, k, v, g, beta, a, b, cu, initial_state, scale, matrix)
    if not output_summary:
        return LinearOutput(o, final, None)
    if fam.transition in ("scalar", "diagonal"):  # closed form: Σg per sequence
        seq = to_device(torch.repeat_interleave(torch.arange(num_seqs), cu[1:] - cu[:-1]), k.device)
        T = g.to(ct).new_zeros(num_seqs, *g.shape[1:]).index_add_(0, seq, g.to(ct))
    state = final if initial_state is None else final - _apply_transition(fam, T, initial_state)
    return LinearOutput(o, final, Summary(T, state))
