"""Re-initialising collapsed value embeddings in a checkpoint (hypic.train.reinit)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from hypic.train.reinit import EMBED, main, mean_cosine, reinit, report, value_token_ids

TOKENIZER = "hypic/assets/tokenizer/tokenizer.json"


def _checkpoint(tmp_path, collapsed: list[str]):
    """A checkpoint folder with the bundled tokenizer, an embedding table whose ``collapsed`` kinds
    point one way (small noise around a shared row), and an unrelated tensor in the same shard."""
    shutil.copy(TOKENIZER, tmp_path / "tokenizer.json")
    tok = Tokenizer.from_file(TOKENIZER)
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(tok.get_vocab_size(), 16, generator=gen)
    shared = torch.randn(16, generator=gen) * 3
    for kind in collapsed:
        for i in value_token_ids(tok, kind):
            table[i] = shared + 0.05 * torch.randn(16, generator=gen)
    other = torch.randn(4, 4, generator=gen)
    save_file({EMBED: table, "model.norm.weight": other}, str(tmp_path / "model-00000.safetensors"))
    where = {EMBED: "model-00000.safetensors", "model.norm.weight": "model-00000.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": where}))
    return tok, table.clone(), other


def test_reinit_spreads_the_collapsed_values_and_touches_nothing_else(tmp_path) -> None:
    tok, before, other = _checkpoint(tmp_path, ["city", "colour"])
    cos = report(tmp_path)
    assert cos["city"] > 0.95 and cos["colour"] > 0.95 and cos["instrument"] < 0.5  # the diagnostic sees it
    ids = reinit(tmp_path, ["city", "colour"], seed=0)
    assert set(ids) == set(value_token_ids(tok, "city")) | set(value_token_ids(tok, "colour"))
    shard = load_file(str(tmp_path / "model-00000.safetensors"))
    after = shard[EMBED]
    reference = before[value_token_ids(tok, "instrument")].norm(dim=1).mean()
    torch.testing.assert_close(after[ids].norm(dim=1), reference.expand(len(ids)), rtol=1e-5, atol=1e-5)
    assert mean_cosine(after[value_token_ids(tok, "city")]) < 0.2
    untouched = torch.ones(after.shape[0], dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(after[untouched], before[untouched]) and torch.equal(shard["model.norm.weight"], other)
    # the same seed gives the same rows: the bundled model's recipe is reproducible
    _checkpoint(tmp_path, ["city", "colour"])
    assert reinit(tmp_path, ["city", "colour"], seed=0) == ids
    torch.testing.assert_close(load_file(str(tmp_path / "model-00000.safetensors"))[EMBED], after, rtol=0, atol=0)


def test_reinit_refuses_what_it_cannot_do(tmp_path, capsys) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        reinit(tmp_path, ["city"])
    shutil.copy(TOKENIZER, tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="not a training checkpoint"):
        reinit(tmp_path, ["city"])
    _checkpoint(tmp_path, [])
    with pytest.raises(ValueError, match="unknown value kind 'planet'"):
        reinit(tmp_path, ["planet"])
    assert main(["--ckpt", str(tmp_path), "--report"]) == 0
    assert "instrument" in capsys.readouterr().out


def test_a_reinit_that_fails_midway_leaves_the_shard(tmp_path, monkeypatch) -> None:
    import errno

    import hypic.train.reinit as module

    _checkpoint(tmp_path, ["city"])
    shard = tmp_path / "model-00000.safetensors"
    before = shard.read_bytes()

    def dies_midway(tensors, path, metadata=None):  # half a file written, then a full disk
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(module, "save_file", dies_midway)
    with pytest.raises(OSError, match="No space left"):
        reinit(tmp_path, ["city"])
    assert shard.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-00000.safetensors", "model.safetensors.index.json",
                                                          "tokenizer.json"]
