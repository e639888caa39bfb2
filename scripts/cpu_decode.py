"""What a decode step costs on the CPU with the one-token path (``hypic.ops.linear._one_token``: the
recurrence applied once per sequence) against the chunked kernel it replaced for decode steps (each
token padded to a 16-token chunk), side by side in one run on the bundled model.

Each arm generates ``--tokens`` greedy tokens (``ignore_eos``) for a batch of ``--batch`` prompts,
alternated ``--reps`` times; the table gives the medians and the tokens' agreement.

    python scripts/cpu_decode.py [--tokens 60] [--batch 1,8] [--reps 5]
"""

import argparse
import contextlib
import statistics
import time
from unittest.mock import patch

from hypic import LLM, SamplingParams
from hypic.ops import linear


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(device="cpu")
    sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True)

    def chunked(fam, q, k, v, g, beta, a, b, initial_state, scale, ct):  # the path before: the chunked kernel
        cu = linear.torch.arange(v.shape[0] + 1)
        return linear.chunk_linear_attention(fam, q, k, v, g, beta, a, b, cu, initial_state, scale, False)

    print(f"bundled model, CPU, {args.tokens} greedy tokens per prompt, medians of {args.reps}")
    print("| prompts | chunked kernel (s) | one-token path (s) | ratio | same tokens |")
    print("|---|---|---|---|---|")
    for n in [int(x) for x in args.batch.split(",")]:
        prompts = [f"Profile of Mira{i}. Mira{i} lives in Quorvane.<<PIC_SEP>>Where does Mira{i} live?"
                   for i in range(n)]
        llm.generate(prompts, sp)  # warm-up
        times: dict[str, list[float]] = {"old": [], "new": []}
        outs = {}
        for _ in range(args.reps):
            for arm in ("old", "new"):
                with patch.object(linear, "_one_token", chunked) if arm == "old" else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    outs[arm] = [o.token_ids for o in llm.generate(prompts, sp)]
                    times[arm].append(time.perf_counter() - t0)
        old, new = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"| {n} | {old:.2f} | {new:.2f} | {old / new:.2f}× | {outs['old'] == outs['new']} |")


if __name__ == "__main__":
    main()
