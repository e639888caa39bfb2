"""The ``hypic bench`` command lines refuse a bad option the way every hypic command does: one line
naming it, exit status 2, before any model is built. They let tracebacks out (an unknown device,
CUDA missing), exited 1 with the prefix printed twice (``bench trace: bench trace: …``), or ran on
nonsense (``--rates nan``, ``--docs 0``) and appended a meaningless table to ``--out``."""

import pytest
import torch

import hypic.models.random_init as random_init
from hypic.cli import main

TINY = ["--shape", "tiny", "--device", "cpu"]
BAD_DEVICES = [(["--device", "foo"], "device: 'foo' is not a device"), (["--device", "cuda:99"], "device: cuda:99")]
if not torch.cuda.is_available():  # CUDA asked for where there is none: was a traceback from random weights
    BAD_DEVICES.append((["--device", "cuda"], "device: cuda requested but CUDA is not available"))


@pytest.fixture
def no_model(monkeypatch):
    """Every case below is refused before a model is built: building one fails the test."""
    def built(*args, **kwargs):
        raise AssertionError("a model was built before the options were checked")

    monkeypatch.setattr(random_init, "random_model", built)


def refused(argv: list[str], capsys) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hypic bench: ") and "bench trace:" not in err, err
    return err


@pytest.mark.parametrize("argv, message", [
    (["--rates", "fast"], "--rates: expected a comma list of finite positive numbers"),
    (["--rates", "nan"], "--rates"), (["--rates", "inf"], "--rates"), (["--rates=-1,2"], "--rates"),
    (["--rates", ""], "--rates"),
    (["--num-docs", "4"], "--num-docs: expected lo,hi"), (["--num-docs", "5,2"], "--num-docs"),
    (["--doc-tokens", "0,8"], "--doc-tokens"),
    (["--modes", "hypic,best"], "--modes: expected a comma list of full, prefix"), (["--modes", ""], "--modes"),
    (["--slo-ms", "-1"], "--slo-ms: expected a finite positive number, got -1"), (["--slo-ms", "0"], "--slo-ms"),
    (["--slo-ms", "nan"], "--slo-ms"),
    (["--requests", "0"], "--requests: expected at least 1, got 0"), (["--warm", "-1"], "--warm"),
    (["--pool", "1"], "--pool"), (["--zipf", "-1"], "--zipf"), (["--max-tokens", "0"], "--max-tokens"),
    (["--max-running", "0"], "--max-running"), (["--max-prefill-tokens", "0"], "--max-prefill-tokens"),
    (["--workers", "-1"], "--workers"), (["--seam", "-1"], "--seam"), (["--cache-gib", "-1"], "--cache-gib"),
    (["--cache-gib", "nan"], "--cache-gib"),
    (["--url", "http://127.0.0.1:9"], "cannot reach"), (["--url", "notaurl"], "cannot reach"),
    *BAD_DEVICES,
])
def test_bench_trace_refuses_bad_options_in_one_line(argv, message, no_model, capsys) -> None:
    assert message in refused(["bench", "trace", *TINY, *argv], capsys)


@pytest.mark.parametrize("argv, message", [
    (["--docs", "0"], "--docs: expected at least 1, got 0"), (["--doc-tokens", "0"], "--doc-tokens"),
    (["--reps", "0"], "--reps"), (["--head-tokens", "0"], "--head-tokens"), (["--query-tokens", "0"], "--query-tokens"),
    (["--seam", "-1"], "--seam"),
    *BAD_DEVICES,
])
def test_bench_ttft_refuses_bad_options_in_one_line(argv, message, no_model, capsys) -> None:
    assert message in refused(["bench", "ttft", *TINY, *argv], capsys)


@pytest.mark.parametrize("argv, message", [
    (["--reps", "0"], "--reps"), (["--docs", "0"], "--docs"), (["--workers", "0"], "--workers"),
    (["--kinds", "uniform,zipf"], "--kinds: expected a comma list of uniform, skewed"),
    *BAD_DEVICES,
])
def test_bench_scatter_refuses_bad_options_in_one_line(argv, message, no_model, capsys) -> None:
    assert message in refused(["bench", "scatter", *TINY, *argv], capsys)


def test_a_prompt_longer_than_the_context_is_refused_before_its_tokens_are_drawn(capsys) -> None:
    """``--doc-tokens 99999999999`` drew the prompts' token lists until the kernel killed the process
    (out of host memory); a skewed scatter's documents reach 4 × --doc-tokens."""
    err = refused(["bench", "ttft", *TINY, "--docs", "2", "--doc-tokens", "99999999999"], capsys)
    assert err == ("hypic bench: --head-tokens + --docs × --doc-tokens + --query-tokens: a prompt of "
                   "200000000574 tokens; the model's context holds 65536")
    err = refused(["bench", "scatter", *TINY, "--docs", "4", "--doc-tokens", "8192", "--kinds", "skewed"], capsys)
    assert "--docs × --doc-tokens (skewed: documents up to 4 × --doc-tokens): a prompt of 131648 tokens" in err


def test_the_sync_report_s_folder_is_checked_before_the_run(no_model, tmp_path, capsys) -> None:
    err = refused(["bench", "ttft", *TINY, "--sync-report", str(tmp_path / "none" / "syncs.txt")], capsys)
    assert err == f"hypic bench: --sync-report {tmp_path / 'none' / 'syncs.txt'}: its folder does not exist"
