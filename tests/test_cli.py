"""The README's main job runs and reports small composition errors."""

import os

import pytest

from hypic.cli import main


def test_demo_self_check_passes(capsys) -> None:
    assert main(["demo", "--self-check", "--length", "40"]) == 0
    out = capsys.readouterr().out
    for family in ("linear", "scalar", "gla", "deltanet", "gdn", "kda", "dplr"):
        assert family in out
    assert "no bundled model" not in out  # asked for, not a fallback: the bundled model is there


def test_demo_self_check_fails_on_nan_states_and_refuses_empty_spans(monkeypatch, capsys) -> None:
    """A kernel returning NaN states is what the check is for; it passed (rc 0), because max()
    drops a NaN. An empty span passed trivially."""
    import hypic.cli as cli

    real = cli.linear_attention

    def nan_states(*args, **kwargs):
        out = real(*args, **kwargs)
        out.final_state.fill_(float("nan"))
        return out

    monkeypatch.setattr(cli, "linear_attention", nan_states)
    assert main(["demo", "--self-check", "--length", "8"]) == 1
    assert "nan" in capsys.readouterr().out
    monkeypatch.setattr(cli, "linear_attention", real)
    assert main(["demo", "--self-check", "--length", "0"]) == 2
    assert capsys.readouterr().err.strip() == "hypic demo: --length: expected at least 1 token per span, got 0"


def test_demo_runs_the_rag_session_on_the_bundled_model(capsys) -> None:
    from hypic.llm import bundled_model_path

    assert main(["demo", "--questions", "1"]) == 0
    out = capsys.readouterr().out
    assert str(bundled_model_path()) in out.splitlines()[0]
    for mode in ("full", "hypic warm", "hypic cold"):
        assert f"\n{mode} " in out


