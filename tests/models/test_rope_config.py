"""Scaled RoPE read from a config: frequencies and attention factor as transformers computes them,
whole models with YaRN and linear scaling against transformers, and the scalings that cannot be
cached position-independently refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hypic.models.loader import load_model
from hypic.models.qwen3_5 import rope_of
from hypic.models.rope_config import rope_scaling
from tests.models.harness import (
    TINY_BASE,
    TINY_GDN,
    TINY_MOE,
    assert_greedy_matches_transformers,
    assert_prefill_matches_transformers,
    hypic_logits,
    randomize_norms,
    save_checkpoint,
)

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "yarn_untruncated": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                         "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                              "attention_factor": 0.9},
    "yarn_mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 128,
                    "mscale": 1.0, "mscale_all_dim": 0.5},
    "yarn_implicit_factor": {"rope_type": "yarn", "original_max_position_embeddings": 1024, "factor": None},
}


def _config(scaling: dict, theta: float = 1e4) -> T.Qwen3_5TextConfig:
    return T.Qwen3_5TextConfig(**TINY_BASE, **TINY_GDN, intermediate_size=64,
                               rope_parameters={**scaling, "rope_theta": theta, "partial_rotary_factor": 0.5})


@pytest.mark.parametrize("name", list(SCALINGS))
def test_frequencies_and_attention_factor_are_transformers(name: str) -> None:
    """The fp32 frequencies and the cos/sin factor equal transformers' own for the same config
    (saved and read back as a checkpoint's config.json is)."""
    config = _config(SCALINGS[name], theta=5e5)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](config, "cpu")
    spec = rope_of(config.to_dict())
    assert spec.rotary_dim == 16 and spec.scaling is not None
    torch.testing.assert_close(spec.inv_freq(torch.float32), want_freq, rtol=2e-7, atol=0)
    assert spec.attention_factor == pytest.approx(want_factor, rel=1e-12)
    plain = rope_of(_config({"rope_type": "default"}, theta=5e5).to_dict())
    assert plain.scaling is None and not torch.allclose(plain.inv_freq(torch.float32), want_freq)


@pytest.mark.parametrize(("scaling", "top"), [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
     {"original_max_position_embeddings": 1024}),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "truncate": None}, {}),
])
def test_yarn_reads_a_top_level_pretraining_length_and_a_null_truncate_as_transformers(scaling: dict,
                                                                                     top: dict) -> None:
    """A top-level ``original_max_position_embeddings`` (Phi-3's place for it) wins over the
    scaling's own, and ``truncate: null`` is false, as transformers reads them."""
    config = T.Qwen3_5TextConfig(**TINY_BASE, **TINY_GDN, intermediate_size=64, **top,
                                 rope_parameters={**scaling, "rope_theta": 5e5, "partial_rotary_factor": 0.5})
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    spec = rope_of(config.to_dict())
    torch.testing.assert_close(spec.inv_freq(torch.float32), want_freq, rtol=2e-7, atol=0)
    assert spec.attention_factor == pytest.approx(want_factor, rel=1e-12)
    plain = rope_of(_config({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
                            theta=5e5).to_dict())
    assert not torch.allclose(plain.inv_freq(torch.float32), want_freq)  # the case differs from the plain read


def test_the_older_rope_scaling_key_reads_the_same() -> None:
    """``rope_scaling`` with ``type`` (configs before transformers 5) gives the same RoPE as the
    same scaling in ``rope_parameters``; asking for two different scalings is refused."""
    top = {**TINY_BASE, **TINY_GDN, "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    old = rope_of({**top, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}})
    new = rope_of({**top, "rope_parameters": {**SCALINGS["yarn"], "rope_theta": 1e4, "partial_rotary_factor": 0.5}})
    assert old == new and old.scaling.kind == "yarn"
    with pytest.raises(ValueError, match="different scalings"):
        rope_of({**top, "rope_scaling": {"type": "linear", "factor": 2.0},
                 "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})


@pytest.mark.parametrize(("spec", "message"), [
    ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic' is not supported: its frequencies grow"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "'longrope' is not supported: it switch"),
    ({"rope_type": "llama3", "factor": 8.0}, "'llama3' is not supported; hypic serves default, mrope, linear, yarn"),
    ({"type": "linear"}, r"config.rope_scaling.factor: required"),
    ({"type": "linear", "factor": 0}, r"config.rope_scaling.factor: expected a finite number > 0, got 0"),
    ({"type": "linear", "factor": float("nan")}, r"factor: expected a finite number > 0"),
    ({"type": "yarn", "factor": 2.0, "original_max_position_embeddings": "big"},
     r"original_max_position_embeddings: expected a positive integer, got 'big'"),
    ({"type": "yarn", "factor": 2.0, "truncate": "yes"}, r"truncate: expected true or false"),
    ({"type": "yarn", "factor": 2.0, "attention_factor": -1.0}, r"attention_factor: expected a finite number > 0"),
    ("yarn", r"config.rope_scaling: expected an object, got str"),
])
def test_unservable_scalings_are_refused_by_name(spec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rope_scaling({"max_position_embeddings": 4096, "rope_scaling": spec})


def _qwen3_5(tmp_path_factory, scaling: dict, cls=T.Qwen3_5ForCausalLM, config_cls=T.Qwen3_5TextConfig, **extra):
    torch.manual_seed(0)
    config = config_cls(**TINY_BASE, **TINY_GDN, intermediate_size=64, **extra,
                        rope_parameters={**scaling, "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    ref = cls(config).eval()
    randomize_norms(ref)
    return ref, load_model(save_checkpoint(ref, tmp_path_factory.mktemp("rope")), device="cpu")


@pytest.mark.parametrize("name", ["linear", "yarn", "yarn_mscale"])
def test_a_scaled_qwen3_5_answers_as_transformers(tmp_path_factory, name: str) -> None:
    ref, loaded = _qwen3_5(tmp_path_factory, SCALINGS[name])
    assert_prefill_matches_transformers(ref, loaded)
    assert_greedy_matches_transformers(ref, loaded)
    # the scaling is felt: the same weights with plain RoPE are far from transformers' logits
    plain = load_model(save_checkpoint(ref, tmp_path_factory.mktemp("plain")), device="cpu")
    for layer in plain.model.modules():
        if hasattr(layer, "rope") and hasattr(layer, "cfg"):
            layer.rope = type(layer.rope)(layer.rope.rotary_dim, layer.rope.theta)
    ids = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    assert (hypic_logits(plain, ids) - want).abs().max() > 1e-2


def test_a_yarn_qwen3_next_answers_as_transformers(tmp_path_factory) -> None:
    ref, loaded = _qwen3_5(tmp_path_factory, SCALINGS["yarn"], cls=T.Qwen3NextForCausalLM,
                           config_cls=T.Qwen3NextConfig, **TINY_MOE)
    assert_prefill_matches_transformers(ref, loaded)


def test_a_yarn_minimax_answers_as_transformers(tmp_path_factory) -> None:
    from tests.models.test_minimax import tiny_reference

    torch.manual_seed(0)
    ref = tiny_reference(rope_parameters={**SCALINGS["yarn"], "rope_theta": 1e4})
    loaded = load_model(save_checkpoint(ref, tmp_path_factory.mktemp("minimax")), device="cpu")
    assert {m.rope.scaling.kind for m in loaded.model.modules() if hasattr(m, "rope")} == {"yarn"}
    assert_prefill_matches_transformers(ref, loaded)
