"""Deepen a training checkpoint without changing what it computes.

Why (docs/quality.md, session 6): the step-12975 model answered single-hop questions at difficulty 1
98.5% of the time but two-hop ones 44%; most wrong two-hop answers are the right kind of value
from a third entity's document — the bridge the first hop read is not carried into the second
lookup. With ``full_attention_interval`` 4 and 8 layers the model has two attention layers, one
per hop. Growing it by whole blocks (three Gated DeltaNet layers and one attention layer) keeps
the architecture's pattern and adds a lookup step, at ≈ 2.8M parameters per block (the 16M cap
allows three more).

Each new layer is a copy of the corresponding layer of the block before the insertion point,
with the projections that write into the residual stream (``linear_attn.out_proj``,
``self_attn.o_proj``, ``mlp.down_proj``) set to zero: every new layer adds exactly zero, so the
grown model's logits equal the old ones (``tests/train/test_grow.py``, fp32), and training starts
from the trained model rather than from scratch. Gradients reach the zeroed projections first
(their inputs are the copied layers' live activations), then the rest of the new layers.

``python -m hypic.train.grow --from CKPT --to NEW [--at 4] [--blocks 1]``: writes a checkpoint
folder that ``python -m hypic.train --out NEW --resume`` continues (the step, log and the old
parameters' Adam moments carry over; the new parameters start with fresh moments). A 12-layer
checkpoint is ≈ 36 MB of fp32 weights and ≈ 36 MB of bf16 moments: over the GPU machine's 64 MiB
carry together, so a device run carries the weights alone and Adam starts afresh there
(docs/training.md).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from hypic.train.args import OneLineParser
from hypic.train.atomic import replace_folder
from hypic.train.checkpoint import load_sharded, save_sharded, weight_files

# parameters whose output is added to the residual stream: zero makes a layer the identity
RESIDUAL_WRITERS = ("linear_attn.out_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _renumber(tensors: dict[str, torch.Tensor], at: int, shift: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        m = _LAYER.match(name.split(".exp_avg")[0])
        if m and int(m.group(1)) >= at:
            name = name.replace(f"model.layers.{m.group(1)}.", f"model.layers.{int(m.group(1)) + shift}.", 1)
        out[name] = t
    return out


def grow_config(config: dict[str, Any], at: int, blocks: int) -> dict[str, Any]:
    if config.get("model_type") != "qwen3_5_text":
        raise ValueError("only Qwen3.5 text checkpoints (model_type qwen3_5_text) can grow, "
                         f"got {config.get('model_type')!r}")
    every = config.get("full_attention_interval", 4)
    n = config["num_hidden_layers"]
    if blocks < 1:
        raise ValueError(f"--blocks must be ≥ 1, got {blocks}")
    if not (every <= at <= n and at % every == 0):
        raise ValueError(f"--at must be a block boundary in [{every}, {n}] (a multiple of {every}), got {at}")
    new = dict(config, num_hidden_layers=n + blocks * every)
    if "layer_types" in config:  # else the interval alone places the attention layers
        types = config["layer_types"]
        new["layer_types"] = types[:at] + types[at - every:at] * blocks + types[at:]
    return new


def grow(src: Path, dst: Path, at: int, blocks: int = 1) -> int:
    """Write the grown checkpoint to ``dst``; returns the number of new parameters."""
    if not (src / "config.json").exists():
        raise ValueError(f"--from {src}: not a checkpoint folder (no config.json)")
    try:
        config = json.loads((src / "config.json").read_text())
    except ValueError as e:  # the bare decoder message named no file
        raise ValueError(f"--from {src / 'config.json'}: not valid JSON ({e})") from None
    new_config = grow_config(config, at, blocks)
    every = config.get("full_attention_interval", 4)
    shift = new_config["num_hidden_layers"] - config["num_hidden_layers"]
    weights = {name: t for file in weight_files(src) for name, t in load_file(str(file)).items()}
    if not any(_LAYER.match(k) for k in weights):
        raise ValueError(f"{src}: no model.layers.* tensors in the checkpoint")
    grown = _renumber(weights, at, shift)
    added = 0
    for b in range(blocks):
        for j in range(every):
            old, new = at - every + j, at + b * every + j
            for name, t in weights.items():
                m = _LAYER.match(name)
                if m and int(m.group(1)) == old:
                    copy = t.clone()
                    if m.group(2) in RESIDUAL_WRITERS:
                        copy.zero_()
                    grown[f"model.layers.{new}.{m.group(2)}"] = copy
                    added += copy.numel()
    # dst replaced whole (hypic.train.atomic): a grow cut short leaves no half-written checkpoint there
    with replace_folder(dst, drop=lambda name: name.endswith(".safetensors")) as stage:
        # layers in order in the shards and the index: readers that list the index see the model's layout
        order = sorted(grown, key=lambda k: (int(m.group(1)), k) if (m := _LAYER.match(k)) else (-1, k))
        where = save_sharded({k: grown[k] for k in order}, stage, "model")
        (stage / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": where},
                                                                       indent=1))
        if any(src.glob("optim-*.safetensors")):
            save_sharded(_renumber(load_sharded(src, "optim"), at, shift), stage, "optim")
        (stage / "config.json").write_text(json.dumps(new_config, indent=1))
        state = json.loads((src / "train_state.json").read_text()) if (src / "train_state.json").exists() else {}
        state.setdefault("log", []).append({"step": state.get("step", 0), "grown": {"at": at, "blocks": blocks,
                                                                                "new_parameters": added}})
        (stage / "train_state.json").write_text(json.dumps(state, indent=1))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (src / name).exists():
                shutil.copy(src / name, stage / name)
    return added


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="hypic.train.grow", description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="src", required=True, help="a training checkpoint folder")
    p.add_argument("--to", dest="dst", required=True, help="the grown checkpoint's folder (new or emptied)")
    p.add_argument("--at", type=int, default=4, help="insert before this layer (a block boundary)")
    p.add_argument("--blocks", type=int, default=1, help="blocks of full_attention_interval layers to add")
    args = p.parse_args(argv)
    src, dst = Path(args.src), Path(args.dst)
    try:
        if src.resolve() == dst.resolve():
            raise ValueError("--to must differ from --from (the source stays as it was)")
        added = grow(src, dst, args.at, args.blocks)
    except ValueError as e:  # one line naming what is wrong, not a traceback
        print(f"hypic.train.grow: {e}", file=sys.stderr)
        return 2
    print(f"grown {src} → {dst}: {added / 1e6:.2f}M new parameters, "
          f"{json.loads((dst / 'config.json').read_text())['num_hidden_layers']} layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
