"""Qwen3.5-MoE: parity with transformers (fp32, CPU) with peaked routing, batched varlen decoding, and
the vision-language checkpoint layout (``Qwen3_5MoeForConditionalGeneration``) loading as text."""

import pytest
import torch
import transformers as T

from hypic.models.loader import load_model
from tests.models.harness import (
    TINY_BASE,
    TINY_GDN,
    TINY_MOE,
    assert_greedy_matches_transformers,
    assert_prefill_matches_transformers,
    assert_varlen_equals_alone,
    hypic_logits,
    randomize_norms,
    save_checkpoint,
)
from tests.models.test_qwen3_next import randomize_routers

TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TINY_BASE["hidden_size"])


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory):
    torch.manual_seed(0)
    ref = T.Qwen3_5MoeForCausalLM(T.Qwen3_5MoeTextConfig(**TINY_BASE, **TINY_GDN, **TINY_MOE)).eval()
    randomize_norms(ref)
    randomize_routers(ref)
    path = save_checkpoint(ref, tmp_path_factory.mktemp("qwen3_5_moe"))
    return ref, load_model(path, device="cpu")


def test_prefill_logits_match_transformers(qwen3_5_moe) -> None:
    assert_prefill_matches_transformers(*qwen3_5_moe)


def test_greedy_decode_matches_transformers(qwen3_5_moe) -> None:
    assert_greedy_matches_transformers(*qwen3_5_moe)


def test_varlen_batch_equals_sequences_alone(qwen3_5_moe) -> None:
    assert_varlen_equals_alone(qwen3_5_moe[1])


def test_vision_language_checkpoint_loads_as_text_model(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = T.Qwen3_5MoeConfig(text_config=dict(**TINY_BASE, **TINY_GDN, **TINY_MOE), vision_config=TINY_VISION)
    ref = T.Qwen3_5MoeForConditionalGeneration(cfg).eval()
    randomize_norms(ref)
    randomize_routers(ref)
    loaded = load_model(save_checkpoint(ref, tmp_path / "vl"), device="cpu")
    ids = torch.randint(3, 512, (64,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = ref(input_ids=ids[None]).logits[0]
    assert (hypic_logits(loaded, ids) - expected).abs().max() <= 1e-4
