"""The train entry points' refusals: one line on stderr naming the option, exit status 2, nothing written."""

import json
import shutil

import pytest

from hypic.train.export import main as export_main
from hypic.train.grow import main as grow_main
from hypic.train.loop import main as train_main
from hypic.train.reinit import main as reinit_main

TOKENIZER = "hypic/assets/tokenizer"


def _one_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("bad, named", [
    (["--log-every", "0"], "--log-every: expected an integer ≥ 1, got 0"),
    (["--batch-tokens", "0"], "--batch-tokens: expected an integer ≥ 1"),
    (["--doc-weight", "-1"], "--doc-weight: expected a finite weight ≥ 0, got -1.0"),
    (["--doc-weight", "nan"], "--doc-weight"),
    (["--warmup", "-5"], "--warmup: expected an integer ≥ 0"),
    (["--ramp-steps", "-10"], "--ramp-steps: expected an integer ≥ 0"),
    (["--standalone-every", "-1"], "--standalone-every"),
    (["--standalone-seam", "-1"], "--standalone-seam"),
    (["--blind-every", "-1"], "--blind-every"),
    (["--workers", "-1"], "--workers"),
    (["--extra-questions", "-1"], "--extra-questions"),
    (["--lr", "-1"], "--lr: expected a finite learning rate > 0"),
    (["--minutes", "0"], "--minutes"),
    (["--easy-share", "2"], "--easy-share: expected a value in [0, 1], got 2.0"),
    (["--easy-max", "nan"], "--easy-max"),
    (["--family-weights", "single_hop=nan,multi_hop=inf"], "--family-weights: expected name=weight"),
    (["--family-weights", "single_hop=-1"], "--family-weights"),
    (["--family-weights", "nope=1"], "--family-weights: unknown families ['nope']"),
    (["--family-weights", "single_hop=0,multi_hop=0,multi_doc_summary=0,report_summary=0"],
     "--family-weights: every family's weight is 0"),
    (["--schedule-start", "-1"], "--schedule-start: expected an integer ≥ 0"),
    (["--total-steps", "0"], "--total-steps 0 must be after --schedule-start 0"),
    (["--device", "nonsense"], "--device: 'nonsense' is not a device"),
    (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),  # argparse's own, in one line too
])
def test_train_refuses_a_bad_option_in_one_line_before_writing(tmp_path, capsys, bad, named) -> None:
    out = tmp_path / "run"
    args = ["--out", str(out), "--tokenizer", TOKENIZER, "--preset", "tiny", "--device", "cpu", "--workers", "0",
            "--batch-tokens", "800", "--total-steps", "2", "--log-every", "1", "--minutes", "1", *bad]
    try:
        rc = train_main(args)
    except SystemExit as e:  # argparse's errors exit
        rc = e.code
    assert rc == 2
    assert named in _one_line(capsys, "hypic.train")
    assert not out.exists()


def test_train_refuses_a_missing_checkpoint_or_tokenizer(tmp_path, capsys) -> None:
    common = ["--preset", "tiny", "--device", "cpu", "--workers", "0", "--total-steps", "2"]
    assert train_main(["--out", str(tmp_path / "none"), "--resume", *common]) == 2
    assert "holds no checkpoint (no train_state.json)" in _one_line(capsys, "hypic.train")
    assert not (tmp_path / "none").exists()
    assert train_main(["--out", str(tmp_path / "run"), "--tokenizer", str(tmp_path), *common]) == 2
    assert "--tokenizer: " in _one_line(capsys, "hypic.train")
    (tmp_path / "parent").mkdir()
    (tmp_path / "parent" / "sub").mkdir()  # a final save replaces --out whole: a folder of folders is refused
    assert train_main(["--out", str(tmp_path / "parent"), "--tokenizer", TOKENIZER, *common]) == 2
    assert "holds folders (sub)" in _one_line(capsys, "hypic.train")


def test_resume_from_a_checkpoint_without_its_weights_is_refused(tiny_trained_model, tmp_path, capsys) -> None:
    ckpt = shutil.copytree(tiny_trained_model, tmp_path / "ckpt")
    (ckpt / "model-00000.safetensors").unlink()
    assert train_main(["--out", str(ckpt), "--resume", "--device", "cpu", "--workers", "0", "--batch-tokens", "800",
                       "--total-steps", "5"]) == 2
    assert "model-00000.safetensors: shard listed in model.safetensors.index.json is missing" in \
        _one_line(capsys, "hypic.train")


