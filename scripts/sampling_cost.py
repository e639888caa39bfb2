"""The sampled draw's cost per decode step, side by side in one process: the per-row draw it replaced
(each row's probabilities copied to the host and drawn by torch.multinomial on the CPU: a stall per
row) against hypic.engine.sampling.sample (every row at once on the logits' device, inverse CDF).

    python3 scripts/sampling_cost.py [--vocab 151936] [--batches 1,8,32,64] [--iters 30] [--out FILE]

Prints a markdown table (milliseconds per step: the whole ``sample`` call, adjustments and read-back
included) and writes it to --out."""

from __future__ import annotations

import argparse
import time

import torch

from hypic.engine.request import SamplingParams
from hypic.engine.sampling import sample

SETTINGS = {"T=1": dict(temperature=1.0), "T=0.7 top_p=0.95": dict(temperature=0.7, top_p=0.95),
            "T=0.7 top_k=50 min_p=0.05": dict(temperature=0.7, top_k=50, min_p=0.05)}


def _legacy_filter(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's cut, as sample() made it before (vLLM V1's order)."""
    zero = torch.zeros_like(probs)
    if p.min_p > 0.0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, zero)
    if 0 < p.top_k < probs.shape[-1]:
        probs = torch.where(probs >= probs.topk(p.top_k).values[-1], probs, zero)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        sorted_p = sorted_p / sorted_p.sum()
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p
        probs = zero.scatter(0, order[keep], sorted_p[keep])
    return probs


def legacy_sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]) -> list[int]:
    """The draw before: a row at a time, each drawn on the host."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for row, p, g in zip(logprobs, params, gens, strict=True):
        probs = _legacy_filter(torch.softmax(row / p.temperature, dim=-1), p)
        out.append(int(torch.multinomial(probs.cpu(), 1, generator=g)))
    return out


def _time(fn, iters: int, device: torch.device) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)  # Qwen3.5's
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows = ["| setting | batch | before (ms/step) | now (ms/step) | ratio |", "|---|---|---|---|---|"]
    for label, kw in SETTINGS.items():
        for b in (int(x) for x in args.batches.split(",")):
            logits = torch.randn(b, args.vocab, device=device) * 3
            params = [SamplingParams(seed=i, **kw) for i in range(b)]
            gens = [torch.Generator().manual_seed(i) for i in range(b)]
            before = _time(lambda: legacy_sample(logits, params, gens), args.iters, device)
            now = _time(lambda: sample(logits, params, gens), args.iters, device)
            rows.append(f"| {label} | {b} | {before:.2f} | {now:.2f} | {before / now:.1f}× |")
            print(rows[-1], flush=True)
    table = "\n".join([f"Sampling cost per decode step, vocab {args.vocab}, {name}, {args.iters} steps each:", "",
                       *rows])
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
