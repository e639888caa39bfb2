"""Qwen3.5 dense: parity with transformers (fp32, CPU), batched varlen, sharded checkpoints."""

import pytest
import torch
import transformers as T

from hypic.models.loader import load_model
from tests.models.harness import (
    TINY_BASE,
    TINY_GDN,
    hf_greedy,
    hypic_greedy,
    hypic_logits,
    randomize_norms,
    save_checkpoint,
)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    torch.manual_seed(0)
    ref = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**TINY_BASE, **TINY_GDN, intermediate_size=256)).eval()
    randomize_norms(ref)
    path = save_checkpoint(ref, tmp_path_factory.mktemp("qwen3_5"))
    return ref, load_model(path, device="cpu")


def test_prefill_logits_match_transformers(qwen3_5) -> None:
    ref, loaded = qwen3_5
    ids = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    assert (hypic_logits(loaded, ids) - expected).abs().max() <= 1e-4


def test_greedy_decode_matches_transformers(qwen3_5) -> None:
    ref, loaded = qwen3_5
    prompt = torch.randint(3, 512, (37,), generator=torch.Generator().manual_seed(2))
    want, want_logits = hf_greedy(ref, prompt, 20)
    got, got_logits = hypic_greedy(loaded, [prompt], 20)
    assert got[0] == want
    assert (got_logits[:, 0] - want_logits).abs().max() <= 1e-4


def test_varlen_batch_equals_sequences_alone(qwen3_5) -> None:
    _, loaded = qwen3_5
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randint(3, 512, (70,), generator=gen), torch.randint(3, 512, (129,), generator=gen)
    both_tokens, both_logits = hypic_greedy(loaded, [a, b], 5)
    for i, p in enumerate((a, b)):
        alone_tokens, alone_logits = hypic_greedy(loaded, [p], 5)
        assert both_tokens[i] == alone_tokens[0]
        assert (both_logits[:, i] - alone_logits[:, 0]).abs().max() <= 1e-5


def test_sharded_checkpoint_loads_the_same(qwen3_5, tmp_path) -> None:
    ref, loaded = qwen3_5
    sharded = load_model(save_checkpoint(ref, tmp_path / "sharded", max_shard_size="200KB"), device="cpu")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    ids = torch.randint(3, 512, (50,), generator=torch.Generator().manual_seed(4))
    assert torch.equal(hypic_logits(sharded, ids), hypic_logits(loaded, ids))