def test_grow_export_and_reinit_refuse_in_one_line(tiny_trained_model, tmp_path, capsys) -> None:
    assert grow_main(["--from", str(tiny_trained_model), "--to", str(tmp_path / "g"), "--at", "3"]) == 2
    assert "--at must be a block boundary" in _one_line(capsys, "hypic.train.grow")
    assert grow_main(["--from", str(tmp_path / "none"), "--to", str(tmp_path / "g")]) == 2
    assert "not a checkpoint folder (no config.json)" in _one_line(capsys, "hypic.train.grow")
    assert not (tmp_path / "g").exists()
    assert export_main(["--from", str(tmp_path / "none"), "--to", str(tmp_path / "e")]) == 2
    assert "is not a directory" in _one_line(capsys, "hypic.train.export")
    assert not (tmp_path / "e").exists()
    assert reinit_main(["--ckpt", str(tiny_trained_model), "--kinds", "planet"]) == 2
    assert "unknown value kind 'planet'" in _one_line(capsys, "hypic.train.reinit")
    assert reinit_main(["--ckpt", str(tmp_path / "none"), "--report"]) == 2
    assert "no tokenizer.json" in _one_line(capsys, "hypic.train.reinit")
    with pytest.raises(SystemExit) as e:
        grow_main(["--from", str(tiny_trained_model), "--to", str(tmp_path / "g"), "--blocks", "x"])
    assert e.value.code == 2 and "--blocks: invalid int value" in _one_line(capsys, "hypic.train.grow")


def test_a_first_run_refuses_a_folder_that_holds_a_checkpoint(tiny_trained_model, tmp_path, capsys) -> None:
    ckpt = shutil.copytree(tiny_trained_model, tmp_path / "ckpt")
    before = {f.name: f.read_bytes() for f in ckpt.iterdir()}
    first = ["--out", str(ckpt), "--tokenizer", str(tiny_trained_model), "--preset", "tiny", "--device", "cpu",
             "--workers", "0", "--batch-tokens", "800", "--total-steps", "1", "--log-every", "1"]
    assert train_main(first) == 2  # --resume forgotten: the step-3 checkpoint would have been replaced
    err = _one_line(capsys, "hypic.train")
    assert "already holds a checkpoint (" in err and "pass --resume to continue it, or --overwrite" in err
    assert {f.name: f.read_bytes() for f in ckpt.iterdir()} == before
    assert train_main([*first, "--resume", "--overwrite"]) == 2
    assert "does not go with --resume" in _one_line(capsys, "hypic.train")
    assert train_main([*first, "--overwrite"]) == 0  # asked for: a new run in its place
    assert json.loads((ckpt / "train_state.json").read_text())["step"] == 1


def test_a_first_run_writes_nothing_until_its_save(tmp_path, monkeypatch) -> None:
    import hypic.train.loop as loop

    def fails(*args, **kwargs):
        raise RuntimeError("the first step fails (injected)")

    monkeypatch.setattr(loop, "loss_of", fails)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected"):
        train_main(["--out", str(out), "--tokenizer", TOKENIZER, "--preset", "tiny", "--device", "cpu",
                    "--workers", "0", "--batch-tokens", "800", "--total-steps", "2"])
    assert not out.exists()  # no config or tokenizer without the weights they belong to


def test_reinit_grow_and_seeds_name_what_is_wrong(tiny_trained_model, tmp_path, capsys) -> None:
    """A checkpoint missing its shard was a FileNotFoundError traceback (reinit); ``--kinds ""`` was
    "no single-token values of [] …"; a config that is not JSON, the decoder's message without the
    file (grow); a seed past torch's range, "Overflow when unpacking long long"."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_trained_model, ckpt)
    assert reinit_main(["--ckpt", str(ckpt), "--kinds", " , "]) == 2
    assert "--kinds: expected a comma list of value kinds" in _one_line(capsys, "hypic.train.reinit")
    assert reinit_main(["--ckpt", str(ckpt), "--seed", str(10**20)]) == 2
    assert "--seed: expected an integer in [-2**63, 2**64)" in _one_line(capsys, "hypic.train.reinit")
    for shard in ckpt.glob("model-*.safetensors"):
        shard.unlink()
    assert reinit_main(["--ckpt", str(ckpt), "--report"]) == 2
    assert "No such file or directory" in _one_line(capsys, "hypic.train.reinit")
    (ckpt / "config.json").write_text("{not json")
    assert grow_main(["--from", str(ckpt), "--to", str(tmp_path / "g")]) == 2
    assert f"--from {ckpt / 'config.json'}: not valid JSON" in _one_line(capsys, "hypic.train.grow")
    assert train_main(["--out", str(tmp_path / "run"), "--tokenizer", TOKENIZER, "--seed", str(10**20)]) == 2
    assert "--seed: expected an integer in [-2**63, 2**64)" in _one_line(capsys, "hypic.train")


def test_export_help_says_where_it_writes(capsys) -> None:
    """The description was the docstring's first line, cut at "… config and tokenizer in"."""
    with pytest.raises(SystemExit):
        export_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "tokenizer in ``hypic/assets/default_model``" in out and "replaced whole" in out
