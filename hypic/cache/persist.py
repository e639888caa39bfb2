"""The segment store saved to a folder and loaded back: a server that restarts comes back warm.

A folder holds one file per entry and a manifest. An entry's file is one JSON line — its
``Header``: key, token ids, seam, where each tensor sits — then its bytes in that layout, the one
the host tier and the wire use (``hypic.cache.layout``), so an entry is written from and read into
one buffer. The manifest names what the entries were computed by — the engine's fingerprint
(configuration and model folder, which every key folds in already), the dtype, and a fingerprint of
the weights, since a checkpoint retrained in place keeps its folder and configuration — and lists
the files from least to most recently used, so loading them in order restores recency, and a
smaller budget keeps the most recent.

Every file is written under a temporary name and renamed, the manifest last; files no manifest
names are removed after it. A save cut off midway leaves the folder loadable (the previous
manifest, whose files a save only ever replaces with the same content, or the new one). A load
that meets a bad file stops with an error naming it; what it loaded before stays, consistent.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hypic.cache.keys import SegmentKey
from hypic.cache.layout import Header, header_of, pack_into, unpack
from hypic.cache.store import SegmentStore
from hypic.models.fingerprint import same_weights

FORMAT = 1
MANIFEST = "manifest.json"
SUFFIX = ".entry"


@dataclass(frozen=True)
class Stamp:
    """What a store's entries were computed by."""

    fingerprint: str  # the engine's: configuration and model folder
    dtype: str
    weights: list[float]  # ``hypic.models.fingerprint.weight_fingerprint``


def _encode(h: Header) -> bytes:
    return (json.dumps({"key": h.key.digest.hex(), "length": h.key.length, "token_ids": list(h.token_ids),
                        "seam": h.seam, "fields": [list(f) for f in h.fields], "nbytes": h.nbytes}) + "\n").encode()


def _decode(line: bytes, where: Path) -> Header:
    try:
        d = json.loads(line)
        key = SegmentKey(bytes.fromhex(d["key"]), int(d["length"]))
        fields = tuple((str(s), int(layer), str(dt), tuple(int(n) for n in shape), int(off))
                       for s, layer, dt, shape, off in d["fields"])
        header = Header(key, tuple(int(t) for t in d["token_ids"]), int(d["seam"]), fields, int(d["nbytes"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cache file {where}: not an entry header ({e})") from None
    if key.length != len(header.token_ids) or where.name != key.digest.hex() + SUFFIX:
        raise ValueError(f"cache file {where}: its header does not match its name or its tokens")
    return header


def _write(path: Path, parts: list[bytes | memoryview]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for p in parts:
            f.write(p)
    os.replace(tmp, path)


def save(store: SegmentStore, folder: str | Path, stamp: Stamp) -> int:
    """Write every entry of ``store`` (both tiers) into ``folder``; the number written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for entry in store.entries():
        header = header_of(entry)
        buf = torch.empty(header.nbytes, dtype=torch.uint8)
        pack_into(entry, header, buf)
        if store.device.type == "cuda":
            torch.cuda.synchronize(store.device)  # the copies to the host were queued, not done
        name = entry.key.digest.hex() + SUFFIX
        _write(folder / name, [_encode(header), memoryview(buf.numpy())])
        names.append(name)
    manifest = {"format": FORMAT, "model": asdict(stamp), "entries": names}
    _write(folder / MANIFEST, [json.dumps(manifest).encode()])
    for stale in set(folder.glob("*" + SUFFIX)) - {folder / n for n in names}:
        stale.unlink()
    return len(names)


def forget(folder: str | Path, digests: set[bytes]) -> int:
    """Drop the entries with these key digests from a saved cache in ``folder`` (a document evicted
    from the live store must not come back at the next start): the manifest rewritten without them
    first, then their files removed. How many the manifest named; 0 when nothing was saved there."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return 0
    except (OSError, ValueError) as e:
        raise ValueError(f"cache folder {folder}: unreadable {MANIFEST} ({e})") from None
    gone = {d.hex() + SUFFIX for d in digests}
    entries = manifest.get("entries", []) if isinstance(manifest, dict) else []
    keep = [n for n in entries if n not in gone]
    if len(keep) != len(entries):
        _write(folder / MANIFEST, [json.dumps({**manifest, "entries": keep}).encode()])
    for name in gone:
        (folder / name).unlink(missing_ok=True)
    return len(entries) - len(keep)


def load(store: SegmentStore, folder: str | Path, stamp: Stamp) -> int:
    """Insert the entries saved in ``folder`` into ``store``, least recently used first (a tier that
    cannot hold them all keeps the most recent); the number the store took. ValueError, naming the
    problem, when the folder holds no saved cache, one for another model, dtype or weights, or a
    damaged file."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise ValueError(f"cache folder {folder}: no {MANIFEST} (no cache was saved there)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cache folder {folder}: unreadable {MANIFEST} ({e})") from None
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    if fmt != FORMAT:
        raise ValueError(f"cache folder {folder}: format {fmt}, this hypic reads format {FORMAT}")
    saved = manifest.get("model", {})
    if saved.get("fingerprint") != stamp.fingerprint or saved.get("dtype") != stamp.dtype:
        raise ValueError(f"cache folder {folder}: saved for another model, model folder or dtype "
                         f"({saved.get('dtype')}); remove it or point --cache-dir elsewhere")
    if not same_weights(saved.get("weights", []), stamp.weights):
        raise ValueError(f"cache folder {folder}: computed by other weights than this model's (a checkpoint "
                         "changed in place?); remove it")
    inserted = 0
    for name in manifest.get("entries", []):
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(SUFFIX):
            raise ValueError(f"cache folder {folder}: {MANIFEST} names {name!r}, not an entry file of this folder")
        path = folder / name
        try:
            with open(path, "rb") as f:
                header = _decode(f.readline(), path)
                data = f.read()
        except OSError as e:
            raise ValueError(f"cache file {path}: unreadable ({e})") from None
        if len(data) != header.nbytes:
            raise ValueError(f"cache file {path}: {len(data)} bytes after its header, expected {header.nbytes}")
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(store.device)
        try:
            entry = unpack(header, buf)
        except (RuntimeError, ValueError, AttributeError, TypeError) as e:  # fields that do not fit
            raise ValueError(f"cache file {path}: its layout does not fit its bytes ({e})") from None
        inserted += store.insert(entry)
    return inserted
