"""Host work of one training step: aten ops (forward, backward, optimiser) and the CPU memory it
holds, for the default preset at a few batch sizes (docs/training.md).

A training step on the GPU is host-bound when its op count does not grow with the batch. Ops of
the scan's step-by-step loop are left out: on the GPU one kernel launch replaces it. Each size runs
in a fresh process so that the peak-RSS growth is that step's alone.

    python scripts/train_host_ops.py [--batch-tokens 8000,32000] [--standalone]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys

import torch
from tokenizers import Tokenizer

from hypic.bench.host_ops import count_ops
from hypic.models.random_init import random_model
from hypic.ops.linear import backend_override
from hypic.train.data import Stream
from hypic.train.loop import loss_of, model_config


def one(batch_tokens: int, standalone: bool) -> None:
    tok = Tokenizer.from_file("hypic/assets/tokenizer/tokenizer.json")
    dev = torch.device("cpu")
    model = random_model(model_config(tok, "default"), device=dev, dtype=torch.float32).model.train()
    model.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stream = Stream(tok, batch_tokens=batch_tokens, seed=0, ramp_steps=1, doc_weight=0.1, workers=0)
    batch = stream.batch(5)

    def step() -> None:
        loss, *_ = loss_of(model, batch, dev, standalone)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    with backend_override("torch"):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        step()  # the first step: its peak RSS growth is the step's memory
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1e6  # kB → GB
        counter = count_ops(step)
    ops = sum(n for site, n in counter.sites.items() if not site.startswith("ops/scan.py"))
    tokens = batch.input_ids.numel()
    print(f"batch {batch_tokens}: {tokens} tokens, {len(batch.lengths)} sequences: {ops} aten ops per step "
          f"(scan loop left out); peak RSS growth {grown:.1f} GB ({grown * 65536 / tokens:.0f} GB per 64k tokens)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-tokens", default="8000,32000")
    ap.add_argument("--standalone", action="store_true")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        one(a.one, a.standalone)
        return
    for size in a.batch_tokens.split(","):
        subprocess.run([sys.executable, __file__, "--one", size] + (["--standalone"] if a.standalone else []),
                       check=True)


if __name__ == "__main__":
    main()
