"""Decode state kept stacked across steps: a batch of sequences decoding together.

A decode step is host-bound on the GPU: with each sequence's state in tensors of its own, every
layer stacked the linear states and conv tails of all sequences and unbound them again, and ran
attention once per sequence — 721 launches for ≈ 10.5 ms of device work in a 51 ms step of 16
sequences at the 9B shape (docs/benchmarks.md). Here the sequences that decode together keep their
state stacked between steps, in arenas of ``slots`` rows (≥ the members): per linear layer the
states [slots, HV, K, V], per conv layer the tails [slots, W−1, D], per attention layer keys and
values [slots, cap, Hkv, D] that each step writes one row of per sequence and attends in one call
(each sequence to its own length: ``hypic.ops.attention_decode``). A layer's work in a step is
then a fixed handful of ops whatever N — and since every arena is written in place and the step's
inputs go into one fixed buffer, the step's tensors keep their addresses until a regrow, so on a
GPU it is captured once as a CUDA graph and replayed (``hypic.models.step_graph``): 40.7 → 12.3
ms a step for 16 sequences at the 9B shape, 9.1 with flash decode attention.

A ``SequenceState`` is either loose (its own tensors: after a prefill) or packed (``state.batch``
set, its own dicts empty). ``gather`` makes one batch hold exactly a step's sequences: those
already together stay put, newcomers are packed in, leavers are unpacked back to loose tensors (a
sequence may continue elsewhere: another group, a prefix-cache continuation). A newcomer is
written into a spare slot and a leaver's slot takes the last member's rows, so joins and leaves
copy only their own sequences' keys and values; the arenas are regrown (everything copied) only
when the members or their lengths outgrow them, by at least a quarter each time.

The price of a plain (unpaged) arena: every sequence is padded to the longest one plus
``HEADROOM`` rows in memory — with very different lengths decoding together that is several times
what the sequences hold. On a GPU the step's attention reads only the used rows (flash attention's
varlen kernel); SDPA, elsewhere, reads the padding too. A paged arena would save the memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hypic.models.context import ForwardContext, KVBuffer, LinearRun, RopeSpec, SequenceState
from hypic.models.hybrid import HybridLM
from hypic.models.step_graph import StepGraph, capture, refused
from hypic.ops.attention_decode import DecodeSpan, decode_attention
from hypic.ops.transfer import copy_to

HEADROOM = 64  # arena rows beyond the longest sequence when the arenas are (re)grown
# eager steps before a capture that ran out of memory is tried again: each try may free the cached
# blocks (a device sync), so not every step; 16 tokens of a request or so
OOM_RETRY_STEPS = 16


def _round16(n: int) -> int:
    return -(-n // 16) * 16


@dataclass
class DecodeStats:
    """What decoding has cost so far (an engine's batches add to one; the trace bench prints it)."""

    steps: int = 0
    replays: int = 0  # steps replayed from a captured graph
    captures: int = 0
    capture_s: float = 0.0  # host time spent capturing
    regrows: int = 0  # arenas (re)allocated: each one drops the batch's graph
    regrow_oom_retries: int = 0  # arena growths that ran out of memory and were tried again (Engine.step)


class DecodeBatch:
    def __init__(self, device: torch.device, *, graphs: bool = False, stats: DecodeStats | None = None) -> None:
        """``graphs``: run steps as a captured CUDA graph (``hypic.models.step_graph``) on a GPU."""
        self.device, self.graphs = device, graphs and device.type == "cuda"
        self.stats = stats if stats is not None else DecodeStats()
        self.members: list[SequenceState] = []  # member i decodes in slot i
        # Every arena has ``slots`` rows (≥ members; spare slots take newcomers without a copy) and
        # is written in place, so its address changes only when it is regrown (a captured step
        # reads and writes these very tensors).
        self.linear: dict[int, Tensor] = {}  # layer → [slots, HV, K, V]
        self.conv: dict[int, Tensor] = {}  # layer → [slots, W−1, D]
        self.keys: dict[int, Tensor] = {}  # layer → [slots, cap, Hkv, D], roped
        self.values: dict[int, Tensor] = {}  # layer → [slots, cap, Hkv, Dv]
        self.slots, self.cap = 0, 0
        self.inputs: Tensor | None = None  # [2, slots] long on the device: the step's token ids, positions
        self.graph: StepGraph | None = None  # the captured step for these arenas
        self.eager_steps = 0  # steps run eagerly since the arenas were (re)grown
        self.capture_at = 1  # the eager step after which a capture is tried (later after one ran out of memory)

    @property
    def lengths(self) -> list[int]:
        return [s.length for s in self.members]

    def _regrow(self, slots: int, cap: int) -> None:
        """Arenas of ``slots`` × ``cap`` rows holding the members' rows so far (a copy of them all:
        only when the members or their lengths outgrow the arenas, by at least a quarter each time)."""
        n = len(self.members)
        # the new arenas are swapped in only once all are made: out of memory halfway, nothing changed
        grown: list[dict[int, Tensor]] = [{}, {}, {}, {}]
        for new, tensors in zip(grown[:2], (self.linear, self.conv), strict=True):
            for layer, t in tensors.items():
                new[layer] = t.new_zeros(slots, *t.shape[1:])
                new[layer][:n] = t[:n]
        for new, tensors in zip(grown[2:], (self.keys, self.values), strict=True):
            for layer, t in tensors.items():
                # zeros, not empty: rows past a sequence's length are masked out of its attention, but
                # a masked row still meets the softmax's zero weight, and 0 × NaN (left-over memory) is NaN
                new[layer] = t.new_zeros(slots, cap, *t.shape[2:])
                new[layer][:n, :self.cap] = t[:n, :self.cap]
        self.linear, self.conv, self.keys, self.values = grown
        self.slots, self.cap = slots, cap
        self.stats.regrows += 1
        self.inputs = torch.zeros(2, slots, dtype=torch.long, device=self.device)
        self.graph, self.eager_steps, self.capture_at = None, 0, 1  # a captured step would use the old arenas

    def _shape_from(self, state: SequenceState) -> None:
        """Empty arenas of the first members' dtypes and shapes (``_regrow`` sizes them)."""
        for layer, t in state.linear.items():
            self.linear[layer] = t.new_zeros(0, *t.shape)
        for layer, t in state.conv.items():
            self.conv[layer] = t.new_zeros(0, *t.shape)
        for layer, buf in state.kv.items():
            self.keys[layer] = buf.keys.new_zeros(0, 0, *buf.keys.shape[1:])
            self.values[layer] = buf.values.new_zeros(0, 0, *buf.values.shape[1:])

    def admit(self, states: list[SequenceState]) -> None:
        """Pack loose states in after the current members (into spare slots when there are some)."""
        if not states:
            return
        if any(s.batch is not None for s in states):
            raise ValueError("admit: a state is packed in a batch already (release it first)")
        n, m = len(self.members), len(states)
        if not self.members and not self.slots:
            self._shape_from(states[0])
        need_cap = _round16(max(s.length for s in states) + HEADROOM) if self.keys else 0
        if n + m > self.slots or need_cap > self.cap:
            # by a quarter at least on the outgrown axis: under serving, newcomers keep arriving
            # longer than the longest member, and each regrow copies every member and recaptures
            cap = self.cap if need_cap <= self.cap else _round16(max(need_cap, self.cap + self.cap // 4))
            self._regrow(max(n + m, self.slots + self.slots // 4), cap)
        for ours, theirs in ((self.linear, [s.linear for s in states]), (self.conv, [s.conv for s in states])):
            for layer, t in ours.items():
                t[n:n + m] = torch.stack([x[layer] for x in theirs])
        for layer in self.keys:
            keys, values = self.keys[layer], self.values[layer]
            for i, s in enumerate(states):
                buf = s.kv[layer]
                keys[n + i, :buf.length] = buf.keys
                values[n + i, :buf.length] = buf.values
                keys[n + i, buf.length:] = 0  # a spare slot may hold a departed member's rows
                values[n + i, buf.length:] = 0
        for s in states:
            s.linear, s.conv, s.kv, s.batch = {}, {}, {}, self
        self.members += states

    def release(self, states: list[SequenceState]) -> None:
        """Unpack these members back to loose tensors of their own (a ``done`` one is just dropped:
        its dicts stay empty). The last member moves into each freed slot (a copy of its rows alone);
        a batch left with no members lets go of its arenas."""
        if not states:
            return
        gone = {id(s) for s in states}
        slots = {id(s): i for i, s in enumerate(self.members)}
        if not gone <= slots.keys():
            raise ValueError("release: a state is not a member of this batch")
        for s in states:
            s.batch = None
            if s.done:
                continue
            i = slots[id(s)]
            s.linear = {layer: t[i].clone() for layer, t in self.linear.items()}
            s.conv = {layer: t[i].clone() for layer, t in self.conv.items()}
            s.kv = {layer: KVBuffer(self.keys[layer][i, :s.length], self.values[layer][i, :s.length])
                    for layer in self.keys}
        order = list(range(len(self.members)))  # order[i]: whose state slot i holds after the moves
        for i in sorted((slots[g] for g in gone), reverse=True):
            last = len(order) - 1
            if i != last:
                length = self.members[order[last]].length
                for tensors in (self.linear, self.conv):
                    for t in tensors.values():
                        t[i] = t[last]
                for tensors in (self.keys, self.values):
                    for t in tensors.values():
                        t[i, :length] = t[last, :length]
                order[i] = order[last]
            order.pop()
        self.members = [self.members[j] for j in order]
        if not self.members:
            self.clear()

    def clear(self) -> None:
        """Drop every member and tensor (all of them finished). Members and batch refer to each
        other; left to the cycle collector, a batch's arenas (gigabytes on a GPU) would outlive its
        last step by an unknown time."""
        for s in self.members:
            s.batch = None
        self.members, self.linear, self.conv, self.keys, self.values = [], {}, {}, {}, {}
        self.slots, self.cap, self.inputs, self.graph, self.eager_steps, self.capture_at = 0, 0, None, None, 0, 1

    def reserve(self) -> None:
        """Room in the arenas for one more row of every member."""
        need = max(self.lengths, default=0) + 1
        if self.keys and need > self.cap:
            self._regrow(self.slots, _round16(max(need + HEADROOM, self.cap + self.cap // 4)))

    def step(self, model: HybridLM, token_ids: list[int]) -> Tensor:
        """One decode step of every member, ``token_ids`` in slot order: logits [members, vocab] fp32.

        Every slot is computed, spare ones on token 0 at position 0 (rows are independent all the
        way through, and a newcomer overwrites its slot's rows), so the step's shapes depend only on
        the arenas: the step that a CUDA graph captures is this same forward."""
        n = len(self.members)
        if len(token_ids) != n:
            raise ValueError(f"token_ids: expected one per member ({n}), got {len(token_ids)}")
        self.reserve()
        pad = [0] * (self.slots - n)
        copy_to(self.inputs, torch.tensor([[*token_ids, *pad], [*self.lengths, *pad]], dtype=torch.long))
        logits = self._forward(model)
        for s in self.members:
            s.length += 1
        return logits[:n]

    def _forward(self, model: HybridLM) -> Tensor:
        self.stats.steps += 1
        if self.graph is None and self.graphs and self.eager_steps >= self.capture_at:
            t0 = time.perf_counter()
            self.graph = capture(model, lambda: model(self.inputs[0], DecodeContext(self)), self.device)
            if self.graph is None:
                self.graphs = not refused(model)  # refused: eager from now on; else out of memory, for now
                self.capture_at = self.eager_steps + OOM_RETRY_STEPS
            self.stats.captures += self.graph is not None
            self.stats.capture_s += time.perf_counter() - t0
        if self.graph is not None:
            self.stats.replays += 1
            return self.graph.replay()
        self.eager_steps += 1
        return model(self.inputs[0], DecodeContext(self))


def gather(states: list[SequenceState], device: torch.device, *, graphs: bool = False,
           stats: DecodeStats | None = None) -> tuple[DecodeBatch, list[int]]:
    """One batch holding exactly ``states`` (the one that holds most of them already, else a new
    one); returns it and each state's slot in it."""
    batches: dict[int, DecodeBatch] = {}
    for s in states:
        if s.batch is not None:
            batches[id(s.batch)] = s.batch
    mine = {id(s) for s in states}
    batch = max(batches.values(), key=lambda b: sum(id(m) in mine for m in b.members), default=None)
    if batch is None:
        batch = DecodeBatch(device, graphs=graphs, stats=stats)
    batch.release([m for m in batch.members if id(m) not in mine])
    for other in batches.values():
        if other is not batch:
            other.release([m for m in other.members if id(m) in mine])
    batch.admit([s for s in states if s.batch is None])
    slots = {id(m): i for i, m in enumerate(batch.members)}
    return batch, [slots[id(s)] for s in states]


class DecodeContext(ForwardContext):
    """One decode step of every slot of a batch, one token each, from the batch's inputs.

    Built from device tensors alone — nothing is copied from the host, nothing read back — so the
    same forward runs eagerly or is captured once and replayed (``hypic.models.step_graph``)."""

    def __init__(self, batch: DecodeBatch) -> None:
        self.batch = batch
        self.cu_seqlens = torch.arange(batch.slots + 1)  # host: every run is one token
        self.positions = batch.inputs[1]
        self._rows = torch.arange(batch.slots, device=batch.device)
        # each slot sees its own rows and the one this step writes
        self._span = DecodeSpan((self.positions + 1).to(torch.int32), batch.cap)

    def conv_tails(self, layer: int, raw: Tensor) -> Tensor | None:
        raise NotImplementedError("DecodeContext runs a step's conv itself, in place (conv)")

    def save_conv(self, layer: int, tails: Tensor) -> None:
        raise NotImplementedError("DecodeContext runs a step's conv itself, in place (conv)")

    def conv(self, layer: int, raw: Tensor, weight: Tensor) -> Tensor:
        """One new input per slot: its window is the tail plus that input (fp32 sums, like the conv
        kernels); the tail moves on by one in place."""
        tails = self.batch.conv[layer]
        window = torch.cat([tails.to(raw.dtype), raw[:, None]], dim=1)  # [slots, W, D]
        y = F.silu((window.float() * weight.t().float()).sum(1)).to(raw.dtype)
        tails.copy_(window[:, 1:])
        return y

    def linear(self, layer: int, family: str, run: LinearRun, rope: RopeSpec | None) -> Tensor:
        state = self.batch.linear[layer]
        out = run(self.cu_seqlens, state, False)
        state.copy_(out.final_state)
        return out.o

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: RopeSpec | None, scale: float) -> Tensor:
        if rope is not None:
            q, k = rope(q, self.positions), rope(k, self.positions)
        keys, values = self.batch.keys[layer], self.batch.values[layer]
        keys[self._rows, self.positions] = k  # each slot's new row, at its own length
        values[self._rows, self.positions] = v
        return decode_attention(q, keys, values, self._span, scale)
