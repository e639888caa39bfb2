"""Qwen3.5 dense: parity with transformers (fp32, CPU), batched varlen, sharded checkpoints."""

import pytest
import torch
import transformers as T

from hypic.models.loader import load_model
from tests.models.harness import (
    TINY_BASE,
    TINY_GDN,
    assert_greedy_matches_transformers,
    assert_prefill_matches_transformers,
    assert_varlen_equals_alone,
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
    assert_prefill_matches_transformers(*qwen3_5)


def test_greedy_decode_matches_transformers(qwen3_5) -> None:
    assert_greedy_matches_transformers(*qwen3_5)


def test_varlen_batch_equals_sequences_alone(qwen3_5) -> None:
    assert_varlen_equals_alone(qwen3_5[1])


def test_sharded_checkpoint_loads_the_same(qwen3_5, tmp_path) -> None:
    ref, loaded = qwen3_5
    sharded = load_model(save_checkpoint(ref, tmp_path / "sharded", max_shard_size="200KB"), device="cpu")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    ids = torch.randint(3, 512, (50,), generator=torch.Generator().manual_seed(4))
    assert torch.equal(hypic_logits(sharded, ids), hypic_logits(loaded, ids))
