"""lm-eval's loglikelihood requests over HTTP against one or more running ``hypic serve``s, alternated
request by request (A/B on one machine: e.g. two trees of hypic on two ports).

Each request is what ``local-completions`` sends: a batch of ``--batch`` token-id prompts (context +
continuation, new every request, as a harness's are), ``echo``, ``logprobs: 1``, ``temperature: 0``,
``max_tokens: 1``; with ``--floor`` the same with ``max_tokens: 0`` (scoring alone) too. Prints each
server's median seconds per request and checks they scored the same.

    python3 scripts/echo_http.py --urls http://127.0.0.1:8124,http://127.0.0.1:8125 [--requests 12] [--batch 16]
"""

import argparse
import json
import random
import statistics
import time
import urllib.request


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--urls", required=True)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--min-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--vocab", type=int, default=1900, help="token ids drawn below this")
    ap.add_argument("--floor", action="store_true", help="also max_tokens 0 (the scoring alone)")
    args = ap.parse_args()
    urls, rng = args.urls.split(","), random.Random(0)
    arms = [(u, 1) for u in urls] + ([(u, 0) for u in urls] if args.floor else [])
    times: dict[tuple[str, int], list[float]] = {a: [] for a in arms}
    worst = 0.0
    for k in range(args.requests):
        prompts = [[rng.randrange(3, args.vocab) for _ in range(rng.randint(args.min_tokens, args.max_tokens))]
                   for _ in range(args.batch)]
        scores = []
        for arm in arms[k % len(arms):] + arms[:k % len(arms)]:  # each arm first in turn
            body = {"prompt": prompts, "echo": True, "logprobs": 1, "temperature": 0, "max_tokens": arm[1]}
            t0 = time.perf_counter()
            out = post(arm[0], body)
            times[arm].append(time.perf_counter() - t0)
            scores.append([c["logprobs"]["token_logprobs"][1:len(p)]
                           for c, p in zip(sorted(out["choices"], key=lambda c: c["index"]), prompts, strict=True)])
        worst = max(worst, max(abs(a - b) for s in scores[1:] for pa, pb in zip(scores[0], s, strict=True)
                               for a, b in zip(pa, pb, strict=True)))
    print(f"{args.requests} requests of {args.batch} prompts of {args.min_tokens}-{args.max_tokens} tokens; "
          f"largest score difference between arms {worst:.1e}")
    print("| server | max_tokens | median s / request |")
    print("|---|---|---|")
    for (url, mt), ts in times.items():
        print(f"| {url} | {mt} | {statistics.median(ts):.2f} |")


if __name__ == "__main__":
    main()
