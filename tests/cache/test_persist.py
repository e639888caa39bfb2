"""The segment cache saved to a folder and loaded into another engine (``hypic.cache.persist``): the
loaded entries are bitwise the saved ones and serve the same answers; a smaller budget keeps the
most recent; a folder of another model, dtype or weights, or a damaged file, is refused with an
error that names it, and the store stays consistent and serving."""

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hypic import LLM, SamplingParams
from hypic.cache import persist
from hypic.cache.host_arena import HostArena
from hypic.cache.persist import MANIFEST, Stamp, load, save
from hypic.cache.store import SegmentStore
from hypic.llm import bundled_model_path
from tests.cache.test_host_arena import _entry, _same

DOCS = [f"Document {i}. The harbour town of Vell{i} trades in amber, salt and {w}." for i, w in
        enumerate(["rope", "glass", "wool", "tin", "cedar", "iron"])]


def _prompt(order: list[int]) -> list[str]:
    return [DOCS[i] for i in order] + ["Question: which town trades in tin?"]


def _tensors(entry) -> list[torch.Tensor]:
    return [t for s in sorted(entry.summaries.items()) for t in s[1] if t is not None] + \
        [entry.conv_tails[k] for k in sorted(entry.conv_tails)] + [entry.keys[k] for k in sorted(entry.keys)] + \
        [entry.values[k] for k in sorted(entry.values)]


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory) -> Path:
    """The bundled model in a folder of its own (some tests change its weights)."""
    return Path(shutil.copytree(bundled_model_path(), tmp_path_factory.mktemp("m") / "model"))


def test_a_saved_cache_loads_into_a_new_engine_and_serves_the_same(tmp_path) -> None:
    params = SamplingParams(max_tokens=6, logprobs=3)
    a = LLM(device="cpu")
    a.generate([_prompt([0, 1, 2, 3])], params)  # four documents cached
    saved = a.save_cache(tmp_path / "cache")
    assert saved == 4 and (tmp_path / "cache" / MANIFEST).exists()
    b = LLM(device="cpu")
    assert b.load_cache(tmp_path / "cache") == 4 and b.engine.store.check_integrity()
    mine = {e.key: e for e in b.engine.store.entries()}
    for e in a.engine.store.entries():  # bitwise, each one buffer (it moves between tiers in one copy)
        assert mine[e.key].buffer is not None and mine[e.key].token_ids == e.token_ids
        assert all(torch.equal(x, y) for x, y in zip(_tensors(e), _tensors(mine[e.key]), strict=True))
    want, got = (llm.generate([_prompt([3, 1, 0, 2])], params)[0] for llm in (a, b))
    assert got.metrics.segment_hits == 4 and got.metrics.segment_misses == 0
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    # saving again into the same folder replaces it: files of entries no longer cached go
    a.engine.store.clear()
    a.generate([_prompt([4])], params)
    assert a.save_cache(tmp_path / "cache") == 1 and len(list((tmp_path / "cache").glob("*.entry"))) == 1


def test_a_smaller_budget_keeps_the_most_recently_used(tmp_path) -> None:
    a = LLM(device="cpu")
    for i in range(5):  # one document per request: the store's recency order is the request order
        a.generate([_prompt([i])], SamplingParams(max_tokens=1))
    a.save_cache(tmp_path / "cache")
    order = [e.key for e in a.engine.store.entries()]
    size = max(e.nbytes for e in a.engine.store.entries())
    b = LLM(device="cpu", cache_device_bytes=2 * size, cache_host_bytes=0)
    assert b.load_cache(tmp_path / "cache") == 5  # each taken in turn; the older ones then evicted
    assert [e.key for e in b.engine.store.entries()] == order[-2:] and b.engine.store.check_integrity()


