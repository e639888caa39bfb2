"""Where 8-bit weights move a random-weight model, layer by layer: each layer of the fp8 model fed the
bf16 model's own input to that layer, its update compared with the bf16 layer's (no error carried
from earlier layers); and, for scale, how far the bf16 model's logits move when only its input
embeddings are perturbed by 0.1% — a random network amplifies any small change, so its end-to-end
logits say little about a quantization's error.

    python scripts/fp8_layers.py --shape qwen3.5-35b-a3b --tokens 2048
"""

from __future__ import annotations

import argparse

import torch

from hypic.bench.shapes import SHAPES
from hypic.models.context import SequenceContext, SequenceState
from hypic.models.random_init import random_model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3.5-35b-a3b")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    dev = torch.device(args.device)
    plain = random_model(SHAPES[args.shape], device=dev, dtype=torch.bfloat16).model
    held = random_model(SHAPES[args.shape], device=dev, dtype=torch.bfloat16, quantization="fp8").model
    ids = torch.randint(10, plain.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(1)).to(dev)

    def ctx() -> SequenceContext:
        return SequenceContext([SequenceState()], [args.tokens], dev)

    x = plain.model.embed_tokens(ids)
    ca, cb = ctx(), ctx()
    print("| layer | kind | relative error of the layer's update (fp8 vs bf16, same input) |")
    print("|---|---|---|")
    errs = []
    for i, (la, lb) in enumerate(zip(plain.model.layers, held.model.layers, strict=True)):
        ya, yb = la(x, ca), lb(x, cb)
        errs.append(rel(yb - x, ya - x))
        print(f"| {i} | {plain.kinds.kinds[i]} | {errs[-1]:.4f} |")
        x = ya
    print(f"median per-layer update error {sorted(errs)[len(errs) // 2]:.4f}, max {max(errs):.4f}")
    rows = torch.arange(args.tokens - 256, args.tokens, device=dev)
    base = plain(ids, ctx(), rows)
    gen = torch.Generator(device=dev).manual_seed(2)
    emb = plain.model.embed_tokens.weight
    noise = torch.randn(emb.shape, device=dev, generator=gen, dtype=torch.float32) * 1e-3
    emb.mul_((1 + noise).to(emb.dtype))
    moved = plain(ids, ctx(), rows)
    print(f"bf16 model, input embeddings perturbed by 0.1%: logits relative change {rel(moved, base):.3f}, "
          f"top-1 agreement {(moved.argmax(-1) == base.argmax(-1)).float().mean().item():.3f}")


if __name__ == "__main__":
    main()
