"""The combine pass: only the recompute set runs through the model, at true positions.

Per request, the prompt in position order is a list of *items*: recompute runs (seams, the query,
in-context segments) and cached bodies. Linear layers fold the items' summaries left to right
(``state ← T·state + S``) to get every run's incoming state: runs' zero-start summaries come from
a first pass, bodies' from the cache (re-rotated to their true position when the layer has RoPE
inside); a second pass computes the runs' outputs from those states. Conv runs (maximal contiguous
recompute spans) start from the preceding body's conv tail. Attention layers see every key in
position order — recomputed keys and cached body keys roped at their true positions — with
position-causal visibility, so a seam sees all earlier segments and its own seam, never its own body.
The pass also leaves each request's decode state and builds the entries of in-context segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hypic.cache.entry import Entry
from hypic.engine.modes import Assembly
from hypic.engine.plan import RequestPlan, SegmentPlan
from hypic.models.context import ForwardContext, KVBuffer, LinearRun, RopeSpec, SequenceState
from hypic.ops import attention_runs, recurrence
from hypic.ops.attention import attention
from hypic.ops.attention_runs import RunsPlan
from hypic.ops.kernels import combine_precision, fused_combine, kernel_device
from hypic.ops.linear import input_map_supported, restart
from hypic.ops.recurrence import Summary
from hypic.ops.scan import prefix_states_many
from hypic.ops.transfer import to_device


@dataclass(frozen=True)
class _Body:
    entry: Entry
    start: int  # true position of the segment's first token (the body starts at start + seam)


@dataclass(frozen=True)
class _PackedKeys:
    """Every request's keys in one buffer, request after request, in position order: where each
    part goes. Built from the items alone (a few ops on index ranges, no list per token): the same
    for every attention layer."""

    offsets: list[int]  # request i's keys start here; the last: all keys
    run_dest: Tensor  # slot of every recomputed row (all requests, row order)
    body_dest: Tensor  # slots of every cached body's keys (all requests, bodies in order)
    body_pos: Tensor  # the positions their keys are roped at: true ones (else standalone, ``addition``)
    body_spans: Tensor  # [2, bodies]: each body's first key's true position, its length (on the device)
    bodies: list[Entry]
    runs: RunsPlan  # the runs' visible key prefixes, for the flash path


def _ranges(starts: Tensor, lengths: Tensor, total: int) -> Tensor:
    """range(s, s + n) for each (s, n), concatenated (``total`` = Σ n, known on the host), made where
    ``starts`` and ``lengths`` lie: on a GPU a few launches and no sync, instead of host tensors of a
    row per token (on the H200 host those CPU ops over a call of 8's ≈ 40k keys took ≈ 37 ms in all)."""
    first = torch.cumsum(lengths, 0) - lengths  # where each range begins in the output
    return (torch.arange(total, device=starts.device)
            + torch.repeat_interleave(starts - first, lengths, output_size=total))


def _buffer_tables(bodies: list[Entry], device: torch.device) -> dict[int, tuple[Tensor, Tensor]]:
    """Every linear layer's address tables of the bodies' T and S, made once per pass when every
    body is one buffer on ``device`` in the model's common layout (``Header.summary_offsets``):
    each buffer's address plus a layer's offsets, one copy of the addresses and one add, instead
    of a Python walk over every body's tensors and a copy per layer. Empty otherwise."""
    if not bodies or any(e.buffer is None or e.buffer.device != device for e in bodies):
        return {}
    offsets = bodies[0].header.summary_offsets
    if not offsets or any(e.header.summary_offsets != offsets for e in bodies[1:]):
        return {}
    base = to_device([e.buffer.data_ptr() for e in bodies], device, dtype=torch.int64)
    add = to_device([x for _, t, s in offsets for x in (t, s)], device, dtype=torch.int64)
    tables = base[None, :] + add[:, None]  # [2 · layers, bodies]: T of a layer, then its S
    return {layer: (tables[2 * i], tables[2 * i + 1]) for i, (layer, _, _) in enumerate(offsets)}


@dataclass(frozen=True)
class _Extract:
    """An in-context segment whose entry this pass builds: body rows and the linear run index."""

    entry: Entry
    seg: SegmentPlan
    rows: tuple[int, int]  # body rows
    run: int  # index of the body's linear run
    conv_run: int  # index of the conv run holding the segment
    conv_end: int  # the segment's last row + 1


class CombineContext(ForwardContext):
    def __init__(self, plans: list[RequestPlan], assembly: Assembly, device: torch.device) -> None:
        self.plans, self.assembly = plans, assembly
        self.items: list[list[tuple[str, int | _Body]]] = []  # per request: ("run", index) | ("body", _Body)
        ids: list[int] = []
        positions: list[int] = []
        linear_rows: list[tuple[int, int]] = []
        conv_rows: list[tuple[int, int]] = []
        self.conv_preceding: list[Entry | None] = []
        self.extracts: list[_Extract] = []
        self.request_rows: list[tuple[int, int]] = []
        self.last_run: list[int] = []
        self.last_conv: list[int] = []
        for plan in plans:
            items: list[tuple[str, int | _Body]] = []
            first_row, end_pos = len(ids), None
            for seg in plan.segments:
                a, b = seg.recompute
                if b > a:
                    row = len(ids)
                    if end_pos != seg.start + a:  # a new conv run after a body (or at the start)
                        last = items[-1][1] if items else None
                        self.conv_preceding.append(last.entry if isinstance(last, _Body) else None)
                        conv_rows.append((row, row))
                    ids += seg.token_ids[a:b]
                    positions += range(seg.start + a, seg.start + b)
                    conv_rows[-1] = (conv_rows[-1][0], len(ids))
                    cuts = [a, b]
                    if seg.in_context and seg.key is not None:  # build its entry: split seam | body
                        seg.entry = Entry(seg.key, tuple(seg.token_ids), seg.seam)
                        cuts = [a, seg.seam, b] if 0 < seg.seam < b else cuts
                    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
                        items.append(("run", len(linear_rows)))
                        linear_rows.append((row + lo - a, row + hi - a))
                    if seg.in_context and seg.key is not None:
                        self.extracts.append(_Extract(seg.entry, seg, (row + seg.seam - a, row + b - a),
                                                      len(linear_rows) - 1, len(conv_rows) - 1, row + b - a))
                    end_pos = seg.start + b
                if not seg.in_context and seg.entry is not None:
                    items.append(("body", _Body(seg.entry, seg.start)))
                    end_pos = None
            self.items.append(items)
            self.request_rows.append((first_row, len(ids)))
            self.last_run.append(len(linear_rows) - 1)
            self.last_conv.append(len(conv_rows) - 1)
        self.input_ids = to_device(ids, device)
        self.host_positions = torch.tensor(positions, dtype=torch.long)
        self.positions = to_device(self.host_positions, device)
        self.cu_seqlens = torch.tensor([0, *[b for _, b in conv_rows]])
        self.linear_cu = torch.tensor([0, *[b for _, b in linear_rows]])
        self.decode_states = [SequenceState(length=p.prompt_tokens) for p in plans]
        self._raw: dict[int, tuple[Tensor, Tensor | None]] = {}
        self._packed: _PackedKeys | None = None
        self._key_positions: Tensor | None = None
        self._indices: dict[tuple, Tensor] = {}
        self._fused: tuple[Tensor, Tensor, list[Entry]] | None = None
        self._body_tables: dict[int, tuple[Tensor, Tensor]] | None = None
        self._biases: dict[tuple[int, torch.dtype], Tensor] = {}

    def logits_rows(self) -> Tensor:
        return to_device([b - 1 for _, b in self.request_rows], self.positions.device)

    def conv_tails(self, layer: int, raw: Tensor) -> Tensor | None:
        tails = None
        if self.assembly.conv_warmup:
            known = [e.conv_tails[layer] for e in self.conv_preceding if e is not None]
            if known:  # one stack, not a copy per run: the host issues each op at a few µs whatever its size
                zero = raw.new_zeros(known[0].shape) if len(known) < len(self.conv_preceding) else None
                tails = torch.stack([zero if e is None else e.conv_tails[layer] for e in self.conv_preceding])
        self._raw[layer] = (raw, tails)
        return tails

    def save_conv(self, layer: int, tails: Tensor) -> None:
        raw, initial = self._raw.pop(layer)
        width = tails.shape[1]  # W − 1
        for state, c in zip(self.decode_states, self.last_conv, strict=True):
            state.conv[layer] = tails[c]
        cu = self.cu_seqlens.tolist()
        for x in self.extracts:  # the segment's last W−1 raw inputs, reaching into the run's initial tail
            start = cu[x.conv_run]
            history = initial[x.conv_run] if initial is not None else raw.new_zeros(width, raw.shape[1])
            seen = torch.cat([history, raw[start:x.conv_end]])
            # its last ``width`` rows by their start: ``[-width:]`` is every row when W = 1 (no tail)
            x.entry.conv_tails[layer] = seen[seen.shape[0] - width:].clone()

    def linear(self, layer: int, family: str, run: LinearRun, rope: RopeSpec | None) -> Tensor:
        if self._fusable(family, rope):
            return self._linear_fused(layer, run)
        single = all(sum(kind == "run" for kind, _ in items) <= 1 for items in self.items)
        # Runs' summaries (from zero) for the chains; on the torch backend the same pass keeps each
        # output's map from its run's initial state, so the runs need not be run again from the states
        # the chains give them (``linear.restart``): one pass, where on the CPU a second cost ≈ 3 ms a layer.
        one_pass = input_map_supported(family, self.positions.device)
        from_zero = None if single and not self.extracts else run(self.linear_cu, None, True, input_map=one_pass)
        runs = None if from_zero is None else from_zero.summary
        # Every request's chain — the spans before its last run, in position order — packed end to
        # end and scanned in one call (on the GPU one launch walks all chains side by side).
        chain: list[int | Summary] = []  # a run's index (its summary is a row of ``runs``) or a body's summary
        starts: list[tuple[int, int]] = []  # (run index, its prefix-state row in the packed chains)
        cu = [0]
        for items in self.items if self.assembly.carry_state else ():
            first = len(chain)
            for kind, item in items:
                if kind == "run":
                    if len(chain) > first:  # a run at a chain's start begins from zero: nothing to scatter
                        starts.append((item, len(chain) + len(cu) - 1))
                    if runs is not None:
                        chain.append(item)
                else:
                    s = item.entry.summaries[layer]
                    if rope is not None and self.assembly.rerotate:
                        s = recurrence.rerotate(family, s, item.start, rope)
                    chain.append(s)
            if len(chain) > first:
                cu.append(len(chain))
        entering: Tensor | None = None  # the state each run of ``starts`` begins from
        if starts:
            X = self._scan(family, chain, cu, runs)
            key = tuple(starts)
            entering = X[self._device_index(("rows", key), [r for _, r in starts], X.device)]  # one gather
        if from_zero is not None and one_pass:
            o, final = restart(family, from_zero, self.linear_cu, [i for i, _ in starts],
                               from_zero.final_state[:0] if entering is None else entering, run.v.dtype)
        else:
            initial: Tensor | None = None  # stays None (every run from zero) without carry_state
            if entering is not None:
                initial = entering.new_zeros(len(self.linear_cu) - 1, *entering.shape[1:])
                initial[self._device_index(("runs", key), [i for i, _ in starts], entering.device)] = entering
            out = run(self.linear_cu, initial, False)
            o, final = out.o, out.final_state
        for state, r in zip(self.decode_states, self.last_run, strict=True):
            state.linear[layer] = final[r]
        for x in self.extracts:
            s = Summary(None if runs.transition is None else runs.transition[x.run].clone(),
                        runs.state[x.run].clone())  # owned, not views of every run's summary
            if rope is not None:  # entries are canonical: as if the segment started at position 0
                s = recurrence.rerotate(family, s, -x.seg.start, rope)
            x.entry.summaries[layer] = s
        return o

    def _scan(self, family: str, chain: list[int | Summary], cu: list[int], runs: Summary | None) -> Tensor:
        """The packed chains' prefix states, each item named where it lies — a row of the runs'
        summaries or a cached body's — so the GPU kernel reads it in place (no stack, no view per run)."""
        def items(field: str) -> list:
            return [(getattr(runs, field), x) if isinstance(x, int) else (getattr(x, field), None) for x in chain]

        T = items("transition")
        return prefix_states_many(family, None if T[0][0] is None else T, items("state"), cu,
                                  naive=not self.assembly.use_transition,
                                  cu_device=self._device_index(("cu", tuple(cu)), cu, self.positions.device))

    def _fusable(self, family: str, rope: RopeSpec | None) -> bool:
        """Whether this layer's pass can run as one GDN kernel: position-independent composition
        (carried state, true transitions), no RoPE inside, no entry to build from the runs (the
        kernel never forms a run's summary), and every request ends on a run (its decode state)."""
        a = self.assembly
        return (family == "gdn" and rope is None and not self.extracts and a.carry_state and a.use_transition
                and fused_combine() and kernel_device(self.positions.device)
                and all(items and items[-1][0] == "run" for items in self.items))

    def _linear_fused(self, layer: int, run: LinearRun) -> Tensor:
        """``ops.triton_gdn_combine``: every request's items walked in one launch."""
        from hypic.ops import triton_gdn_combine as fused
        from hypic.ops.triton_chain import addresses

        dev = self.positions.device
        if self._fused is None:  # the schedule is the same for every layer: built once
            cu, bodies, requests = self.linear_cu.tolist(), [], []
            for items in self.items:
                steps = []
                for kind, item in items:
                    if kind == "run":
                        steps.append((fused.RUN, cu[item], cu[item + 1]))
                    else:
                        steps.append((fused.BODY, len(bodies), 0))
                        bodies.append(item.entry)
                requests.append(steps)
            self._fused = (*fused.schedule(requests, dev), bodies)
        items, offsets, bodies = self._fused
        if self._body_tables is None:
            self._body_tables = _buffer_tables(bodies, dev)
        held_t = held_s = None
        if layer in self._body_tables:
            T, S = self._body_tables[layer]
        else:  # some body is not one buffer of the common layout: its tensors' addresses, this layer
            T, held_t = addresses([(e.summaries[layer].transition, None) for e in bodies], dev)
            S, held_s = addresses([(e.summaries[layer].state, None) for e in bodies], dev)
        x = run.tokens()
        scale = run.scale if run.scale is not None else x["k"].shape[-1] ** -0.5
        o, final = fused.gdn_combine(x["q"], x["k"], x["v"], x["g"], x["beta"], scale, T, S, items, offsets,
                                     precision=combine_precision())
        for state, s in zip(self.decode_states, final, strict=True):
            state.linear[layer] = s
        del held_t, held_s  # the kernel is queued on this stream: freed memory is reused only after it
        return o

    def _device_index(self, key: tuple, values: list[int], device: torch.device) -> Tensor:
        """A device copy of ``values``, made once per pass: the same for every linear layer."""
        if key not in self._indices:
            self._indices[key] = to_device(values, device)
        return self._indices[key]

    def _bias(self, i: int, dtype: torch.dtype) -> Tensor:
        """Request i's mask as the additive bias SDPA would make of it in every layer, made once: in
        the model's dtype, the key axis padded to a multiple of 16 so the fused kernel takes it as is.
        Visible: key position ≤ query position (compared on the device)."""
        if (i, dtype) not in self._biases:
            pk = self._packed_keys()
            if self._key_positions is None:  # every key's true position, packed as the keys
                pos = self.positions.new_empty(pk.offsets[-1])
                pos[pk.run_dest] = self.positions
                if pk.bodies:  # roped at their true positions unless ``addition``
                    pos[pk.body_dest] = pk.body_pos if self.assembly.rope_fix else \
                        _ranges(*pk.body_spans, len(pk.body_dest))
                self._key_positions = pos
            (a, b), (ra, rb) = pk.offsets[i:i + 2], self.request_rows[i]
            visible = self._key_positions[None, a:b] <= self.positions[ra:rb, None]
            bias = torch.full((rb - ra, -(-(b - a) // 16) * 16), float("-inf"), dtype=dtype, device=visible.device)
            bias[:, :b - a].masked_fill_(visible, 0.0)
            self._biases[(i, dtype)] = bias[:, :b - a]
        return self._biases[(i, dtype)]

    def _packed_keys(self) -> _PackedKeys:
        """Where every key goes, made once per pass: per item a range of slots (a run's rows, a
        body's keys), laid out request after request in position order."""
        if self._packed is None:
            cu = self.linear_cu.tolist()
            offsets, n = [0], 0
            run_slots: list[int] = []  # per run: its first slot (runs in row order)
            body_slots, body_lengths, rope_starts, true_starts, bodies = [], [], [], [], []
            starts, used = [], []  # per run: its request's first slot, the keys it sees
            for items in self.items:
                for kind, item in items:
                    if kind == "run":
                        length = cu[item + 1] - cu[item]
                        run_slots.append(n)
                        starts.append(offsets[-1])
                        used.append(n + length - offsets[-1])
                    else:
                        e = item.entry
                        length = e.body_length
                        body_slots.append(n)
                        body_lengths.append(length)
                        true_starts.append(item.start + e.seam)
                        rope_starts.append(true_starts[-1] if self.assembly.rope_fix else e.seam)
                        bodies.append(e)
                    n += length
                offsets.append(n)
            dev, k, nb = self.positions.device, len(cu), len(bodies)
            run_lengths = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
            # one copy of the per-item numbers; the per-key slots are made from them on the device
            # (the bodies' true starts and lengths last, so the pair the layers read is a slice: indexing
            # a device tensor by a list of rows is a blocking copy, a stall mid-forward)
            ranges = to_device([*run_slots, *run_lengths, *body_slots, *rope_starts, *true_starts, *body_lengths], dev)
            runs_at, bodies_at = ranges[:2 * (k - 1)].view(2, -1), ranges[2 * (k - 1):].view(4, nb)
            run_dest = _ranges(runs_at[0], runs_at[1], cu[-1])
            total = sum(body_lengths)
            body_dest, body_pos = _ranges(bodies_at[0], bodies_at[3], total), _ranges(bodies_at[1], bodies_at[3], total)
            meta = to_device([*cu, *starts, n, *used], dev, dtype=torch.int32)
            longest = max(run_lengths, default=1)
            runs = RunsPlan(meta[:k], meta[k:2 * k], meta[2 * k:], longest, max(used, default=1))
            self._packed = _PackedKeys(offsets, run_dest, body_dest, body_pos, bodies_at[2:], bodies, runs)
        return self._packed

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: RopeSpec | None, scale: float) -> Tensor:
        qr, kr = (q, k) if rope is None else (rope(q, self.positions), rope(k, self.positions))
        pk = self._packed_keys()
        # every request's keys in position order, in one buffer: a few ops a layer whatever the requests
        K = kr.new_empty(pk.offsets[-1], *kr.shape[1:])
        V = v.new_empty(pk.offsets[-1], *v.shape[1:])
        K[pk.run_dest], V[pk.run_dest] = kr, v
        if pk.bodies:  # all cached bodies at once: one concatenation, one RoPE
            body_k = torch.cat([e.keys[layer] for e in pk.bodies]).to(k.dtype)
            K[pk.body_dest] = body_k if rope is None else rope(body_k, pk.body_pos)
            V[pk.body_dest] = torch.cat([e.values[layer] for e in pk.bodies]).to(v.dtype)
        spans = list(zip(pk.offsets[:-1], pk.offsets[1:], strict=True))
        if attention_runs.supported(qr, K, V):
            out = attention_runs.runs_attention(qr, K, V, pk.runs, scale)
        else:
            out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
            for i, ((ra, rb), (a, b)) in enumerate(zip(self.request_rows, spans, strict=True)):
                out[ra:rb] = attention(qr[ra:rb], K[a:b], V[a:b], q_positions=self.positions[ra:rb], k_positions=None,
                                       scale=scale, visible=self._bias(i, q.dtype))
        for state, (a, b) in zip(self.decode_states, spans, strict=True):
            state.kv[layer] = KVBuffer(K[a:b], V[a:b])
        for x in self.extracts:
            a, b = x.rows
            x.entry.keys[layer], x.entry.values[layer] = k[a:b].clone(), v[a:b].clone()
        return out
