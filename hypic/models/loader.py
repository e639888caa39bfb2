"""Load a local Hugging Face model folder: config.json, one or many *.safetensors (with
model.safetensors.index.json), tokenizer.json (or Kimi's tiktoken.model) / tokenizer_config.json.
Nothing is fetched.

The model is built on the meta device, given uninitialised storage on the target device and
dtype, and each checkpoint tensor is read lazily and copied into its parameter: no second full
copy of the weights is ever held.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hypic.models.hybrid import HybridLM
from hypic.models.layers.fp8 import FP8, write_rows
from hypic.models.quantized import (
    FLOAT8,
    IGNORED_SUFFIXES,
    SCALE_SUFFIXES,
    Fp8Weights,
    check_quantization,
    dequantize,
    fp8_weights,
    hold_in_fp8,
    resolved_quantization,
)
from hypic.models.registry import resolve
from hypic.models.tiktoken_file import PATTERNS, special_tokens, tiktoken_tokenizer


@dataclass
class LoadedModel:
    model: HybridLM
    config: dict[str, Any]
    path: Path
    tokenizer: Any | None  # tokenizers.Tokenizer
    tokenizer_config: dict[str, Any]
    device: torch.device
    dtype: torch.dtype
    quantization: str | None = None  # "fp8": projections and experts held in 8 bits (hypic.models.layers.fp8)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: weight_map must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        if not files:
            raise ValueError(f"{index}: weight_map is empty")
        for name in files:
            if Path(name).name != name:  # a shard is a file of the model's folder, never a path out of it
                raise ValueError(f"{index}: weight_map names {name!r}, not a file of this folder")
            if not (path / name).exists():
                raise ValueError(f"{path / name}: shard listed in {index.name} is missing")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors checkpoint found")
    return files


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _scale_of(params: dict[str, torch.nn.Parameter], target: str) -> tuple[str, torch.Tensor]:
    """An 8-bit parameter's row scales (or, for one expert's slice, that expert's)."""
    m = re.fullmatch(r"(.*)\[(\d+)\]", target)
    if m:
        return f"{m[1]}_scale[{m[2]}]", params[f"{m[1]}_scale"][int(m[2])]
    return f"{target}_scale", params[f"{target}_scale"]


def _destination(params: dict[str, torch.nn.Parameter], target: str) -> tuple[str, torch.Tensor] | None:
    """The parameter (or the slice of a stacked expert parameter) a checkpoint tensor fills."""
    if target in params:
        return target, params[target]
    m = _EXPERT.match(target)
    if m and f"{m[1]}.{m[3]}" in params:
        stacked = params[f"{m[1]}.{m[3]}"]
        if int(m[2]) < stacked.shape[0]:
            return f"{m[1]}.{m[3]}[{m[2]}]", stacked[int(m[2])]
    return None


