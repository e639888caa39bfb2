"""Scatter over GPUs (NCCL): entries prefilled on another GPU equal the engine's own."""

import pytest
import torch

from hypic.bench.shapes import SHAPES
from hypic.engine.engine import Engine
from hypic.models.random_init import random_model

pytestmark = pytest.mark.gpu


def test_entries_from_another_gpu_equal_the_engines_own():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    loaded = random_model(SHAPES["tiny"], device="cuda:0", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (300, 40, 700, 129, 64, 1000)]
    prompt = [docs[0], *docs[1:], [7, 8, 9]]
    alone = Engine(loaded, seam=8)
    want, _ = alone.prefill_logits([prompt])
    pooled = Engine(loaded, seam=8, cold_workers=1)
    try:
        got, metrics = pooled.prefill_logits([prompt])
        assert metrics[0].segment_misses == len(docs)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2)  # bf16 logits: one kernel batch vs two
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        remote = [k for k, o in zip(pooled.pool.route([(d, 8, None) for d in docs]), docs, strict=True) if k]
        assert remote, "the router must send some documents to the other GPU"
        for key, mine in pooled.store._tiers["device"].items():
            other = alone.store._tiers["device"][key]
            assert all(t.device == torch.device("cuda:0") for t in mine.keys.values())
            for layer, s in mine.summaries.items():
                torch.testing.assert_close(s.state, other.summaries[layer].state, rtol=2e-2, atol=2e-3)
                torch.testing.assert_close(s.transition, other.summaries[layer].transition, rtol=2e-2, atol=2e-3)
            for layer, k in mine.keys.items():
                torch.testing.assert_close(k, other.keys[layer], rtol=2e-2, atol=2e-2)
    finally:
        pooled.close()
