"""Replace a checkpoint folder, or one file of it, all at once.

Why: a checkpoint was written over in place, shard by shard, into the only copy
(``python -m hypic.train --out .ckpt --resume``); a save that died midway (Ctrl-C, a full disk, an
out-of-memory kill) left the index naming deleted shards, or new weights beside the old step and no
Adam moments. Now the new folder is written and synced beside the old one and swapped in by two
renames (old aside, new in), and the old one is removed only then: a failed save leaves the previous
checkpoint as it was. A process killed between the two renames leaves both complete folders,
``DIR.old-PID`` and ``DIR.tmp-PID``, beside the missing ``DIR``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hypic.cache.persist import sync_path


def check_replaceable(folder: Path) -> None:
    """ValueError unless ``folder`` is missing or a folder of files: ``replace_folder`` carries over
    files, and a subfolder would be deleted with the old folder (``--out .`` would take the repository)."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder")
    subfolders = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if subfolders:
        raise ValueError(f"{folder}: holds folders ({', '.join(subfolders[:3])}); a checkpoint or model folder "
                         "is replaced whole at each save, so it must hold files only")


@contextmanager
def replace_folder(folder: Path, drop: Callable[[str], bool]) -> Iterator[Path]:
    """Yields a new folder beside ``folder`` that starts with copies of its files, less those ``drop``
    names (what the writer replaces: old shards would outlive a smaller new set); when the block ends,
    the new folder is synced and takes ``folder``'s place. If the block raises, ``folder`` is untouched."""
    folder = folder.resolve()  # a symlink's target is what gets replaced; the link keeps pointing at it
    check_replaceable(folder)
    stage = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    aside = folder.with_name(f"{folder.name}.old-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)  # a stale one left by a killed process with this pid
    stage.mkdir(parents=True)
    try:
        if folder.exists():
            shutil.copymode(folder, stage)
            for file in folder.iterdir():
                if not drop(file.name):
                    shutil.copy2(file, stage / file.name)
        yield stage
        for file in stage.iterdir():
            sync_path(file)
        sync_path(stage)
        if folder.exists():
            try:
                os.rename(folder, aside)
            except OSError:  # a mount point (a container's volume) cannot be renamed: file by file
                _replace_files(stage, folder)
                return
            try:
                os.rename(stage, folder)
            except BaseException:
                os.rename(aside, folder)
                raise
            shutil.rmtree(aside)
        else:
            os.rename(stage, folder)
        sync_path(folder.parent)
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # gone already after a swap


LAST = ("model.safetensors.index.json", "train_state.json")  # what names the rest: replaced last


def _replace_files(stage: Path, folder: Path) -> None:
    """``folder`` made ``stage``'s copy where the folder itself cannot be swapped (a training run
    into a mounted volume failed at its first save, after all its steps): each file copied beside
    its place, synced and renamed over it (atomic per file, and across filesystems: the stage sits
    beside the mount), the index and the loop state last, then the files the stage lacks removed.
    Weaker than the swap: a save cut off midway can leave new shards beside an old index."""
    names = sorted((p.name for p in stage.iterdir()), key=lambda n: n in LAST)
    for name in names:
        tmp = folder / f"{name}.tmp-{os.getpid()}"
        shutil.copy2(stage / name, tmp)
        sync_path(tmp)
        os.replace(tmp, folder / name)
    for old in folder.iterdir():
        if old.name not in names:
            old.unlink()
    sync_path(folder)


def replace_file(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` a temporary file beside ``path``, sync it, then rename it over ``path`` (atomic)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        sync_path(tmp)
        os.replace(tmp, path)
        sync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
