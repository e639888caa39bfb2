"""The host tier's arena: regions first-fit from slabs, freed and coalesced, never beyond capacity;
a store demotes into it and promotes out of it without ever serving another entry's bytes, and
drops (never stalls) when the arena has no room yet; the background thread pins ahead of demand."""

import gc
import random
import threading
import time

import pytest
import torch

from hypic.cache.entry import Entry
from hypic.cache.host_arena import HostArena
from hypic.cache.keys import segment_key
from hypic.cache.layout import ALIGN
from hypic.cache.store import SegmentStore
from hypic.ops.recurrence import Summary


def _entry(doc: int, length: int = 6) -> Entry:
    """An entry with every kind of tensor, of mixed dtypes and sizes, filled from its document id."""
    g = torch.Generator().manual_seed(doc)
    ids = [doc] * length
    e = Entry(segment_key(ids, model_fingerprint="m", seam=2, dtype="bfloat16"), tuple(ids), 2)
    for layer in (0, 1, 2):
        e.summaries[layer] = Summary(torch.randn(2, 4, 4, generator=g), torch.randn(2, 4, 3, generator=g))
        e.conv_tails[layer] = torch.randn(3, 5, generator=g).to(torch.bfloat16)
    e.keys[3] = torch.randn(length - 2, 1, 7, generator=g).to(torch.bfloat16)
    e.values[3] = torch.randn(length - 2, 1, 7, generator=g).to(torch.bfloat16)
    return e


def _same(a: Entry, b: Entry) -> bool:
    pairs = [(a.summaries[i].transition, b.summaries[i].transition) for i in a.summaries]
    pairs += [(a.summaries[i].state, b.summaries[i].state) for i in a.summaries]
    pairs += [(a.conv_tails[i], b.conv_tails[i]) for i in a.conv_tails]
    pairs += [(a.keys[i], b.keys[i]) for i in a.keys] + [(a.values[i], b.values[i]) for i in a.values]
    return a.token_ids == b.token_ids and all(torch.equal(x.cpu(), y.cpu()) for x, y in pairs)


def test_regions_are_first_fit_coalesced_and_bounded_by_capacity() -> None:
    arena = HostArena(3 * 1024, slab_bytes=1024, pin=False, background=False)
    assert arena.allocate(10) is None  # nothing pinned yet: no region, no stall
    assert arena.grow() and arena.grow() and arena.grow() and not arena.grow()  # capacity: 3 slabs
    assert arena.pinned_bytes == 3 * 1024
    a, b, c = arena.allocate(100), arena.allocate(300), arena.allocate(1)
    assert (a.slab, a.offset, a.nbytes) == (0, 0, 128) and (b.offset, b.nbytes) == (128, 320)
    assert c.offset == 448 and c.nbytes == ALIGN and arena.used == 128 + 320 + 64
    assert arena.allocate(2000) is None  # larger than any slab
    big = [arena.allocate(1024) for _ in range(2)]
    assert [r.slab for r in big] == [1, 2] and arena.allocate(1024) is None
    arena.free(b)
    again = arena.allocate(300)
    assert again.offset == 128 and again.slab == 0  # b's hole, first fit
    for r in (a, c, *big, again):
        arena.free(r)
        assert arena.check()
    assert arena.used == 0 and arena._free == [[(0, 1024)]] * 3  # everything coalesced
    assert arena.check()


def test_a_store_round_trips_entries_through_the_arena_without_mixing_them() -> None:
    """Zipf lookups over more entries than fit: demotions, promotions and evictions reuse regions;
    every lookup must return its own document's tensors, bit for bit."""
    originals = {d: _entry(d, length=4 + d % 5) for d in range(24)}
    size = max(e.nbytes for e in originals.values())
    slab = (2 * size + 40 * ALIGN) // ALIGN * ALIGN  # two entries and their alignment padding, about
    arena = HostArena(3 * slab, slab_bytes=slab, pin=False, background=False)
    while arena.grow():
        pass
    store = SegmentStore(torch.device("cpu"), device_bytes=4 * size, host_bytes=6 * size, arena=arena)
    for d, e in originals.items():
        assert store.insert(_entry(d, length=e.length))
        assert store.check_integrity()
    s = store.stats()
    assert s.demotions > 0 and s.evictions > 0 and s.entries["host"] > 0
    assert all(e.region is not None for e in store._tiers["host"].values())
    rng = random.Random(0)
    for d in rng.choices(range(24), [1 / (k + 1) for k in range(24)], k=300):
        got = store.lookup(originals[d].key, originals[d].token_ids)
        if got is None:
            assert store.insert(_entry(d, length=originals[d].length))
        else:
            assert _same(got, originals[d]) and got.region is None  # promoted: a device copy,
            if got.buffer is not None:  # one buffer: its next demotion is one copy
                assert all(got.buffer.data_ptr() <= t.data_ptr() < got.buffer.data_ptr() + got.buffer.numel()
                           for t in got._tensors())
        assert store.check_integrity()
    s = store.stats()
    assert s.promotions > 20 and s.demotions > 20
    assert any(e.buffer is not None for e in store._tiers["device"].values())  # promoted ones
    store.clear()
    assert arena.used == 0 and store.check_integrity() and arena.pinned_bytes == 3 * slab


