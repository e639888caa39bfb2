"""Qwen3-Next: parity with transformers (fp32, CPU) with peaked routing, dense and MoE layers mixed,
``norm_topk_prob`` off; batched varlen decoding."""

import pytest
import torch
import transformers as T

from hypic.models.layers.mlp import SwiGLU
from hypic.models.layers.moe import MoE
from hypic.models.loader import load_model
from hypic.models.qwen3_next import build_qwen3_next
from tests.models.harness import (
    TINY_BASE,
    TINY_GDN,
    TINY_MOE,
    assert_greedy_matches_transformers,
    assert_prefill_matches_transformers,
    assert_varlen_equals_alone,
    randomize_norms,
    save_checkpoint,
)


def randomize_routers(model: torch.nn.Module, scale: float = 2.0, seed: int = 0) -> None:
    """Router and shared-expert-gate logits of std ≈ ``scale``: the default init gives near-uniform
    expert probabilities and a shared gate stuck at σ(0) = ½, which would hide routing mistakes."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5)


# Layer 2 dense (mlp_only_layers); without renormalisation the top-2 weights sum to < 1, so ignoring
# norm_topk_prob changes the output.
CONFIG = dict(**TINY_BASE, **TINY_GDN, **TINY_MOE, intermediate_size=256, mlp_only_layers=[2], norm_topk_prob=False)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    torch.manual_seed(0)
    ref = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**CONFIG)).eval()
    randomize_norms(ref)
    randomize_routers(ref)
    path = save_checkpoint(ref, tmp_path_factory.mktemp("qwen3_next"))
    return ref, load_model(path, device="cpu")


def test_prefill_logits_match_transformers(qwen3_next) -> None:
    assert_prefill_matches_transformers(*qwen3_next)


def test_greedy_decode_matches_transformers(qwen3_next) -> None:
    assert_greedy_matches_transformers(*qwen3_next)


def test_varlen_batch_equals_sequences_alone(qwen3_next) -> None:
    assert_varlen_equals_alone(qwen3_next[1])


@pytest.mark.parametrize("sparse_step, mlp_only", [(1, []), (2, []), (2, [1]), (1, [0, 3])])
def test_moe_layers_follow_the_config(sparse_step: int, mlp_only: list[int]) -> None:
    cfg = T.Qwen3NextConfig(**TINY_BASE, **TINY_GDN, **TINY_MOE, intermediate_size=256,
                            decoder_sparse_step=sparse_step, mlp_only_layers=mlp_only)
    with torch.device("meta"):
        ref = T.Qwen3NextForCausalLM(cfg)
        ours = build_qwen3_next(cfg.to_dict())
    want = [isinstance(layer.mlp, T.models.qwen3_next.modeling_qwen3_next.Qwen3NextSparseMoeBlock)
            for layer in ref.model.layers]
    assert [isinstance(layer.mlp, MoE) for layer in ours.model.layers] == want
    assert all(isinstance(layer.mlp, SwiGLU) for layer, moe in zip(ours.model.layers, want, strict=True) if not moe)
