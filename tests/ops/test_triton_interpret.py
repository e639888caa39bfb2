"""hypic's Triton kernels (and its use of fla's recurrent GDN kernel) on CPU, in Triton's interpreter.

These kernels run on CUDA in production; their GPU tests are marked ``gpu``. Triton's interpreter
runs the same kernel code on CPU tensors, so the logic (masks, tails, strides, the identity trick
for T) is checked here where the GPU is absent. Needs triton (and fla for the GDN test) and
``TRITON_INTERPRET=1`` set before triton is imported, e.g.

    TRITON_INTERPRET=1 python -m pytest -q tests/ops/test_triton_interpret.py

The CPU-only CI has no triton, so it skips them.
"""

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
                                reason="needs triton and TRITON_INTERPRET=1")


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("with_tails", [True, False])
@pytest.mark.parametrize("strided", [True, False])
def test_triton_conv_matches_torch_conv(with_tails: bool, strided: bool) -> None:
    from hypic.ops import conv
    from hypic.ops.triton_conv import causal_conv1d_triton

    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 6, 6, 43, 45, 109])
    T, D, W = 109, 48, 4
    x = torch.randn(T, D + 30, generator=g)[:, 7:7 + D] if strided else torch.randn(T, D, generator=g)
    w = torch.randn(D, W, generator=g)
    tails = torch.randn(len(cu) - 1, W - 1, D, generator=g) if with_tails else None
    y, tail = causal_conv1d_triton(x, w, cu, tails, True)
    ref = conv.causal_conv1d(x.double(), w.double(), cu_seqlens=cu,
                             initial_tail=None if tails is None else tails.double(), activation="silu")
    assert (y.double() - ref.y).abs().max() < 1e-5 and torch.equal(tail.double(), ref.tail)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_triton_norm_matches_fp64(offset: float) -> None:
    from hypic.ops.triton_norm import rms_norm

    g = torch.Generator().manual_seed(1)
    x, z, w = torch.randn(37, 96, generator=g), torch.randn(37, 96, generator=g), torch.randn(96, generator=g)
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * (w.double() + offset)
    assert (rms_norm(x, w, 1e-6, weight_offset=offset).double() - want).abs().max() < 1e-5
    gated = rms_norm(x, w, 1e-6, z, "silu", weight_offset=offset).double()
    assert (gated - want * torch.nn.functional.silu(z.double())).abs().max() < 1e-5


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention")
@pytest.mark.parametrize("with_state", [True, False])
def test_gdn_short_runs_match_the_chunked_reference(with_state: bool) -> None:
    from hypic.ops.linear import linear_attention
    from hypic.ops.linear_fla import gdn_short_runs
    from hypic.ops.samples import family_inputs, token_kwargs

    lens = [1, 8, 3, 5, 0]
    cu = torch.tensor([0, *lens]).cumsum(0)
    x = family_inputs("gdn", sum(lens), heads=2, value_heads=4, key_dim=16, value_dim=8, seed=3)
    s0 = torch.randn(len(lens), 4, 16, 8, dtype=torch.float64) if with_state else None
    ref = linear_attention("gdn", x["q"], x["k"], x["v"], **token_kwargs(x), cu_seqlens=cu, initial_state=s0,
                           output_summary=True, backend="torch")
    xf = {n: t.float() for n, t in x.items()}
    kw = token_kwargs(xf)
    s0f = None if s0 is None else s0.float()
    o, final, T = gdn_short_runs(xf["q"], xf["k"], xf["v"], kw["g"], kw["beta"], cu, s0f, 16**-0.5, True)
    assert _rel(o, ref.o) < 1e-5 and _rel(final, ref.final_state) < 1e-5
    assert _rel(T, ref.summary.transition) < 1e-5
    o2, final2, none = gdn_short_runs(xf["q"], xf["k"], xf["v"], kw["g"], kw["beta"], cu, s0f, 16**-0.5, False)
    assert none is None and torch.equal(o2, o) and _rel(final2, ref.final_state) < 1e-5


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention")
@torch.no_grad()
def test_engine_gpu_path_equals_the_torch_path(monkeypatch) -> None:
    """Cold and warm hypic requests through the GPU branch of every kernel-choosing site (Triton
    conv and norms, the scan's Triton chains, fla's recurrent GDN for runs ≤ 64 tokens, the fused
    GDN kernel for the combine pass and the cold seams' pass) equal the
    same requests through the PyTorch kernels. Every run is kept ≤ 64 tokens: fla's chunked kernels
    autotune, which needs a real GPU."""
    import hypic.ops.linear_fla as linear_fla
    import hypic.ops.triton_chain as triton_chain
    import hypic.ops.triton_conv as triton_conv
    from hypic.bench.shapes import SHAPES
    from hypic.bench.ttft import RagShape, rag_prompts
    from hypic.engine.engine import Engine
    from hypic.models.random_init import random_model

    calls = {"conv": 0, "gdn": 0, "chains": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(triton_conv, "causal_conv1d_triton", counted("conv", triton_conv.causal_conv1d_triton))
    monkeypatch.setattr(linear_fla, "gdn_short_runs", counted("gdn", linear_fla.gdn_short_runs))
    monkeypatch.setattr(triton_chain, "matrix_chains_at", counted("chains", triton_chain.matrix_chains_at))
    loaded = random_model(SHAPES["tiny"], device="cpu", dtype=torch.float32)
    prompts = rag_prompts(RagShape(2, 24, 8, 5), loaded.model.vocab_size, 2, seed=1)
    from hypic.ops import triton_gdn_combine

    monkeypatch.setattr(triton_gdn_combine, "gdn_combine", counted("fused", triton_gdn_combine.gdn_combine))
    from hypic.engine import combine

    tables, real_tables = [], combine._buffer_tables

    def recorded(bodies, device):  # the bodies' T and S found at buffer + offset, not looked up per layer
        found = real_tables(bodies, device)
        tables.append(bool(found))
        return found

    monkeypatch.setattr(combine, "_buffer_tables", recorded)
    logits = {}
    for kernels, fused in (("0", "0"), ("1", "0"), ("1", "1")):  # the GDN combine in one kernel, or not
        monkeypatch.setenv("HYPIC_INTERPRET_KERNELS", kernels)
        monkeypatch.setenv("HYPIC_FUSED_COMBINE", fused)
        calls.update(dict.fromkeys(calls, 0), fused=0)
        engine = Engine(loaded, seam=4)
        engine.prewarm([list(range(3, 40))])  # a document of no prompt: the entry layout's probe runs here
        start = calls["fused"]
        cold = engine.prefill_logits([prompts[1]], mode="hypic")[0]
        in_cold = calls["fused"] - start
        engine.prefill_logits([prompts[0]], mode="hypic")
        before = calls["fused"]
        logits[kernels + fused] = (cold, engine.prefill_logits([prompts[1]], mode="hypic")[0])
        # a cold call's GDN layers run the kernel twice — its seams' pass, then the combine — a warm one's once
        assert in_cold == 2 * (calls["fused"] - before), calls
        assert (min(calls[k] for k in ("conv", "gdn")) > 0) == (kernels == "1"), calls  # only when switched on
        assert (calls["fused"] > 0) == (fused == "1") and (calls["chains"] > 0) == (kernels + fused == "10"), calls
    assert len(tables) == 3 and all(tables)  # each of the fused arm's calls, cold bodies built in one too
    for other in ("10", "11"):
        for torch_path, kernel_path in zip(logits["00"], logits[other], strict=True):
            assert (torch_path - kernel_path).abs().max() < 1e-4


def test_affine_chain_kernel_path_matches_the_loop(monkeypatch) -> None:
    """Training's chunk chain through the Triton scan kernel, forward and backward (the backward
    is the same kernel on reversed, transposed inputs)."""
    from hypic.ops.chain_grad import affine_chain

    g = torch.Generator().manual_seed(2)
    A0 = 0.3 * torch.randn(7, 5, 16, 16, generator=g)
    S0, w = torch.randn(7, 5, 16, 8, generator=g), torch.randn(8, 5, 16, 8, generator=g)
    grads = {}
    for kernels in ("0", "1"):
        monkeypatch.setenv("HYPIC_INTERPRET_KERNELS", kernels)
        A, S = A0.clone().requires_grad_(True), S0.clone().requires_grad_(True)
        X = affine_chain(A, S)
        grads[kernels] = (X, *torch.autograd.grad((X * w).sum(), (A, S)))
    for a, b in zip(grads["0"], grads["1"], strict=True):
        assert _rel(b, a) < 1e-5


def test_packed_chains_kernel_matches_each_chain_alone() -> None:
    """The combine pass's scan: chains of 4, 1, 0 and 6 items in one launch, each chain's prefix
    states (zero start included) where the packing says, against the loop over that chain alone."""
    from hypic.ops.scan import chain_loop, rows
    from hypic.ops.triton_chain import addresses, matrix_chains_at

    g = torch.Generator().manual_seed(4)
    cu = [0, 4, 5, 5, 11]
    T, S = 0.3 * torch.randn(11, 3, 16, 16, generator=g), torch.randn(11, 3, 16, 8, generator=g)
    X = matrix_chains_at(addresses(rows(T), T.device)[0], addresses(rows(S), S.device)[0], torch.tensor(cu), 3, 16, 8)
    assert X.shape == (15, 3, 16, 8)
    for c, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        want = chain_loop("matrix", T[a:b].double(), S[a:b].double())
        assert float((X[a + c:b + c + 1].double() - want).abs().max()) <= 1e-5 * (1 + float(want.abs().max()))


@pytest.mark.parametrize("with_transition", [False, True])
def test_training_chunk_path_with_the_chain_kernel(monkeypatch, with_transition: bool) -> None:
    """The differentiable chunked GDN (training's path: torch kernels, the chunk chain on the scan
    kernel when kernels are on) gives the same outputs, final state, T and gradients either way."""
    import hypic.ops.triton_chain as triton_chain
    from hypic.ops.linear import backend_override, linear_attention
    from hypic.ops.samples import family_inputs, token_kwargs

    launches = []
    chain = triton_chain.matrix_chain
    monkeypatch.setattr(triton_chain, "matrix_chain", lambda *a, **k: launches.append(1) or chain(*a, **k))
    lens = [70, 5, 130]
    cu = torch.tensor([0, *lens]).cumsum(0)
    x0 = {n: t.float() for n, t in family_inputs("gdn", sum(lens), heads=2, value_heads=4, key_dim=16, value_dim=8,
                                                   seed=5).items()}
    s0 = torch.randn(len(lens), 4, 16, 8)
    results = {}
    for kernels in ("0", "1"):
        monkeypatch.setenv("HYPIC_INTERPRET_KERNELS", kernels)
        x = {n: t.clone().requires_grad_(True) for n, t in x0.items()}
        with backend_override("torch"):
            out = linear_attention("gdn", x["q"], x["k"], x["v"], **token_kwargs(x), cu_seqlens=cu, initial_state=s0,
                                   output_summary=with_transition)
        loss = out.o.square().sum() + out.final_state.sum()
        if with_transition:
            loss = loss + out.summary.transition.square().sum()
        grads = torch.autograd.grad(loss, [x["q"], x["k"], x["v"]])
        results[kernels] = (out.o, out.final_state, *grads) + ((out.summary.transition,) if with_transition else ())
        assert len(launches) == (2 if kernels == "1" else 0)  # forward and backward: one chain launch each
    for a, b in zip(results["0"], results["1"], strict=True):
        assert _rel(b, a) < 1e-4


def test_gdn_gates_match_torch() -> None:
    import torch.nn.functional as F

    from hypic.ops.triton_gates import gdn_gates

    g = torch.Generator().manual_seed(3)
    wide = 8 * torch.randn(50, 20, generator=g)  # strided rows, values past softplus's threshold of 20
    wide[0, :6] = torch.tensor([-40.0, -20.0, 0.0, 19.9, 20.1, 60.0])
    a, b = wide[:, :6], wide[:, 10:16]
    A_log, dt_bias = torch.randn(6, generator=g), torch.randn(6, generator=g)
    got_g, got_beta = gdn_gates(a, b, A_log, dt_bias)
    want_g = -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    assert ((got_g.double() - want_g).abs() <= 1e-5 * (1 + want_g.abs())).all()
    assert (got_beta.double() - torch.sigmoid(b.double())).abs().max() < 1e-6
