"""Training checkpoints (hypic.train.checkpoint): a resume loads every parameter or refuses."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from hypic.models.random_init import random_model
from hypic.train.checkpoint import load_checkpoint


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def _fresh(folder):
    """The model and optimizer ``hypic.train`` builds before it resumes from ``folder`` (seed 0)."""
    model = random_model(_config(folder), device="cpu", dtype=torch.float32, seed=0).model.train()
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


def _failing_write(monkeypatch, module, at: int) -> None:
    """The ``at``-th safetensors write of ``module`` (1-based) dies midway, as on a full disk: half a
    file written, then OSError."""
    import errno

    calls = []

    def save_file(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == at:
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(tensors, path, metadata=metadata)

    real = module.save_file
    monkeypatch.setattr(module, "save_file", save_file)


def _files(folder) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


@pytest.mark.parametrize("at", [1, 2])
def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tiny_trained_model, tmp_path, monkeypatch,
                                                                 at) -> None:
    import hypic.train.checkpoint as checkpoint

    ckpt = shutil.copytree(tiny_trained_model, tmp_path / "ckpt")
    (ckpt / "notes.txt").write_text("kept")  # a file the save does not write is carried over
    before = _files(ckpt)
    model, opt = _fresh(ckpt)
    state = load_checkpoint(ckpt, model, opt)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    _failing_write(monkeypatch, checkpoint, at)  # 1: the weights' shard, 2: the moments'
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save_checkpoint(ckpt, model, opt, dict(state, step=103), _config(ckpt))
    assert _files(ckpt) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert load_checkpoint(ckpt, *_fresh(ckpt))["step"] == 3  # loadable, as it was
    monkeypatch.undo()
    checkpoint.save_checkpoint(ckpt, model, opt, dict(state, step=103), _config(ckpt))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and (ckpt / "notes.txt").read_text() == "kept"
    again, opt2 = _fresh(ckpt)
    assert load_checkpoint(ckpt, again, opt2)["step"] == 103
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters(), strict=True))


def test_an_export_that_fails_midway_leaves_the_exported_model(tiny_trained_model, tmp_path, monkeypatch) -> None:
    import hypic.train.checkpoint as checkpoint
    from hypic.models.loader import load_model
    from hypic.train.export import export

    dst = tmp_path / "bundled"
    export(tiny_trained_model, dst)
    before = _files(dst)
    _failing_write(monkeypatch, checkpoint, 1)
    with pytest.raises(OSError, match="No space left"):
        export(tiny_trained_model, dst, dtype=torch.float32)
    assert _files(dst) == before and sorted(p.name for p in tmp_path.iterdir()) == ["bundled"]
    assert load_model(dst, device="cpu").model is not None


def test_a_grow_that_fails_midway_leaves_the_folder_it_would_replace(tiny_trained_model, tmp_path,
                                                                     monkeypatch) -> None:
    import hypic.train.checkpoint as checkpoint
    from hypic.train.grow import grow

    dst = tmp_path / "grown"
    grow(tiny_trained_model, dst, at=4)
    before = _files(dst)
    _failing_write(monkeypatch, checkpoint, 2)
    with pytest.raises(OSError, match="No space left"):
        grow(tiny_trained_model, dst, at=4, blocks=2)
    assert _files(dst) == before and sorted(p.name for p in tmp_path.iterdir()) == ["grown"]


def test_a_folder_with_subfolders_is_not_replaced(tiny_trained_model, tmp_path) -> None:
    from hypic.train.checkpoint import save_checkpoint

    ckpt = shutil.copytree(tiny_trained_model, tmp_path / "ckpt")
    (ckpt / "keep").mkdir()
    model, opt = _fresh(ckpt)
    state = load_checkpoint(ckpt, model, opt)
    with pytest.raises(ValueError, match="holds folders \\(keep\\)"):
        save_checkpoint(ckpt, model, opt, state, _config(ckpt))
    assert (ckpt / "keep").is_dir()


def test_a_folder_that_cannot_be_renamed_is_replaced_file_by_file(tmp_path, monkeypatch) -> None:
    """A mount point (``--out /ckpt``, a container's volume) cannot be renamed aside: the save
    replaces its files one by one instead (a run failed at its first save, after all its steps)."""
    import errno
    import os

    from hypic.train import atomic

    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name, text in (("model-00001.safetensors", "old weights"), ("model-00002.safetensors", "old second"),
                       ("config.json", "{}"), ("train_state.json", "old state")):
        (folder / name).write_text(text)
    real = os.rename

    def rename(src, dst) -> None:
        if str(src) == str(folder):
            raise OSError(errno.EBUSY, "Device or resource busy", str(src))
        real(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)
    with atomic.replace_folder(folder, drop=lambda n: n.startswith("model-")) as stage:
        (stage / "model-00001.safetensors").write_text("new weights")
        (stage / "train_state.json").write_text("new state")
    assert {p.name: p.read_text() for p in folder.iterdir()} == {
        "model-00001.safetensors": "new weights", "config.json": "{}", "train_state.json": "new state"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no stage or temporary file left