def test_a_cache_of_another_model_or_weights_or_a_damaged_file_is_refused(tmp_path, model_copy) -> None:
    a = LLM(str(model_copy), device="cpu")
    a.generate([_prompt([0, 1, 2])], SamplingParams(max_tokens=1))
    folder = tmp_path / "cache"
    a.save_cache(folder)
    with pytest.raises(ValueError, match="no manifest.json"):
        a.load_cache(tmp_path / "nothing")
    escaping = tmp_path / "escaping"  # a manifest may only name files of its own folder
    shutil.copytree(folder, escaping)
    manifest = json.loads((escaping / MANIFEST).read_text())
    (escaping / MANIFEST).write_text(json.dumps({**manifest, "entries": ["../cache/" + manifest["entries"][0]]}))
    with pytest.raises(ValueError, match="not an entry file of this folder"):
        a.load_cache(escaping)
    # the same checkpoint in another folder (model_copy is the bundled model's copy): its cache loads and hits
    moved = LLM(device="cpu")
    assert moved.load_cache(folder) == len(a.engine.store.entries())
    assert moved.generate([_prompt([0, 1, 2])], SamplingParams(max_tokens=1))[0].metrics.segment_hits == 3
    with pytest.raises(ValueError, match="another model configuration or dtype"):
        LLM(str(model_copy), device="cpu", dtype="bfloat16").load_cache(folder)
    other = tmp_path / "other"  # another configuration: another fingerprint
    shutil.copytree(model_copy, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": config.get("rms_norm_eps", 1e-6) * 2}))
    with pytest.raises(ValueError, match="another model configuration"):
        LLM(str(other), device="cpu").load_cache(folder)
    # a damaged file (cut short) and a missing one: each skipped with a warning naming it, the
    # others loaded, the engine serves the prompt as before, and the next save drops the damaged file
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    names = sorted(damaged.glob("*.entry"))
    assert len(names) >= 3
    victim, gone = names[0], names[1]
    victim.write_bytes(victim.read_bytes()[:-100])
    gone.unlink()
    b = LLM(str(model_copy), device="cpu")
    with pytest.warns(UserWarning, match="2 entry file.*skipped — damaged") as caught:
        assert b.load_cache(damaged) == len(names) - 2
    said = str(caught[0].message)
    assert victim.name in said and gone.name in said and "bytes after its header" in said
    assert b.engine.store.check_integrity()
    want = a.generate([_prompt([0, 1, 2])], SamplingParams(max_tokens=4))[0].token_ids
    assert b.generate([_prompt([0, 1, 2])], SamplingParams(max_tokens=4))[0].token_ids == want
    saved = b.save_cache(damaged)  # the damaged file dropped or written anew: the folder loads clean
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert LLM(str(model_copy), device="cpu").load_cache(damaged) == saved
    # the checkpoint retrained in place: same folder and configuration, other weights
    shard = sorted(model_copy.glob("*.safetensors"))[0]
    weights = load_file(str(shard))
    name = sorted(weights)[0]
    weights[name] = weights[name] * 1.5
    save_file(weights, str(shard), metadata={"format": "pt"})
    c = LLM(str(model_copy), device="cpu")
    with pytest.raises(ValueError, match="other weights"):
        c.load_cache(folder)
    assert c.cache_stats()["entries"] == {"device": 0, "host": 0}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_both_tiers_are_saved_and_load_back_bitwise_in_recency_order(tmp_path, device) -> None:
    """Host-tier entries live in arena regions (pinned on a GPU): they are saved from there too."""
    originals = {d: _entry(d) for d in range(6)}
    size = originals[0].nbytes
    arena = HostArena(1 << 20, slab_bytes=1 << 20, pin=device == "cuda", background=False)
    assert arena.grow()
    store = SegmentStore(torch.device(device), device_bytes=2 * size, host_bytes=None, arena=arena)
    for e in originals.values():
        assert store.insert(e.to(device, "device"))
    assert store.stats().entries == {"device": 2, "host": 4}
    assert all(e.region is not None for e in store.entries()[:4])
    stamp = Stamp("m", "bfloat16", [1.0, 2.0])
    assert save(store, tmp_path, stamp) == 6
    other = SegmentStore(torch.device(device))  # unbounded: takes them all, on its device
    assert load(other, tmp_path, stamp) == 6 and other.check_integrity()
    assert [e.key for e in other.entries()] == [e.key for e in store.entries()]
    for e in originals.values():
        got = other.lookup(e.key, e.token_ids)
        assert got is not None and got.keys[3].device.type == device and _same(got, e)


def _small_store(device: str = "cpu") -> SegmentStore:
    store = SegmentStore(torch.device(device))
    for d in range(3):
        assert store.insert(_entry(d).to(device, "device"))
    return store


def test_an_entry_damaged_on_disk_is_refused_not_served(tmp_path) -> None:
    """A byte flipped in an entry's tensors (the file keeps its length) is caught by its checksum."""
    stamp = Stamp("m", "bfloat16", [1.0, 2.0])
    save(_small_store(), tmp_path, stamp)
    victim = sorted(tmp_path.glob("*.entry"))[1]
    raw = bytearray(victim.read_bytes())
    raw[-7] ^= 0x10  # in the tensors' bytes, past the header line
    victim.write_bytes(bytes(raw))
    other = SegmentStore(torch.device("cpu"))
    with pytest.warns(UserWarning, match=f"{victim.name}.*checksum"):
        assert load(other, tmp_path, stamp) == 2
    assert other.check_integrity() and len(other.entries()) == 2
    for got in other.entries():  # the two others, bitwise as saved
        assert _same(got, next(e for e in _small_store().entries() if e.key == got.key))


def _flip_in_header(path: Path, old: bytes, new: bytes, *, drop_own_checksum: bool = False) -> None:
    head, _, data = path.read_bytes().partition(b"\n")
    assert old in head, head[:300]
    head = head.replace(old, new, 1)
    if drop_own_checksum:  # as a format 2 file, whose header has no checksum of its own
        header = json.loads(head)
        del header["header_crc32"]
        head = json.dumps(header).encode()
    path.write_bytes(head + b"\n" + data)


def test_a_bit_flipped_in_an_entrys_header_is_caught_by_the_headers_own_checksum(tmp_path) -> None:
    """The header says where each tensor lies: a flipped digit in an offset would lay the bytes out
    wrong — served silently, with the data's checksum intact — so the header has a checksum too."""
    stamp = Stamp("m", "bfloat16", [1.0, 2.0])
    save(_small_store(), tmp_path, stamp)
    victim = sorted(tmp_path.glob("*.entry"))[0]
    offset = json.loads(victim.read_bytes().partition(b"\n")[0])["fields"][1][4]
    _flip_in_header(victim, f", {offset}]".encode(), f", {offset ^ 64}]".encode())
    other = SegmentStore(torch.device("cpu"))
    with pytest.warns(UserWarning, match=f"{victim.name}: its header does not match its checksum"):
        assert load(other, tmp_path, stamp) == 2
    assert other.check_integrity()


def test_an_older_files_header_is_held_to_the_engines_layout(tmp_path) -> None:
    """A format 2 file has no header checksum: its seam, tensors and offsets are checked against the
    layout the engine gives its own entries, and one that differs is skipped (a miss, computed again)."""
    params = SamplingParams(max_tokens=6, logprobs=3)
    a = LLM(device="cpu")
    want = a.generate([_prompt([0, 1])], params)[0]
    folder = tmp_path / "cache"
    a.save_cache(folder)
    files = sorted(folder.glob("*.entry"))
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "format": 2}))
    offset = json.loads(files[0].read_bytes().partition(b"\n")[0])["fields"][1][4]
    _flip_in_header(files[0], f", {offset}]".encode(), f", {offset ^ 64}]".encode(), drop_own_checksum=True)
    _flip_in_header(files[1], b'"seam": 8', b'"seam": 9', drop_own_checksum=True)
    b = LLM(device="cpu")
    with pytest.warns(UserWarning, match="2 entry file.*skipped — damaged.*not an entry of this engine's layout"):
        assert b.load_cache(folder) == 0
    got = b.generate([_prompt([0, 1])], params)[0]
    assert got.metrics.segment_misses == 2 and got.token_ids == want.token_ids and b.engine.store.check_integrity()
    a.save_cache(folder)  # untouched but for the missing header checksum: a format 2 file loads
    for f in sorted(folder.glob("*.entry")):
        _flip_in_header(f, b'"seam"', b'"seam"', drop_own_checksum=True)
    (folder / MANIFEST).write_text(json.dumps({**manifest, "format": 2}))
    assert LLM(device="cpu").load_cache(folder) == 2


