"""Metrics against values worked out by hand."""

import pytest

from hypic.eval.metrics import best_score, exact_match, f1, lcs_length, normalize_answer, rouge_l, score


def test_normalize_answer_follows_squad() -> None:
    assert normalize_answer("  The Brassline  Guild! ") == "brassline guild"
    assert normalize_answer("an owl.") == "owl"


def test_exact_match() -> None:
    assert exact_match("the Brassline Guild", "Brassline Guild") == 1.0
    assert exact_match("Quorvane.", "quorvane") == 1.0
    assert exact_match("Brassline", "Brassline Guild") == 0.0


def test_token_f1() -> None:
    # 2 shared tokens; precision 2/3, recall 1 -> 2·(2/3)/(5/3) = 0.8
    assert f1("Brassline Guild Trust", "Brassline Guild") == pytest.approx(0.8)
    # precision 1, recall 1/2 -> 2/3
    assert f1("Guild", "the Brassline Guild") == pytest.approx(2 / 3)
    assert f1("harp", "lute") == 0.0
    assert f1("", "") == 1.0 and f1("the", "harp") == 0.0  # "the" normalises to nothing


def test_lcs_length() -> None:
    assert lcs_length(list("ABCBDAB"), list("BDCABA")) == 4
    assert lcs_length([], ["a"]) == 0


def test_rouge_l() -> None:
    ref = "lives in Quorvane; plays the harp"  # 6 tokens
    assert rouge_l(ref, ref) == 1.0
    # LCS "lives in plays the harp" = 5 of 6 both ways
    assert rouge_l("lives in Eldmere; plays the harp", ref) == pytest.approx(5 / 6)
    # order matters: LCS 3, precision 3/6, recall 3/6
    assert rouge_l("plays the harp; lives in Quorvane", ref) == pytest.approx(0.5)
    # a prefix: precision 1, recall 1/2 -> 2/3
    assert rouge_l("lives in Quorvane", ref) == pytest.approx(2 / 3)
    assert rouge_l("", ref) == 0.0


def test_score_dispatches_on_the_metric() -> None:
    assert score("em_f1", "The harp", "harp") == {"em": 1.0, "f1": 1.0}
    assert score("rougeL", "lives in Quorvane", "lives in Quorvane") == {"rougeL": 1.0}
    with pytest.raises(ValueError):
        score("bleu", "a", "b")


def test_best_score_takes_each_number_at_its_best_reference() -> None:
    """SQuAD's rule for several gold answers: each metric the maximum over them."""
    got = best_score("em_f1", "the Moonwell Institute", ("Flintlock Guild", "Moonwell Institute"))
    assert got == {"em": 1.0, "f1": 1.0}
    got = best_score("em_f1", "Moonwell Guild", ("Flintlock Guild", "Moonwell Institute"))
    assert got == {"em": 0.0, "f1": pytest.approx(0.5)}
    assert best_score("rougeL", "a b c", ["a b c", "x"]) == {"rougeL": 1.0}
    with pytest.raises(ValueError, match="no reference"):
        best_score("em_f1", "x", ())
