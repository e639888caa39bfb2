"""The quality runner end to end on a tiny model trained for a few steps (scores are not judged
here; the bundled model's bounds are)."""

import json

import pytest

from hypic.cli import main as cli
from hypic.eval.quality import LABELS, evaluate
from hypic.models.loader import load_model


@pytest.fixture(scope="module")
def model_dir(tiny_trained_model):
    return tiny_trained_model


def test_every_label_is_scored_and_fidelity_orders_the_ladder(model_dir) -> None:
    res = evaluate(load_model(model_dir, device="cpu"), n=3, difficulty=0.2, labels=list(LABELS))
    assert set(res) == set(LABELS)
    assert res["full"].kl == pytest.approx(0.0, abs=1e-9) and res["full"].top1 == 100.0
    assert res["prefix"].kl < 1e-6  # exact reuse
    assert res["naive"].kl > res["hypic_w8"].kl  # the transition operator matters
    for r in res.values():
        assert set(r.family_scores) == {"single_hop", "multi_hop", "multi_doc_summary", "report_summary"}
        assert all(0.0 <= s <= 100.0 for s in r.family_scores.values())


def test_cli_quick_json_and_report(model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "quality.md"
    assert cli(["eval", "quality", "--model", str(model_dir), "--quick", "--n", "2", "--json", "--out", str(out)]) == 0
    scores = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["scores"]
    assert {"full", "prefix", "naive", "transition", "hypic_w0", "hypic_w32"} <= set(scores)
    assert "| hypic_w8 |" in out.read_text() and out.with_suffix(".png").stat().st_size > 1000
    assert "Exact match per answered relation" in out.read_text()
    assert "| mode | " in out.read_text().split("by the number of documents")[1]
    assert set(json.loads(out.with_suffix(".json").read_text())["by_documents"]["naive"])
    # the footer names the command as given to main (was sys.argv: pytest's own arguments here)
    assert f"Command: `hypic eval quality --model {model_dir} --quick --n 2 --json --out {out}`" in out.read_text()
    # a report it wrote is rewritten by the next run (checked before the model loads)
    assert cli(["eval", "quality", "--model", str(tmp_path / "nope"), "--quick", "--out", str(out)]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_a_report_never_replaces_a_file_it_did_not_write(tmp_path, capsys) -> None:
    """The report rewrites its files whole after every label: a hand-written document (or a JSON
    record, a folder) at --out is refused by name before the model loads (the model folder here
    does not exist, and that is not what is said)."""
    kept = tmp_path / "quality.md"
    kept.write_text("# Quality\n\nhand-written\n")
    (tmp_path / "run.md").mkdir()
    (tmp_path / "other.json").write_text("{}")
    cases = [("quality", str(kept), f"{kept} exists and {kept} does not begin with the line hypic eval"),
             ("deviation", str(kept), f"{kept} exists and {kept} does not begin with the line hypic eval"),
             ("quality", str(tmp_path / "other.md"), f"{tmp_path / 'other.json'} exists"),
             ("quality", str(tmp_path / "run.md"), "expected a .md file path"),
             ("quality", str(tmp_path / "run.json"), "expected a .md file path")]
    for command, out, needle in cases:
        assert cli(["eval", command, "--model", str(tmp_path / "nope"), "--out", out]) == 2
        err = capsys.readouterr().err
        assert needle in err and "not a directory" not in err, (command, out, err)
    assert kept.read_text() == "# Quality\n\nhand-written\n"
    # deviation writes one file, of any name; a quality report's .md may be upper case
    from hypic.cli import _check_report_out

    _check_report_out(str(tmp_path / "dev.txt"))
    _check_report_out(str(tmp_path / "Q.MD"), sides=(".png", ".json"))
    for command in ("quality", "deviation"):
        with pytest.raises(SystemExit):
            cli(["eval", command, "--batch", "0"])
        assert "--batch: expected a whole number of at least 1, got '0'" in capsys.readouterr().err


def test_relation_em_averages_the_family_em(model_dir) -> None:
    """EM per answered relation: every QA example counted once, under the relation its answer comes
    from (a two-hop question under its second hop), so the size-weighted mean is the family's EM."""
    from hypic.eval.report import relation_table
    from hypic.eval.tasks import generate

    n = 6
    r = evaluate(load_model(model_dir, device="cpu"), n=n, difficulty=0.0, labels=["full"])["full"]
    for family in ("single_hop", "multi_hop"):
        rels = [ex.meta["relation"].split(">")[-1] for ex in generate(family, n, 1234, difficulty=0.0)]
        keys = {k: v for k, v in r.relation_em.items() if k.startswith(family + ":")}
        assert set(keys) == {f"{family}:{rel}" for rel in rels}
        weighted = sum(keys[f"{family}:{rel}"] for rel in rels) / n  # each example weighs its group's mean
        assert weighted == pytest.approx(r.family_em[family])
    table = relation_table(r)
    assert table.count("\n") == 3 and "| single_hop |" in table and "| multi_hop |" in table


def test_demo_session_reports_cold_and_warm(model_dir, capsys) -> None:
    assert cli(["demo", "--model", str(model_dir), "--questions", "1"]) == 0
    out = capsys.readouterr().out
    assert "hypic warm" in out and "hypic cold" in out and "full" in out
    from hypic.demo import rag_session
    from hypic.llm import LLM

    rows = rag_session(LLM(str(model_dir), device="cpu"), questions=1, seed=3)
    warm = next(r for r in rows if r["mode"] == "hypic warm")
    cold = next(r for r in rows if r["mode"] == "hypic cold")
    assert cold["cached"] == 0 and warm["cached"] > 0 and warm["recomputed"] < warm["prompt"] / 4


def test_table_leaves_the_gap_blank_without_full() -> None:
    """`--labels naive,hypic_w8` scores no `full` row: the gap column says so instead of `nan`."""
    from hypic.eval.quality import LabelResult
    from hypic.eval.report import table

    fams = ("single_hop", "multi_hop", "multi_doc_summary", "report_summary")

    def result(score: float) -> LabelResult:
        return LabelResult(family_scores=dict.fromkeys(fams, score), family_em=dict.fromkeys(fams[:2], score))

    rows = table({"naive": result(70.0), "hypic_w8": result(89.5)}).splitlines()[2:]
    assert [r.split(" | ")[6] for r in rows] == ["–", "–"] and "nan" not in "".join(rows)
    rows = table({"full": result(90.0), "hypic_w8": result(89.5)}).splitlines()[2:]
    assert [r.split(" | ")[6] for r in rows] == ["+0.0", "-0.5"]


def test_scores_by_document_count() -> None:
    """Buckets are powers of two; a bucket's score is the mean over the families present in it of
    each family's mean there; the report's cells carry the gap to `full` in the same bucket."""
    from hypic.eval.quality import LabelResult, _by_docs, docs_bucket
    from hypic.eval.report import docs_table

    assert [docs_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == \
        ["1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "9-16", "17-32", "17-32"]
    with pytest.raises(ValueError, match="num_docs"):
        docs_bucket(0)
    per = {"a": [(4, 1.0), (3, 0.0), (20, 1.0)], "b": [(6, 0.5), (30, 0.0), (31, 1.0)]}
    got = _by_docs(per)
    assert list(got) == ["3-4", "5-8", "17-32"]  # ordered by size, empty buckets absent
    assert got == {"3-4": pytest.approx(50.0), "5-8": pytest.approx(50.0), "17-32": pytest.approx((100 + 50) / 2)}
    full = LabelResult(docs_scores={"3-4": 90.0, "5-8": 80.0})
    naive = LabelResult(docs_scores={"3-4": 85.0, "5-8": 60.0})
    rows = docs_table({"full": full, "naive": naive}).splitlines()
    assert rows[0] == "| mode | 3-4 documents | 5-8 documents |"
    assert rows[2] == "| full | 90.0 | 80.0 |" and rows[3] == "| naive | 85.0 (-5.0) | 60.0 (-20.0) |"


def test_evaluate_buckets_match_the_prompts(model_dir) -> None:
    from hypic.eval.quality import docs_bucket
    from hypic.eval.tasks import FAMILIES, generate

    r = evaluate(load_model(model_dir, device="cpu"), n=4, difficulty=0.5, labels=["naive"])["naive"]
    counts = {len(ex.segments) - 2 for f in FAMILIES for ex in generate(f, 4, 1234, difficulty=0.5)}
    assert set(r.docs_scores) == {docs_bucket(c) for c in counts} and len(r.docs_scores) > 1
    assert all(0.0 <= v <= 100.0 for v in r.docs_scores.values())
