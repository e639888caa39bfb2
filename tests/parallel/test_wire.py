"""Entries survive packing into one buffer: every family's summaries, conv tails, keys, values."""

import pytest
import torch

from hypic.cache.keys import segment_key
from hypic.engine.cold import ColdContext
from hypic.models.loader import load_model
from hypic.parallel.wire import ALIGN, pack, split


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear", "ring_linear", "minimax"])
def test_pack_unpack_is_bitwise(model_paths, family):
    loaded = load_model(model_paths[family], device="cpu", dtype="bfloat16")
    g = torch.Generator().manual_seed(1)
    segments = [(torch.randint(0, 64, (n,), generator=g).tolist(), w) for n, w in ((23, 4), (9, 0))]
    ctx = ColdContext([(ids, w, segment_key(ids, model_fingerprint="t", seam=w, dtype="bf16")) for ids, w in segments],
                      torch.device("cpu"))
    with torch.no_grad():
        loaded.model.hidden_states(ctx.input_ids, ctx)
    headers, buf = pack(ctx.entries)
    assert buf.dtype == torch.uint8 and buf.numel() == sum(h.nbytes for h in headers)
    for entry, header, back in zip(ctx.entries, headers, split(headers, buf), strict=True):
        assert all(f[4] % ALIGN == 0 for f in header.fields) and header.nbytes % ALIGN == 0
        assert back.summaries[min(back.summaries)].state.untyped_storage().nbytes() == header.nbytes  # its own copy
        assert (back.key, back.token_ids, back.seam) == (entry.key, entry.token_ids, entry.seam)
        assert back.nbytes == entry.nbytes
        for layer, s in entry.summaries.items():
            t = back.summaries[layer]
            assert (s.transition is None) == (t.transition is None)
            if s.transition is not None:
                assert s.transition.dtype == t.transition.dtype and torch.equal(s.transition, t.transition)
            assert s.state.dtype == t.state.dtype and torch.equal(s.state, t.state)
        for name in ("conv_tails", "keys", "values"):
            mine, theirs = getattr(entry, name), getattr(back, name)
            assert mine.keys() == theirs.keys() and (mine or name == "conv_tails")  # Ring-linear has no conv
            for layer in mine:
                assert mine[layer].dtype == theirs[layer].dtype and torch.equal(mine[layer], theirs[layer])


def test_a_buffer_of_the_wrong_size_is_refused(model_paths):
    loaded = load_model(model_paths["qwen3_5"], device="cpu", dtype="float32")
    ids = list(range(12))
    ctx = ColdContext([(ids, 2, segment_key(ids, model_fingerprint="t", seam=2, dtype="f32"))], torch.device("cpu"))
    with torch.no_grad():
        loaded.model.hidden_states(ctx.input_ids, ctx)
    headers, buf = pack(ctx.entries)
    with pytest.raises(ValueError, match="bytes"):
        split(headers, buf[:-1])
