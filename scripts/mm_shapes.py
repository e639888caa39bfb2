"""Host time of a matmul launch on the GPU, by how its shape recurs: the cold call's profile read
≈ 106 µs of host time per ``aten::mm`` (128 a call), ten times a usual launch. Is a token count the
process has not met before the cause (cuBLAS choosing an algorithm per new shape)?

    python3 scripts/mm_shapes.py [--calls 2000] [--blas cublas|cublaslt]

Arms, each launching ``--calls`` bf16 ``F.linear`` of [N, 4096] by a [8192, 4096] weight (a 9B-shape
projection, as the model calls it) the device synchronized after each (so no launch waits for a full queue; only the launch is timed):
the same N every call; N drawn from a few values met before; N new at every call (never met in this
process); N padded up to a multiple of 64 (the values recur). Then each arm again, the new-N arm with
values still unmet.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def arm(weight: torch.Tensor, sizes: list[int], x: torch.Tensor) -> float:
    """Median and mean host µs per launch over ``sizes``."""
    times = []
    for n in sizes:
        a = x[:n]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, weight)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times), 1e6 * statistics.mean(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="launches per arm (at most 4 000)")
    ap.add_argument("--blas", choices=("default", "cublas", "cublaslt"), default="default",
                    help="torch.backends.cuda.preferred_blas_library")
    ap.add_argument("--pad", type=int, default=64, help="the padded arm's multiple")
    args = ap.parse_args()
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    print(f"blas: {torch.backends.cuda.preferred_blas_library()}")
    dev = torch.device("cuda")
    w = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)  # [out, in], as nn.Linear holds it
    x = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
    rng = random.Random(0)
    unmet = rng.sample(range(65, 8192), 2 * args.calls)  # each N once: half per pass
    for n in (64, 128, 256, 512):  # warm-up: cuBLAS loaded, a few shapes met
        torch.nn.functional.linear(x[:n], w)
    arms = {
        "same N (512)": [512] * args.calls,
        "N among 4 met values": [rng.choice((64, 128, 256, 512)) for _ in range(args.calls)],
        "N new every call": unmet[:args.calls],
        f"N new, padded to {args.pad}": [-(-n // args.pad) * args.pad for n in rng.sample(range(65, 8192), args.calls)],
    }
    print(f"| arm ({args.calls} launches) | host µs per launch, median | mean |")
    print("|---|---|---|")
    for name, sizes in arms.items():
        med, mean = arm(w, sizes, x)
        print(f"| {name} | {med:.1f} | {mean:.1f} |", flush=True)
    for name, sizes in arms.items():  # again: the padded arm's values have all been met by now
        med, mean = arm(w, sizes if "new every" not in name else unmet[args.calls:], x)
        print(f"| {name}, second pass | {med:.1f} | {mean:.1f} |", flush=True)


if __name__ == "__main__":
    main()
