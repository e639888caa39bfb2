"""Checkpoints whose weights are stored as 8-bit floats (Hugging Face's ``quant_method: "fp8"``).

Many hybrid models are released as FP8 builds beside (or instead of) their bf16 ones — Qwen3-Next's
and Qwen3.5's "fine-grained FP8": every large projection an ``float8_e4m3fn`` tensor ``X.weight`` and
beside it ``X.weight_scale_inv``, one scale per 128 × 128 block of it (``weight_block_size``), the
small and sensitive tensors (norms, embeddings, the head, gates, the linear layers' ``A_log`` and
conv) left in bf16 (``modules_to_not_convert``). Older FP8 builds (AutoFP8) have no blocks: one
``X.weight_scale`` per tensor or per output row, and an ``X.input_scale`` for a static activation
scheme. llm-compressor's (``quant_method: "compressed-tensors"``, format ``float-quantized``) name
every scale ``X.weight_scale``: per channel, per tensor or per block.

hypic reads such a checkpoint by turning each 8-bit weight back into full precision as it is
loaded: ``w = q · s`` element by element, ``s`` the scale of the block (row, tensor) holding it.
The weights then serve as any other — exactly the weights a bf16 checkpoint holding those products
would give — or, held in 8 bits (``quantization="fp8"``, ``hold_in_fp8``), are quantized again per
row. Activation scales are for 8-bit matmuls and are not needed here; they are read past. Any other
``quant_method`` (GPTQ, AWQ, bitsandbytes, ...) and compressed-tensors' integer or 4-bit formats are
refused by name: their tensors would otherwise load as garbage or fail far from the cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FLOAT8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))
# tensors an fp8 checkpoint holds beside its weights, read with them (scales) or not at all
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".q_scale", ".kv_scale", ".activation_scale")


@dataclass(frozen=True)
class Fp8Weights:
    """How an fp8 checkpoint scales its weights: one scale per ``block`` (rows, columns) of a
    weight, or per tensor or per output row (told apart by the scale's shape), read from
    ``X.weight`` + ``suffix`` (Hugging Face's fp8 blocks: ``_scale_inv``; otherwise ``_scale``)."""

    block: tuple[int, int] | None
    suffix: str = "_scale"
    weights: bool = True  # False: a quantization_config for the KV cache only; no weight is 8-bit

    def scale_name(self, weight_name: str) -> str:
        return weight_name + self.suffix


def fp8_weights(config: dict[str, Any]) -> Fp8Weights | None:
    """The checkpoint's fp8 scheme from ``quantization_config`` (top level, or a multimodal
    config's ``text_config``): Hugging Face's ``quant_method: "fp8"`` or compressed-tensors'
    8-bit float weights (llm-compressor's FP8 builds); None when it declares none. ValueError for
    any other method or format."""
    q = config.get("quantization_config")
    if q is None and isinstance(config.get("text_config"), dict):
        q = config["text_config"].get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_fp8(q)
    if method != "fp8":
        raise ValueError(f"config.json: quantization_config.quant_method {method!r} is not supported: hypic reads "
                         "fp8 checkpoints (quant_method \"fp8\", or compressed-tensors' float-quantized 8-bit "
                         "weights) and unquantized ones")
    block = q.get("weight_block_size")
    if block is None:
        return Fp8Weights(None)
    return Fp8Weights(_block(block, "weight_block_size"), "_scale_inv")


def _block(block: Any, where: str) -> tuple[int, int]:
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"config.json: quantization_config.{where} must be two positive integers "
                         f"[rows, columns], got {block!r}")
    return block[0], block[1]


def _compressed_fp8(q: dict[str, Any]) -> Fp8Weights:
    """compressed-tensors' config: every group 8-bit float weights (``float-quantized``), scaled per
    channel, per tensor or per block (one block shape for all); activation schemes are for 8-bit
    matmuls and are not needed to read the weights. Integer and 4-bit groups are refused by name."""
    groups = q.get("config_groups")
    if groups in (None, {}):  # a quantized KV cache alone (kv_cache_scheme): the weights are as they are
        return Fp8Weights(None, weights=False)
    if not isinstance(groups, dict):
        raise ValueError("config.json: quantization_config.config_groups: expected an object of groups "
                         "(compressed-tensors)")
    blocks = set()
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ValueError(f"config.json: {where}.weights: expected an object")
        fmt = group.get("format") or q.get("format")
        bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
        if bits != 8 or kind != "float" or fmt not in ("float-quantized", "naive-quantized", None):
            raise ValueError(f"config.json: {where}: {bits}-bit {kind} weights ({fmt}) are not supported: hypic "
                             "reads compressed-tensors' 8-bit float weights (float-quantized)")
        if strategy == "block":
            blocks.add(_block(weights.get("block_structure"), f"{where.removeprefix('quantization_config.')}"
                                                               ".weights.block_structure"))
        elif strategy not in ("channel", "tensor"):
            raise ValueError(f"config.json: {where}.weights.strategy {strategy!r} is not supported: hypic reads "
                             "8-bit weights scaled per channel, per tensor or per block")
    if len(blocks) > 1:
        raise ValueError(f"config.json: quantization_config: groups of different block shapes {sorted(blocks)} "
                         "are not supported")
    return Fp8Weights(blocks.pop() if blocks else None)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Weights, name: str) -> torch.Tensor:
    """``weight`` (8-bit floats) times its scales, in fp32: per ``scheme.block`` of the last two
    dimensions (a stacked [experts, out, in] weight has [experts, rows, columns] scales), else one
    scale for the tensor or one per output row. ValueError naming ``name`` when the scales do not
    fit the weight."""
    w, s = weight.float(), scale.float()
    if weight.dim() < 2:
        raise ValueError(f"tensor {name!r} is stored as {weight.dtype} but is not a matrix "
                         f"(shape {list(weight.shape)})")
    out_dim, in_dim = weight.shape[-2:]
    if s.numel() == 1:
        return w * s.reshape(())
    if tuple(s.shape) in ((*weight.shape[:-1], 1), tuple(weight.shape[:-1])):
        return w * s.reshape(*weight.shape[:-1], 1)
    if scheme.block is not None:
        rows, cols = scheme.block
        want = (*weight.shape[:-2], -(-out_dim // rows), -(-in_dim // cols))
        if tuple(s.shape) != want:
            raise ValueError(f"tensor {name!r}: its block scales have shape {list(s.shape)}, a {list(weight.shape)} "
                             f"weight in blocks of {rows} x {cols} needs {list(want)}")
        s = s.repeat_interleave(rows, dim=-2)[..., :out_dim, :].repeat_interleave(cols, dim=-1)[..., :in_dim]
        return w * s
    raise ValueError(f"tensor {name!r}: its scale has shape {list(s.shape)}, neither one value nor one per "
                     f"output row of a {list(weight.shape)} weight")


# `LLM(quantization=...)`: how the loaded weights are held (None: in the serving dtype; "auto": as
# the checkpoint holds them where 8-bit matmuls run — an FP8 build on a GPU stays in 8 bits, as
# vLLM serves it, else None)
QUANTIZATIONS = ("fp8",)
# projections left in the serving dtype under quantization="fp8": the head, and the small ones that
# set the linear layers' decays and gates (the FP8 builds leave them in bf16 too)
KEEP_UNQUANTIZED = frozenset({"lm_head", "in_proj_ba", "in_proj_b", "in_proj_a", "shared_expert_gate",
                              "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj"})


def check_quantization(quantization: str | None) -> str | None:
    if quantization is not None and quantization not in (*QUANTIZATIONS, "auto"):
        raise ValueError(f"quantization: expected one of {', '.join(QUANTIZATIONS)}, auto or None, "
                         f"got {quantization!r}")
    return quantization


def resolved_quantization(quantization: str | None, config: dict[str, Any], device: torch.device) -> str | None:
    """``auto``: "fp8" for an FP8 checkpoint on a GPU (an 80B FP8 build dequantized would not fit
    one), None otherwise (on the CPU 8-bit weights only save memory: each matmul widens them)."""
    if quantization != "auto":
        return quantization
    scheme = fp8_weights(config)
    return "fp8" if scheme is not None and scheme.weights and device.type == "cuda" else None


def hold_in_fp8(model: torch.nn.Module) -> None:
    """Every projection and expert stack the caches' algebra never sees as 8-bit weights with row
    scales (``hypic.models.layers.fp8``), built on the meta device before the weights are loaded
    (the loader quantizes each tensor as it is read: the full-precision model never exists on the
    device)."""
    from hypic.models.layers.fp8 import Fp8Linear, quantizable
    from hypic.models.layers.moe import Experts

    for module in list(model.modules()):
        if isinstance(module, Experts):
            if module.quantizable():  # else left in the serving dtype, as a linear would be
                module.hold_in_fp8()
            continue
        for name, child in list(module.named_children()):
            if name not in KEEP_UNQUANTIZED and quantizable(child):
                with torch.device(child.weight.device):
                    setattr(module, name, Fp8Linear(child.in_features, child.out_features))
