"""A prompt's own log-probabilities: each token's, given the tokens before it.

Position-independent reuse never computes logits at a cached document's tokens — that is where its
speed comes from — so scoring a prompt is a ``full`` forward over all of it, whatever the mode its
generation runs in. Who asks: the completions API's ``echo`` with ``logprobs`` (how lm-eval and
similar harnesses score a continuation given a context), and ``SamplingParams.prompt_logprobs``.
The language-model head runs over chunks of rows, so a long prompt never holds its
[tokens × vocabulary] logits at once (at the 9B shape's 248 320-token vocabulary, 1 GiB per 1 000
rows): at most 128 MiB of them, beside a serving store that keeps the device nearly full.

The same forward holds the logits of the token after each prompt (its last row's): ``first`` asks for
them. A harness scoring a continuation sends ``echo`` with ``max_tokens: 1`` (lm-eval's loglikelihood);
the token it draws is its prompt's first under ``full``, so the server draws it from these logits
rather than prefill the prompt a second time (``Engine.start(first_logits=…)``).

Several prompts (a harness's batch) are scored together: packed into forwards of at most ``PIECE``
tokens, each prompt its own sequence there, a long one cut into pieces that each continue the last's
state. Every forward runs under the lock the caller names: between forwards the engine serves its
other requests (a 15 000-token prompt held every stream's decoding for 10 s on a CPU), and a scorer
whose client left or whose time ran out stops there (``stop``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hypic.engine.request import check_top
from hypic.models.context import SequenceContext, SequenceState
from hypic.models.hybrid import HybridLM
from hypic.ops.transfer import to_device

ROWS = 512  # rows of logits at once, at most …
CHUNK_BYTES = 128 << 20  # … and at most this many bytes of fp32 logits (the 9B shape's vocabulary: 135 rows)
PIECE = 2048  # prompt tokens per forward
STATE_BYTES = 512 << 20  # the sequences of one forward hold at most about this much state ...
FIRST_SEQS = 4  # ... and the first forward, before a state's size is known, at most this many
SHARED_MIN = 32  # tokens prompts must share for their common prefix to be scored once (not on a GPU) ...
WAVE = 8  # ... groups of them at a time: each holds its prefix's state until its members start


class ScoringStopped(Exception):
    """``stop`` said why between two pieces: the rest of the prompt was not scored."""


Rows = list[dict[int, float] | None]


@dataclass
class Scored:
    """Per prompt: each token's row (``score_prompt``), and, where asked, the [vocab] logits of the
    token after it (``full``'s first-token logits for that prompt), on the device in the head's dtype:
    what a prefill's ``HybridLM.forward`` turns to fp32, half the bytes of that in bf16."""

    rows: list[Rows]
    first_logits: list[torch.Tensor | None]
    # per prompt, per token: its rank in its position's distribution (1: the likeliest; None for the
    # first token) — vLLM's prompt_logprobs report it
    ranks: list[list[int | None]] | None = None


def score_prompt(model: HybridLM, device: torch.device, ids: list[int], top: int, *,
                 lock: threading.Lock | threading.RLock | None = None,
                 stop: Callable[[], str | None] | None = None) -> list[dict[int, float] | None]:
    """Per token of ``ids``: None for the first (nothing before it); else its log-probability and
    those of the ``top`` likeliest tokens at its position, token → log-probability (fp32 softmax).
    Each piece's forward holds ``lock``; before each, ``stop()`` (a reason, or None to go on) may end
    the scoring with ``ScoringStopped``."""
    return score_prompts(model, device, [ids], [top], lock=lock, stop=stop)[0]


def _check(model: HybridLM, prompts: list[list[int]], tops: list[int]) -> None:
    if len(tops) != len(prompts):
        raise ValueError(f"top: expected one per prompt ({len(prompts)}), got {len(tops)}")
    for k, (ids, top) in enumerate(zip(prompts, tops, strict=True)):
        name = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
        check_top(top)
        if not ids:
            raise ValueError(f"{name}: expected at least one token")
        outside = [t for t in ids if not 0 <= t < model.vocab_size]
        if outside:
            raise ValueError(f"{name}: token id {outside[0]} is outside the vocabulary [0, {model.vocab_size})")


def _next_pack(lengths: list[int], done: list[int], max_seqs: int) -> list[tuple[int, int, int]]:
    """The next forward: at most ``PIECE`` tokens of at most ``max_seqs`` prompts, as (prompt, start,
    stop) spans, every prompt's spans in order and at most one of them per forward (each continues
    the state the last left); ``done`` (tokens scored per prompt) moves on. Short prompts share a
    forward (lm-eval sends its contexts in batches of a few hundred tokens each: one forward apiece
    cost a whole model's fixed cost per prompt)."""
    room, pack = PIECE, []
    for k, n in enumerate(lengths):
        if done[k] < n and room > 0 and len(pack) < max_seqs:
            take = min(n - done[k], room)
            pack.append((k, done[k], done[k] + take))
            done[k] += take
            room -= take
    return pack


def _state_bytes(state: SequenceState) -> int:
    """What one sequence's state holds on the device (its linear states, conv tails, keys and values)."""
    tensors = [*state.linear.values(), *state.conv.values(),
               *(t for kv in state.kv.values() for t in (kv.keys, kv.values))]
    return sum(t.numel() * t.element_size() for t in tensors)


def score_prompts(model: HybridLM, device: torch.device, prompts: list[list[int]], tops: list[int], *,
                  lock: threading.Lock | threading.RLock | None = None,
                  stop: Callable[[], str | None] | None = None) -> list[Rows]:
    """``score_prompt`` for each of ``prompts`` (its own ``top``), packed together into forwards of
    at most ``PIECE`` tokens: each prompt is its own sequence in them, its state carried from one
    forward to the next."""
    return score_with_first(model, device, prompts, tops, lock=lock, stop=stop).rows


@torch.no_grad()
def score_with_first(model: HybridLM, device: torch.device, prompts: list[list[int]], tops: list[int], *,
                     first: list[bool] | None = None, lock: threading.Lock | threading.RLock | None = None,
                     stop: Callable[[], str | None] | None = None) -> Scored:
    """``score_prompts``, and the first-token logits of each prompt ``first`` marks (one flag per
    prompt; None: none), read off the last row of its last piece. Prompts that share a long prefix
    (``shared_prefixes``) have it scored once."""
    _check(model, prompts, tops)
    first = [False] * len(prompts) if first is None else first
    if len(first) != len(prompts):
        raise ValueError(f"first: expected one flag per prompt ({len(prompts)}), got {len(first)}")
    if not prompts:
        return Scored([], [], [])
    # on a GPU a forward's fixed cost rules at these sizes: sharing adds forwards (the prefixes', then
    # the members' short tails, at most a state budget's worth of sequences each) and measured 0.68–0.92×
    # of scoring every prompt whole at the 9B shape (contexts of 100–400 tokens); on the CPU it halves
    groups = shared_prefixes(prompts) if device.type != "cuda" else []
    if not groups:
        return _run(model, device, prompts, tops, first, lock=lock, stop=stop)[0]
    out = Scored([[] for _ in prompts], [None] * len(prompts), [[] for _ in prompts])
    grouped = {k for _, members in groups for k in members}
    alone = [k for k in range(len(prompts)) if k not in grouped]
    if alone:
        _place(out, alone, _run(model, device, [prompts[k] for k in alone], [tops[k] for k in alone],
                                [first[k] for k in alone], lock=lock, stop=stop)[0])
    for w in range(0, len(groups), WAVE):  # a wave's prefix states are held until its members start
        wave = groups[w:w + WAVE]
        # the prefixes, each once (as many alternatives as its members ask), their states kept
        heads, kept = _run(model, device, [prompts[m[0]][:n] for n, m in wave],
                           [max(tops[k] for k in m) for _, m in wave], [True] * len(wave), keep=True,
                           lock=lock, stop=stop)
        members = [k for _, m in wave for k in m]
        starts = [_fork(kept[g]) for g, (_, m) in enumerate(wave) for _ in m]
        tails = _run(model, device, [prompts[k][n:] for n, m in wave for k in m], [tops[k] for k in members],
                     [first[k] for k in members], starts=starts, lock=lock, stop=stop)[0]
        del kept, starts
        at = 0
        for g, (n, m) in enumerate(wave):
            logp = heads.first_logits[g].float().log_softmax(-1)  # the row after the prefix: each member's own
            for k in m:
                token = prompts[k][n]
                top = logp.topk(tops[k]) if tops[k] else None
                row = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                row[token] = float(logp[token])
                out.rows[k] = [*_rows(heads.rows[g], prompts[k][:n], tops[k]), row, *tails.rows[at][1:]]
                out.ranks[k] = [*heads.ranks[g], int((logp > logp[token]).sum()) + 1, *tails.ranks[at][1:]]
                out.first_logits[k] = tails.first_logits[at]
                at += 1
    return out


def shared_prefixes(prompts: list[list[int]]) -> list[tuple[int, list[int]]]:
    """Groups of prompts whose common prefix is worth scoring once — a harness's options of one
    question (lm-eval's multiple choice: one context, several continuations) — as (prefix length,
    prompts): at least two prompts sharing at least ``SHARED_MIN`` tokens, each with a token of its
    own after them. Prompts sorted by their tokens sit beside those they share most with; a run of
    them grows while the tokens it saves do not shrink."""
    order = sorted(range(len(prompts)), key=lambda k: prompts[k])
    groups: list[tuple[int, list[int]]] = []
    shared, run = 0, [order[0]]
    for a, b in zip(order, order[1:], strict=False):
        common = min(_common(prompts[a], prompts[b]), len(prompts[a]) - 1, len(prompts[b]) - 1)
        grown = common if len(run) == 1 else min(shared, common)
        if grown >= SHARED_MIN and grown * len(run) >= shared * (len(run) - 1):
            shared, run = grown, [*run, b]
            continue
        if len(run) > 1:
            groups.append((shared, run))
        shared, run = 0, [b]
    if len(run) > 1:
        groups.append((shared, run))
    return groups


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _fork(state: SequenceState) -> Callable[[], SequenceState]:
    """A copy of ``state`` made when it is first needed (a wave's members do not all hold one at once)."""
    return lambda: SequenceState({k: v.clone() for k, v in state.linear.items()},
                                 {k: v.clone() for k, v in state.conv.items()},
                                 {k: v.clone() for k, v in state.kv.items()}, state.length)


def _rows(rows: Rows, ids: list[int], top: int) -> Rows:
    """A shared prefix's rows (scored for its members' largest ``top``) cut to one member's ``top``."""
    return [None if r is None else {**dict(sorted(r.items(), key=lambda kv: -kv[1])[:top]), t: r[t]}
            for t, r in zip(ids, rows, strict=True)]


def _place(out: Scored, where: list[int], part: Scored) -> None:
    for k, rows, logits, ranks in zip(where, part.rows, part.first_logits, part.ranks or [], strict=True):
        out.rows[k], out.first_logits[k], out.ranks[k] = rows, logits, ranks


def _run(model: HybridLM, device: torch.device, prompts: list[list[int]], tops: list[int], first: list[bool], *,
         starts: list[Callable[[], SequenceState]] | None = None, keep: bool = False,
         lock: threading.Lock | threading.RLock | None = None,
         stop: Callable[[], str | None] | None = None) -> tuple[Scored, list[SequenceState | None]]:
    """The packed forwards: each prompt from its ``starts`` state (made when its first piece is packed;
    its first token's row is then not this call's to give) or from nothing; with ``keep``, each
    prompt's state at its end is returned too."""
    firsts: list[torch.Tensor | None] = [None] * len(prompts)
    states: list[SequenceState | None] = [None] * len(prompts)
    finals: list[SequenceState | None] = [None] * len(prompts)
    pending = list(starts) if starts is not None else [SequenceState] * len(prompts)
    out: list[Rows] = [[None] for _ in prompts]
    ranks: list[list[int | None]] = [[None] for _ in prompts]
    rows = max(1, min(ROWS, CHUNK_BYTES // (4 * model.vocab_size)))
    most = max(tops)
    lengths, done = [len(p) for p in prompts], [0] * len(prompts)
    # a forward's sequences each hold a whole state (48 MiB at the 9B shape): as many as STATE_BYTES
    # of them, once the first forward has shown one's size
    max_seqs, sized = FIRST_SEQS, False
    while pack := _next_pack(lengths, done, max_seqs):
        reason = stop() if stop is not None else None
        if reason is not None:
            raise ScoringStopped(reason)
        # per scored row (a token whose next one is in its prompt): where it is, what follows, whose
        where, nxt, whose = [], [], []
        offset = 0
        for k, a, b in pack:
            scored = min(b, len(prompts[k]) - 1) - a
            where += range(offset, offset + scored)
            nxt += prompts[k][a + 1:a + 1 + scored]
            whose += [k] * scored
            offset += b - a
        with lock if lock is not None else contextlib.nullcontext():
            for k, a, _ in pack:
                if a == 0:  # its first piece: its state now
                    states[k], pending[k] = pending[k](), None
            ctx = SequenceContext([states[k] for k, _, _ in pack], [b - a for _, a, b in pack], device)
            hidden = model.hidden_states(to_device([t for k, a, b in pack for t in prompts[k][a:b]], device), ctx)
            ctx.finish()
            if not sized:
                max_seqs, sized = max(1, STATE_BYTES // max(1, _state_bytes(states[pack[0][0]]))), True
            ends, offset = [], 0  # the prompts asking whose last token this forward holds, and its row
            for k, a, b in pack:
                offset += b - a
                if b == len(prompts[k]):
                    finals[k] = states[k] if keep else None
                    states[k] = None  # scored whole: its state is not needed any more (unless kept)
                    if first[k]:
                        ends.append((k, offset - 1))
            for a in range(0, len(ends), rows):
                part = ends[a:a + rows]
                # kept as the head gives them: a harness's round holds hundreds of prompts (0.5 MiB each in
                # bf16 at a 248k vocabulary); a copy to the host and back cost 1.6 ms a prompt at the 9B shape
                logits = model.lm_head(hidden[to_device([row for _, row in part], device)])
                for (k, _), row in zip(part, logits, strict=True):
                    firsts[k] = row
            at, nxt_d = to_device(where, device), to_device(nxt, device)
            for a in range(0, len(where), rows):
                b = min(a + rows, len(where))
                # gathered and ranked where the logits are: only [rows × (1 + top)] numbers leave the device
                logp = model.lm_head(hidden[at[a:b]]).float().log_softmax(-1)
                gathered = logp.gather(1, nxt_d[a:b, None])
                rank = ((logp > gathered).sum(-1) + 1).tolist()
                actual = gathered[:, 0].tolist()
                values, indices = (logp.topk(most, dim=-1) if most else (logp[:, :0], logp[:, :0].long()))
                for k, token, lp, r, vs, ix in zip(whose[a:b], nxt[a:b], actual, rank, values.tolist(),
                                                   indices.tolist(), strict=True):
                    row = dict(zip(ix[:tops[k]], vs[:tops[k]], strict=True))
                    row[token] = lp
                    out[k].append(row)
                    ranks[k].append(r)
    return Scored(out, firsts, ranks), finals