def test_without_pinned_room_a_demotion_is_an_eviction() -> None:
    a, b = _entry(1), _entry(2)
    arena = HostArena(None, pin=False, background=False)  # never grown: no pinned memory at all
    store = SegmentStore(torch.device("cpu"), device_bytes=a.nbytes, host_bytes=None, arena=arena)
    assert store.insert(a) and store.insert(b)
    s = store.stats()
    assert s.evictions == 1 and s.demotions == 0 and s.entries == {"device": 1, "host": 0}
    assert store.lookup(a.key, a.token_ids) is None and store.check_integrity()


def test_the_background_thread_pins_capacity_once_and_ends_with_the_arena() -> None:
    arena = HostArena(10 * 4096, slab_bytes=4096, pin=False)
    assert arena._thread is None and arena.pinned_bytes == 0  # nothing pinned before the first demotion
    assert arena.allocate(100) is None  # the first request starts the thread, and finds nothing yet
    assert arena.pin_all(timeout=10) and arena.pinned_bytes == 10 * 4096  # all of capacity, once
    assert arena.allocate(100) is not None
    thread = arena._thread
    del arena
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_at_exit_every_arena_is_closed_and_its_thread_waited_for() -> None:
    """``close_all`` runs at interpreter exit: no pinning thread is left inside CUDA as it is torn down."""
    from hypic.cache.host_arena import _RUNNING, close_all

    arenas = [HostArena(None, slab_bytes=4096, ahead_bytes=8 * 4096, pin=False) for _ in range(2)]
    for a in arenas:
        a.pin_ahead()
    threads = [a._thread for a in arenas]
    assert all(t is not None and t.is_alive() for t in threads) and all(a in _RUNNING for a in arenas)
    close_all(arenas, wait_s=10)  # at exit: every arena in _RUNNING (here only these: others live on)
    assert not any(t.is_alive() for t in threads) and all(a._closed for a in arenas)


def test_pin_ahead_starts_the_thread_without_waiting_and_it_pins_capacity() -> None:
    """A server's startup: pinning starts before any demotion and the caller does not wait for it."""
    gate = threading.Lock()
    arena = HostArena(4 * 4096, slab_bytes=4096, pin=False, gate=gate)
    with gate:  # the thread cannot pin while the engine holds the gate, and pin_ahead does not wait
        arena.pin_ahead()
        assert arena._thread is not None and arena.pinned_bytes == 0
    deadline = time.monotonic() + 10
    while arena.pinned_bytes < 4 * 4096 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert arena.pinned_bytes == 4 * 4096 and all(arena.allocate(4096) for _ in range(4))
    arena.close()


def test_unbounded_the_thread_pins_ahead_of_what_is_used() -> None:
    arena = HostArena(None, slab_bytes=4096, ahead_bytes=3 * 4096, pin=False)
    assert arena.pin_all(timeout=10) and arena.pinned_bytes == 3 * 4096
    regions = [arena.allocate(4096) for _ in range(3)]
    assert all(r is not None for r in regions)
    assert arena.pin_all(timeout=10) and arena.pinned_bytes == 6 * 4096  # three used, three more ahead
    arena.close()
    sync = HostArena(2 * 4096, slab_bytes=4096, pin=False, background=False)
    assert sync.pin_all() and sync.pinned_bytes == 2 * 4096 and sync._thread is None


