"""A cold request's TTFT against ``full`` on the CPU, on the bundled model: RAG prompts of the
synthetic trace (6–10 documents of 96–256 tokens), each answered in ``full`` and then in ``hypic``
under a fresh cache salt (every document missed: prefilled standalone, its entry built), rounds
alternated. Each package named runs in a process of its own, one after the other, so an older
checkout can be put beside this one:

    python scripts/cpu_cold.py [--prompts 8] [--reps 3] [--package old=/path/to/checkout]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from packages import add_package_args, child_done, run_packages  # noqa: E402


def measure(prompts: int, reps: int) -> dict[str, list[float]]:
    from hypic import LLM, SamplingParams
    from hypic.eval.trace import generate_trace

    llm = LLM(device="cpu")
    trace = generate_trace(0, num_requests=prompts, pool_size=10 * prompts, num_docs=(6, 10), doc_tokens=(96, 256))
    examples = [trace.example(r).segments for r in trace.requests]
    one = SamplingParams(max_tokens=1)
    llm.generate([examples[0]], one, mode="hypic", cache_salt="warm-up")  # first-call costs out of the way
    out: dict[str, list[float]] = {"full": [], "cold": []}
    for rep in range(reps):
        for i, segments in enumerate(examples):
            for label, mode in (("full", "full"), ("cold", "hypic")):
                answer = llm.generate([segments], one, mode=mode, cache_salt=f"{rep}-{i}")[0]
                out[label].append(1e3 * answer.metrics.ttft_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    add_package_args(ap)
    args = ap.parse_args()
    if child_done(args, lambda: measure(args.prompts, args.reps)):
        return
    runs = run_packages(__file__, ["--prompts", str(args.prompts), "--reps", str(args.reps)], args.package)
    print(f"{args.prompts} prompts × {args.reps} rounds, TTFT (ms) medians; cold / full: per prompt, the median")
    print("| package | full | hypic cold | cold / full |")
    print("|---|---|---|---|")
    for label, t in runs.items():
        ratio = statistics.median(c / f for c, f in zip(t["cold"], t["full"], strict=True))
        print(f"| {label} | {statistics.median(t['full']):.1f} | {statistics.median(t['cold']):.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
