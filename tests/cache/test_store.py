"""The tiered store: budgets, LRU demotion and eviction, promotion, pinning, collisions, integrity."""

import pytest
import torch

import hypic.cache.store as store_module
from hypic.cache.entry import Entry
from hypic.cache.host_arena import HostArena
from hypic.cache.keys import SegmentKey, segment_key
from hypic.cache.store import SegmentStore
from hypic.ops.recurrence import Summary


def _entry(ids: list[int], floats: int = 100) -> Entry:
    key = segment_key(ids, model_fingerprint="m", seam=2, dtype="float32")
    e = Entry(key, tuple(ids), 2)
    e.summaries[0] = Summary(torch.zeros(1, 2, 2), torch.zeros(floats - 4))
    return e


def test_keys_depend_on_content_seam_salt_not_position() -> None:
    k = segment_key([1, 2, 3], model_fingerprint="m", seam=8, dtype="bf16")
    assert k == segment_key([1, 2, 3], model_fingerprint="m", seam=8, dtype="bf16")
    for other in (segment_key([1, 2, 4], model_fingerprint="m", seam=8, dtype="bf16"),
                  segment_key([1, 2, 3], model_fingerprint="m", seam=4, dtype="bf16"),
                  segment_key([1, 2, 3], model_fingerprint="m", seam=8, dtype="bf16", salt="t"),
                  segment_key([1, 2, 3], model_fingerprint="n", seam=8, dtype="bf16")):
        assert other != k


def test_key_digests_are_the_documented_hash() -> None:
    """Saved caches on disk are found by digest, so the key's bytes may never drift: blake2b-160 over
    each length-prefixed part (fingerprint, seam, dtype, salt or "", mode), then the ids as int64 —
    computed here from scratch, for several models, tenants and modes in turn."""
    import hashlib
    import struct

    def reference(ids, fingerprint, seam, dtype, salt, mode):
        h = hashlib.blake2b(digest_size=20)
        for part in (fingerprint, str(seam), dtype, salt or "", mode):
            h.update(struct.pack("<I", len(part.encode())) + part.encode())
        h.update(struct.pack(f"<{len(ids)}q", *ids))
        return h.digest()

    for ids, fingerprint, seam, salt, mode in [([1, 2, 3], "m", 8, None, "hypic"), ([5] * 40, "n", 0, "t", "naive"),
                                               ([1, 2, 3], "m", 8, "", "hypic"), ([7, -1, 2**40], "m", 8, "t", "hypic"),
                                               ([1, 2, 3], "m", 8, None, "hypic")]:
        k = segment_key(ids, model_fingerprint=fingerprint, seam=seam, dtype="bf16", salt=salt, mode=mode)
        assert k.digest == reference(ids, fingerprint, seam, "bf16", salt, mode) and k.length == len(ids)


def test_lru_demotes_to_host_then_evicts_and_promotes_back() -> None:
    a, b, c = _entry([1]), _entry([2]), _entry([3])
    store = SegmentStore(torch.device("cpu"), device_bytes=a.nbytes * 2, host_bytes=a.nbytes)
    for e in (a, b, c):
        assert store.insert(e)
        assert store.check_integrity()
    s = store.stats()
    assert s.entries == {"device": 2, "host": 1} and s.demotions == 1
    assert store.lookup(a.key, a.token_ids).tier == "device"  # promoted, b (LRU) demoted into its place
    s = store.stats()
    assert s.promotions == 1 and s.demotions == 2 and s.entries == {"device": 2, "host": 1} and s.evictions == 0
    assert store.lookup(b.key, b.token_ids).tier == "device" and store.stats().entries == {"device": 2, "host": 1}
    assert store.check_integrity()


def test_pinned_entries_stay_and_collisions_miss() -> None:
    a, b = _entry([1]), _entry([2])
    store = SegmentStore(torch.device("cpu"), device_bytes=a.nbytes, host_bytes=0)
    store.insert(a)
    store.pin([a.key])
    assert not store.insert(b)  # a is pinned, nothing may leave, no tier has room
    store.unpin([a.key])
    assert store.insert(b) and store.lookup(a.key, a.token_ids) is None
    forged = SegmentKey(b.key.digest, 1)
    assert store.lookup(forged, (999,)) is None  # same digest, other tokens: never served
    assert store.stats().misses == 2 and store.check_integrity()


