"""The fused GDN combine kernel's launch shapes timed side by side on the GPU, on a schedule shaped like
a warm trace call (``hypic.eval.trace``: 4–32 cached documents per request, each entered through a
recompute run of the seam window, then the question) at the 9B shape's linear heads (16 key heads,
32 value heads, K = V = 128). On the H200 the first kernel (state key-major, 8 warps, value blocks of
32) took 54.8 of a warm call of 8's 97.8 ms of device time (2.3 ms a layer): its T tile in registers
leaves one program per SM, so a layer runs in ≈ 8 waves of sequential token steps. Each variant is
checked against the first kernel (fp32 inputs, relative error of the outputs and final states).

    python3 scripts/gdn_combine_bench.py [--requests 8] [--seam 8] [--variants kv,vk,vk,16,2]
"""

from __future__ import annotations

import argparse
import random

import torch

H, HV, K, V = 16, 32, 128, 128


def schedule_rows(requests: int, seam: int, question: int, seed: int) -> tuple[list, int, int]:
    """Per request: (RUN, a, b) of ``seam`` rows then (BODY, i, 0) per document, then a question run."""
    from hypic.ops.triton_gdn_combine import BODY, RUN

    rng = random.Random(seed)
    rows = bodies = 0
    sched = []
    for _ in range(requests):
        items = [(RUN, rows, rows + 24)]  # the head
        rows += 24
        for _ in range(rng.randint(4, 32)):
            items += [(RUN, rows, rows + seam), (BODY, bodies, 0)]
            rows, bodies = rows + seam, bodies + 1
        items.append((RUN, rows, rows + question))
        rows += question
        sched.append(items)
    return sched, rows, bodies


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--question", type=int, default=24)
    ap.add_argument("--variants", default="kv;vk;vk,16,2;vk,32,2;vk,32,4;vk,16,4")
    args = ap.parse_args()
    from hypic.ops import triton_gdn_combine as fused
    from hypic.ops.triton_chain import addresses

    dev = torch.device("cuda")
    sched, rows, n_bodies = schedule_rows(args.requests, args.seam, args.question, 0)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(rows, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(rows, H, K, generator=gen), dim=-1)
    v = torch.randn(rows, HV, V, generator=gen)
    g = -torch.rand(rows, HV, generator=gen) * 0.1
    beta = torch.rand(rows, HV, generator=gen)
    # bodies: contractive transitions (a decayed identity minus a small rank-8 part) and random states
    eye = torch.eye(K).expand(HV, K, K)
    trans = [(0.9 * eye - 0.05 * torch.randn(HV, K, 8, generator=gen) @ torch.randn(HV, 8, K, generator=gen) / K)
             .to(dev).contiguous() for _ in range(n_bodies)]
    states = [torch.randn(HV, K, V, generator=gen).to(dev) for _ in range(n_bodies)]
    T, held_t = addresses([(t, None) for t in trans], dev)
    S, held_s = addresses([(s, None) for s in states], dev)
    items, cu = fused.schedule(sched, dev)
    print(f"{args.requests} requests, {rows} run rows, {n_bodies} bodies; 24 layers' worth timed per variant")
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = [t.to(dev, dtype) for t in (q, k, v)]
        gb = (g.to(dev), beta.to(dev))
        for variant in args.variants.split(";"):
            try:
                call = lambda vr=variant: fused.gdn_combine(*x, *gb, K ** -0.5, T, S, items, cu, variant=vr)  # noqa: E731
                o, final = call()
                torch.cuda.synchronize()
                for _ in range(2):
                    call()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(24):
                    call()
                b.record()
                b.synchronize()
                results[(dtype, variant)] = (a.elapsed_time(b), o.float(), final)
            except Exception as e:  # noqa: BLE001 — a variant that fails prints why and the rest go on
                print(f"{variant} {dtype}: {type(e).__name__}: {str(e)[:300]}")
    print("| inputs | variant (layout, BV, warps) | 24 layers (ms) | vs kv | output rel. err vs kv | final rel. err |")
    print("|---|---|---|---|---|---|")
    for (dtype, variant), (ms, o, final) in results.items():
        base = results.get((dtype, "kv"))
        if base is None:
            continue
        eo = ((o - base[1]).norm() / base[1].norm()).item()
        ef = ((final - base[2]).norm() / base[2].norm()).item()
        print(f"| {str(dtype)[6:]} | {variant} | {ms:.2f} | {base[0] / ms:.2f}× | {eo:.1e} | {ef:.1e} |")


if __name__ == "__main__":
    main()
