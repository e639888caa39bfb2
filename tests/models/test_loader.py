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
