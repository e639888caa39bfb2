"""Export a training checkpoint as the bundled model: bf16 weights, config and tokenizer in
``hypic/assets/default_model`` (what ``LLM()`` loads). ``python -m hypic.train.export --from CKPT``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from hypic.llm import bundled_model_path
from hypic.models.loader import load_model
from hypic.train.args import OneLineParser
from hypic.train.checkpoint import save_model


def export(src: Path, dst: Path, dtype: torch.dtype = torch.bfloat16) -> int:
    """Returns the bytes written for the weights. ``dst`` is replaced whole (``save_model``): an
    export that fails midway leaves the model that was there as it was."""
    loaded = load_model(src, device="cpu", dtype=torch.float32)
    save_model(dst, loaded.model, json.loads((src / "config.json").read_text()), dtype=dtype,
               tokenizer=src / "tokenizer.json")
    return sum(f.stat().st_size for f in dst.glob("model-*.safetensors"))


def main(argv: list[str] | None = None) -> int:
    # the docstring's first paragraph, not its first line: that ended "… and tokenizer in"
    p = OneLineParser(prog="hypic.train.export", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--from", dest="src", required=True, help="a training checkpoint folder")
    p.add_argument("--to", dest="dst", default=str(bundled_model_path()),
                   help="the model folder written, replaced whole (default: the bundled model's)")
    args = p.parse_args(argv)
    try:
        size = export(Path(args.src), Path(args.dst))
    except ValueError as e:  # one line naming what is wrong, not a traceback
        print(f"hypic.train.export: {e}", file=sys.stderr)
        return 2
    print(f"exported to {args.dst}: {size / 2**20:.1f} MiB of bf16 weights")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
