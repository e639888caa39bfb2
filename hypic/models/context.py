"""What a forward pass needs besides the weights.

A forward computes *runs*: packed token spans (``cu_seqlens``) at given positions. Where each
run's incoming linear state, conv tail and attention keys come from differs by caller: a plain
prefill or decode step continues each sequence's own state (``SequenceContext`` here); the
engine's combine pass composes cached segment summaries and re-ropes cached keys. Layers ask the
context and never know which: one model forward serves every mode.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hypic.ops.attention import attention
from hypic.ops.attention_batch import causal_prefill_batch
from hypic.ops.conv import causal_conv1d
from hypic.ops.linear import LinearOutput, linear_attention
from hypic.ops.rope import RopeSpec
from hypic.ops.transfer import to_device

if TYPE_CHECKING:
    from hypic.models.decode_batch import DecodeBatch

@dataclass(frozen=True, eq=False)
class LinearRun:
    """A layer's linear attention as a function of what the context decides: called with
    (cu_seqlens, initial_state [N, HV, K, V] | None, output_summary, rows) → LinearOutput. The
    context chooses the split (it may cut its runs finer for linear layers, e.g. a seam apart from
    its body) and may run only some token rows (e.g. just the seams). Its inputs stay readable
    (``tokens``) for a context that runs a kernel of its own (``ops.triton_gdn_combine``)."""

    family: str
    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor | None = None
    beta: Tensor | None = None
    scale: float | None = None
    whole: slice | None = None  # the rows of the inputs this run sees (one token set of a wider forward)

    def restrict(self, whole: slice) -> LinearRun:
        """This run over one token set: rows given later are relative to it."""
        return dataclasses.replace(self, whole=whole)

    def tokens(self) -> dict[str, Tensor | None]:
        """The inputs of the rows this run sees: q, k, v, g, beta."""
        return {name: x if x is None or self.whole is None else x[self.whole]
                for name, x in (("q", self.q), ("k", self.k), ("v", self.v), ("g", self.g), ("beta", self.beta))}

    def __call__(self, cu_seqlens: Tensor, initial_state: Tensor | None, output_summary: bool,
                 rows: Tensor | slice | None = None, input_map: bool = False) -> LinearOutput:
        if self.whole is not None:
            rows = self.whole if rows is None else (rows + self.whole.start if self.whole.start else rows)

        def pick(x: Tensor | None) -> Tensor | None:
            return x if x is None or rows is None else x[rows]

        return linear_attention(self.family, pick(self.q), pick(self.k), pick(self.v), g=pick(self.g),
                                beta=pick(self.beta), cu_seqlens=cu_seqlens, initial_state=initial_state,
                                output_summary=output_summary, output_input_map=input_map, scale=self.scale)


def linear_run(family: str, q: Tensor, k: Tensor, v: Tensor, *, g: Tensor | None = None,
               beta: Tensor | None = None, scale: float | None = None) -> LinearRun:
    """The layer's linear attention as a function of what the context decides."""
    return LinearRun(family, q, k, v, g, beta, scale)


class ForwardContext(ABC):
    """The runs of one forward and the source of every layer's incoming state."""

    cu_seqlens: Tensor  # host [N + 1]: run boundaries in the packed tokens
    positions: Tensor  # [T] on the model's device: each token's true position

    @abstractmethod
    def conv_tails(self, layer: int, raw: Tensor) -> Tensor | None:
        """Initial conv tails [N, W−1, D] for the runs, given this layer's raw conv inputs [T, D]."""

    @abstractmethod
    def save_conv(self, layer: int, tails: Tensor) -> None:
        """Each run's last W−1 raw inputs after this layer's conv."""

    def conv(self, layer: int, raw: Tensor, weight: Tensor) -> Tensor:
        """The layer's causal SiLU conv over the runs: raw [T, D], weight [D, W] → y [T, D]. Runs
        continue from ``conv_tails`` and hand theirs to ``save_conv``; a context may instead cut
        some tokens' windows finer (training's standalone segments, ``hypic.train.pic``)."""
        out = causal_conv1d(raw, weight, cu_seqlens=self.cu_seqlens, initial_tail=self.conv_tails(layer, raw),
                            activation="silu")
        self.save_conv(layer, out.tail)
        return out.y

    @abstractmethod
    def linear(self, layer: int, family: str, run: LinearRun, rope: RopeSpec | None) -> Tensor:
        """Run the layer's linear attention over the runs (choosing initial states); return o."""

    @abstractmethod
    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: RopeSpec | None, scale: float) -> Tensor:
        """Attention of the runs' queries over their visible keys. q, k are normed and *before*
        RoPE (the context ropes them at true positions); returns [T, Hq, Dv]."""


