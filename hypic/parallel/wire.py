"""Cache entries on the wire: one byte buffer per entry plus a small picklable header.

A worker prefills segments on its own device and hands the entries to the engine's device. All
tensors of all entries of its share (per linear layer the summary ``(T, S)`` and conv tail, per
attention layer the body keys and values) are gathered into one contiguous uint8 buffer, so a share
crosses in one point-to-point transfer (NCCL between GPUs, gloo between CPU processes), and the
headers — shapes, dtypes, offsets, key, token ids — go over the control pipe. (An entry's ~90
tensors packed and sent one by one cost ~90 launches and a send each: per-document host work on the
worker.) On arrival each entry's bytes are copied out on their own, and its tensors are views into
that copy: one allocation per entry, freed with the entry. The layout is ``hypic.cache.layout``'s,
the one the host tier uses too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hypic.cache.entry import Entry
from hypic.cache.layout import ALIGN, Header, header_of, tensors, unpack

__all__ = ["ALIGN", "Header", "pack", "split", "unpack"]


def pack(entries: list[Entry]) -> tuple[list[Header], Tensor]:
    """Entries as (one header each, one uint8 buffer on their device holding them all, each entry's
    bytes contiguous and in order): one gather kernel and one transfer for a worker's whole share."""
    headers = [header_of(e) for e in entries]
    pad, parts = None, []
    for entry in entries:
        if entry.buffer is not None:  # one buffer already, laid out as its header says: one part
            parts.append(entry.buffer)
            continue
        for _, _, t in tensors(entry):
            n = t.numel() * t.element_size()
            parts.append(t.contiguous().reshape(-1).view(torch.uint8))
            gap = -n % ALIGN
            if gap:
                pad = torch.zeros(ALIGN, dtype=torch.uint8, device=t.device) if pad is None else pad
                parts.append(pad[:gap])
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