def test_discard_drops_an_entry_from_either_tier_but_never_a_pinned_one() -> None:
    a, b, c = _entry([1]), _entry([2]), _entry([3])
    store = SegmentStore(torch.device("cpu"), device_bytes=a.nbytes * 2, host_bytes=a.nbytes)
    for e in (a, b, c):
        store.insert(e)
    assert store.stats().entries == {"device": 2, "host": 1}  # a is in the host tier
    assert store.discard(a.key) == "evicted" and store.lookup(a.key, a.token_ids) is None
    assert store.discard(a.key) == "absent"
    store.pin([b.key])
    assert store.discard(b.key) == "in_use" and store.lookup(b.key, b.token_ids) is not None
    store.unpin([b.key])
    assert store.discard(b.key) == "evicted" and store.discard(c.key) == "evicted"
    s = store.stats()
    assert s.entries == {"device": 0, "host": 0} and s.bytes == {"device": 0, "host": 0} and store.check_integrity()


def test_a_smaller_budget_moves_entries_out_at_once_oldest_first_pinned_staying() -> None:
    a, b, c, d = _entry([1]), _entry([2]), _entry([3]), _entry([4])
    n = a.nbytes
    store = SegmentStore(torch.device("cpu"), device_bytes=4 * n, host_bytes=n)
    for e in (a, b, c, d):
        store.insert(e)
    store.lookup(a.key, a.token_ids)  # a is now the most recently used
    store.pin([b.key])
    store.set_budget("device", n)  # b pinned stays over the budget; c, d, a demoted in turn, a kept last
    tiers = {e.token_ids: (hit.tier if (hit := store._tiers["device"].get(e.key) or store._tiers["host"].get(e.key))
                           else None) for e in (a, b, c, d)}
    assert tiers == {(1,): "host", (2,): "device", (3,): None, (4,): None}, tiers
    assert store.stats().demotions == 3 and store.stats().evictions == 2 and store.check_integrity()
    store.unpin([b.key])
    store.set_budget("device", None)  # unbounded again: nothing moves
    assert store.stats().entries == {"device": 1, "host": 1} and store.check_integrity()
    store.set_budget("device", 0)
    assert store.stats().entries == {"device": 0, "host": 1} and store.check_integrity()
    for bad in (-1, 1.5, True, "auto"):
        with pytest.raises(ValueError, match="set_budget"):
            store.set_budget("device", bad)
    with pytest.raises(ValueError, match="tier"):
        store.set_budget("disk", 0)
    assert store.budgets["device"] == 0


def test_budgets_are_validated() -> None:
    with pytest.raises(ValueError, match="cache_host_bytes"):
        SegmentStore(torch.device("cpu"), host_bytes=-1)


def test_an_entry_must_own_the_memory_it_is_accounted_for() -> None:
    """A view into a batch's states keeps the whole batch alive past eviction: integrity fails."""
    batch = torch.zeros(4, 96)  # four segments' states in one buffer, as a batched prefill makes them
    key = segment_key([9], model_fingerprint="m", seam=2, dtype="float32")
    viewed = Entry(key, (9,), 2, summaries={0: Summary(None, batch[1])})
    assert viewed.nbytes == 96 * 4 and viewed.storage_bytes == 4 * 96 * 4
    store = SegmentStore(torch.device("cpu"))
    store.insert(viewed)
    assert not store.check_integrity()
    owned = Entry(key, (9,), 2, summaries={0: Summary(None, batch[1].clone())})
    assert owned.storage_bytes == owned.nbytes
    fresh = SegmentStore(torch.device("cpu"))
    fresh.insert(owned)
    assert fresh.check_integrity()


def test_store_set_budget_out_of_memory_mid_demotion_loses_no_entry(monkeypatch) -> None:
    """The bf16 host tier (GPU default) converts each demoted entry through a device buffer: out of
    memory there (what shedding runs into) must not make an entry vanish or break the budget."""
    store = SegmentStore(torch.device("cpu"), device_bytes=None, host_bytes=None, host_dtype=torch.bfloat16)
    for ids in ([1], [2], [3]):
        store.insert(_entry(ids))
    oom = torch.OutOfMemoryError("CUDA out of memory (simulated)")
    monkeypatch.setattr(store_module, "converted", lambda *a: (_ for _ in ()).throw(oom))
    with pytest.raises(torch.OutOfMemoryError):
        store.set_budget("device", 0)
    s = store.stats()
    # none lost: the host copy is made before the entry leaves its tier
    assert s.entries["device"] + s.entries["host"] == 3, s.entries
    assert store.check_integrity()  # the budget stopped at what is held


