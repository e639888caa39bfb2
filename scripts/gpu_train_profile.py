"""Where a training step's time goes on the GPU: times the data stream and the step separately, then
profiles two steps (device kernels and host ops) into $OUT/profile_train_*.txt. Each batch size's
line gives the peak memory too (the device's; on CPU the process's resident peak), which is what
`gpu_train.sh`'s BATCH_SWEEP picks a batch size by."""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch.profiler import ProfilerActivity, profile

from hypic.models.random_init import random_model
from hypic.ops.linear import backend_override
from hypic.train.data import Stream
from hypic.train.loop import loss_of, model_config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--difficulty-step", type=int, default=1500, help="stream step (sets the difficulty)")
    p.add_argument("--batch-tokens", default="65536",
                   help="comma-separated batch sizes: each is timed (the first also profiled)")
    p.add_argument("--standalone", action="store_true", help="time standalone-segment steps (hypic.train.pic)")
    p.add_argument("--standalone-seam", type=int, default=0, help="hypic's seam w in those steps")
    a = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = Tokenizer.from_file("hypic/assets/tokenizer/tokenizer.json")
    model = random_model(model_config(tok, "default"), device=dev, dtype=torch.float32).model.train()
    model.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=dev.type == "cuda")
    sizes = [int(x) for x in a.batch_tokens.split(",")]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step(b):
        loss, *_ = loss_of(model, b, dev, a.standalone, a.standalone_seam)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    prof = None
    for size in sizes:  # host-bound steps: tokens/s should grow with the batch until the device is busy
        stream = Stream(tok, batch_tokens=size, seed=0, ramp_steps=3000, doc_weight=0.1, workers=8)
        t0 = time.perf_counter()
        batches = [stream.batch(a.difficulty_step + i) for i in range(6)]
        print(f"data: {1e3 * (time.perf_counter() - t0) / 6:.1f} ms per batch "
              f"({sum(len(b.lengths) for b in batches) / 6:.0f} sequences, {batches[0].input_ids.numel()} tokens)")
        stream.close()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with backend_override("torch"):
            for b in batches[:3]:
                step(b)
            sync()
            t0 = time.perf_counter()
            for b in batches[3:5]:
                step(b)
            sync()
            ms = 1e3 * (time.perf_counter() - t0) / 2
            # on CPU the process's resident peak so far (Linux reports kilobytes)
            mem = (torch.cuda.max_memory_allocated() if dev.type == "cuda"
                   else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 1e9
            tokens = sum(b.input_ids.numel() for b in batches[3:5]) / 2
            print(f"batch {size}: step {ms:.1f} ms, {tokens / ms * 1e3:.0f} tokens/s, peak {mem:.1f} GB")
            if prof is None:
                with profile(activities=[ProfilerActivity.CPU]
                             + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])) as prof:
                    step(batches[5])
                    sync()
    avg = prof.key_averages()
    for key in ("cuda_time_total", "cpu_time_total"):
        key = key if dev.type == "cuda" else "cpu_time_total"
        table = avg.table(sort_by=key, row_limit=50, max_name_column_width=60)
        Path(a.out, f"profile_train_{key.split('_')[0]}.txt").write_text(table)
    print("\n".join(avg.table(sort_by="cuda_time_total" if dev.type == "cuda" else "cpu_time_total", row_limit=20, max_name_column_width=60).splitlines()))
    print(f"kernel launches: {sum(e.count for e in avg if e.device_type.name == 'CUDA')}")


if __name__ == "__main__":
    main()
