"""Cache entries on the wire: one byte buffer per entry plus a small picklable header.

A worker prefills segments on its own device and hands the entries to the engine's device. Each
entry's tensors (per linear layer the summary ``(T, S)`` and conv tail, per attention layer the body
keys and values) are packed into one contiguous uint8 buffer, so an entry crosses in one
point-to-point transfer (NCCL between GPUs, gloo between CPU processes) and the header — shapes,
dtypes, offsets, key, token ids — goes over the control pipe. Unpacked tensors are views into the
received buffer: one allocation per entry, freed with the entry. Offsets are aligned so every view
is aligned for its dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hypic.cache.entry import Entry
from hypic.cache.keys import SegmentKey
from hypic.ops.recurrence import Summary

ALIGN = 64  # bytes: ≥ every dtype's size, and a cache line

# (slot, layer, dtype name, shape, byte offset); slot ∈ "T", "S", "conv", "k", "v"
Field = tuple[str, int, str, tuple[int, ...], int]


@dataclass(frozen=True)
class Header:
    key: SegmentKey
    token_ids: tuple[int, ...]
    seam: int
    fields: tuple[Field, ...]
    nbytes: int  # the buffer's size
    no_transition: tuple[int, ...]  # linear layers whose summary has no T (plain linear attention)


def _tensors(entry: Entry) -> list[tuple[str, int, Tensor]]:
    out: list[tuple[str, int, Tensor]] = []
    for layer, s in sorted(entry.summaries.items()):
        if s.transition is not None:
            out.append(("T", layer, s.transition))
        out.append(("S", layer, s.state))
    out += [("conv", layer, t) for layer, t in sorted(entry.conv_tails.items())]
    out += [("k", layer, t) for layer, t in sorted(entry.keys.items())]
    out += [("v", layer, t) for layer, t in sorted(entry.values.items())]
    return out


def pack(entry: Entry) -> tuple[Header, Tensor]:
    """The entry as (header, uint8 buffer on the entry's device)."""
    parts = _tensors(entry)
    fields, offset = [], 0
    for slot, layer, t in parts:
        fields.append((slot, layer, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    device = parts[0][2].device if parts else torch.device("cpu")
    buf = torch.empty(offset, dtype=torch.uint8, device=device)
    for (_, _, t), f in zip(parts, fields, strict=True):
        n = t.numel() * t.element_size()
        buf[f[4]:f[4] + n] = t.contiguous().reshape(-1).view(torch.uint8)
    no_t = tuple(layer for layer, s in sorted(entry.summaries.items()) if s.transition is None)
    return Header(entry.key, entry.token_ids, entry.seam, tuple(fields), offset, no_t), buf


def unpack(header: Header, buf: Tensor) -> Entry:
    """The entry back from its header and buffer (views into ``buf``)."""
    if buf.dtype != torch.uint8 or buf.numel() != header.nbytes:
        raise ValueError(f"entry {header.key}: expected a uint8 buffer of {header.nbytes} bytes, "
                         f"got {buf.dtype} × {buf.numel()}")
    got: dict[tuple[str, int], Tensor] = {}
    for slot, layer, dtype_name, shape, offset in header.fields:
        dtype = getattr(torch, dtype_name)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        got[slot, layer] = buf[offset:offset + n].view(dtype).view(shape)
    entry = Entry(header.key, header.token_ids, header.seam)
    for (slot, layer), t in got.items():
        if slot == "S":
            entry.summaries[layer] = Summary(None if layer in header.no_transition else got["T", layer], t)
        elif slot == "conv":
            entry.conv_tails[layer] = t
        elif slot == "k":
            entry.keys[layer] = t
        elif slot == "v":
            entry.values[layer] = t
    return entry