def test_an_entry_no_slab_holds_is_dropped_alone() -> None:
    """With the capacity pinned in slabs smaller than an entry, the entry cannot be demoted however
    many others leave (a region never spans slabs): it is dropped, the host tier kept whole (each such
    demotion emptied about twice its size of the tier first)."""
    small = [_entry(i) for i in range(20)]
    big = Entry(segment_key([999], model_fingerprint="m", seam=2, dtype="float32"), (999,), 2)
    big.summaries[0] = Summary(torch.zeros(1, 4, 4), torch.zeros(8 * small[0].nbytes // 4))
    slab = 4 * small[0].nbytes + (-4 * small[0].nbytes % ALIGN)
    arena = HostArena(6 * slab, slab_bytes=slab, pin=False, background=False)
    arena.pin_all()  # a server pins its whole host tier at startup
    assert big.nbytes > slab and not arena.slab_holds(big.nbytes) and arena.slab_holds(small[0].nbytes)
    store = SegmentStore(torch.device("cpu"), device_bytes=big.nbytes, host_bytes=6 * slab, arena=arena)
    for e in small:
        store.insert(e)
    assert store.insert(big)  # alone in the device tier now: the small ones demoted
    held = store.stats().entries["host"]
    assert held >= 10 and store.stats().entries["device"] == 1
    assert store.insert(_entry(100))  # the device tier makes room: the big entry leaves
    s = store.stats()
    assert big.key not in store._tiers["host"] and s.entries["host"] == held  # and nothing else went
    assert store.check_integrity() and arena.check()


def test_pinning_waits_for_the_gate_and_a_large_entry_gets_a_slab_of_its_size() -> None:
    """The thread pins only while it holds the gate (the engine's lock, between engine calls); an
    entry larger than ``slab_bytes`` makes the next slab its size instead of never fitting."""
    gate = threading.Lock()
    arena = HostArena(None, slab_bytes=1024, ahead_bytes=1024, pin=False, gate=gate)
    with gate:  # an engine call in progress
        assert arena.allocate(5000) is None  # starts the thread
        time.sleep(0.3)
        assert arena.pinned_bytes == 0  # it waits for the call to end
    deadline = time.monotonic() + 10
    while not arena.slabs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert arena.slabs[0].numel() == 5056  # 5000 rounded up to ALIGN
    assert arena.allocate(5000) is not None and arena.check()
    arena.close()


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="slab_bytes"):
        HostArena(None, slab_bytes=100)
    with pytest.raises(ValueError, match="arena"):
        SegmentStore(torch.device("cpu"), arena="pinned")


@pytest.mark.gpu
@pytest.mark.parametrize("host_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("promote_after", [1, 2])
def test_on_a_gpu_demotions_land_in_pinned_memory_and_come_back_intact(host_dtype, promote_after) -> None:
    """… bit for bit, or with a bf16 host tier its summaries rounded once (converted on the GPU);
    ``promote_after=2``: a first host hit is a device copy, the entry staying pinned on the host."""
    originals = {d: _entry(d) for d in range(6)}
    size = originals[0].nbytes
    store = SegmentStore(torch.device("cuda"), device_bytes=2 * size, host_bytes=None, host_dtype=host_dtype,
                         promote_after=promote_after)
    assert store.arena is not None
    assert store.arena.grow()  # one slab now (the background thread would do it on first demand)
    for e in originals.values():
        assert store.insert(Entry(e.key, e.token_ids, e.seam, {i: Summary(s.transition.cuda(), s.state.cuda())
                                                                for i, s in e.summaries.items()},
                                  {i: t.cuda() for i, t in e.conv_tails.items()},
                                  {i: t.cuda() for i, t in e.keys.items()},
                                  {i: t.cuda() for i, t in e.values.items()}))
    host = list(store._tiers["host"].values())
    assert len(host) == 4 and all(t.is_pinned() for e in host for t in e._tensors())
    demoted = set(store._tiers["host"])  # keys that went through the host tier: their summaries rounded
    for d in (0, 1, 2, 3, 4, 5, 0, 1, 0, 0):
        key = originals[d].key
        got = store.lookup(key, originals[d].token_ids)
        want = originals[d] if host_dtype is None or key not in demoted else _rounded(originals[d], host_dtype)
        demoted |= set(store._tiers["host"])
        assert got is not None and got.summaries[0].state.dtype == torch.float32
        assert got.keys[3].is_cuda  # served on the device, whatever tier holds it (fp32 too: a copy)
        assert _same(got, want) and store.check_integrity()
    assert store.stats().promotions > 0


def _rounded(e: Entry, dtype: torch.dtype) -> Entry:
    """``e`` with its summaries rounded through ``dtype``: what the host tier keeps of them."""
    out = Entry(e.key, e.token_ids, e.seam, conv_tails=dict(e.conv_tails), keys=dict(e.keys), values=dict(e.values))
    for i, s in e.summaries.items():
        out.summaries[i] = Summary(s.transition.to(dtype).float(), s.state.to(dtype).float())
    return out


def _packed(e: Entry) -> Entry:
    """``e`` as one buffer (how the cold prefill and the wire make entries): it moves run by run."""
    from hypic.cache.layout import layout, pack_into

    header = layout(e)
    return pack_into(e, header, torch.empty(header.nbytes, dtype=torch.uint8))


def test_converting_run_by_run_equals_tensor_by_tensor_and_refuses_another_layout() -> None:
    """``convert_buffer`` (one copy per run of one kind and shape) against the per-tensor path."""
    from hypic.cache.layout import convert_buffer, convert_into, layout, retyped, unpack

    e = _entry(5, length=7)
    header = layout(e)
    narrow = retyped(header, torch.float32, torch.bfloat16)
    assert len(header.runs) < len(header.fields) and header.tensor_bytes == e.nbytes
    by_tensor = convert_into(e, narrow, torch.empty(narrow.nbytes, dtype=torch.uint8))  # e has no buffer
    packed = _packed(e)
    assert packed.nbytes == e.nbytes and _same(packed, e)
    out = torch.empty(narrow.nbytes, dtype=torch.uint8)
    by_run = unpack(narrow, convert_buffer(header, packed.buffer, narrow, out))
    want = Entry(e.key, e.token_ids, e.seam, {i: Summary(s.transition.bfloat16(), s.state.bfloat16())
                                              for i, s in e.summaries.items()}, e.conv_tails, e.keys, e.values)
    assert _same(by_run, by_tensor) and _same(by_run, want)
    back = retyped(narrow, torch.bfloat16, torch.float32)
    assert back.fields == header.fields and back.nbytes == header.nbytes  # the exact inverse
    other = layout(_entry(5, length=9))  # keys and values of another length
    with pytest.raises(ValueError, match="layout"):
        convert_buffer(header, packed.buffer, other, torch.empty(other.nbytes, dtype=torch.uint8))


@pytest.mark.parametrize("host_dtype", [None, torch.bfloat16])
def test_promote_after_serves_early_host_hits_in_place_and_promotes_on_the_nth(host_dtype) -> None:
    """``promote_after=2``: the first hit since a demotion is served from a device copy (its region
    kept, nothing demoted), the second promotes; a new demotion starts the count again."""
    originals = {d: _entry(d, length=6) for d in range(4)}
    size = originals[0].nbytes
    slab = (8 * size + 80 * ALIGN) // ALIGN * ALIGN
    arena = HostArena(slab, slab_bytes=slab, pin=False, background=False)
    arena.grow()
    store = SegmentStore(torch.device("cpu"), device_bytes=2 * size, host_bytes=None, arena=arena,
                         host_dtype=host_dtype, promote_after=2)
    for d in originals:
        assert store.insert(_packed(_entry(d, length=6)))
    a = originals[0]  # demoted (the LRU of four into two device slots)
    assert a.key in store._tiers["host"]
    used, demotions = arena.used, store.stats().demotions
    first = store.lookup(a.key, a.token_ids)
    want = a if host_dtype is None else _rounded(a, host_dtype)
    assert first is not None and _same(first, want) and first.summaries[0].state.dtype == torch.float32
    assert a.key in store._tiers["host"] and arena.used == used  # stays, its region kept
    assert store.stats().demotions == demotions and store.stats().promotions == 0 and store.check_integrity()
    second = store.lookup(a.key, a.token_ids)
    assert a.key in store._tiers["device"] and store.stats().promotions == 1 and _same(second, want)
    assert store.stats().demotions == demotions + 1 and store.check_integrity()
    assert store.stats().move_s > 0  # the moves' host time, which /metrics exports
    with pytest.raises(ValueError, match="promote_after"):
        SegmentStore(torch.device("cpu"), promote_after=0)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_arena", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_host_tier_holds_more_and_gives_back_fp32(with_arena: bool, dtype: torch.dtype,
                                                                   packed: bool) -> None:
    """``host_dtype``: demoted entries keep their summaries in half precision (the other tensors as
    they are), so a host budget holds more of them; a promotion gives back fp32 summaries — the
    originals rounded once — in the entry's own fp32 layout, and nothing else changes. ``packed``:
    the entries are one buffer each (converted run by run), else loose tensors (tensor by tensor)."""
    from hypic.cache.layout import header_of, layout, narrowed

    originals = {d: _entry(d, length=6) for d in range(12)}
    size = originals[0].nbytes
    stores = {}
    for host_dtype in (None, dtype):
        arena = None
        if with_arena:
            slab = (8 * size + 80 * ALIGN) // ALIGN * ALIGN  # eight entries and their alignment padding
            arena = HostArena(slab, slab_bytes=slab, pin=False, background=False)
            arena.grow()
        store = SegmentStore(torch.device("cpu"), device_bytes=2 * size, host_bytes=4 * size, arena=arena,
                             host_dtype=host_dtype)
        for d in originals:
            assert store.insert(_packed(_entry(d, length=6)) if packed else _entry(d, length=6))
            assert store.check_integrity()
        stores[host_dtype] = store
    full, half = stores[None].stats().entries["host"], stores[dtype].stats().entries["host"]
    assert full == 4 and half > full  # summaries are most of an entry: the same bytes hold more
    store = stores[dtype]
    for e in store._tiers["host"].values():
        assert narrowed(header_of(e)) == dtype and e.nbytes < size
        assert e.conv_tails[0].dtype == torch.bfloat16  # only summaries are narrowed
    for d in list(store._tiers["host"]):
        key = store._tiers["host"][d].key
        doc = next(k for k, o in originals.items() if o.key == key)
        got = store.lookup(key, originals[doc].token_ids)
        assert got is not None and got.tier == "device" and narrowed(layout(got)) is None
        assert _same(got, _rounded(originals[doc], dtype))
        assert layout(got).fields == layout(originals[doc]).fields  # the common fp32 layout again
        assert store.check_integrity()
    with pytest.raises(ValueError, match="host_dtype"):
        SegmentStore(torch.device("cpu"), host_dtype=torch.int8)


def test_entries_saved_from_a_half_precision_host_tier_load_back_as_fp32(tmp_path) -> None:
    from hypic.cache import persist
    from hypic.cache.layout import layout, narrowed

    stamp = persist.Stamp("m", "float32", [1.0])
    store = SegmentStore(torch.device("cpu"), device_bytes=_entry(0).nbytes, host_bytes=None,
                         host_dtype=torch.bfloat16)
    for d in range(3):
        store.insert(_entry(d))
    assert store.stats().entries == {"device": 1, "host": 2}
    assert persist.save(store, tmp_path, stamp) == 3
    fresh = SegmentStore(torch.device("cpu"))
    assert persist.load(fresh, tmp_path, stamp) == 3
    for d in range(3):
        got = fresh.lookup(_entry(d).key, _entry(d).token_ids)
        assert got is not None and narrowed(layout(got)) is None
        assert _same(got, _rounded(_entry(d), torch.bfloat16)) or _same(got, _entry(d))  # demoted or not
    assert fresh.check_integrity()


@pytest.mark.gpu
@pytest.mark.parametrize("host_dtype", ["float32", "bfloat16"])
def test_on_a_gpu_an_engine_answers_from_host_tier_hits_as_from_fresh_entries(host_dtype: str) -> None:
    """A prompt's entries demoted by another prompt's, then hit in the host tier (served in place:
    ``promote_after=2``), answer as a fresh engine does. An fp32 host tier once handed the combine
    pass its pinned entries as they lay, and the request failed (tensors on two devices)."""
    from hypic import LLM

    rng = random.Random(3)
    a, b = ([[rng.randrange(3, 1800) for _ in range(n)] for n in lengths] for lengths in ([40, 50, 6], [45, 55, 6]))

    def logits(llm: LLM, prompt: list[list[int]]) -> torch.Tensor:
        return llm.engine.prefill_logits([prompt], mode="hypic")[0][0].float().cpu()

    fresh = LLM(device="cuda", dtype="float32", cache_host_dtype=host_dtype)
    want = logits(fresh, a)
    one = fresh.engine.store.stats().bytes["device"] // 2  # a's two documents
    small = LLM(device="cuda", dtype="float32", cache_host_dtype=host_dtype, cache_device_bytes=2 * one + 10,
                cache_host_bytes=None)
    assert small.engine.store.arena is not None and small.engine.store.arena.grow()
    logits(small, a)
    logits(small, b)  # a's entries go down to the host tier
    assert small.engine.store.stats().entries["host"] >= 2
    got = logits(small, a)
    tolerance = 1e-4 if host_dtype == "float32" else 0.2  # bf16 summaries: rounded once on the way down
    assert (got - want).abs().max().item() <= tolerance