def test_a_folder_of_the_first_format_still_loads_and_a_bad_stamp_is_a_value_error(tmp_path) -> None:
    stamp = Stamp("m", "bfloat16", [1.0, 2.0])
    save(_small_store(), tmp_path, stamp)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    for f in tmp_path.glob("*.entry"):  # format 1: no checksum in the headers
        head, _, data = f.read_bytes().partition(b"\n")
        header = json.loads(head)
        del header["crc32"]
        f.write_bytes(json.dumps(header).encode() + b"\n" + data)
    (tmp_path / MANIFEST).write_text(json.dumps({**manifest, "format": 1}))
    assert load(SegmentStore(torch.device("cpu")), tmp_path, stamp) == 3
    for bad, needle in (({"model": None}, "model stamp"), ({"entries": "x.entry"}, "entry list"),
                        ({"model": {**manifest["model"], "weights": ["1.0", 2.0]}}, "other weights")):
        (tmp_path / MANIFEST).write_text(json.dumps({**manifest, **bad}))
        with pytest.raises(ValueError, match=needle):
            load(SegmentStore(torch.device("cpu")), tmp_path, stamp)


def test_a_saved_file_is_on_disk_before_a_manifest_names_it(tmp_path, monkeypatch) -> None:
    """A machine losing power mid-save must not leave a manifest naming empty files (the server
    would then refuse to start until the folder is removed): each file's bytes are synced before
    its rename, the folder after the entries' renames and before (and after) the manifest's."""
    events: list[tuple[str, ...]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(persist.os, "fsync", fsync)
    monkeypatch.setattr(persist.os, "replace", replace)
    save(_small_store(), tmp_path, Stamp("m", "bfloat16", [1.0]))
    folder = os.path.realpath(tmp_path)
    renames = [i for i, e in enumerate(events) if e[0] == "replace"]
    assert len(renames) == 4 and events[renames[-1]][2] == os.path.join(folder, MANIFEST)
    for i in renames:
        assert ("fsync", events[i][1]) in events[:i]  # the file's bytes before its name
    assert ("fsync", folder) in events[renames[-2]:renames[-1]]  # the entries' names before the manifest
    assert ("fsync", folder) in events[renames[-1]:]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_save_removes_what_a_save_cut_off_midway_left(tmp_path) -> None:
    """A save killed while it wrote a file (SIGKILL, an OOM kill, power) leaves that file's temporary
    copy; no later save removed it (only unnamed ``.entry`` files were), so each such crash left up to
    an entry's bytes on disk for good. The next save removes them."""
    stamp = Stamp("m", "bfloat16", [1.0])
    save(_small_store(), tmp_path, stamp)
    named = sorted(p.name for p in tmp_path.glob("*.entry"))
    left = [tmp_path / f"{named[0]}.99999.tmp", tmp_path / f"{MANIFEST}.99999.tmp"]
    for path in left:
        path.write_bytes(b"partial")
    assert save(_small_store(), tmp_path, stamp) == 3
    assert not list(tmp_path.glob("*.tmp"))
    assert sorted(p.name for p in tmp_path.glob("*.entry")) == named

def test_a_folder_is_held_by_one_process_at_a_time(tmp_path) -> None:
    """Two processes saving into one folder would remove each other's entry files: the second to
    claim it is refused, naming the holder's pid, until the holder ends."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import sys; from hypic.cache import persist; "
                               f"persist.claim({str(tmp_path)!r}); print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=f"in use by another hypic process \\(pid {holder.pid}\\)"):
            persist.claim(tmp_path)
    finally:
        holder.communicate("", timeout=60)
    persist.claim(tmp_path)  # the holder ended: its lock went with it
    persist.claim(tmp_path)  # this process holds it already: no conflict with itself
    assert (tmp_path / persist.LOCK).read_text().strip() == str(os.getpid())
    save(_small_store(), tmp_path, Stamp("m", "bfloat16", [1.0]))
    assert (tmp_path / persist.LOCK).exists()  # a save leaves the lock file alone


@pytest.mark.gpu
def test_an_engine_on_the_gpu_saves_both_tiers_and_loads_them_through_its_layout_check(tmp_path) -> None:
    """On the GPU the host tier keeps summaries in bf16: those entries are saved in bf16 and must pass
    the engine's layout check on the way back (``layout.mismatch`` lets a host tier's dtype through)."""
    params = SamplingParams(max_tokens=6)
    a = LLM(device="cuda", cache_host_dtype="bfloat16", cache_host_bytes=64 << 20)
    arena = a.engine.store.arena
    arena.background = False  # pinned now, not while the demotions wait (they would drop the entries)
    while arena.grow():
        pass
    a.generate([_prompt([0])], params)
    size = a.engine.store.entries()[0].nbytes
    a.engine.store.set_budget("device", 2 * size)
    a.generate([_prompt([1, 2, 3, 4])], params)
    assert a.cache_stats()["entries"]["host"] >= 2
    assert a.save_cache(tmp_path / "cache") == 5
    b = LLM(device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no file skipped
        assert b.load_cache(tmp_path / "cache") == 5
    got = b.generate([_prompt([4, 3, 2, 1, 0])], params)[0]
    assert got.metrics.segment_hits == 5 and b.engine.store.check_integrity()
