"""The one-launch GDN combine (``ops.triton_gdn_combine``) against the fp64 reference: each request's
items walked in order — cached bodies applied as ``T·x + S``, recompute runs stepped token by token —
every output row and each request's state after its last run.

The kernel runs on CUDA (marked ``gpu``) and, for its logic without a GPU, in Triton's interpreter
(``TRITON_INTERPRET=1``, as tests/ops/test_triton_interpret.py)."""

import importlib.util
import os

import pytest
import torch

from hypic.ops import recurrence as R
from hypic.ops.samples import family_inputs, token_kwargs

interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs triton and TRITON_INTERPRET=1")

# three requests: runs (first row, end row) and bodies (index), in position order
REQUESTS = [[("run", 0, 3), ("body", 0), ("run", 3, 5), ("body", 1), ("body", 2), ("run", 5, 9)],
            [("body", 3), ("run", 9, 10)],
            [("run", 10, 14)]]


def _case(K: int, V: int, H: int = 2, HV: int = 4, rows: int = 14, bodies: int = 4):
    x = family_inputs("gdn", rows, heads=H, value_heads=HV, key_dim=K, value_dim=V, seed=3)
    spans = [family_inputs("gdn", n, heads=H, value_heads=HV, key_dim=K, value_dim=V, seed=10 + i)
             for i, n in enumerate((5, 9, 2, 7)[:bodies])]
    summaries = [R.summarize("gdn", R.expand_heads(s["k"], HV), s["v"], **token_kwargs(s)) for s in spans]
    return x, summaries


def _reference(x, summaries, scale):
    o = torch.zeros_like(x["v"])
    finals = []
    for items in REQUESTS:
        state = torch.zeros(x["v"].shape[1], x["q"].shape[2], x["v"].shape[2], dtype=torch.float64)
        for item in items:
            if item[0] == "body":
                state = R.apply("gdn", summaries[item[1]], state)
            else:
                a, b = item[1], item[2]
                out = R.run("gdn", x["q"][a:b], x["k"][a:b], x["v"][a:b], **token_kwargs(x, slice(a, b)),
                            initial_state=state, scale=scale)
                o[a:b], state = out.o, out.final_state
        finals.append(state)
    return o, torch.stack(finals)


def _fused(x, summaries, scale, device, dtype, shape=(32, 2), precision="tf32x3"):
    from hypic.ops import triton_gdn_combine as fused
    from hypic.ops.triton_chain import addresses

    sched = [[(fused.RUN, it[1], it[2]) if it[0] == "run" else (fused.BODY, it[1], 0) for it in items]
             for items in REQUESTS]
    items, cu = fused.schedule(sched, torch.device(device))
    T, held_t = addresses([(s.transition, None) for s in summaries], torch.device(device))
    S, held_s = addresses([(s.state, None) for s in summaries], torch.device(device))
    t = {n: v.to(device, dtype if n in ("q", "k", "v") else torch.float32) for n, v in x.items()}
    return fused.gdn_combine(t["q"], t["k"], t["v"], t["g"], t["beta"], scale, T, S, items, cu,
                             block_v=shape[0], warps=shape[1], precision=precision,
                             **({"body_chunk": shape[2]} if len(shape) > 2 else {}))


@interpreter
@pytest.mark.parametrize("shape", [(32, 2, 16), (16, 1, 32)])
def test_in_the_interpreter_the_fused_combine_matches_fp64(shape: tuple[int, int, int]) -> None:
    """K = 16: one K-chunk of 16, or below a chunk of 32 (masked); V = 8 below the value block."""
    x, summaries = _case(K=16, V=8)
    want_o, want_final = _reference(x, summaries, 0.3)
    o, final = _fused(x, summaries, 0.3, "cpu", torch.float32, shape)
    assert (o.double() - want_o).abs().max() < 1e-4
    assert (final.double() - want_final).abs().max() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize(("shape", "precision"), [((32, 2), "tf32x3"), ((16, 1), "tf32x3"), ((128, 8), "tf32x3"),
                                                   ((32, 2), "bf16x3"), ((32, 2, 32), "bf16x3"), ((32, 2), "bf16x6")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_the_fused_combine_matches_fp64(dtype: torch.dtype, shape: tuple[int, ...], precision: str) -> None:
    """At the 9B shape's head sizes (K = V = 128); bf16 inputs rounded once, the state kept in fp32."""
    x, summaries = _case(K=128, V=128)
    if dtype == torch.bfloat16:  # the reference sees the same rounded inputs
        x = {n: v.to(dtype).double() if n in ("q", "k", "v") else v for n, v in x.items()}
    want_o, want_final = _reference(x, summaries, 128**-0.5)
    o, final = _fused(x, summaries, 128**-0.5, "cuda", dtype, shape, precision)
    tol = 2e-3 if dtype == torch.float32 else 2e-2
    assert ((o.double().cpu() - want_o).norm() / want_o.norm()) < tol
    assert ((final.double().cpu() - want_final).norm() / want_final.norm()) < 1e-3


def test_bad_layouts_are_refused() -> None:
    """Rows may be strided, but each row's heads and dims must be packed (the kernel's addressing)."""
    pytest.importorskip("triton")
    from hypic.ops.triton_gdn_combine import gdn_combine

    q = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match="k's heads and dims"):
        gdn_combine(q, torch.zeros(3, 8, 2).transpose(1, 2), torch.zeros(3, 2, 4), torch.zeros(3, 2),
                    torch.zeros(3, 2), 1.0, torch.zeros(0), torch.zeros(0), torch.zeros(0, 3), torch.zeros(1))


def test_a_bad_combine_precision_is_refused(monkeypatch) -> None:
    from hypic.ops.kernels import combine_precision

    monkeypatch.delenv("HYPIC_COMBINE_PRECISION", raising=False)
    assert combine_precision() == "tf32x3"
    monkeypatch.setenv("HYPIC_COMBINE_PRECISION", "fp8")
    with pytest.raises(ValueError, match="HYPIC_COMBINE_PRECISION"):
        combine_precision()
    monkeypatch.setenv("HYPIC_COMBINE_PRECISION", "bf16x3")
    assert combine_precision() == "bf16x3"


def test_the_schedules_offsets_start_16_byte_aligned_whatever_the_item_count() -> None:
    """Triton compiles a kernel again for a pointer argument that is not 16-byte aligned: an odd item
    count put ``cu`` at an unaligned offset of its buffer, and a request meeting it first paid a
    compile after the warm-up (0.7 s on the H200, scripts/first_requests.py)."""
    pytest.importorskip("triton")
    from hypic.ops import triton_gdn_combine as fused

    for n in range(1, 9):
        items, cu = fused.schedule([[(fused.RUN, i, i + 1) for i in range(n)], [(fused.BODY, 0, 0)]],
                                   torch.device("cpu"))
        assert cu.data_ptr() % 16 == 0 and items.data_ptr() % 16 == 0, n
        assert items.tolist() == [[fused.RUN, i, i + 1] for i in range(n)] + [[fused.BODY, 0, 0]]
        assert cu.tolist() == [0, n, n + 1]
