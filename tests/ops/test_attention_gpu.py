"""The CUDA attention paths (flash with GQA, bottom-right causal, padded groups, the additive bias)
against the explicit position mask, in bf16 on the GPU."""

import pytest
import torch

from hypic.ops.attention import attention
from hypic.ops.attention_batch import causal_prefill_batch

pytestmark = pytest.mark.gpu


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def test_cuda_attention_paths_match_the_explicit_mask() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    past, new = 700, 300

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).bfloat16()

    q, k, v = rnd(new, 16, 256), rnd(past + new, 4, 256), rnd(past + new, 4, 256)
    q_pos, k_pos = torch.arange(past, past + new, device="cuda"), torch.arange(past + new, device="cuda")
    ref = attention(q.float(), k.float(), v.float(), q_positions=q_pos, k_positions=k_pos, scale=0.0625)
    suffix = attention(q, k, v, q_positions=q_pos, k_positions=k_pos, scale=0.0625, causal_suffix=True)
    masked = attention(q, k, v, q_positions=q_pos, k_positions=k_pos, scale=0.0625)
    bias = torch.zeros(new, past + new, device="cuda", dtype=torch.bfloat16).masked_fill(
        k_pos[None, :] > q_pos[:, None], float("-inf"))
    biased = attention(q, k, v, q_positions=None, k_positions=None, scale=0.0625, visible=bias)
    for got in (suffix, masked, biased):
        assert got.dtype == torch.bfloat16 and _rel(got, ref) < 1e-2

    lengths = [300, 290, 17, 1, 64]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    T = int(cu[-1])
    qs, ks, vs = rnd(T, 16, 256), rnd(T, 4, 256), rnd(T, 4, 256)
    runs = zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
    one_by_one = torch.cat([attention(qs[a:b], ks[a:b], vs[a:b], q_positions=None, k_positions=None, scale=0.0625,
                                      causal_prefill=True) for a, b in runs])
    assert _rel(causal_prefill_batch(qs, ks, vs, cu, 0.0625), one_by_one) < 1e-2


def test_long_prefill_on_a_bucketed_length_matches_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    """A causal prefill past CUDNN_MIN_TOKENS takes cuDNN on a length padded to its bucket; its
    outputs are the unpadded ones (against flash attention on the exact length)."""
    from hypic.ops import attention as attention_module

    gen = torch.Generator(device="cuda").manual_seed(3)
    n = attention_module.CUDNN_MIN_TOKENS + 37
    assert attention_module.long_length(n) > n
    q, k, v = (torch.randn(n, h, 256, device="cuda", generator=gen).bfloat16() for h in (16, 4, 4))
    kw = dict(q_positions=None, k_positions=None, scale=0.0625, causal_prefill=True)
    with torch.no_grad():
        long = attention(q, k, v, **kw)
        monkeypatch.setattr(attention_module, "CUDNN_MIN_TOKENS", 1 << 40)
        flash = attention(q, k, v, **kw)
    assert long.shape == flash.shape and _rel(long, flash) < 1e-2
