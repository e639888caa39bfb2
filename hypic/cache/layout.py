"""An entry's tensors laid out in one contiguous byte buffer, and back.

Two places need an entry as one block of bytes: the wire (a worker's share crosses in one
transfer, ``hypic.parallel.wire``) and the host tier (an entry demoted into pinned host memory
comes back to the device in one copy instead of ~90, ``hypic.cache.host_arena``). A ``Header``
says where each tensor sits: per linear layer the summary ``(T, S)`` and conv tail, per attention
layer the body keys and values, kind by kind, each offset aligned so every view is aligned for its
dtype. ``unpack`` turns a buffer back into an entry whose tensors are views into it.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import Tensor

from hypic.cache.entry import Entry
from hypic.cache.keys import SegmentKey
from hypic.ops.recurrence import Summary

ALIGN = 64  # bytes: ≥ every dtype's size, and a cache line

# (slot, layer, dtype name, shape, byte offset); slot ∈ "T", "S", "conv", "k", "v"
Field = tuple[str, int, str, tuple[int, ...], int]
# (byte offset, count, dtype name, shape, the fields' (slot, layer)): ``count`` fields back to back
Run = tuple[int, int, str, tuple[int, ...], tuple[tuple[str, int], ...]]


@functools.lru_cache(maxsize=4096)
def _runs(fields: tuple[Field, ...]) -> tuple[Run, ...]:
    """Runs of fields of one kind, dtype and shape, each right after the one before."""
    out, i = [], 0
    while i < len(fields):
        slot, _, dtype_name, shape, offset = fields[i]
        n = torch.Size(shape).numel() * getattr(torch, dtype_name).itemsize
        j = i + 1
        while (j < len(fields) and fields[j][0] == slot and fields[j][2:4] == (dtype_name, shape)
               and fields[j][4] == offset + (j - i) * n):
            j += 1
        out.append((offset, j - i, dtype_name, shape, tuple((f[0], f[1]) for f in fields[i:j])))
        i = j
    return tuple(out)


@dataclass(frozen=True)
class Header:
    key: SegmentKey
    token_ids: tuple[int, ...]
    seam: int
    fields: tuple[Field, ...]
    nbytes: int  # the buffer's size

    @functools.cached_property
    def runs(self) -> tuple[Run, ...]:
        """The fields as runs of one kind, dtype and shape back to back: ``unpack`` makes one view per
        run and unbinds it, and a conversion copies run by run (≈ 5 copies for an entry's ≈ 80
        tensors). Worked out once per header."""
        return _runs(self.fields)

    @functools.cached_property
    def tensor_bytes(self) -> int:
        """The bytes of the entry's tensors (``Entry.nbytes``), without the alignment padding."""
        return sum(count * numel * getattr(torch, dtype_name).itemsize
                   for _, count, dtype_name, shape, _ in self.runs for numel in (torch.Size(shape).numel(),))

    @functools.cached_property
    def summary_offsets(self) -> tuple[tuple[int, int, int], ...]:
        """(layer, T's byte offset, S's byte offset) of every linear layer whose T and S are fp32:
        the same for every entry of a model (the summaries come first and have one shape), so a
        kernel finds an entry's T and S of any layer at its buffer's address plus these. Worked out
        once per header (an entry keeps its header for life)."""
        t = {f[1]: f[4] for f in self.fields if f[0] == "T" and f[2] == "float32"}
        return tuple((f[1], t[f[1]], f[4]) for f in self.fields if f[0] == "S" and f[2] == "float32" and f[1] in t)


def tensors(entry: Entry) -> list[tuple[str, int, Tensor]]:
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


