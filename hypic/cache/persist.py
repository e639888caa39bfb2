"""The segment store saved to a folder and loaded back: a server that restarts comes back warm.

A folder holds one file per entry and a manifest. An entry's file is one JSON line — its
``Header``: key, token ids, seam, where each tensor sits — then its bytes in that layout, the one
the host tier and the wire use (``hypic.cache.layout``), so an entry is written from and read into
one buffer. The manifest names what the entries were computed by — the engine's fingerprint (its
configuration, which every key folds in already), the dtype, and a fingerprint of the weights, since a
checkpoint retrained in place keeps its configuration; not the model's folder, so a checkpoint moved
or copied (a container's mount, the bundled model in another environment) keeps its cache — and lists
the files from least to most recently used, so loading them in order restores recency, and a
smaller budget keeps the most recent.

Every file is written under a temporary name, flushed to disk (fsync) and renamed, the folder synced
before the manifest is renamed in and again after it; files no manifest names are removed after it.
A save cut off midway — the process killed or the machine losing power — leaves the folder loadable
(the previous manifest, whose files a save only ever replaces with the same content, or the new
one), and the next save removes the temporary file it was writing. Each entry's header carries a
CRC-32 of its bytes and one of itself, and is held to the engine's own layout (its seam, tensors,
dtypes and offsets): a file damaged on disk is refused, never served. A load that meets a damaged
entry file skips it with a warning that names it (the segment is a miss, computed again when a
prompt needs it, and the next save drops the file): one bad file must not keep a server from
starting warm. A manifest that cannot be trusted (another model, dtype or weights, unreadable,
naming files outside its folder) stops the load with an error naming it; what it loaded before
stays, consistent.
"""

from __future__ import annotations

import fcntl
import json
import os
import warnings
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hypic.cache.entry import Entry
from hypic.cache.keys import SegmentKey
from hypic.cache.layout import Header, header_of, pack_into, unpack
from hypic.cache.store import SegmentStore
from hypic.models.fingerprint import same_weights

FORMAT = 3  # 2: each entry's header carries the CRC-32 of its bytes; 3: and of itself
READS = (1, 2, 3)
MANIFEST = "manifest.json"
SUFFIX = ".entry"


@dataclass(frozen=True)
class Stamp:
    """What a store's entries were computed by."""

    fingerprint: str  # the engine's: its configuration
    dtype: str
    weights: list[float]  # ``hypic.models.fingerprint.weight_fingerprint``


def _said(h: Header) -> bytes:
    """What a header says, as its checksum reads it (the same text for the same header)."""
    return json.dumps({"key": h.key.digest.hex(), "length": h.key.length, "token_ids": list(h.token_ids),
                       "seam": h.seam, "fields": [list(f) for f in h.fields], "nbytes": h.nbytes}).encode()


def _encode(h: Header, crc: int) -> bytes:
    said = _said(h)
    return said[:-1] + f', "crc32": {crc}, "header_crc32": {zlib.crc32(said)}}}\n'.encode()


def _decode(line: bytes, where: Path, fmt: int) -> tuple[Header, int | None]:
    """The header and the CRC-32 of the bytes after it (None in a format 1 file, which has none).
    From format 3 the header's own CRC-32 is checked too: a bit flipped in an offset or the seam
    would otherwise lay the bytes out wrong, silently."""
    try:
        d = json.loads(line)
        crc = int(d["crc32"]) if fmt >= 2 else None
        key = SegmentKey(bytes.fromhex(d["key"]), int(d["length"]))
        fields = tuple((str(s), int(layer), str(dt), tuple(int(n) for n in shape), int(off))
                       for s, layer, dt, shape, off in d["fields"])
        header = Header(key, tuple(int(t) for t in d["token_ids"]), int(d["seam"]), fields, int(d["nbytes"]))
        own = int(d["header_crc32"]) if fmt >= 3 else None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cache file {where}: not an entry header ({e})") from None
    if own is not None and zlib.crc32(_said(header)) != own:
        raise ValueError(f"cache file {where}: its header does not match its checksum (damaged on disk)")
    if key.length != len(header.token_ids) or where.name != key.digest.hex() + SUFFIX:
        raise ValueError(f"cache file {where}: its header does not match its name or its tokens")
    return header, crc


def _write(path: Path, parts: list[bytes | memoryview]) -> None:
    """``parts`` into ``path`` whole or not at all: a temporary file (of this process: another
    process saving into the folder never writes into it) flushed to disk, then renamed."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for p in parts:
                f.write(p)
            f.flush()
            os.fsync(f.fileno())  # the bytes on disk before the name: a crash never leaves a named, empty file
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def sync_path(path: Path) -> None:
    """A file's bytes, or a folder's entries (the renames into it, the removals), on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


Unfit = Callable[[Header], "str | None"]  # why a saved header is no layout of the engine's entries, or None


LOCK = ".hypic.lock"  # held by the process that owns a folder: its pid inside
_CLAIMED: dict[str, int] = {}  # folder (real path) → the descriptor holding its lock, for the process's life


def claim(folder: str | Path) -> None:
    """Hold ``folder`` for this process's life (the lock goes with the process); ValueError when
    another process holds it. Two servers saving into one folder would each remove the other's
    entry files (a save removes the files its manifest does not name)."""
    folder = Path(folder)
    key = os.path.realpath(folder)
    if key in _CLAIMED:
        return
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ValueError(f"cache folder {folder}: in use by another hypic process (pid {holder}); give each "
                         "server its own --cache-dir") from None
    except OSError as e:  # a file system without locks
        os.close(fd)
        raise ValueError(f"cache folder {folder}: cannot be locked ({e.strerror or e})") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _CLAIMED[key] = fd


