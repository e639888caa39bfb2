"""GPU→GPU bandwidth on this machine, the two ways hypic could move cache entries: NCCL point-to-point
between two processes (what hypic.parallel uses) and a peer copy inside one process. Prints a table.

    python3 scripts/p2p_bandwidth.py [--sizes-mib 96,1024]
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _nccl(rank: int, sizes: list[int], port: int, q) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for mib in sizes:
        buf = torch.empty(mib << 20, dtype=torch.uint8, device=rank)
        times = []
        for _ in range(6):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if rank == 1:
                dist.send(buf, dst=0)
            else:
                dist.recv(buf, src=1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        if rank == 0:
            q.put(("nccl send/recv, 2 processes", mib, min(times[1:])))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", default="96,1024")
    sizes = [int(s) for s in ap.parse_args().sizes_mib.split(",")]
    print("peer access 1→0:", torch.cuda.can_device_access_peer(0, 1))
    rows = []
    for mib in sizes:
        src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda:1")
        times = []
        for _ in range(6):
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            src.to("cuda:0")
            torch.cuda.synchronize(0)
            times.append(time.perf_counter() - t0)
        rows.append(("peer copy, 1 process", mib, min(times[1:])))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    mp.start_processes(_nccl, args=(sizes, port, q), nprocs=2, start_method="spawn")
    while not q.empty():
        rows.append(q.get())
    print("| path | size (MiB) | time (ms) | GB/s |\n|---|---|---|---|")
    for path, mib, t in rows:
        print(f"| {path} | {mib} | {1000 * t:.2f} | {(mib << 20) / t / 1e9:.1f} |")


if __name__ == "__main__":
    main()
