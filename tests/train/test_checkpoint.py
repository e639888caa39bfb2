"""Training checkpoints (hypic.train.checkpoint): a resume loads every parameter or refuses."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from hypic.models.random_init import random_model
from hypic.train.checkpoint import load_checkpoint


def _fresh(folder):
    """The model and optimizer ``hypic.train`` builds before it resumes from ``folder`` (seed 0)."""
    config = json.loads((folder / "config.json").read_text())
    model = random_model(config, device="cpu", dtype=torch.float32, seed=0).model.train()
    return model, torch.optim.AdamW(model.parameters())


def test_a_complete_checkpoint_loads_every_parameter(tiny_trained_model, tmp_path) -> None:
    ckpt = shutil.copytree(tiny_trained_model, tmp_path / "ckpt")
    model, opt = _fresh(ckpt)
    state = load_checkpoint(ckpt, model, opt)
    assert state["step"] == 3
    saved = load_file(str(ckpt / "model-00000.safetensors"))
    params = dict(model.named_parameters())
    assert all(torch.equal(params[name], t) for name, t in saved.items())
    assert len(opt.state) == len(params)  # Adam moments for every parameter


def test_resume_refuses_a_checkpoint_without_its_weights(tiny_trained_model, tmp_path) -> None:
    ckpt = shutil.copytree(tiny_trained_model, tmp_path / "ckpt")
    (ckpt / "model-00000.safetensors").unlink()  # a shard that did not come back from a device call
    with pytest.raises(ValueError, match="model-00000.safetensors: shard listed in model.safetensors.index.json"):
        load_checkpoint(ckpt, *_fresh(ckpt))
    (ckpt / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match="no model-\\*.safetensors weight shards"):
        load_checkpoint(ckpt, *_fresh(ckpt))


def test_resume_refuses_weights_that_do_not_fit_the_config(tiny_trained_model, tmp_path) -> None:
    ckpt = shutil.copytree(tiny_trained_model, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    # a grown config beside the old shards: the new layers would start random
    (ckpt / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=8)))
    with pytest.raises(ValueError, match="checkpoint lacks .* tensors, e.g. \\['model.layers.4"):
        load_checkpoint(ckpt, *_fresh(ckpt))
    # another MLP width: shapes differ (copy_ would broadcast some of them)
    (ckpt / "config.json").write_text(json.dumps(dict(config, intermediate_size=2 * config["intermediate_size"])))
    with pytest.raises(ValueError, match="has shape"):
        load_checkpoint(ckpt, *_fresh(ckpt))


def test_resume_refuses_adam_moments_of_another_shape(tiny_trained_model, tmp_path) -> None:
    from safetensors.torch import save_file

    ckpt = shutil.copytree(tiny_trained_model, tmp_path / "ckpt")
    moments = load_file(str(ckpt / "optim-00000.safetensors"))
    key = "model.norm.weight.exp_avg"
    moments[key] = torch.zeros(2 * moments[key].numel(), dtype=moments[key].dtype)
    save_file(moments, str(ckpt / "optim-00000.safetensors"))
    with pytest.raises(ValueError, match="Adam moment 'model.norm.weight.exp_avg' does not fit"):
        load_checkpoint(ckpt, *_fresh(ckpt))
