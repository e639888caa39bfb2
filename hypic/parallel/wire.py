"""Cache entries on the wire: one byte buffer per entry plus a small picklable header.

A worker prefills segments on its own device and hands the entries to the engine's device. All
tensors of all entries of its share (per linear layer the summary ``(T, S)`` and conv tail, per
attention layer the body keys and values) are gathered into one contiguous uint8 buffer, so a share
crosses in one point-to-point transfer (NCCL between GPUs, gloo between CPU processes), and the
headers — shapes, dtypes, offsets, key, token ids — go over the control pipe. (An entry's ~90
tensors packed and sent one by one cost ~90 launches and a send each: per-document host work on the
worker.) On arrival each entry's bytes are copied out on their own, and its tensors are views into
that copy: one allocation per entry, freed with the entry. Offsets are aligned so every view is
aligned for its dtype.
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


def _tensors(entry: Entry) -> list[tuple[str, int, Tensor]]:
    """An entry's tensors, kind by kind (every layer's T, then every S, …): runs of one shape, which
    ``unpack`` turns into views with one call per run instead of one per tensor (~90 per entry at
    a 9B shape: 9.6 → 2.3 ms of host time for a share of 18 entries, scripts/wire_host_time.py)."""
    summaries = sorted(entry.summaries.items())
    out = [("T", layer, s.transition) for layer, s in summaries if s.transition is not None]
    out += [("S", layer, s.state) for layer, s in summaries]
    out += [("conv", layer, t) for layer, t in sorted(entry.conv_tails.items())]
    out += [("k", layer, t) for layer, t in sorted(entry.keys.items())]
    out += [("v", layer, t) for layer, t in sorted(entry.values.items())]
    return out


def pack(entries: list[Entry]) -> tuple[list[Header], Tensor]:
    """Entries as (one header each, one uint8 buffer on their device holding them all, each entry's
    bytes contiguous and in order): one gather kernel and one transfer for a worker's whole share."""
    pad = None
    parts: list[Tensor] = []
    headers, offset = [], 0
    for entry in entries:
        fields, start = [], offset
        for slot, layer, t in _tensors(entry):
            n = t.numel() * t.element_size()
            fields.append((slot, layer, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset - start))
            parts.append(t.contiguous().reshape(-1).view(torch.uint8))
            gap = -n % ALIGN
            if gap:
                pad = torch.zeros(ALIGN, dtype=torch.uint8, device=t.device) if pad is None else pad
                parts.append(pad[:gap])
            offset += n + gap
        headers.append(Header(entry.key, entry.token_ids, entry.seam, tuple(fields), offset - start))
    buf = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return headers, buf


def split(headers: list[Header], buf: Tensor) -> list[Entry]:
    """``pack``'s buffer back into entries, each on its own copy of its bytes (so the store frees an
    entry's memory when it evicts it, not when the whole share is gone)."""
    want = sum(h.nbytes for h in headers)
    if buf.numel() != want:
        raise ValueError(f"expected {want} bytes for {len(headers)} entries, got {buf.numel()}")
    out, offset = [], 0
    for h in headers:
        out.append(unpack(h, buf[offset:offset + h.nbytes].clone()))
        offset += h.nbytes
    return out


def unpack(header: Header, buf: Tensor) -> Entry:
    """The entry back from its header and buffer (views into ``buf``)."""
    if buf.dtype != torch.uint8 or buf.numel() != header.nbytes:
        raise ValueError(f"entry {header.key}: expected a uint8 buffer of {header.nbytes} bytes, "
                         f"got {buf.dtype} × {buf.numel()}")
    got: dict[tuple[str, int], Tensor] = {}
    fields, i = header.fields, 0
    while i < len(fields):  # a run of one kind, dtype and shape, back to back: one view, unbound
        slot, _, dtype_name, shape, offset = fields[i]
        dtype = getattr(torch, dtype_name)
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        j = i + 1
        while (j < len(fields) and fields[j][0] == slot and fields[j][2:4] == (dtype_name, shape)
               and fields[j][4] == offset + (j - i) * n):
            j += 1
        run = buf[offset:offset + (j - i) * n].view(dtype).view(j - i, *shape)
        for f, t in zip(fields[i:j], run.unbind(0), strict=True):
            got[f[0], f[1]] = t
        i = j
    entry = Entry(header.key, header.token_ids, header.seam)
    for (slot, layer), t in got.items():
        if slot == "S":
            entry.summaries[layer] = Summary(got.get(("T", layer)), t)  # no T field: plain linear attention
        elif slot == "conv":
            entry.conv_tails[layer] = t
        elif slot == "k":
            entry.keys[layer] = t
        elif slot == "v":
            entry.values[layer] = t
    return entry
