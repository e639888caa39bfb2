"""Answer metrics: exact match and token F1 (as in SQuAD) for QA, ROUGE-L F-measure for summaries.

Our own small implementations, so scoring needs no extra dependency and behaves the same on
every machine. They follow the reference definitions: SQuAD's answer normalisation (lower case,
no punctuation, no articles, single spaces) and ROUGE-L as the F-measure (beta = 1) of the
longest common subsequence over lower-cased alphanumeric tokens.
"""

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
_ROUGE_TOKEN = re.compile(r"[a-z0-9]+")


def normalize_answer(text: str) -> str:
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def f1(prediction: str, reference: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:  # SQuAD's rule: two empty answers agree, one empty answer scores 0
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def lcs_length(a: list[str], b: list[str]) -> int:
    """Longest common subsequence by the classic row-by-row dynamic programme, O(len(a)·len(b))."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, reference: str) -> float:
    pred, ref = _ROUGE_TOKEN.findall(prediction.lower()), _ROUGE_TOKEN.findall(reference.lower())
    lcs = lcs_length(pred, ref) if pred and ref else 0
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def score(metric: str, prediction: str, reference: str) -> dict[str, float]:
    """The scores one example's metric reports: {"em", "f1"} for "em_f1", {"rougeL"} for "rougeL"."""
    if metric == "em_f1":
        return {"em": exact_match(prediction, reference), "f1": f1(prediction, reference)}
    if metric == "rougeL":
        return {"rougeL": rouge_l(prediction, reference)}
    raise ValueError(f"unknown metric {metric!r}; choose 'em_f1' or 'rougeL'")


def best_score(metric: str, prediction: str, references: tuple[str, ...] | list[str]) -> dict[str, float]:
    """``score`` against each reference, each number the best over them (SQuAD's rule for several
    gold answers: a prediction is right if it matches any)."""
    scores = [score(metric, prediction, r) for r in references]
    if not scores:
        raise ValueError("best_score: no reference")
    return {k: max(s[k] for s in scores) for k in scores[0]}
