"""docs/quality.md: the table across the ladder and a plot of score against the seam width."""

from __future__ import annotations

from pathlib import Path

from hypic.eval.quality import SEAMS, LabelResult
from hypic.eval.tasks import FAMILIES


def table(results: dict[str, LabelResult]) -> str:
    fams = list(FAMILIES)
    head = ("| mode | " + " | ".join(fams) +
            " | average | Δ vs full | EM single/multi-hop | KL(full‖mode) | top-1 vs full |")
    lines = [head, "|" + "---|" * (len(fams) + 6)]
    full = results["full"].average if "full" in results else None  # a --labels run may leave it out
    for label, r in results.items():
        em = "/".join(f"{r.family_em.get(f, float('nan')):.1f}" for f in ("single_hop", "multi_hop"))
        cells = [f"{r.family_scores[f]:.1f}" for f in fams]
        delta = "–" if full is None else f"{r.average - full:+.1f}"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {r.average:.1f} | {delta} | {em} | "
                     f"{max(r.kl, 0.0):.4f} | {r.top1:.1f}% |")  # a KL is ≥ 0: −0.0000 was rounding
    return "\n".join(lines)


def docs_table(results: dict[str, LabelResult]) -> str:
    """The family average per document-count bucket, with its difference from ``full`` in the bucket."""
    buckets = list(next(iter(results.values())).docs_scores) if results else []
    full = results.get("full")
    lines = ["| mode | " + " | ".join(f"{b} documents" for b in buckets) + " |", "|" + "---|" * (len(buckets) + 1)]
    for label, r in results.items():
        cells = []
        for b in buckets:
            value = r.docs_scores.get(b)
            if value is None:
                cells.append("–")
            elif full is None or label == "full" or b not in full.docs_scores:
                cells.append(f"{value:.1f}")
            else:
                cells.append(f"{value:.1f} ({value - full.docs_scores[b]:+.1f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def relation_table(result: LabelResult) -> str:
    """EM per answered relation, one row per QA family: where a model has not learned a lookup."""
    rels = sorted({key.split(":", 1)[1] for key in result.relation_em})
    fams = sorted({key.split(":", 1)[0] for key in result.relation_em})
    lines = ["| family | " + " | ".join(rels) + " |", "|" + "---|" * (len(rels) + 1)]
    for fam in fams:
        cells = [f"{result.relation_em[f'{fam}:{r}']:.0f}" if f"{fam}:{r}" in result.relation_em else "–" for r in rels]
        lines.append(f"| {fam} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, LabelResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [w for w in SEAMS if f"hypic_w{w}" in results]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot([max(w, 0.5) for w in xs], [results[f"hypic_w{w}"].average for w in xs], "o-", label="hypic")
    refs = (("full", "k--"), ("naive", "r:"), ("addition", "y:"), ("zero_state", "c:"), ("transition", "m-."),
            ("prefix", "g--"))
    for label, style in refs:
        if label in results:
            ax.axhline(results[label].average, linestyle=style[1:], color=style[0], label=label)
    if xs:  # a partial run (cut off before any hypic label) still gets its reference lines
        ax.set_xscale("log", base=2)
        ax.set_xticks([max(w, 0.5) for w in xs], [str(w) for w in xs])
    ax.set_xlabel("seam window w (tokens)")
    ax.set_ylabel("score (avg over task families, 0–100)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