def save(store: SegmentStore, folder: str | Path, stamp: Stamp) -> int:
    """Write every entry of ``store`` (both tiers) into ``folder``; the number written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    if store.device.type == "cuda":  # a demotion's copy into the host tier may still be on its way
        torch.cuda.synchronize(store.device)
    for entry in store.entries():
        header = header_of(entry)
        buf = torch.empty(header.nbytes, dtype=torch.uint8)
        pack_into(entry, header, buf)
        if store.device.type == "cuda":
            torch.cuda.synchronize(store.device)  # the copies to the host were queued, not done
        name = entry.key.digest.hex() + SUFFIX
        data = memoryview(buf.numpy())
        _write(folder / name, [_encode(header, zlib.crc32(data)), data])
        names.append(name)
    sync_path(folder)  # every entry file in place before a manifest names it
    manifest = {"format": FORMAT, "model": asdict(stamp), "entries": names}
    _write(folder / MANIFEST, [json.dumps(manifest).encode()])
    sync_path(folder)
    for stale in set(folder.glob("*" + SUFFIX)) - {folder / n for n in names}:
        stale.unlink()
    # and the temporary files of a save cut off midway (a process killed while writing one): this
    # save's own are renamed by now, and a folder is one process's (``claim``)
    for partial in [*folder.glob(f"*{SUFFIX}.*.tmp"), *folder.glob(f"{MANIFEST}.*.tmp")]:
        partial.unlink(missing_ok=True)
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
        sync_path(folder)  # the manifest without them on disk before their files go
    for name in gone:
        (folder / name).unlink(missing_ok=True)
    return len(entries) - len(keep)


def load(store: SegmentStore, folder: str | Path, stamp: Stamp, unfit: Unfit | None = None) -> int:
    """Insert the entries saved in ``folder`` into ``store``, least recently used first (a tier that
    cannot hold them all keeps the most recent); the number the store took. ValueError, naming the
    problem, when the folder holds no saved cache, one for another model, dtype or weights, or a
    manifest that names a file outside it; a damaged entry file — or one whose header ``unfit``
    says is no layout of the engine's entries — is skipped with a warning."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise ValueError(f"cache folder {folder}: no {MANIFEST} (no cache was saved there)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cache folder {folder}: unreadable {MANIFEST} ({e})") from None
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    if fmt not in READS:
        raise ValueError(f"cache folder {folder}: format {fmt}, this hypic reads formats {READS}")
    saved, names = manifest.get("model"), manifest.get("entries", [])
    if not isinstance(saved, dict) or not isinstance(names, list):
        raise ValueError(f"cache folder {folder}: {MANIFEST} has no model stamp or entry list")
    if saved.get("fingerprint") != stamp.fingerprint or saved.get("dtype") != stamp.dtype:
        raise ValueError(f"cache folder {folder}: saved for another model configuration or dtype "
                         f"({saved.get('dtype')}); remove it or point --cache-dir elsewhere")
    weights = saved.get("weights")
    if not isinstance(weights, list) or not all(isinstance(w, (int, float)) for w in weights) \
            or not same_weights(weights, stamp.weights):
        raise ValueError(f"cache folder {folder}: computed by other weights than this model's (another "
                         "checkpoint of the same configuration, or one changed in place); remove it or point "
                         "--cache-dir elsewhere")
    inserted, skipped = 0, []
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(SUFFIX):
            raise ValueError(f"cache folder {folder}: {MANIFEST} names {name!r}, not an entry file of this folder")
        try:
            entry = _read_entry(folder / name, fmt, store.device, unfit)
        except ValueError as e:
            skipped.append(str(e))
            continue
        inserted += store.insert(entry)
    if skipped:
        warnings.warn(f"cache folder {folder}: {len(skipped)} entry file(s) skipped — damaged, or of a layout "
                      f"not this engine's (another seam) —, their segments "
                      f"computed again when needed: {'; '.join(skipped[:3])}", stacklevel=2)
    return inserted


def _read_entry(path: Path, fmt: int, device: torch.device, unfit: Unfit | None = None) -> Entry:
    """The entry saved in ``path``; ValueError naming the file when it is missing, unreadable, cut
    short, damaged (its checksums), its layout is not the engine's (``unfit``) or does not fit its bytes."""
    try:
        with open(path, "rb") as f:
            header, crc = _decode(f.readline(), path, fmt)
            data = f.read()
    except OSError as e:
        raise ValueError(f"cache file {path}: unreadable ({e.strerror or e})") from None
    why = None if unfit is None else unfit(header)
    if why is not None:
        raise ValueError(f"cache file {path}: not an entry of this engine's layout ({why})")
    if len(data) != header.nbytes:
        raise ValueError(f"cache file {path}: {len(data)} bytes after its header, expected {header.nbytes}")
    if crc is not None and zlib.crc32(data) != crc:
        raise ValueError(f"cache file {path}: its bytes do not match their checksum (damaged on disk)")
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    try:
        return unpack(header, buf)
    except (RuntimeError, ValueError, AttributeError, TypeError) as e:  # fields that do not fit
        raise ValueError(f"cache file {path}: its layout does not fit its bytes ({e})") from None
