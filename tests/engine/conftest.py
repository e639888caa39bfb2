"""Tiny random checkpoints for the engine tests: GDN (Qwen3.5), KDA + NoPE MLA (Kimi-Linear), scalar
decay with RoPE inside the linear layers (Ring-linear) and without (MiniMax, whose residual adds the
normed input)."""

import json

import pytest
import torch
import transformers as T
from safetensors.torch import save_file

from tests.models.harness import TINY_BASE, TINY_GDN, randomize_norms, save_checkpoint
from tests.models.test_kimi_linear import TINY_KIMI
from tests.models.test_minimax import tiny_reference as minimax_reference
from tests.models.test_ring_linear import CONFIG as RING_CONFIG
from tests.models.test_ring_linear import tiny_checkpoint as ring_weights


def _qwen3_5(path, **overrides):
    torch.manual_seed(0)
    ref = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**{**TINY_BASE, **TINY_GDN, "intermediate_size": 256,
                                                      "eos_token_id": None, **overrides})).eval()
    randomize_norms(ref)
    with torch.no_grad():  # a real spread of decays
        for layer in ref.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-1.0, 1.0)
    return save_checkpoint(ref, path)


def _kimi(path):
    torch.manual_seed(0)
    ref = T.KimiLinearForCausalLM(T.KimiLinearConfig(**{**TINY_KIMI, "eos_token_id": None})).eval()
    randomize_norms(ref)
    return save_checkpoint(ref, path)


def _ring(path, **overrides):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**RING_CONFIG, **overrides}))
    save_file(ring_weights(RING_CONFIG), str(path / "model.safetensors"))
    return path


# YaRN over a short pretraining context, so the tiny prompts' positions feel both the rescaled
# frequencies and the attention factor
_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def _minimax(path):
    return save_checkpoint(minimax_reference(eos_token_id=None), path)


BUILDERS = {"qwen3_5": _qwen3_5, "kimi_linear": _kimi, "ring_linear": _ring, "minimax": _minimax,
            "qwen3_5_yarn": lambda path: _qwen3_5(path, rope_scaling=_YARN),
            "ring_linear_yarn": lambda path: _ring(path, rope_scaling=_YARN)}


@pytest.fixture(scope="session")
def model_paths(tmp_path_factory):
    return {name: build(tmp_path_factory.mktemp(name)) for name, build in BUILDERS.items()}


@pytest.fixture(scope="session")
def qwen3_5_path(model_paths):
    return model_paths["qwen3_5"]


@pytest.fixture(scope="session")
def linear_only_path(tmp_path_factory):
    """One GDN layer and nothing else: the combine pass is exact for any seam ≥ W − 1."""
    return _qwen3_5(tmp_path_factory.mktemp("linear_only"), num_hidden_layers=1, layer_types=["linear_attention"])
