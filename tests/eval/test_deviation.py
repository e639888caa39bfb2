"""Per-layer deviation from `full` (hypic.eval.deviation) on a tiny trained checkpoint.

The checks hold for any weights, so they can fail only if the engine or the probe is wrong: `full`
against itself is zero, exact reuse (`prefix`) is zero to rounding at every layer, and at the first
linear layer — whose input is the token embeddings alone — hypic's composed state (exact T, conv
warm-up, seams w ≥ W − 1) is the in-context state to rounding while the naive sum is far from it.
"""

import json

import pytest

from hypic.cli import main as cli
from hypic.eval.deviation import measure, tables
from hypic.models.loader import load_model


@pytest.fixture(scope="module")
def loaded(tiny_trained_model):
    return load_model(tiny_trained_model, device="cpu")


def test_exact_modes_are_exact_and_naive_is_not(loaded) -> None:
    res = measure(loaded, n=2, difficulty=0.2, labels=["full", "prefix", "naive", "transition", "hypic_w8"],
                  batch=3)
    kinds = loaded.model.kinds
    first = kinds.linear_layers[0]
    assert first == 0 and len(res["full"].residual) == len(kinds.kinds)
    assert set(res["full"].state) == set(kinds.linear_layers)
    assert all(v == 0.0 for v in res["full"].residual) and all(v == 0.0 for v in res["full"].state.values())
    assert max(res["prefix"].residual) < 1e-5 and max(res["prefix"].state.values()) < 1e-5
    assert res["hypic_w8"].state[first] < 1e-5  # the composition is exact where the inputs are
    assert res["hypic_w8"].residual[0] < 1e-5
    assert res["naive"].state[first] > 1e-2 > 1e3 * res["hypic_w8"].state[first]
    assert res["naive"].residual[-1] > res["hypic_w8"].residual[-1]
    text = tables(res, kinds.kinds)
    assert text.count("| naive |") == 2 and f"0 {kinds.kinds[0]}" in text


def test_unknown_label_and_empty_run_are_refused(loaded) -> None:
    with pytest.raises(ValueError, match="labels: unknown"):
        measure(loaded, n=1, labels=["full", "hypic_w3"])
    with pytest.raises(ValueError, match="n: expected"):
        measure(loaded, n=0)


def test_cli_json_and_report(tiny_trained_model, tmp_path, capsys) -> None:
    out = tmp_path / "deviation.md"
    assert cli(["eval", "deviation", "--model", str(tiny_trained_model), "--n", "1", "--difficulty", "0.1",
                "--labels", "full,naive,hypic_w8_in_context", "--json", "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(data["deviation"]) == {"full", "naive", "hypic_w8_in_context"}
    assert len(data["deviation"]["naive"]["residual"]) == len(data["kinds"])
    assert "Linear state after the prompt" in out.read_text() and "| hypic_w8_in_context |" in out.read_text()