def load_weights(model: HybridLM, files: list[Path], arch_name_map: Any, device: torch.device,
                 dtype: torch.dtype, fp8: Fp8Weights | None = None) -> None:
    """Every checkpoint tensor into its parameter; ``fp8``: the checkpoint's 8-bit weights are
    multiplied by their scales (``hypic.models.quantized``), which may lie in another shard."""
    params = dict(model.named_parameters())
    stacked = {n: p.shape[0] for n, p in params.items()
               if n.removesuffix("_scale").endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj"))}
    loaded: set[str] = set()
    with ExitStack() as stack:
        handles = {}
        for file in files:  # opened up front (lazily read): a weight's scale may sit in another shard
            try:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except Exception as e:  # safetensors' own error type: a damaged or truncated file
                raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        holder = {name: file for file, f in handles.items() for name in f.keys()}
        scales_read: set[str] = set()
        for file, f in handles.items():
            for name in f.keys():
                if fp8 is not None and name.endswith(SCALE_SUFFIXES + IGNORED_SUFFIXES):
                    continue  # read with its weight, or not needed (activation scales)
                target = arch_name_map(name)
                if target is None:
                    continue
                dest = _destination(params, target)
                if dest is None:
                    if target == "lm_head.weight" and model.tie_embeddings:
                        continue
                    if fp8 is None and name.endswith(SCALE_SUFFIXES + IGNORED_SUFFIXES):
                        raise ValueError(f"{file.name}: tensor {name!r} is a quantization scale, but config.json "
                                         "declares no quantization_config")
                    raise ValueError(f"{file.name}: tensor {name!r} does not belong to this model")
                target, param = dest
                tensor = f.get_tensor(name)
                if tensor.dtype in FLOAT8:
                    if fp8 is None or not fp8.weights:
                        raise ValueError(f"{file.name}: tensor {name!r} is stored as {tensor.dtype}, but config.json "
                                         "declares no quantization_config of its weights to scale it by")
                    scale = fp8.scale_name(name)
                    if scale not in holder:
                        raise ValueError(f"{file.name}: tensor {name!r} is stored as {tensor.dtype}, and its scale "
                                         f"{scale!r} is in no file of the checkpoint")
                    tensor = dequantize(tensor, handles[holder[scale]].get_tensor(scale), fp8, name)
                    scales_read.add(scale)
                elif not tensor.dtype.is_floating_point:  # an integer/bool tensor cast into a weight: silently wrong
                    raise ValueError(f"{file.name}: tensor {name!r} has dtype {tensor.dtype}, "
                                     f"expected a floating-point tensor")
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"{file.name}: tensor {name!r} has shape {list(tensor.shape)}, "
                                     f"the model expects {list(param.shape)}")
                with torch.no_grad():
                    if param.dtype == FP8:  # held in 8 bits: quantized as it is read, on the device
                        scale_name, scale = _scale_of(params, target)
                        write_rows(param, scale, tensor)
                        loaded.add(scale_name)
                    else:
                        param.copy_(tensor.to(device=device, dtype=param.dtype))  # fp32 where kept
                loaded.add(target)
        for name in sorted(set(holder) - scales_read):  # a scale no 8-bit weight used: its weight would be unscaled
            if fp8 is not None and name.endswith(SCALE_SUFFIXES):
                weight = name[:-len("_scale_inv")] if name.endswith("_scale_inv") else name[:-len("_scale")]
                stored = handles[holder[weight]].get_slice(weight).get_dtype() if weight in holder else ""
                if arch_name_map(weight) is not None and stored and not stored.startswith("F8"):
                    raise ValueError(f"{holder[name].name}: tensor {name!r} scales {weight!r}, which is not "
                                     f"stored as 8-bit floats ({stored})")
    for name, experts in stacked.items():  # a stacked parameter is loaded when every slice is
        if all(f"{name}[{e}]" in loaded for e in range(experts)):
            loaded.add(name)
    own = {f"{n}_scale" for n, p in params.items() if p.dtype == FP8}  # hypic's row scales, not the checkpoint's
    missing = sorted(set(params) - loaded - own - ({"lm_head.weight"} if model.tie_embeddings else set()))
    if missing:
        raise ValueError(f"{files[0].parent}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` checked (ValueError: not a device, CUDA missing, no such GPU); None: the default."""
    if device is None:
        return default_device()
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {device!r} is not a device ({e})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device} requested but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device} requested but only {torch.cuda.device_count()} CUDA devices exist")
    elif device.type != "cpu":
        raise ValueError(f"device: expected cpu or cuda, got {device}")
    return device


def materialized(model: HybridLM, dtype: torch.dtype, device: torch.device, quantization: str | None) -> HybridLM:
    """A model built on the meta device given uninitialised storage on ``device``: cast to ``dtype``
    there first (never an fp32 copy on the device), its projections made 8-bit for ``"fp8"``, a tied
    head tied again (``to_empty`` unties shared parameters)."""
    model = model.cast(dtype)
    if quantization == "fp8":
        hold_in_fp8(model)
    model = model.to_empty(device=device)
    if model.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_model(path: str | Path, *, device: str | torch.device | None = None,
               dtype: torch.dtype | str | None = None, quantization: str | None = "auto") -> LoadedModel:
    """``quantization="fp8"``: the projections and experts held in 8 bits with row scales, each
    quantized as it is read (``hypic.models.layers.fp8``); None: every weight in ``dtype``; "auto"
    (the default): "fp8" for an FP8 checkpoint on a GPU, else None."""
    check_quantization(quantization)
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model: {path} is not a directory")
    config = _read_json(path / "config.json")
    arch = resolve(config)
    fp8 = fp8_weights(config)
    device = resolve_device(device)
    quantization = resolved_quantization(quantization, config, device)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if isinstance(dtype, str):
        dtype = dtypes.get(dtype, dtype)
    if dtype is not None and dtype not in dtypes.values():
        raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {dtype!r}")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    files = checkpoint_files(path)
    try:
        with torch.device("meta"):
            model = arch.build(config)
    except KeyError as e:
        raise ValueError(f"{path / 'config.json'}: missing key {e.args[0]!r}") from None
    except TypeError as e:  # a value of the wrong type (a string for a size, ...)
        raise ValueError(f"{path / 'config.json'}: a value has the wrong type ({e})") from None
    model = materialized(model, dtype, device, quantization)
    load_weights(model, files, arch.checkpoint_name, device, dtype, fp8)
    model.eval().requires_grad_(False)
    tokenizer = None
    tok_cfg = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").exists() else {}
    if (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception
            raise ValueError(f"{path / 'tokenizer.json'}: not a valid tokenizer ({e})") from None
    elif (path / "tiktoken.model").exists() and config.get("model_type") in PATTERNS:
        # Kimi-Linear ships a tiktoken file and remote code: converted here (hypic.models.tiktoken_file)
        tokenizer = tiktoken_tokenizer(path / "tiktoken.model", PATTERNS[config["model_type"]],
                                       special_tokens(tok_cfg))
    return LoadedModel(model, config, path, tokenizer, tok_cfg, device, dtype, quantization)
