"""Quality across the mode ladder: every task family under ``full``, ``prefix``, ``naive``,
``transition`` and ``hypic`` at seams 0…32 (and the in-context cold strategy), scored against the
references and against ``full`` itself (first-token KL divergence and top-1 agreement).

Each label gets a fresh engine (an empty cache), and its documents are prefilled by its own cold
strategy: standalone entries are the same whether a document was cached earlier or just now, so
one pass measures warm quality. In-context entries depend on what preceded them, so that label
first builds them from the same documents in reverse order, then answers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.eval.metrics import best_score
from hypic.eval.tasks import FAMILIES, generate
from hypic.eval.tokenizer import encode_example
from hypic.models.loader import LoadedModel

SEAMS = (0, 1, 2, 4, 8, 16, 32)
# label → (mode, seam, cold strategy)
LABELS: dict[str, tuple[str, int, str]] = {
    "full": ("full", 8, "standalone"), "prefix": ("prefix", 8, "standalone"), "naive": ("naive", 0, "standalone"),
    "zero_state": ("zero_state", 0, "standalone"), "addition": ("addition", 0, "standalone"),
    "transition": ("transition", 0, "standalone"),
    **{f"hypic_w{w}": ("hypic", w, "standalone") for w in SEAMS},
    "hypic_w8_in_context": ("hypic", 8, "in_context"),
}
MAX_TOKENS = {"em_f1": 8, "rougeL": 48}


@dataclass
class LabelResult:
    family_scores: dict[str, float] = field(default_factory=dict)  # 0–100: F1 (QA) or ROUGE-L
    family_em: dict[str, float] = field(default_factory=dict)  # QA exact match, 0–100
    # QA exact match per relation the answer comes from ("single_hop:colour", "multi_hop:home"), 0–100:
    # a model can learn to look some relations up and not others, which a family average hides
    relation_em: dict[str, float] = field(default_factory=dict)
    # the family average within each document-count bucket ("5-8": …): how a mode's loss grows with
    # the number of cached segments composed before the query
    docs_scores: dict[str, float] = field(default_factory=dict)
    kl: float = 0.0  # mean first-token KL(full ‖ label)
    top1: float = 0.0  # first-token top-1 agreement with full, 0–100

    @property
    def average(self) -> float:
        return sum(self.family_scores.values()) / max(1, len(self.family_scores))


def _batches(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _by_relation(family: str, examples: list, ems: list[float]) -> dict[str, float]:
    """Mean EM (0–100) per answered relation; a two-hop question counts under its second hop."""
    groups: dict[str, list[float]] = {}
    for ex, em in zip(examples, ems, strict=True):
        groups.setdefault(f"{family}:{ex.meta['relation'].split('>')[-1]}", []).append(em)
    return {key: 100 * sum(v) / len(v) for key, v in sorted(groups.items())}


def docs_bucket(num_docs: int) -> str:
    """Power-of-two buckets of the document count: 1, 2, 3-4, 5-8, 9-16, 17-32, …"""
    if num_docs < 1:
        raise ValueError(f"num_docs must be ≥ 1, got {num_docs}")
    hi = 1 << (num_docs - 1).bit_length()
    return str(num_docs) if hi <= 2 else f"{hi // 2 + 1}-{hi}"


def _by_docs(per_family: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """(document count, score) per example and family → the family average per bucket (families
    with no example in a bucket are left out of its average)."""
    cells: dict[str, dict[str, list[float]]] = {}  # filled smallest count first: buckets in order
    for num_docs, family, value in sorted((d, f, v) for f, pairs in per_family.items() for d, v in pairs):
        cells.setdefault(docs_bucket(num_docs), {}).setdefault(family, []).append(value)
    return {bucket: sum(100 * sum(v) / len(v) for v in fams.values()) / len(fams) for bucket, fams in cells.items()}


def check_labels(labels: list[str]) -> list[str]:
    unknown = [label for label in labels if label not in LABELS]
    if unknown:
        raise ValueError(f"labels: unknown {unknown}; choose from {list(LABELS)}")
    return labels


def task_prompts(loaded: LoadedModel, n: int, seed: int, difficulty: float) -> tuple[dict[str, list], dict[str, list]]:
    """Every family's ``n`` examples and their encodings (prompt segments as token ids)."""
    if loaded.tokenizer is None:
        raise ValueError("model: the task prompts need a tokenizer.json")
    examples = {f: generate(f, n, seed, difficulty=difficulty) for f in FAMILIES}
    return examples, {f: [encode_example(loaded.tokenizer, ex) for ex in examples[f]] for f in FAMILIES}