def layout(entry: Entry) -> Header:
    """Where each of the entry's tensors goes in its buffer (no data moves)."""
    fields, offset = [], 0
    for slot, layer, t in tensors(entry):
        fields.append((slot, layer, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        n = t.numel() * t.element_size()
        offset += n + (-n % ALIGN)
    return Header(entry.key, entry.token_ids, entry.seam, tuple(fields), offset)


def header_of(entry: Entry) -> Header:
    """The entry's layout: the header it keeps when it is one buffer already, else worked out."""
    return entry.header if entry.buffer is not None else layout(entry)


def mismatch(header: Header, template: Header, seams: Collection[int]) -> str | None:
    """Why ``header`` — read from outside, a saved file — is no layout this model's entries take, or
    None: its seam one of ``seams``, its tensors the template's (kinds, layers, shapes resized to its
    body; dtypes the template's, summaries also a host tier's), laid out as ``layout`` lays them (no
    overlap, no gap). ``unpack`` trusts a header; this is what may be trusted."""
    if header.seam not in seams:
        return f"seam {header.seam}, where this engine's entries of {header.key.length} tokens have {sorted(seams)}"
    want = resized(template, header.key, header.token_ids, header.seam)
    if [(f[0], f[1], f[3]) for f in header.fields] != [(f[0], f[1], f[3]) for f in want.fields]:
        return "its tensors are not this model's (kinds, layers or shapes)"
    offset = 0
    for (slot, layer, dtype_name, shape, at), expected in zip(header.fields, want.fields, strict=True):
        if dtype_name != expected[2] and not (slot in SUMMARY_SLOTS and dtype_name in HOST_DTYPES):
            return f"{slot} of layer {layer} in {dtype_name}, not {expected[2]}"
        if at != offset:
            return f"{slot} of layer {layer} at byte {at}, not {offset} (tensors overlapping or apart)"
        n = torch.Size(shape).numel() * getattr(torch, dtype_name).itemsize
        offset += n + (-n % ALIGN)
    return None if offset == header.nbytes else f"{header.nbytes} bytes, where its tensors take {offset}"


def resized(template: Header, key: SegmentKey, token_ids: tuple[int, ...], seam: int) -> Header:
    """The layout of another segment of the same model: ``template``'s fields with the keys' and
    values' rows (their first dim: the body, ``len(token_ids) − seam``) resized, offsets recomputed.
    Every other field (summaries, conv tails) has the same shape for every segment of a model."""
    body, fields, offset = len(token_ids) - seam, [], 0
    for slot, layer, dtype_name, shape, _ in template.fields:
        shape = (body, *shape[1:]) if slot in ("k", "v") else shape
        fields.append((slot, layer, dtype_name, shape, offset))
        n = torch.Size(shape).numel() * getattr(torch, dtype_name).itemsize
        offset += n + (-n % ALIGN)
    return Header(key, tuple(token_ids), seam, tuple(fields), offset)


SUMMARY_SLOTS = ("T", "S")
# what the host tier may store summaries in, by name (the engine's and the command line's spelling)
HOST_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HALF = (torch.bfloat16, torch.float16)


def retyped(header: Header, src: torch.dtype, dst: torch.dtype) -> Header:
    """``header`` with its summaries (T, S) of dtype ``src`` stored as ``dst``, offsets recomputed in
    the same order: how the host tier narrows an entry (fp32 → bf16) and widens it back, the
    exact inverse of the layout (the same fields, the same order, the same alignment)."""
    fields, nbytes = _retyped_fields(header.fields, src, dst)
    return Header(header.key, header.token_ids, header.seam, fields, nbytes)


@functools.lru_cache(maxsize=4096)  # every demotion and promotion asks; entries of a length share fields
def _retyped_fields(fields: tuple[Field, ...], src: torch.dtype, dst: torch.dtype) -> tuple[tuple[Field, ...], int]:
    name = {d: str(d).removeprefix("torch.") for d in (src, dst)}
    out, offset = [], 0
    for slot, layer, dtype_name, shape, _ in fields:
        if slot in SUMMARY_SLOTS and dtype_name == name[src]:
            dtype_name = name[dst]
        out.append((slot, layer, dtype_name, shape, offset))
        n = torch.Size(shape).numel() * getattr(torch, dtype_name).itemsize
        offset += n + (-n % ALIGN)
    return tuple(out), offset


def narrowed(header: Header) -> torch.dtype | None:
    """The half-precision dtype an entry's summaries are stored in (the host tier's), else None."""
    for slot, _, dtype_name, _, _ in header.fields:
        if slot in SUMMARY_SLOTS and getattr(torch, dtype_name) in HALF:
            return getattr(torch, dtype_name)
    return None


def convert_into(entry: Entry, header: Header, buf: Tensor) -> Entry:
    """The entry's tensors copied into ``buf`` laid out by ``header`` — its own fields, maybe in other
    dtypes (``retyped``) — converting as they go, on ``buf``'s device; returns the entry as views
    into ``buf``."""
    out = unpack(header, converted(entry, header, buf))
    out.hits = entry.hits
    return out


def converted(entry: Entry, header: Header, buf: Tensor) -> Tensor:
    """``buf`` holding the entry laid out by ``header`` (``convert_into`` without unpacking the
    result): run by run when the entry is one buffer already, else in one multi-tensor copy."""
    if entry.buffer is not None and entry.header is not None:
        return convert_buffer(entry.header, entry.buffer, header, buf)
    src = [t for _, _, t in tensors(entry)]
    dst = [t for _, _, t in tensors(unpack(header, buf))]
    if [x.shape for x in src] != [x.shape for x in dst]:
        raise ValueError(f"entry {entry.key}: its tensors do not match the layout it is converted into")
    torch._foreach_copy_(dst, src)
    return buf


def convert_buffer(src: Header, src_buf: Tensor, dst: Header, dst_buf: Tensor) -> Tensor:
    """``src_buf`` (laid out by ``src``) copied into ``dst_buf`` laid out by ``dst`` — the same fields
    in the same order, maybe in other dtypes (``retyped``) — one copy per run, converting as it
    goes, with no per-tensor views (a host-tier move's host time: scripts/store_moves.py); returns
    ``dst_buf``."""
    if [r[1:4:2] + (r[4],) for r in src.runs] != [r[1:4:2] + (r[4],) for r in dst.runs]:
        raise ValueError(f"entry {src.key}: its fields do not match the layout it is converted into")
    for a, b in zip(_run_views(src, src_buf), _run_views(dst, dst_buf), strict=True):
        b.copy_(a)
    return dst_buf


def allocate(header: Header, device: torch.device) -> Entry:
    """An entry of ``header``'s layout in one new buffer of its own on ``device``, not yet written:
    its tensors are views to be filled in place (the cold prefill writes each layer into them)."""
    return unpack(header, torch.empty(header.nbytes, dtype=torch.uint8, device=device))


def pack_into(entry: Entry, header: Header, buf: Tensor) -> Entry:
    """Copy the entry's tensors into ``buf`` (uint8, ``header.nbytes``, any device) by ``header``;
    returns the entry as views into ``buf``. Copies are issued non-blocking: a device→pinned-host
    copy returns at once and completes in stream order. An entry that is one buffer already with
    this layout moves in one copy, else tensor by tensor."""
    packed = unpack(header, buf)
    if entry.buffer is not None and entry.header == header:
        buf.copy_(entry.buffer, non_blocking=True)
    else:
        for (_, _, t), (_, _, dst) in zip(tensors(entry), tensors(packed), strict=True):
            dst.copy_(t, non_blocking=True)
    packed.hits = entry.hits
    return packed


def _run_views(header: Header, buf: Tensor) -> list[Tensor]:
    """Each run of ``header`` as one view into ``buf`` [count, *shape]."""
    views = []
    for offset, count, dtype_name, shape, _ in header.runs:
        dtype = getattr(torch, dtype_name)
        n = count * torch.Size(shape).numel() * dtype.itemsize
        views.append(buf[offset:offset + n].view(dtype).view(count, *shape))
    return views


def unpack(header: Header, buf: Tensor) -> Entry:
    """The entry back from its header and buffer (views into ``buf``)."""
    if buf.dtype != torch.uint8 or buf.numel() != header.nbytes:
        raise ValueError(f"entry {header.key}: expected a uint8 buffer of {header.nbytes} bytes, "
                         f"got {buf.dtype} × {buf.numel()}")
    got: dict[tuple[str, int], Tensor] = {}
    for run, view in zip(header.runs, _run_views(header, buf), strict=True):  # one view per run, unbound
        got.update(zip(run[4], view.unbind(0), strict=True))
    entry = Entry(header.key, header.token_ids, header.seam, header=header, buffer=buf)
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


def owns_memory(entry: Entry) -> bool:
    """The entry holds exactly the memory it is accounted for, up to alignment padding: its own
    tensors, one buffer of its own (``unpack``), or its region of the host arena — never a view into
    a larger buffer (a batch's states) that dropping the entry would not free."""
    ts = entry._tensors()
    if entry.region is not None:
        lo = entry.region.buffer.data_ptr()
        hi = lo + entry.region.nbytes
        if any(not lo <= t.data_ptr() <= t.data_ptr() + t.numel() * t.element_size() <= hi for t in ts):
            return False
    return entry.nbytes <= entry.storage_bytes <= entry.nbytes + ALIGN * (len(ts) + 1)
