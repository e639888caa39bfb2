"""What ``LLM.generate`` holds for a large batch: every prompt started at once (``max_num_seqs`` at
least the batch, as every call ran before it was bounded) against at most ``max_num_seqs`` answers
decoding together, the next prompts prefilled as answers end. One process per setting, so each
peak is its own: wall time, peak resident memory (the CPU) or peak device memory (CUDA), and
whether the answers equal the first setting's.

    python scripts/generate_waves.py [--n 1024] [--seqs 0,256,64] [--difficulty 0.3] [--max-tokens 8]
                                     [--device cpu]

``--seqs``: the ``max_num_seqs`` of each setting, 0 meaning the batch's size (all at once). Prompts
are the single-hop family's (the bundled model, fp32 on the CPU, its default dtype on CUDA), greedy.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def child(n: int, seqs: int, difficulty: float, max_tokens: int, device: str) -> None:
    import torch

    from hypic import LLM, SamplingParams
    from hypic.eval import tasks

    prompts = [ex.segments for ex in tasks.generate("single_hop", n, seed=0, difficulty=difficulty)]
    llm = LLM(device=device, max_num_seqs=seqs or n)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens), mode="full")
    wall = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    tokens = sum(len(s) for p in prompts for s in llm.tokenize(p))
    print(json.dumps({"wall_s": wall, "peak_bytes": peak, "prompt_tokens": tokens,
                      "answers": [o.token_ids for o in outs]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--seqs", default="0,256,64")
    ap.add_argument("--difficulty", type=float, default=0.3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.n, args.child, args.difficulty, args.max_tokens, args.device)
        return
    rows, first = [], None
    for seqs in (int(s) for s in args.seqs.split(",")):
        out = subprocess.run([sys.executable, __file__, "--child", str(seqs), "--n", str(args.n), "--difficulty",
                              str(args.difficulty), "--max-tokens", str(args.max_tokens), "--device", args.device],
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"max_num_seqs {seqs}: the child failed\n{out.stderr[-3000:]}")
        got = json.loads(out.stdout.strip().splitlines()[-1])
        first = first or got
        rows.append((seqs or args.n, got, got["answers"] == first["answers"]))
    what = "peak device memory (GiB)" if args.device == "cuda" else "peak resident memory (GiB)"
    print(f"{args.n} single-hop prompts ({rows[0][1]['prompt_tokens']} tokens), {args.max_tokens} tokens each, "
          f"greedy, {args.device}")
    print(f"| max_num_seqs | wall (s) | {what} | answers as the first row's |")
    print("|---|---|---|---|")
    for seqs, got, same in rows:
        print(f"| {seqs} | {got['wall_s']:.1f} | {got['peak_bytes'] / 2**30:.2f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
