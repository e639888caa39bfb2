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
    hf_greedy,
    hypic_greedy,
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
    ref, loaded = qwen3_5_moe
    ids = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
    assert (hypic_logits(loaded, ids) - expected).abs().max() <= 1e-4


def test_greedy_decode_matches_transformers(qwen3_5_moe) -> None:
    ref, loaded = qwen3_5_moe
    prompt = torch.randint(3, 512, (37,), generator=torch.Generator().manual_seed(2))
    want, want_logits = hf_greedy(ref, prompt, 20)
    got, got_logits = hypic_greedy(loaded, [prompt], 20)
    assert got[0] == want
    assert (got_logits[:, 0] - want_logits).abs().max() <= 1e-4


def test_varlen_batch_equals_sequences_alone(qwen3_5_moe) -> None:
    _, loaded = qwen3_5_moe
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randint(3, 512, (70,), generator=gen), torch.randint(3, 512, (129,), generator=gen)
    both_tokens, both_logits = hypic_greedy(loaded, [a, b], 5)
    for i, p in enumerate((a, b)):
        alone_tokens, alone_logits = hypic_greedy(loaded, [p], 5)
        assert both_tokens[i] == alone_tokens[0]
        assert (both_logits[:, i] - alone_logits[:, 0]).abs().max() <= 1e-5


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
