"""Peak host memory of one standalone training step (forward + backward) at a seam, on CPU: what
`--standalone-seam` adds to a step before a GPU run risks running out (docs/training.md).

    python scripts/train_memory_probe.py W [--ckpt .ckpt]   # run once per W: the peak is per process
"""
import json
import resource
import sys

import torch
from tokenizers import Tokenizer

from hypic.models.random_init import random_model
from hypic.ops.linear import backend_override
from hypic.train.data import Stream
from hypic.train.loop import loss_of

seam = int(sys.argv[1])
ckpt = sys.argv[sys.argv.index("--ckpt") + 1] if "--ckpt" in sys.argv else ".ckpt"
cfg = json.load(open(f"{ckpt}/config.json"))
tok = Tokenizer.from_file(f"{ckpt}/tokenizer.json")
model = random_model(cfg, device="cpu", dtype=torch.float32, seed=0).model.train()
model.requires_grad_(True)
stream = Stream(tok, batch_tokens=16000, seed=0, ramp_steps=2000, doc_weight=0.1, workers=0, extra=16,
                extra_multi=16, family_weights={}, easy_share=0.0, easy_max=0.1)
batch = stream.batch(5000)  # past the ramp: difficulty 1, the long prompts
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with backend_override("torch"):
    loss, *_ = loss_of(model, batch, torch.device("cpu"), True, seam)
    loss.backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"seam {seam}: tokens {batch.input_ids.numel()} peak {peak/1e6:.2f} GB (before step {base/1e6:.2f} GB)")
