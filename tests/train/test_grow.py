"""Deepening a checkpoint by whole blocks (hypic.train.grow): same logits, and training goes on."""

import json

import pytest
import torch

from hypic.models.context import SequenceContext, SequenceState
from hypic.models.loader import load_model
from hypic.train.checkpoint import load_sharded
from hypic.train.grow import RESIDUAL_WRITERS, grow, grow_config
from hypic.train.grow import main as grow_main
from hypic.train.loop import main as train_main


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_trained_model):
    """A real 4-layer training checkpoint (weights, Adam moments, state) after 3 steps."""
    return tiny_trained_model


def _logits(folder, ids: torch.Tensor) -> torch.Tensor:
    m = load_model(folder, device="cpu", dtype=torch.float32)
    ctx = SequenceContext([SequenceState()], [len(ids)], torch.device("cpu"), keep_state=False)
    with torch.no_grad():
        return m.model(ids, ctx)


def test_grown_model_computes_the_same_logits_and_keeps_training(tiny_ckpt, tmp_path) -> None:
    grown = tmp_path / "grown"
    added = grow(tiny_ckpt, grown, at=4, blocks=1)
    config = json.loads((grown / "config.json").read_text())
    assert config["num_hidden_layers"] == 8 and added > 0
    ids = torch.randint(2, 500, (97,), generator=torch.Generator().manual_seed(0))
    before, after = _logits(tiny_ckpt, ids), _logits(grown, ids)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)  # each new layer adds exactly zero
    model = load_model(grown, device="cpu", dtype=torch.float32).model
    params = dict(model.named_parameters())
    for j in range(4, 8):
        writers = [n for n in params if n.startswith(f"model.layers.{j}.") and n.endswith(RESIDUAL_WRITERS)]
        assert writers and all(params[n].abs().max() == 0 for n in writers)
    assert params["model.layers.7.self_attn.q_proj.weight"].abs().max() > 0  # the copy is live
    # training continues from the grown folder: moments of the old layers carried, new ones fresh
    assert train_main(["--out", str(grown), "--resume", "--device", "cpu", "--batch-tokens", "1500", "--workers", "0",
                       "--minutes", "5", "--total-steps", "5", "--warmup", "1", "--lr", "3e-3"]) == 0
    state = json.loads((grown / "train_state.json").read_text())
    assert state["step"] == 5 and any("grown" in e for e in state["log"])
    trained = dict(load_model(grown, device="cpu", dtype=torch.float32).model.named_parameters())
    assert trained["model.layers.4.mlp.down_proj.weight"].abs().max() > 0  # gradients reached the new layers
    # inserting in the middle renumbers the later layers' weights and Adam moments
    middle = tmp_path / "middle"
    grow(grown, middle, at=4, blocks=1)
    torch.testing.assert_close(_logits(middle, ids), _logits(grown, ids), rtol=0, atol=1e-6)
    old, new = load_sharded(grown, "optim"), load_sharded(middle, "optim")
    key = "model.layers.5.linear_attn.in_proj_qkv.weight.exp_avg"
    assert torch.equal(new[key.replace("layers.5.", "layers.9.")], old[key]) and key not in new


def test_grow_refuses_what_would_break_the_pattern(tiny_ckpt, tmp_path, capsys) -> None:
    config = json.loads((tiny_ckpt / "config.json").read_text())
    with pytest.raises(ValueError, match="block boundary"):
        grow_config(config, at=2, blocks=1)
    with pytest.raises(ValueError, match="blocks must be"):
        grow_config(config, at=4, blocks=0)
    with pytest.raises(ValueError, match="qwen3_5_text"):
        grow_config(dict(config, model_type="kimi_linear"), at=4, blocks=1)
    assert grow_main(["--from", str(tiny_ckpt), "--to", str(tiny_ckpt)]) == 2
    assert capsys.readouterr().err == "hypic.train.grow: --to must differ from --from (the source stays as it was)\n"
    typed = dict(config, layer_types=["linear_attention"] * 3 + ["full_attention"])
    assert grow_config(typed, at=4, blocks=2)["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 3
