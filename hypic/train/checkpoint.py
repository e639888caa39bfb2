"""Checkpoints small enough to carry between short GPU runs: tensors in safetensors shards of at
most 15 MiB, parameters in fp32, Adam moments in bf16, the loop's state in JSON. The same folder
is a loadable HF model folder (config.json, tokenizer.json, index of the weight shards)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from hypic.models.loader import checkpoint_files, load_weights
from hypic.models.registry import resolve
from hypic.train.atomic import replace_folder

SHARD_BYTES = 15 * 2**20


def save_sharded(tensors: dict[str, torch.Tensor], folder: Path, prefix: str) -> dict[str, str]:
    """Write tensors into ``{prefix}-NNNNN.safetensors`` shards; returns name → file."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous().cpu()
        size += nbytes
    where = {}
    for i, shard in enumerate(shards):
        file = f"{prefix}-{i:05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        where |= {name: file for name in shard}
    return where


def load_sharded(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob(f"{prefix}-*.safetensors")):
        out |= load_file(str(file))
    return out


def shard_of(*prefixes: str) -> Callable[[str], bool]:
    """Whether a file name is a shard of one of ``prefixes``: the files a save replaces as a set."""
    return lambda name: name.endswith(".safetensors") and name.startswith(tuple(f"{p}-" for p in prefixes))


def tokenizer_config(config: dict[str, Any], tokenizer: Tokenizer,
                     base: dict[str, Any] | None = None) -> dict[str, Any]:
    """tokenizer_config.json for a folder whose tokenizer.json hypic reads with ``tokenizers``: ``base``
    with the class transformers must use, and the special tokens of the config's ids (hypic's eos is
    config.json's ``eos_token_id``). Without the class, AutoTokenizer maps ``model_type`` qwen3_5_text
    to Qwen3.5's own tokenizer class, which replaces tokenizer.json's pre-tokenizer: other ids for
    the same text (`Question` read as `Qu` `estion`), and the bundled model's eos read as
    ``<|endoftext|>``. hypic itself reads only ``chat_template``, ``bos_token`` and ``eos_token`` from
    this file (``ChatTemplate.from_model``), none of which the built-in template uses."""
    out = dict(base or {}, tokenizer_class="PreTrainedTokenizerFast")
    for kind in ("bos", "eos", "pad"):
        ids = config.get(f"{kind}_token_id")
        first = ids[0] if isinstance(ids, list) and ids else ids
        if isinstance(first, int) and tokenizer.id_to_token(first) is not None:
            out[f"{kind}_token"] = tokenizer.id_to_token(first)
    return out


def _write_model(folder: Path, model: torch.nn.Module, config: dict[str, Any], dtype: torch.dtype,
                 tokenizer: Path | None) -> None:
    params = {n: p.to(dtype) for n, p in model.named_parameters()
              if n != "lm_head.weight" or not getattr(model, "tie_embeddings", False)}
    where = save_sharded(params, folder, "model")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": where}, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer is not None:
        (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
        # always written, whether or not the source had one: a device run's checkpoint has none
        base = tokenizer.parent / "tokenizer_config.json"
        hf = tokenizer_config(config, Tokenizer.from_file(str(tokenizer)),
                              json.loads(base.read_text()) if base.exists() else None)
        (folder / "tokenizer_config.json").write_text(json.dumps(hf, indent=1))


def save_model(folder: Path, model: torch.nn.Module, config: dict[str, Any], *, dtype: torch.dtype = torch.float32,
               tokenizer: Path | None = None) -> None:
    """A loadable model folder: config.json, sharded weights with their index, and the tokenizer
    files next to ``tokenizer`` (a tokenizer.json) when given. bf16 halves what ships. The folder is
    replaced whole (``hypic.train.atomic``): its other files are kept, its old weights go."""
    with replace_folder(folder, drop=shard_of("model")) as stage:
        _write_model(stage, model, config, dtype, tokenizer)


def save_checkpoint(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                    config: dict[str, Any], files: dict[str, bytes] | None = None,
                    weights_dtype: torch.dtype = torch.float32) -> None:
    """Weights, config, Adam moments, ``train_state.json`` and ``files`` (name → content: a first
    run's tokenizer) into ``folder``, replaced whole: a save that fails midway leaves the previous
    checkpoint as it was (``hypic.train.atomic``)."""
    moments = {}
    names = {p: n for n, p in model.named_parameters()}
    for p, s in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            moments[f"{names[p]}.{key}"] = s[key].to(torch.bfloat16)
    with replace_folder(folder, drop=shard_of("model", "optim")) as stage:
        _write_model(stage, model, config, weights_dtype, None)
        save_sharded(moments, stage, "optim")
        for name, content in (files or {}).items():
            (stage / name).write_bytes(content)
        (stage / "train_state.json").write_text(json.dumps(state, indent=1))


def weight_files(folder: Path) -> list[Path]:
    """The weight shards: those the index names (the serving loader checks that each exists), else
    every ``model-*.safetensors`` (the optimizer's shards sit beside them)."""
    if (folder / "model.safetensors.index.json").exists():
        return checkpoint_files(folder)
    files = sorted(folder.glob("model-*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no model-*.safetensors weight shards")
    return files


def load_checkpoint(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load the weights, Adam moments and loop state of ``folder`` into ``model`` and ``optimizer``.

    The weights go through the serving loader's checks (the shards the index names, every parameter
    present, shapes equal; ValueError otherwise): a parameter left out kept its random
    initialisation, and a run resumed from a checkpoint whose shard had not come back trained on
    from the untrained model at step N without a word (docs/training.md). Moments may be missing
    (a grown model's new layers, a device run that carried the weights alone): those parameters
    start with fresh ones."""
    config = json.loads((folder / "config.json").read_text())
    params = dict(model.named_parameters())
    first = next(iter(params.values()))
    load_weights(model, weight_files(folder), resolve(config).checkpoint_name, first.device, first.dtype)
    moments = load_sharded(folder, "optim")
    for key, t in moments.items():
        name, kind = key.rsplit(".", 1)
        pair = f"{name}.{'exp_avg_sq' if kind == 'exp_avg' else 'exp_avg'}"
        if name not in params or tuple(t.shape) != tuple(params[name].shape) or pair not in moments:
            raise ValueError(f"{folder}: Adam moment {key!r} does not fit the model (no parameter of its "
                             f"shape {list(t.shape)}, or no {pair!r} beside it)")
    state = json.loads((folder / "train_state.json").read_text())
    # fused and capturable AdamW keep the step counter on the parameter's device, the others on the host
    on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
    for name, p in params.items():
        if f"{name}.exp_avg" in moments:
            step = torch.tensor(float(state["step"]), dtype=torch.float32, device=p.device if on_device else "cpu")
            optimizer.state[p] = {"step": step,
                                  "exp_avg": moments[f"{name}.exp_avg"].to(p.device, torch.float32),
                                  "exp_avg_sq": moments[f"{name}.exp_avg_sq"].to(p.device, torch.float32)}
    return state
