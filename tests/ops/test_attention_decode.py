"""A decode step's attention over a padded token-major arena against an fp64 reference that looks at
each sequence's used rows alone (so padding that leaked in, or a row cut off, fails)."""

import pytest
import torch

from hypic.ops import attention_decode
from hypic.ops.attention_decode import DecodeSpan, decode_attention, uses_flash


def _case(slots: int, cap: int, hq: int, hkv: int, d: int, dv: int, device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(slots, hq, d, generator=g, dtype=torch.float64)
    keys = torch.randn(slots, cap, hkv, d, generator=g, dtype=torch.float64)
    values = torch.randn(slots, cap, hkv, dv, generator=g, dtype=torch.float64)
    used = torch.randint(1, cap + 1, (slots,), generator=g)
    used[0] = cap  # one sequence fills its rows, one sees a single row
    used[-1] = 1
    return q, keys, values, used, [x.to(device, dtype) for x in (q, keys, values)]


def _reference(q, keys, values, used, scale):
    out = []
    for i, n in enumerate(used.tolist()):
        k = keys[i, :n].repeat_interleave(q.shape[1] // keys.shape[2], 1)  # [n, Hq, D]
        v = values[i, :n].repeat_interleave(q.shape[1] // keys.shape[2], 1)
        w = torch.einsum("hd,nhd->hn", q[i], k).mul(scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", w, v))
    return torch.stack(out)


@pytest.mark.parametrize("dv", [16, 8], ids=["equal-heads", "mla-value-heads"])
def test_on_the_cpu_each_sequence_attends_its_used_rows_only(dv: int) -> None:
    q, keys, values, used, (qc, kc, vc) = _case(5, 40, 8, 2, 16, dv, "cpu", torch.float32)
    kc[:, :, :, :] = torch.where(torch.arange(40)[None, :, None, None] < used[:, None, None, None], kc, 1e4)
    span = DecodeSpan(used.to(torch.int32), 40)
    out = decode_attention(qc, kc, vc, span, 0.25)
    assert out.shape == (5, 8, dv)
    torch.testing.assert_close(out.double(), _reference(q, keys, values, used, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_a_gpu_the_flash_kernel_matches_fp64_and_replays_in_a_graph(dtype: torch.dtype) -> None:
    q, keys, values, used, (qc, kc, vc) = _case(6, 512, 16, 4, 256, 256, "cuda", dtype)
    assert uses_flash(qc, kc, vc)
    span = DecodeSpan(used.to("cuda", torch.int32), 512)
    ref = _reference(q, keys, values, used, 256**-0.5)
    out = decode_attention(qc, kc, vc, span, 256**-0.5)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=0, atol=2e-2)
    # the same inputs in place, captured once, replayed after new rows and lengths: what a step does
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin()
        captured = decode_attention(qc, kc, vc, span, 256**-0.5)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    q2, keys2, values2, used2, (qn, kn, vn) = _case(6, 512, 16, 4, 256, 256, "cuda", dtype, seed=1)
    for mine, new in ((qc, qn), (kc, kn), (vc, vn), (span.used, used2.to("cuda", torch.int32))):
        mine.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured.double().cpu(), _reference(q2, keys2, values2, used2, 256**-0.5),
                               rtol=0, atol=2e-2)


@pytest.mark.gpu
def test_on_a_gpu_sdpa_and_flash_agree(monkeypatch) -> None:
    """HYPIC_DECODE_FLASH=0 (SDPA over the padded arena) is the A/B's other arm: same answer."""
    _, _, _, used, (qc, kc, vc) = _case(4, 300, 16, 4, 128, 128, "cuda", torch.bfloat16)
    span = DecodeSpan(used.to("cuda", torch.int32), 300)
    flash = decode_attention(qc, kc, vc, span, 0.1)
    monkeypatch.setattr(attention_decode, "FLASH", False)
    assert not uses_flash(qc, kc, vc)
    torch.testing.assert_close(decode_attention(qc, kc, vc, span, 0.1), flash, rtol=0, atol=2e-2)
