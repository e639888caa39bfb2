"""The main job (``make demo`` / ``hypic demo``): a short RAG session on the bundled model.

A pool of documents and a few questions from the trace generator; each question is asked with
its documents in a fresh order under ``full`` (no cache), ``hypic`` cold (the first time the
documents are seen: standalone prefill, then the combine pass) and ``hypic`` warm (every document
cached, an order never seen before). It prints the answers with TTFT, cached and recomputed tokens.
"""

from __future__ import annotations

import random

from hypic.engine.request import SamplingParams
from hypic.eval.metrics import exact_match
from hypic.eval.trace import generate_trace
from hypic.llm import LLM


def rag_session(llm: LLM, *, questions: int = 3, seed: int = 0) -> list[dict]:
    trace = generate_trace(seed, num_requests=questions, pool_size=24, num_docs=(6, 10), doc_tokens=(96, 256))
    rng = random.Random(seed)
    rows = []
    sp = SamplingParams(max_tokens=12)
    for i, request in enumerate(trace.requests):
        ex = trace.example(request)
        head, docs, query = ex.segments[0], ex.segments[1:-1], ex.segments[-1]
        salt = f"demo-{seed}-{i}"  # a fresh tenant per question: its first hypic request is cold
        for label, mode in (("full", "full"), ("hypic cold", "hypic"), ("hypic warm", "hypic")):
            order = rng.sample(docs, len(docs))
            out = llm.generate([[head, *order, query]], sp, mode=mode, cache_salt=salt)[0]
            answer = out.text.strip()
            rows.append({"question": query.removeprefix("Question: ").split("\n")[0], "mode": label,
                         "answer": answer, "reference": ex.answer,
                         "correct": any(exact_match(answer, r) for r in ex.references),
                         "ttft_ms": 1000 * out.metrics.ttft_s, "prompt": out.metrics.prompt_tokens,
                         "cached": out.metrics.cached_tokens, "recomputed": out.metrics.recomputed_tokens})
    return rows


def print_session(rows: list[dict]) -> None:
    print(f"{'mode':<11}{'TTFT ms':>9}{'prompt':>8}{'cached':>8}{'recomp':>8}  answer (reference)")
    question = None
    for r in rows:
        if r["question"] != question:
            question = r["question"]
            print(f"\nQ: {question}")
        mark = "✓" if r["correct"] else "✗"
        print(f"{r['mode']:<11}{r['ttft_ms']:>9.1f}{r['prompt']:>8}{r['cached']:>8}{r['recomputed']:>8}  "
              f"{mark} {r['answer']!r} ({r['reference']})")
