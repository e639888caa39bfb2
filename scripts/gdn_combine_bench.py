"""The fused GDN combine kernel's launch shapes timed side by side on the GPU, on a schedule shaped like
a warm trace call (``hypic.eval.trace``: 4–32 cached documents per request, each entered through a
recompute run of the seam window, then the question) at the 9B shape's linear heads (16 key heads,
32 value heads, K = V = 128). On the H200 the first kernel (state key-major, 8 warps, value blocks of
32) took 54.8 of a warm call of 8's 97.8 ms of device time (2.3 ms a layer): its T tile in registers
left one program per SM. Each launch shape is checked against the first one listed (relative error
of the outputs and final states).

    python3 scripts/gdn_combine_bench.py [--requests 8] [--seam 8] [--variants "32,2;16,1"]
    python3 scripts/gdn_combine_bench.py --seam 0 --question 0   # the bodies alone
    python3 scripts/gdn_combine_bench.py --no-bodies             # the token steps alone
    python3 scripts/gdn_combine_bench.py --precisions tf32x3,bf16x3,bf16x6   # the bodies' dots
"""

from __future__ import annotations

import argparse
import functools
import random

import torch

H, HV, K, V = 16, 32, 128, 128


def schedule_rows(requests: int, seam: int, question: int, seed: int, bodies_on: bool = True) -> tuple[list, int, int]:
    """Per request: (RUN, a, b) of ``seam`` rows then (BODY, i, 0) per document, then a question run."""
    from hypic.ops.triton_gdn_combine import BODY, RUN

    rng = random.Random(seed)
    rows = bodies = 0
    sched = []
    for _ in range(requests):
        items = [(RUN, rows, rows + 24)]  # the head
        rows += 24
        for _ in range(rng.randint(4, 32)):
            items += [(RUN, rows, rows + seam)] if seam else []
            items += [(BODY, bodies, 0)] if bodies_on else []
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
    ap.add_argument("--no-bodies", action="store_true", help="runs only: the token steps' cost alone")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--precisions", default="tf32x3",
                    help="the body dots' input precisions, comma-separated (tf32x3, bf16x3, bf16x6, tf32, ieee)")
    ap.add_argument("--variants", default="32,2;16,1;16,2;32,4;64,4;128,8",
                    help="launch shapes: value block,warps[,body chunk[,stages[,max registers]]]")
    args = ap.parse_args()
    from hypic.ops import triton_gdn_combine as fused
    from hypic.ops.triton_chain import addresses

    dev = torch.device("cuda")
    sched, rows, n_bodies = schedule_rows(args.requests, args.seam, args.question, 0, not args.no_bodies)
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
    longest = max(sum(it[2] - it[1] if it[0] == fused.RUN else 0 for it in r) for r in sched)
    print(f"{args.requests} requests, {rows} run rows (longest request {longest}), {n_bodies} bodies; "
          "24 layers' worth timed per variant")
    results = {}
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        x = [t.to(dev, dtype) for t in (q, k, v)]
        gb = (g.to(dev), beta.to(dev))
        for variant in args.variants.split(";"):
            for precision in args.precisions.split(","):
                try:
                    bv, warps, *rest = (int(n) for n in variant.split(","))
                    call = functools.partial(fused.gdn_combine, *x, *gb, K ** -0.5, T, S, items, cu,
                                             precision=precision, block_v=bv, warps=warps,
                                             body_chunk=rest[0] if rest else 16,
                                             **dict(zip(("num_stages", "maxnreg"), rest[1:], strict=False)))
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
                    results[(dtype, variant, precision)] = (a.elapsed_time(b), o.float(), final)
                except Exception as e:  # noqa: BLE001 — a variant that fails prints why and the rest go on
                    print(f"{variant} {precision} {dtype}: {type(e).__name__}: {str(e)[:300]}")
    first = (args.variants.split(";")[0], args.precisions.split(",")[0])
    print(f"| inputs | value block, warps | dots | 24 layers (ms) | vs {', '.join(first)} | output rel. err vs it "
          "| final rel. err |")
    print("|---|---|---|---|---|---|---|")
    for (dtype, variant, precision), (ms, o, final) in results.items():
        base = results.get((dtype, *first))
        if base is None:
            continue
        eo = ((o - base[1]).norm() / base[1].norm()).item()
        ef = ((final - base[2]).norm() / base[2].norm()).item()
        print(f"| {str(dtype)[6:]} | {variant} | {precision} | {ms:.2f} | {base[0] / ms:.2f}× | {eo:.1e} | {ef:.1e} |")
    # registers and spills of every compiled variant (spilled state goes through local memory)
    for cache in fused._gdn_combine_kernel.device_caches.values():
        for compiled in cache[0].values():
            c = compiled.metadata
            print(f"compiled: warps {c.num_warps}, {compiled.n_regs} registers, {compiled.n_spills} spills, "
                  f"shared {c.shared} B, constants "
                  f"{ {n: v for n, v in getattr(compiled.src, 'constants', {}).items() if isinstance(v, (int, str))} }")

if __name__ == "__main__":
    main()
