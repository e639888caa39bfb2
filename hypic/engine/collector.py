"""Python's cycle collector and a serving process's long-lived objects.

A full collection (generation 2) walks every object the collector tracks. A serving process holds
millions that never die: a 151 000-token vocabulary's tries alone (structured output's
``TokenVocab``) are ≈ 1.45 million, and a full pass over them took 0.5–0.7 s — set off, every few
hundred masks, by the allocations of the serving loop itself (each mask's walk keeps thousands of
states alive for a moment, which the collector counts as new long-lived objects). Every stream
stalled for it: over 643 masks along values whose every state is new, 8 passes cost 4.4 s, the
masks' 99th percentile 531 ms (``scripts/gc_pause.py``, docs/benchmarks.md, session 45).

``freeze_long_lived`` collects what is garbage now and moves everything alive out of the collector's
passes (``gc.freeze``): reference counting still frees any of it dropped later, but a frozen object
that ends in a reference cycle stays until ``gc.unfreeze``. So it is done where hypic owns the
process — ``hypic serve`` and ``run-batch``, once the model is loaded and warmed up, and again when
structured output's vocabulary is built later (``Engine.freeze_collector``) — not by the library on
a caller's process.
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> None:
    """Garbage collected now; every object alive moved out of the collector's full passes."""
    gc.collect()
    gc.freeze()