class KVBuffer:
    """One layer's roped keys and values of one sequence, in a buffer that grows by doubling, so a
    decode step writes one row instead of copying the whole history."""

    def __init__(self, keys: Tensor, values: Tensor, headroom: int = 64) -> None:
        n = keys.shape[0]
        self._k = keys.new_empty(n + headroom, *keys.shape[1:])
        self._v = values.new_empty(n + headroom, *values.shape[1:])
        self._k[:n], self._v[:n] = keys, values
        self.length = n

    @property
    def keys(self) -> Tensor:  # [L, Hkv, D]
        return self._k[: self.length]

    @property
    def values(self) -> Tensor:  # [L, Hkv, Dv]
        return self._v[: self.length]

    def append(self, keys: Tensor, values: Tensor) -> None:
        n = self.length + keys.shape[0]
        if n > self._k.shape[0]:
            cap = max(n, 2 * self._k.shape[0])
            self._k = torch.cat([self._k[: self.length], self._k.new_empty(cap - self.length, *self._k.shape[1:])])
            self._v = torch.cat([self._v[: self.length], self._v.new_empty(cap - self.length, *self._v.shape[1:])])
        self._k[self.length:n], self._v[self.length:n] = keys, values
        self.length = n

    def clone(self) -> KVBuffer:
        return KVBuffer(self.keys, self.values)

    def view(self) -> KVBuffer:
        """The rows so far, sharing storage: appends write only past ``length``, so the view stays
        valid while the original grows. Never append to a view (``clone`` it first)."""
        shared = KVBuffer.__new__(KVBuffer)
        shared._k, shared._v, shared.length = self._k, self._v, self.length
        return shared


@dataclass
class SequenceState:
    """Everything one sequence carries between forwards: the decode state."""

    linear: dict[int, Tensor] = field(default_factory=dict)  # layer → state [HV, K, V] fp32
    conv: dict[int, Tensor] = field(default_factory=dict)  # layer → tail [W−1, D]
    kv: dict[int, KVBuffer] = field(default_factory=dict)  # attention layer → roped keys and values
    length: int = 0  # tokens seen: the next position
    # Decoding in a batch (``hypic.models.decode_batch``): the state lives stacked there, the dicts
    # above are empty until it is released.
    batch: DecodeBatch | None = field(default=None, compare=False, repr=False)
    done: bool = False  # no more steps will come: leaving a batch, it is dropped, not unpacked


class SequenceContext(ForwardContext):
    """Continue each sequence from its own state: plain prefill (from empty states) and decode."""

    def __init__(self, states: list[SequenceState], lengths: list[int], device: torch.device, *,
                 keep_state: bool = True) -> None:
        """``keep_state=False``: nothing is kept for later steps — no keys and values, linear states or
        conv tails per sequence (training: hundreds of sequences a batch, each a Python-level store)."""
        self.states, self.keep_state = states, keep_state
        self.lengths = lengths
        self.cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
        starts = [s.length for s in states]
        self.positions = to_device(torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)]),
                                   device)
        self._starts = starts

    def _runs(self) -> list[slice]:
        cu = self.cu_seqlens.tolist()
        return [slice(a, b) for a, b in zip(cu[:-1], cu[1:], strict=True)]

    def conv_tails(self, layer: int, raw: Tensor) -> Tensor | None:
        have = [s.conv[layer] for s in self.states if layer in s.conv]
        if not have:
            return None
        # a sequence with no tail yet starts here: its inputs before it are zeros (as with None)
        zero = torch.zeros_like(have[0])
        return torch.stack([s.conv.get(layer, zero) for s in self.states]).to(raw.dtype)

    def save_conv(self, layer: int, tails: Tensor) -> None:
        if not self.keep_state:
            return
        for s, t in zip(self.states, tails, strict=True):
            s.conv[layer] = t

    def linear(self, layer: int, family: str, run: LinearRun, rope: RopeSpec | None) -> Tensor:
        have = [s.linear[layer] for s in self.states if layer in s.linear]
        initial = None
        if have:  # sequences starting here beside ones going on (scoring packs both): theirs is zero
            zero = torch.zeros_like(have[0])
            initial = torch.stack([s.linear.get(layer, zero) for s in self.states])
        out = run(self.cu_seqlens, initial, False)
        if self.keep_state:
            for s, f in zip(self.states, out.final_state, strict=True):
                s.linear[layer] = f
        return out.o

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: RopeSpec | None, scale: float) -> Tensor:
        if rope is not None:
            q, k = rope(q, self.positions), rope(k, self.positions)
        if not any(self._starts):  # a fresh prefill of every sequence: one batched causal pass
            out = causal_prefill_batch(q, k, v, self.cu_seqlens, scale)
            if self.keep_state:
                for s, run in zip(self.states, self._runs(), strict=True):
                    if run.start != run.stop:
                        s.kv[layer] = KVBuffer(k[run], v[run])
            return out
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for s, run, start in zip(self.states, self._runs(), self._starts, strict=True):
            if run.start == run.stop:
                continue
            if start == 0:
                s.kv[layer] = KVBuffer(k[run], v[run])
            else:
                s.kv[layer].append(k[run], v[run])
            # the queries are always the newest keys: one of the mask-free cases, no positions needed
            out[run] = attention(q[run], s.kv[layer].keys, s.kv[layer].values, q_positions=None, k_positions=None,
                                 scale=scale, causal_prefill=start == 0, all_visible=run.stop - run.start == 1,
                                 causal_suffix=True)
        return out

    def finish(self) -> None:
        for s, n in zip(self.states, self.lengths, strict=True):
            s.length += n