def build_entries(engine: Engine, prompts: list[list[list[int]]], mode: str, cold: str) -> None:
    """What a label's cache holds when its prompts arrive. In-context entries depend on what preceded
    them, so that strategy first builds them from the same documents in reverse order; standalone
    entries are the same whether a document was cached earlier or is filled by the request itself."""
    if cold == "in_context":
        engine.prefill_logits([[p[0], *p[-2:0:-1], p[-1]] for p in prompts], mode=mode)


def evaluate(loaded: LoadedModel, *, n: int, seed: int = 1234, difficulty: float = 1.0,
             labels: list[str] | None = None, batch: int = 8,
             on_label: Callable[[dict[str, LabelResult]], None] | None = None) -> dict[str, LabelResult]:
    """Scores per label. `on_label` sees the results so far after each label: a long run that is cut
    off (a device call's time limit) still leaves every finished label behind."""
    examples, data = task_prompts(loaded, n, seed, difficulty)
    tok = loaded.tokenizer
    labels = check_labels(labels or list(LABELS))
    results: dict[str, LabelResult] = {}
    # Every family's prompts in one stream of batches: fewer decode steps than a batch per family,
    # though on the H200 not less time — a step is row-bound there (docs/training.md, session 7).
    items = [(family, e) for family, encoded in data.items() for e in encoded]
    # the reference logits in the same batches as every label: `full` then matches itself bitwise
    reference = torch.log_softmax(torch.cat([Engine(loaded).prefill_logits([e.segments for _, e in chunk],
                                                                           mode="full")[0]
                                             for chunk in _batches(items, batch)]), -1)
    for label in labels:
        mode, seam, cold = LABELS[label]
        engine = Engine(loaded, seam=seam, cold=cold)
        res, first = LabelResult(), []
        preds: dict[str, list[str]] = {f: [] for f in data}
        for chunk in _batches(items, batch):
            params = [SamplingParams(max_tokens=MAX_TOKENS[FAMILIES[f].metric]) for f, _ in chunk]
            prompts = [e.segments for _, e in chunk]
            build_entries(engine, prompts, mode, cold)
            runs = engine.start(prompts, params, mode=mode, keep_logits=True)
            engine.finish(runs)
            first += [r.first_logits for r in runs]
            for (family, _), r in zip(chunk, runs, strict=True):
                preds[family].append(tok.decode(r.output.token_ids, skip_special_tokens=True).strip())
        per_docs: dict[str, list[tuple[int, float]]] = {}
        for family in data:
            metric = FAMILIES[family].metric
            scores = [best_score(metric, p, ex.references) for p, ex in zip(preds[family], examples[family],
                                                                            strict=True)]
            key = "f1" if metric == "em_f1" else "rougeL"
            res.family_scores[family] = 100 * sum(s[key] for s in scores) / len(scores)
            per_docs[family] = [(len(ex.segments) - 2, s[key]) for ex, s in zip(examples[family], scores, strict=True)]
            if metric == "em_f1":
                res.family_em[family] = 100 * sum(s["em"] for s in scores) / len(scores)
                res.relation_em.update(_by_relation(family, examples[family], [s["em"] for s in scores]))
        res.docs_scores = _by_docs(per_docs)
        p, q = reference, torch.log_softmax(torch.stack(first), -1)  # every prompt, in `items` order
        res.kl = (p.exp() * (p - q)).sum(-1).mean().item()
        res.top1 = 100 * (p.argmax(-1) == q.argmax(-1)).float().mean().item()
        results[label] = res
        if on_label is not None:
            on_label(results)
    return results
