"""Loader errors name the file or tensor at fault."""

import json
import shutil

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from hypic.models.loader import load_model
from tests.models.harness import TINY_BASE, TINY_GDN, save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    ref = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**TINY_BASE, **TINY_GDN, intermediate_size=256))
    sharded = save_checkpoint(ref, tmp_path_factory.mktemp("sharded"), max_shard_size="200KB")
    single = save_checkpoint(ref, tmp_path_factory.mktemp("single"))
    return single, sharded


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_shard_is_named(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint[1], tmp_path / "m")
    victim = sorted(path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ValueError, match=victim.name):
        load_model(path, device="cpu")


def test_unknown_architecture_is_named(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint[0], tmp_path / "u")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        load_model(path, device="cpu")


def test_wrong_tensor_shape_is_named(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint[0], tmp_path / "w")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.linear_attn.in_proj_z.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="in_proj_z"):
        load_model(path, device="cpu")


def test_missing_tensor_and_folder(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint[0], tmp_path / "t")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_model(path, device="cpu")
    with pytest.raises(ValueError, match="not a directory"):
        load_model(tmp_path / "nowhere", device="cpu")
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        load_model(path, device="cpu")


def test_bad_config_index_tensor_and_device_are_value_errors(checkpoint, tmp_path) -> None:
    path = _copy(checkpoint[0], tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    with pytest.raises(ValueError, match="missing key 'hidden_size'"):
        load_model(path, device="cpu")
    (path / "config.json").write_text(json.dumps({**cfg, "hidden_size": "128"}))
    with pytest.raises(ValueError, match="config.json"):
        load_model(path, device="cpu")
    (path / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        load_model(path, device="cpu")
    (path / "config.json").write_text(json.dumps(cfg))
    for device in ("gpu", "cuda:99" if torch.cuda.is_available() else "cuda", "meta"):
        with pytest.raises(ValueError, match="device"):
            load_model(path, device=device)
    for dtype in ("fp16", torch.int8, torch.float64, 3):
        with pytest.raises(ValueError, match="dtype"):
            load_model(path, device="cpu", dtype=dtype)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    with pytest.raises(ValueError, match="weight_map"):
        load_model(path, device="cpu")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../model.safetensors"}}))
    with pytest.raises(ValueError, match="not a file of this folder"):  # never a file outside the model
        load_model(path, device="cpu")
    (path / "model.safetensors.index.json").unlink()
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"], dtype=torch.int32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight.*int32"):  # never silently cast into a weight
        load_model(path, device="cpu")
    (path / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(path, device="cpu")


@pytest.mark.parametrize("arch", ["Qwen3_5ForCausalLM", "Qwen3NextForCausalLM", "MiniMaxForCausalLM",
                                  "BailingMoeLinearV2ForCausalLM"])
def test_every_family_takes_fixed_scalings_and_refuses_the_rest_by_name(arch: str) -> None:
    """YaRN and linear scaling (in ``rope_parameters`` or the older ``rope_scaling``) reach every
    RoPE of the model, full-attention and (Ring-linear) linear layers alike, and stretch the
    context the model accepts; a scaling whose
    frequencies follow the prompt's length is refused, not served with wrong phases; plain and mrope
    configs build plain RoPE."""
    from hypic.models.registry import resolve
    from tests.models.harness import TINY_BASE, TINY_GDN, TINY_MOE
    from tests.models.test_minimax import TINY_MINIMAX
    from tests.models.test_ring_linear import CONFIG as RING

    base = {"Qwen3_5ForCausalLM": {**TINY_BASE, **TINY_GDN, "intermediate_size": 64},
            "Qwen3NextForCausalLM": {**TINY_BASE, **TINY_GDN, **TINY_MOE, "intermediate_size": 64},
            "MiniMaxForCausalLM": dict(TINY_MINIMAX), "BailingMoeLinearV2ForCausalLM": dict(RING)}[arch]
    base = {**base, "architectures": [arch], "max_position_embeddings": 4096}

    def ropes(config: dict, context: int = 4096) -> set:
        with torch.device("meta"):
            model = resolve(config).build(config)
        assert model.max_positions == context
        return {m.rope.scaling for m in model.modules() if getattr(m, "rope", None) is not None}

    # the context a scaling serves: Qwen's YaRN recipe leaves max_position_embeddings at the
    # pretraining length (4 096 here, 4× as far with the scaling); linear stretches the config's own
    for key, spec, kind, context in (
            ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "yarn", 16384),
            ("rope_scaling", {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}, "yarn", 4096),
            ("rope_scaling", {"type": "linear", "factor": 4.0}, "linear", 16384)):
        scalings = ropes({**base, key: spec}, context)
        assert len(scalings) == 1 and next(iter(scalings)).kind == kind
    with pytest.raises(ValueError, match="config.rope_scaling: rope_type 'dynamic' is not supported"), \
            torch.device("meta"):
        resolve(base).build({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    for key, spec in (("rope_parameters", {"rope_type": "default", "rope_theta": 1e4}),
                      ("rope_scaling", {"type": "mrope", "mrope_section": [2, 2, 4]})):
        assert ropes({**base, key: spec}) == {None}
