"""Tiny random checkpoints for the engine tests: one GDN family (Qwen3.5), more as they exist."""

import pytest
import torch
import transformers as T

from tests.models.harness import TINY_BASE, TINY_GDN, randomize_norms, save_checkpoint


@pytest.fixture(scope="session")
def qwen3_5_path(tmp_path_factory):
    torch.manual_seed(0)
    ref = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**TINY_BASE, **TINY_GDN, intermediate_size=256,
                                                   eos_token_id=None)).eval()
    randomize_norms(ref)
    with torch.no_grad():  # give the GDN gates a real spread of decays
        for layer in ref.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-1.0, 1.0)
    return save_checkpoint(ref, tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(scope="session")
def linear_only_path(tmp_path_factory):
    """One GDN layer and nothing else: the combine pass is exact for any seam ≥ W − 1."""
    torch.manual_seed(1)
    cfg = dict(TINY_BASE, num_hidden_layers=1)
    ref = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**cfg, **TINY_GDN, intermediate_size=256,
                                                   layer_types=["linear_attention"], eos_token_id=None)).eval()
    randomize_norms(ref)
    return save_checkpoint(ref, tmp_path_factory.mktemp("linear_only"))
