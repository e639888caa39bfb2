"""The combine pass's packed key layout (``CombineContext._packed_keys``, built from items by range
expansion) against a per-key reference walked from the plans: where every recomputed row and every
cached body key goes, the positions the bodies are roped at, each run's visible key prefix, and the
non-flash path's mask — for a warm request with seams and one with an in-context miss, under both
RoPE treatments (``hypic``: true positions; ``addition``: standalone ones)."""

import pytest
import torch

from hypic.bench.shapes import SHAPES
from hypic.bench.ttft import RagShape, rag_prompts
from hypic.engine.combine import CombineContext, _ranges
from hypic.engine.engine import Engine
from hypic.engine.modes import ASSEMBLY
from hypic.engine.request import SamplingParams
from hypic.models.random_init import random_model


def test_ranges_concatenates_each_range_including_empty_ones() -> None:
    starts, lengths = [5, 0, 9, 2], [3, 0, 1, 4]
    got = _ranges(torch.tensor(starts), torch.tensor(lengths), sum(lengths))
    assert got.tolist() == [x for s, n in zip(starts, lengths, strict=True) for x in range(s, s + n)]
    assert _ranges(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), 0).numel() == 0


def _reference(ctx: CombineContext, rope_fix: bool):
    """Per request, walk its items key by key: (slot of each recomputed row, slot and roped position
    of each body key, each key's true position, each run's (request key start, keys it sees))."""
    cu = ctx.linear_cu.tolist()
    positions = ctx.positions.tolist()
    run_dest, body_dest, body_pos, key_pos, runs, offsets = [], [], [], [], [], [0]
    for items in ctx.items:
        base = offsets[-1]
        for kind, item in items:
            if kind == "run":
                for r in range(cu[item], cu[item + 1]):
                    run_dest.append(len(key_pos))
                    key_pos.append(positions[r])
                runs.append((base, len(key_pos) - base))
            else:
                e = item.entry
                for j in range(e.seam, e.length):
                    body_dest.append(len(key_pos))
                    body_pos.append(item.start + j if rope_fix else j)
                    key_pos.append(item.start + j)
        offsets.append(len(key_pos))
    return run_dest, body_dest, body_pos, key_pos, runs, offsets


@pytest.mark.parametrize("mode", ["hypic", "addition"])
def test_packed_keys_match_a_per_key_walk(mode: str) -> None:
    loaded = random_model(SHAPES["tiny"], device="cpu", dtype=torch.float32)
    engine = Engine(loaded, seam=3)
    prompts = rag_prompts(RagShape(4, 12, 6, 5), loaded.model.vocab_size, 3, seed=4)
    engine.generate([prompts[0]], [SamplingParams(max_tokens=1)], mode=mode)  # its documents cached
    fresh = [[(t + 1) % loaded.model.vocab_size for t in prompts[2][1]]]  # one document never seen: in context
    asked = [prompts[1], [prompts[2][0], *fresh, *prompts[2][2:]]]
    plans = [engine._plan(p, mode, None) for p in asked]
    ctx = CombineContext(plans, ASSEMBLY[mode], torch.device("cpu"))
    pk = ctx._packed_keys()
    run_dest, body_dest, body_pos, key_pos, runs, offsets = _reference(ctx, ASSEMBLY[mode].rope_fix)
    assert pk.offsets == offsets and len(pk.bodies) > 2
    assert pk.run_dest.tolist() == run_dest
    assert pk.body_dest.tolist() == body_dest and pk.body_pos.tolist() == body_pos
    assert list(zip(pk.runs.cu_keys[:-1].tolist(), pk.runs.used.tolist(), strict=True)) == runs
    assert pk.runs.cu_rows.tolist() == ctx.linear_cu.tolist()
    for i, (ra, rb) in enumerate(ctx.request_rows):
        a, b = offsets[i], offsets[i + 1]
        want = torch.tensor(key_pos[a:b])[None, :] <= ctx.positions[ra:rb, None]
        assert torch.equal(ctx._bias(i, torch.float32) == 0, want)
