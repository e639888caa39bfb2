"""What a beam search costs under each mode: every step re-asks every beam's next token, so under
`full` each step recomputes the whole prompt, under `hypic` only the seams and the query with the
beam's tokens (the documents cached once, at the first step).

    python scripts/beam_cost.py --width 4 --max-tokens 16 --questions 3

The bundled model, its RAG prompts (hypic.demo); per mode, the search's wall time (median over the
questions, each with a fresh cache salt so its first step is cold) and the tokens the model ran.
"""

from __future__ import annotations

import argparse
import statistics
import time

from hypic import BeamSearchParams
from hypic.eval.trace import generate_trace
from hypic.llm import LLM


def rag_prompts(questions: int, seed: int) -> list[list[str]]:
    """The demo's prompts (hypic.demo): a head, 6–10 documents of 96–256 tokens, a question."""
    trace = generate_trace(seed, num_requests=questions, pool_size=24, num_docs=(6, 10), doc_tokens=(96, 256))
    return [trace.example(r).segments for r in trace.requests]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    llm = LLM()
    prompts = rag_prompts(args.questions, args.seed)
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens, ignore_eos=True)
    llm.beam_search([prompts[0]], BeamSearchParams(beam_width=2, max_tokens=2), mode="full")  # warm-up
    rows, texts = {}, {}
    for mode in ("full", "hypic"):
        times = []
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            out = llm.beam_search([prompt], params, mode=mode, cache_salt=f"beam-{mode}-{i}")[0]
            times.append(time.perf_counter() - t0)
            texts.setdefault(i, {})[mode] = [b.text for b in out.sequences]
        rows[mode] = statistics.median(times)
    same = sum(texts[i]["full"][0] == texts[i]["hypic"][0] for i in texts)
    print(f"Beam search, width {args.width}, {args.max_tokens} tokens, {len(prompts)} questions "
          f"(median prompt {statistics.median(sum(len(s) for s in llm.tokenize(p)) for p in prompts):.0f} tokens):")
    print("| mode | search (s), median | vs full |")
    print("|---|---|---|")
    for mode, t in rows.items():
        print(f"| {mode} | {t:.2f} | {rows['full'] / t:.2f}× |")
    print(f"best beam the same under both modes: {same} of {len(prompts)}")


if __name__ == "__main__":
    main()