def test_generate_command_reports_cache_use(tmp_path, capsys) -> None:
    from pathlib import Path

    import torch

    from hypic.bench.shapes import SHAPES
    from hypic.models.random_init import random_model
    from hypic.train.checkpoint import save_model

    config = dict(SHAPES["tiny"], vocab_size=2048)
    tokenizer = Path(__file__).parent.parent / "hypic" / "assets" / "tokenizer" / "tokenizer.json"
    save_model(tmp_path, random_model(config, device="cpu", dtype=torch.float32).model, config, tokenizer=tokenizer)
    doc = "Profile of Tal. Tal plays the harp in the evening after work."
    assert main(["generate", "--model", str(tmp_path), "--repeat", "2", "--max-tokens", "3",
                 f"A reader.<<PIC_SEP>>{doc}<<PIC_SEP>>Question: What does Tal play?\nAnswer:"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "hits 0" in err[0] and "hits 1" in err[1]
    # with a cache folder, a second run (a new process's worth of state) starts warm
    prompt = f"A reader.<<PIC_SEP>>{doc} Also the lute.<<PIC_SEP>>Question: What does Tal play?\nAnswer:"
    for expected in ("hits 0", "hits 1"):
        assert main(["generate", "--model", str(tmp_path), "--max-tokens", "3", "--cache-dir",
                     str(tmp_path / "cache"), prompt]) == 0
        assert expected in capsys.readouterr().err
    with pytest.warns(UserWarning, match="another seam"):  # the folder's entries, of seam 8, are skipped by name
        assert main(["generate", "--model", str(tmp_path), "--cache-dir", str(tmp_path / "cache"), "--seam", "4",
                     prompt]) == 0  # another seam: other keys, the same model: loads, and hits nothing
    assert "hits 0" in capsys.readouterr().err
    other = tmp_path / "other"
    save_model(other, random_model(config, device="cpu", dtype=torch.float32, seed=1).model, config,
               tokenizer=tokenizer)
    assert main(["generate", "--model", str(other), "--cache-dir", str(tmp_path / "cache"), prompt]) == 2
    # the same configuration with other weights: the fingerprint matches, the weight check refuses
    assert "computed by other weights than this model's" in capsys.readouterr().err
    # sampling options: top-k 1 is greedy whatever the temperature; a bad value is refused by name
    answers = []
    for extra in ([], ["--temperature", "1.5", "--seed", "3", "--top-k", "1", "--min-p", "0.1", "--top-p", "0.9",
                       "--repetition-penalty", "1.0"]):
        assert main(["generate", "--model", str(tmp_path), "--max-tokens", "4", *extra, prompt]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1]
    assert main(["generate", "--model", str(tmp_path), "--min-p", "2", prompt]) == 2
    assert "--min-p: expected a number in [0, 1], got 2.0" in capsys.readouterr().err


def test_byte_counts_and_budgets_parse() -> None:
    import argparse

    import pytest

    from hypic.cli import parse_budget, parse_bytes

    assert parse_bytes("4GiB") == 4 * 2**30 and parse_bytes("512MB") == 512 * 10**6 and parse_bytes("1000") == 1000
    assert parse_budget("auto") == "auto" and parse_budget("None") is None and parse_budget("1KiB") == 1024
    for bad in ("lots", "-1GB", "4XB"):
        with pytest.raises(argparse.ArgumentTypeError, match="byte count"):
            parse_budget(bad)


def test_generate_answers_in_json_with_a_schema_inline_or_from_a_file(tmp_path, capsys) -> None:
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    prompt = "Question: Where does Mira live?\nAnswer:"
    outs = []
    for given in (json.dumps(schema), str(tmp_path / "schema.json")):
        assert main(["generate", "--max-tokens", "40", "--json-schema", given, prompt]) == 0
        outs.append(capsys.readouterr().out.strip())
    value = json.loads(outs[0])
    assert outs[0] == outs[1] and set(value) == {"city"} and len(value["city"]) <= 10
    assert main(["generate", "--json-schema", "{not json", prompt]) == 2
    assert "--json-schema: neither a file nor JSON" in capsys.readouterr().err
    assert main(["generate", "--json-schema", '{"type": "string", "format": "idn-hostname"}', prompt]) == 2
    assert "format 'idn-hostname' is not supported" in capsys.readouterr().err


def test_generate_prints_the_beams_a_beam_search_keeps(capsys) -> None:
    """``--beam-width``: the beams LLM.beam_search keeps, best first, each with its summed
    log-probability; a width past 10 is refused by flag."""
    from hypic import LLM, BeamSearchParams

    prompt = "Profile of Mira. Mira lives in Quorvane.<<PIC_SEP>>Question: Where does Mira live?\nAnswer:"
    assert main(["generate", "--beam-width", "3", "--max-tokens", "6", prompt]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    want = LLM().beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=6))[0].sequences
    assert [float(line.split()[0]) for line in lines] == [round(b.cum_logprob, 3) for b in want]
    assert all(line.endswith(b.text) for line, b in zip(lines, want, strict=True))
    assert main(["generate", "--beam-width", "11", prompt]) == 2
    assert "--beam-width: expected an integer in [1, 10]" in capsys.readouterr().err


def test_generate_answers_as_a_grammar_or_a_regex_says(tmp_path, capsys) -> None:
    """``--grammar`` (a file or the text: GBNF or Lark, the text past a file name's length) and
    ``--regex``; two constraints at once are refused by flag."""
    import re

    from hypic.engine.structured import compile_grammar
    from hypic.engine.structured.matcher import accepts

    prompt = "Profile of Mira. Mira lives in Quorvane.<<PIC_SEP>>Question: Where does Mira live?\nAnswer:"
    lark = 'start: "In " CITY "."\nCITY: "A".."Z" /[a-z]{2,12}/\n' + "// a long comment " * 20
    (tmp_path / "g.lark").write_text(lark)
    outs = []
    for given in (lark, str(tmp_path / "g.lark")):
        assert main(["generate", "--max-tokens", "20", "--grammar", given, prompt]) == 0
        outs.append(capsys.readouterr().out.strip())
    assert outs[0] == outs[1] and accepts(compile_grammar(lark), outs[0].encode()), outs
    assert main(["generate", "--max-tokens", "20", "--regex", "[A-Z][a-z]+ [0-9]", prompt]) == 0
    assert re.fullmatch("[A-Z][a-z]+ [0-9]", capsys.readouterr().out.strip())
    assert main(["generate", "--grammar", 'root ::= "a"', "--regex", "a", prompt]) == 2
    assert "one constraint at a time" in capsys.readouterr().err
    assert main(["generate", "--grammar", "start: rule\n%declare X", prompt]) == 2
    assert "--grammar: Lark: %declare is not read" in capsys.readouterr().err


def test_the_bundled_model_is_served_as_hypic_however_it_is_named(tmp_path) -> None:
    """``--model hypic/assets/default_model`` served it as "default_model", so requests for "hypic"
    (the README's name) were 404s; another folder keeps its own name."""
    from hypic.cli import _served_name
    from hypic.llm import bundled_model_path

    assert _served_name(None) == "hypic" == _served_name(str(bundled_model_path()))
    assert _served_name(os.path.relpath(bundled_model_path())) == "hypic"
    (tmp_path / "my-model").mkdir()
    assert _served_name(str(tmp_path / "my-model")) == "my-model"


def test_the_model_path_given_is_an_alias_unless_a_name_is_served(tmp_path) -> None:
    from hypic.cli import _aliases

    folder = tmp_path / "my-model"
    folder.mkdir()
    rel = os.path.relpath(folder)
    assert _aliases(rel, None) == (rel, str(folder.resolve()))
    assert _aliases(str(folder.resolve()), None) == (str(folder.resolve()),)
    assert _aliases(rel, "mine") == () == _aliases(None, None)


def test_a_failing_warm_up_stops_serve_with_on_and_is_a_warning_with_auto(monkeypatch, capsys) -> None:
    from types import SimpleNamespace

    import pytest

    import hypic.cli as cli
    from hypic.engine.warm_up import WarmUp
    from hypic.llm import LLM

    def broken(self):
        raise RuntimeError("the device is out of memory")

    monkeypatch.setattr(LLM, "warm_up", broken)
    assert main(["serve", "--device", "cpu", "--port", "0", "--warm-up", "on"]) == 2  # before listening
    err = capsys.readouterr().err
    assert "--warm-up on: the warm-up failed: RuntimeError: the device is out of memory" in err

    # auto (on a GPU only, so the choice is tested on its own): a warning, and serving goes on
    fake = SimpleNamespace(engine=SimpleNamespace(device=SimpleNamespace(type="cuda")), warm_up=lambda: broken(None))
    cli._warm_up(fake, "serve", required=False)
    err = capsys.readouterr().err
    assert "the warm-up failed (RuntimeError: the device is out of memory); serving without it" in err
    with pytest.raises(ValueError, match="--warm-up on: the warm-up failed"):
        cli._warm_up(fake, "serve", required=True)
    # faults met on the way are said
    fake.warm_up = lambda: WarmUp(1.0, 7, 100, out_of_memory=1, workers_lost=2)
    cli._warm_up(fake, "serve", required=True)
    out = capsys.readouterr()
    assert "warmed up in 1.0 s" in out.out and "1 calls out of device memory (retried), 2 cold workers lost" in out.err


def _tiny_model(folder) -> str:
    from pathlib import Path

    import torch

    from hypic.bench.shapes import SHAPES
    from hypic.models.random_init import random_model
    from hypic.train.checkpoint import save_model

    config = dict(SHAPES["tiny"], vocab_size=2048)
    tokenizer = Path(__file__).parent.parent / "hypic" / "assets" / "tokenizer" / "tokenizer.json"
    save_model(folder, random_model(config, device="cpu", dtype=torch.float32).model, config, tokenizer=tokenizer)
    return str(folder)


def _refused(argv: list[str], capsys) -> str:
    """Exit status 2 and one line on stderr (argparse's own errors: its last line), no traceback."""
    import pytest

    try:
        rc = main(argv)
    except SystemExit as e:  # argparse: usage, then the error
        rc = e.code
        err = capsys.readouterr().err.strip().splitlines()[-1]
    else:
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
    if rc != 2:
        pytest.fail(f"{argv}: exit status {rc}, not 2 ({err})")
    assert "Traceback" not in err
    return err


def test_bad_values_are_refused_by_the_option_s_name_before_the_work(tmp_path, capsys) -> None:
    """Each ran, or failed unnamed: ``--repeat 0`` printed nothing with exit status 0 (``--questions -1``
    failed in the trace generator's words after the model loaded); ``--length 10**9`` was a
    traceback from the allocator; ``--seed 10**20`` "Overflow when unpacking long long"; library
    checks named their field (``max_tokens: … or None``), not the flag typed."""
    model = _tiny_model(tmp_path / "m")
    assert "--questions: expected a whole number of at least 1" in _refused(["demo", "--questions", "0"], capsys)
    assert "--repeat: expected a whole number of at least 1" in _refused(
        ["generate", "--model", model, "--repeat", "0", "hi"], capsys)
    assert _refused(["demo", "--self-check", "--length", str(10**9)], capsys) == (
        "hypic demo: --length: expected at most 10000 tokens per span, got 1000000000")
    assert "hypic demo: --seed: expected an integer in" in _refused(
        ["demo", "--self-check", "--length", "2", "--seed", str(10**20)], capsys)
    assert _refused(["generate", "--model", model, "--max-tokens", "0", "hi"], capsys) == (
        "hypic generate: --max-tokens: expected an integer ≥ 1, got 0")
    assert _refused(["generate", "--model", str(tmp_path / "none"), "hi"], capsys).startswith(
        "hypic generate: --model: ")
    assert "--cold-workers: expected a count ≥ 0, got -1" in _refused(
        ["serve", "--model", model, "--port", "0", "--cold-workers", "-1"], capsys)
    for difficulty in ("nan", "1.5", "hard"):  # refused after the model had loaded, unnamed ("difficulty must")
        assert f"--difficulty: expected a number in [0, 1], got {difficulty!r}" in _refused(
            ["eval", "quality", "--model", str(tmp_path / "none"), "--difficulty", difficulty], capsys)
    for empty in ("", "cuda:1,,cuda:2"):  # served with no workers, or with two
        assert f"--cold-workers: expected a count such as 2 (0: none) or devices such as cuda:1,cuda:2, got {empty!r}" \
            in _refused(["serve", "--model", model, "--port", "0", "--cold-workers", empty], capsys)


def test_empty_paths_and_names_are_refused_not_read_as_left_out(tmp_path, capsys) -> None:
    """``--labels ""`` ran every label (hours on the bundled model), ``--cache-dir ""`` ran without the
    cache, ``--out ""`` wrote no report, ``--served-model-name ""`` served the folder's name; an
    ``--out`` folder was a traceback after the benchmark had run."""
    model = _tiny_model(tmp_path / "m")
    missing = str(tmp_path / "none")  # the labels are checked before the model is looked for
    assert "--labels: expected a comma list of mode labels, got ''" in _refused(
        ["eval", "quality", "--model", missing, "--labels", ""], capsys)
    assert "--labels" in _refused(["eval", "deviation", "--model", missing, "--labels", "full,,naive"], capsys)
    assert "--out: empty path" in _refused(["eval", "quality", "--model", missing, "--out", ""], capsys)
    assert f"--out {tmp_path}: a folder" in _refused(
        ["bench", "ttft", "--shape", "tiny", "--device", "cpu", "--out", str(tmp_path)], capsys)
    assert "--cache-dir: empty path" in _refused(["generate", "--model", model, "--cache-dir", "", "hi"], capsys)
    assert f"--cache-dir {tmp_path / 'm' / 'config.json'}: not a folder" in _refused(
        ["generate", "--model", model, "--cache-dir", str(tmp_path / "m" / "config.json"), "hi"], capsys)
    assert "--served-model-name: empty" in _refused(
        ["serve", "--model", model, "--port", "0", "--served-model-name", ""], capsys)


def test_run_batch_keeps_its_input_and_names_its_files(tmp_path, capsys) -> None:
    """``-o`` the ``-i`` file wrote the results over the requests; OSErrors named no option."""
    model = _tiny_model(tmp_path / "m")
    requests = tmp_path / "requests.jsonl"
    line = '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}\n'
    requests.write_text(line)
    assert "--output" in _refused(["run-batch", "--model", model, "-i", str(requests), "-o", str(requests)], capsys)
    assert requests.read_text() == line
    assert f"--input {tmp_path / 'none'}: No such file" in _refused(
        ["run-batch", "--model", model, "-i", str(tmp_path / "none"), "-o", str(tmp_path / "out")], capsys)
    assert f"--input {tmp_path}: a folder" in _refused(
        ["run-batch", "--model", model, "-i", str(tmp_path), "-o", str(tmp_path / "out")], capsys)


def test_serve_refuses_an_address_it_cannot_listen_on_before_loading_the_model(monkeypatch, tmp_path,
                                                                               capsys) -> None:
    """A port in use (or a host not this machine's) was found by uvicorn after the model had loaded
    and warmed up (minutes on a GPU): exit status 3, uvicorn's log line."""
    import socket

    from hypic import llm

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the address was checked")

    monkeypatch.setattr(llm.LLM, "__init__", loaded)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert _refused(["serve", "--port", str(port)], capsys) == (
            f"hypic serve: --port {port}: cannot listen on 127.0.0.1:{port} (Address already in use)")
    assert "hypic serve: --host 192.0.2.1: cannot listen on 192.0.2.1" in _refused(
        ["serve", "--host", "192.0.2.1", "--port", "0"], capsys)  # TEST-NET-1: no machine's own