def test_store_promotion_out_of_memory_leaks_no_arena_region(monkeypatch) -> None:
    a, b = _entry([1]), _entry([2])
    n = a.nbytes
    arena = HostArena(None, slab_bytes=1 << 20, pin=False, background=False)
    arena.grow()
    store = SegmentStore(torch.device("cpu"), device_bytes=n, host_bytes=4 * n, arena=arena)
    store.insert(a)
    store.insert(b)  # a demoted into an arena region
    assert store.stats().entries == {"device": 1, "host": 1} and store.check_integrity()
    real = store_module.unpack
    calls = []

    def unpack(*args):  # the promotion's device copy runs out of memory
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args)

    monkeypatch.setattr(store_module, "unpack", unpack)
    with pytest.raises(torch.OutOfMemoryError):
        store.lookup(a.key, a.token_ids)
    # a left the store and its arena region with it
    assert store.check_integrity(), (store.stats().entries, arena.used)


def _bf16_entry(doc: int) -> Entry:
    ids = (doc,) * 10
    e = Entry(segment_key(list(ids), model_fingerprint="m", seam=2, dtype="float32"), ids, 2)
    e.summaries[0] = Summary(torch.full((4, 16, 16), float(doc)), torch.full((4, 16, 16), float(doc)))
    return e


def test_an_entry_under_its_key_with_other_tokens_is_replaced_and_discarded() -> None:
    """Other tokens under a key (an entry file damaged on disk) are never served — and must not block
    the key: the right entry replaces it, and a discard drops it whatever it holds."""
    a = _entry([1, 2])
    wrong = _entry([1, 3])
    wrong.key = a.key  # what a flipped token id in a saved header gives
    store = SegmentStore(torch.device("cpu"))
    assert store.insert(wrong) and store.lookup(a.key, a.token_ids) is None  # a miss, never served
    assert store.insert(a) and store.lookup(a.key, a.token_ids) is a  # replaced: hit from now on
    assert store.stats().entries["device"] == 1 and store.check_integrity()
    store.discard(a.key)
    assert store.insert(wrong) and store.discard(a.key) == "evicted" and store.stats().entries["device"] == 0
    store.insert(wrong)
    store.pin([a.key])  # a request holds what is under the key: it stays, the new one is not cached
    assert not store.insert(a) and store.check_integrity()


def test_a_half_precision_host_tier_makes_room_for_what_it_keeps() -> None:
    """The host tier keeps summaries in bf16: room is made for that size, not the device's fp32 one."""
    fp32 = _bf16_entry(1).nbytes
    store = SegmentStore(torch.device("cpu"), device_bytes=fp32, host_bytes=fp32 + 64, arena=None,
                         host_dtype=torch.bfloat16)  # room for two bf16 entries
    for d in (1, 2, 3):
        store.insert(_bf16_entry(d))
    s = store.stats()
    assert s.entries == {"device": 1, "host": 2} and s.evictions == 0 and store.check_integrity(), s
    assert store.lookup(_bf16_entry(1).key, (1,) * 10).summaries[0].state.dtype == torch.float32


def test_a_pinned_host_entry_is_not_promoted_under_its_holder() -> None:
    """A plan holding a host entry served in place (pinned) keeps reading it: a second lookup does not
    promote it and free its arena region for the next demotion to overwrite."""
    from hypic.cache.layout import layout, pack_into

    def packed(doc: int) -> Entry:
        e = _bf16_entry(doc)
        h = layout(e)
        return pack_into(e, h, torch.empty(h.nbytes, dtype=torch.uint8))

    n = packed(1).nbytes
    arena = HostArena(4 * n, slab_bytes=4 * n, pin=False, background=False)
    arena.grow()
    store = SegmentStore(torch.device("cpu"), device_bytes=n, host_bytes=4 * n, arena=arena, promote_after=2)
    store.insert(packed(1))
    store.insert(packed(2))  # 1 demoted into the arena
    key = packed(1).key
    held = store.lookup(key, (1,) * 10)
    store.pin([key])
    assert held.tier == "host"
    store.lookup(key, (1,) * 10)  # its second host hit: would promote, but it is pinned
    store.pin([key])
    store.insert(packed(3))  # a demotion: must not land in 1's region
    assert held.summaries[0].state.flatten()[0].item() == 1.0 and store.check_integrity()
    store.unpin([key, key])
    assert store.lookup(key, (1,) * 10).tier == "device"  # unpinned, its next hit promotes it


def test_unpinning_after_a_smaller_budget_brings_the_tier_back_within_it() -> None:
    a, b = _entry([1]), _entry([2])
    store = SegmentStore(torch.device("cpu"), device_bytes=2 * a.nbytes, host_bytes=0)
    store.insert(a)
    store.insert(b)
    store.pin([a.key, b.key])
    store.set_budget("device", a.nbytes)  # both pinned: over budget, as allowed
    assert store.stats().entries["device"] == 2 and store.check_integrity()
    store.unpin([a.key, b.key])
    s = store.stats()
    assert s.entries["device"] == 1 and s.bytes["device"] <= a.nbytes and store.check_integrity()
