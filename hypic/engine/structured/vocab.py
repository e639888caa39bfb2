"""The vocabulary as bytes, in a trie: which tokens may come next in a structured output.

Each step of a constrained request asks which tokens keep the text inside the grammar. Walking the
trie of the tokens' bytes with the matcher prunes a whole subtree at its first refused byte, so a
step costs what the *allowed* prefixes cost, not the vocabulary. The answer depends only on the
matcher's state, and states recur (inside a string, after a comma), so it is memoized per state.

Token bytes come from the tokenizer's decoder: byte-level BPE (GPT-2's printable stand-ins for the
256 bytes; Qwen's and the bundled tokenizer's kind), SentencePiece-style ``▁`` for spaces and
``<0xNN>`` byte fallbacks, else the token's own decoding. Special tokens are never part of a JSON
text; the end-of-sequence tokens are allowed by the constraint itself, once the value is whole.
Each other special or added token is also spelled by its *marks* (``token_marks``): the bytes a
structural tag's token-level formats name it by, which no text holds, in a trie of their own.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
import threading
import weakref
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from hypic.engine.sampling import token_mask
from hypic.engine.structured.matcher import (
    State,
    accepting,
    advance,
    advance_bytes,
    char_loop,
    finished,
    free_string_room,
    free_text_loop,
    start,
    string_loop,
)
from hypic.engine.structured.schema import Node
from hypic.engine.structured.tags import MARK_BYTES, token_mark

MEMO_IDS = 1 << 24  # token ids the memo holds at most (128 MiB): a free string's set is the vocabulary
MASK_BYTES = 64 << 20  # the device masks memoized at most (≈ 440 states at a 151 936-token vocabulary)
# Constraints (a compiled schema, pattern, choice, grammar or tag set) whose states the memo keeps at
# once, the least recently used out with their masks. A memoized state holds its constraint's root,
# and through it the compiled nodes and a pattern's automaton with its own step memo (≈ 0.3 MB at the
# bundled vocabulary, up to ≈ 17 MB at 150 000 tokens): without a bound, every distinct constraint a
# server ever met stayed alive past the compile caches' own bounds (a regex per request: 360 KB a
# request, linearly, on the bundled model).
MEMO_ROOTS = 64


def _root_of(state: State) -> object:
    """The constraint a state belongs to: the bottom frame of its stacks (every state of one
    constraint shares it: ``matcher.start``)."""
    stack = state.alts[0][0]
    while stack[2] is not None:
        stack = stack[2]
    return stack[0]


class _Memo:
    """One constraint's memoized states: the ids each allows, and the device masks made of them."""

    __slots__ = ("ids", "masks", "size")

    def __init__(self) -> None:
        self.ids: dict[State, torch.Tensor] = {}
        self.masks: set[tuple] = set()  # its keys of ``TokenVocab._masks``
        self.size = 0  # token ids held


def _byte_stand_ins() -> dict[str, int]:
    """Byte-level BPE's printable character for each byte → the byte: printable Latin-1 bytes stand
    for themselves, the other 68 for the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in out.values():
            out[chr(256 + extra)] = b
            extra += 1
    return out


_TOKEN_BYTES: weakref.WeakKeyDictionary[Any, dict[int, bytes]] = weakref.WeakKeyDictionary()


def token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """Token id → the bytes it adds to the text, for every token that is not special. Read once per
    tokenizer (the whole vocabulary): structured output's trie and log-probabilities' names share it.
    Not to be changed by its readers."""
    got = _TOKEN_BYTES.get(tokenizer)
    if got is None:
        got = _TOKEN_BYTES[tokenizer] = _read_token_bytes(tokenizer)
    return got


def _read_token_bytes(tokenizer: Any) -> dict[int, bytes]:
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    stand_ins = _byte_stand_ins() if "ByteLevel" in kinds else None
    out: dict[int, bytes] = {}
    for text, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i in special:
            continue
        if stand_ins is not None and all(c in stand_ins for c in text):
            out[i] = bytes(stand_ins[c] for c in text)
        elif "ByteFallback" in kinds and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            out[i] = bytes([int(text[3:5], 16)])
        elif "Metaspace" in kinds or "Replace" in kinds:
            out[i] = text.replace("\u2581", " ").encode()
        else:
            decoded = tokenizer.decode([i], skip_special_tokens=False)
            if decoded and "\ufffd" not in decoded:
                out[i] = decoded.encode()
    return out


def token_marks(tokenizer: Any, eos: set[int] | frozenset[int] = frozenset()) -> dict[int, tuple[bytes, bytes]]:
    """Each special or added token but the end-of-sequence ones → its marks, by its text and by its
    id (``tags.token_mark``): how a token-level format names it. The answer's end is the
    constraint's own (``JsonConstraint``), not a token a format may place."""
    return {i: (token_mark(t.content, "token"), token_mark(i, "token"))
            for i, t in tokenizer.get_added_tokens_decoder().items() if t.content and i not in eos}


# pattern loops whose tokens are kept: each a list of ids and a trie of the other tokens (sharing
# the vocabulary trie's subtrees: a few MB at a 150 000-token vocabulary) — a few loops recur
INSIDE_SETS = 4


class _Inside(NamedTuple):
    tokens: ByLength  # plain tokens of a loop's characters only
    others: _Trie  # every other token


class _Trie:
    __slots__ = ("children", "ids", "n")

    def __init__(self) -> None:
        self.children: dict[int, _Trie] = {}
        self.ids: list[int] = []
        self.n = 0  # the tokens in this subtree


def _trie(pieces: dict[int, bytes], ids: list[int]) -> _Trie:
    return _trie_of((i, pieces[i]) for i in ids)


def _trie_of(spellings) -> _Trie:  # (id, bytes) pairs: a token may have more than one
    root = _Trie()
    for i, data in spellings:
        node = root
        node.n += 1
        for b in data:
            child = node.children.get(b)
            if child is None:  # (not setdefault: that builds a node for every byte of every token)
                child = node.children[b] = _Trie()
            node = child
            node.n += 1
        node.ids.append(i)
    return root


def _without(root: _Trie, pieces: dict[int, bytes], tokens: list[int], drop: list[int]) -> _Trie:
    """The trie of ``tokens`` (``root``'s) but ``drop``: built afresh when the kept tokens have fewer
    bytes than the dropped; else from ``root``, copying only the nodes above both a dropped token
    and a kept one — a subtree holding none of the dropped is shared, one holding only dropped tokens
    left out. (Built afresh, a URL loop's trie of the other tokens was ≈ 600 000 new nodes, 1.5 s
    and ≈ 100 MB at a 150 000-token vocabulary; the copied nodes are a few per cent of that.)"""
    gone = set(drop)
    kept = [i for i in tokens if i not in gone]
    if sum(len(pieces[i]) for i in kept) <= sum(len(pieces[i]) for i in drop):
        return _trie(pieces, kept)
    under: dict[int, int] = {}  # id(node) → the dropped tokens in its subtree
    for i in drop:
        node = root
        under[id(node)] = under.get(id(node), 0) + 1
        for b in pieces[i]:
            node = node.children[b]
            under[id(node)] = under.get(id(node), 0) + 1
    out = _Trie()
    todo = [(root, out)]
    while todo:  # (a stack, not recursion: a token may be hundreds of bytes long)
        node, copy = todo.pop()
        copy.ids = [i for i in node.ids if i not in gone] if node.ids else []
        copy.n = node.n - under.get(id(node), 0)
        for b, child in node.children.items():
            k = under.get(id(child), 0)
            if k == 0:
                copy.children[b] = child
            elif k < child.n:
                copy.children[b] = _Trie()
                todo.append((child, copy.children[b]))
    return out


class ByLength(NamedTuple):
    """Plain tokens ordered by their length in characters: the first ``upto[n]`` are n or fewer."""

    ids: torch.Tensor
    upto: list[int]
    lengths: list[int]  # each token's, in that order

    @staticmethod
    def of(pieces: dict[int, bytes], ids: list[int]) -> ByLength:
        ids = sorted(ids, key=lambda i: (len(pieces[i].decode()), i))
        return ByLength._made(ids, [len(pieces[i].decode()) for i in ids])

    @staticmethod
    def _made(ids: list[int], lengths: list[int]) -> ByLength:
        return ByLength(torch.tensor(ids, dtype=torch.long),
                        [bisect.bisect_right(lengths, n) for n in range(max(lengths, default=0) + 1)], lengths)

    def take(self, keep: list[int]) -> ByLength:
        """The tokens at positions ``keep`` (ascending): still in order, nothing decoded or sorted again."""
        ids = self.ids.tolist()
        return ByLength._made([ids[k] for k in keep], [self.lengths[k] for k in keep])

    def upto_length(self, n: int) -> torch.Tensor:
        """The tokens of at most ``n`` characters."""
        return self.ids[:self.upto[min(n, len(self.upto) - 1)]] if n > 0 and self.upto else self.ids[:0]


SMALL_SET = 1 << 16  # code points: a class (or its complement) this small is tested as a set


@functools.lru_cache(maxsize=64)
def _ascii_left_out(chars: tuple[tuple[int, int], ...]) -> bytes | None:
    """The characters a class leaves out, as bytes, when they are all ASCII (b"": none); else None."""
    out, at = bytearray(), 0
    for lo, hi in sorted(chars):
        if lo > at:
            if lo > 0x80:
                return None
            out += bytes(range(at, lo))
        at = max(at, hi + 1)
    return bytes(out) if at >= 0x110000 else None


def _all_within(text: str, chars: tuple[tuple[int, int], ...]) -> bool:
    """Whether every character of ``text`` is in ``chars`` (ranges of code points): a set test when
    the class or its complement is small (a URL's characters; ``.``'s few exclusions), else a search."""
    return _class_test(chars)(text)


@functools.lru_cache(maxsize=64)
def _class_test(chars: tuple[tuple[int, int], ...]):  # -> Callable[[str], bool]
    size = sum(hi - lo + 1 for lo, hi in chars)
    if size <= SMALL_SET:
        inside = frozenset(chr(c) for lo, hi in chars for c in range(lo, hi + 1) if not 0xD800 <= c <= 0xDFFF)
        return lambda text: inside.issuperset(text)
    if 0x110000 - size <= SMALL_SET:
        kept, out, at = sorted(chars), [], 0
        for lo, hi in kept:
            out += range(at, lo)
            at = hi + 1
        outside = frozenset(chr(c) for c in (*out, *range(at, 0x110000)) if not 0xD800 <= c <= 0xDFFF)
        return lambda text: outside.isdisjoint(text)
    starts = [lo for lo, _ in chars]

    def search(text: str) -> bool:
        for c in text:
            k = bisect.bisect_right(starts, ord(c)) - 1
            if k < 0 or ord(c) > chars[k][1]:
                return False
        return True
    return search


def _plain(data: bytes) -> bool:
    """Whether a token is text any JSON string may hold as it is: whole UTF-8 characters, no quote,
    backslash or control character."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return False
    return bool(text) and '"' not in text and "\\" not in text and min(text) >= " "


class TokenVocab:
    """The vocabulary's bytes in a trie, with the allowed tokens memoized per matcher state.

    Inside a string without a pattern — most of a JSON text's tokens, and the one place where
    almost every token is allowed — the walk would visit the whole trie. There every *plain* token
    (``_plain``) no longer than the string's room (maxLength) is allowed, so they are taken from one
    precomputed list, ordered by length, and only the others (``rest``: tokens holding a quote, a
    backslash, a control byte or part of a character) are walked (a maxLength string's every
    character is a new state: walking all cost seconds a token at a 150 000-token vocabulary).
    Inside a patterned string at a loop of its pattern (``.*``, a URL's path) the same holds for
    the plain tokens of the loop's characters (``_inside``: a list of them and a trie of the others,
    built once per loop)."""

    def __init__(self, pieces: dict[int, bytes], marks: dict[int, tuple[bytes, ...]] | None = None) -> None:
        # A token holding byte 0xFE or 0xFF (byte-level BPE's single-byte tokens) is no text's — no
        # UTF-8 holds those bytes — but it could spell a mark (``tags.MARK_BYTES``) byte by byte:
        # left out, so that a mark is written by its token alone.
        if any(MARK_BYTES[0] in d or MARK_BYTES[1] in d for d in pieces.values()):
            pieces = {i: d for i, d in pieces.items() if MARK_BYTES[0] not in d and MARK_BYTES[1] not in d}
        self.pieces = pieces
        self.id_bound = 1 + max([*pieces, *(marks or {})], default=-1)  # past every token id
        # special and added tokens' marks (``token_marks``), walked in a trie of their own: few, and
        # refused at their first byte everywhere but where a token-level format names one
        self.marks = marks or {}
        self.marked = {m: i for i, ms in self.marks.items() for m in ms}
        self.mark_trie = _trie_of((i, m) for i, ms in self.marks.items() for m in ms)
        tokens = [i for i, data in pieces.items() if data]
        plain = [i for i in tokens if _plain(pieces[i])]
        self.root = _trie(pieces, tokens)
        self.tokens = tokens
        self.rest = _without(self.root, pieces, tokens, plain)
        self.rest_ids = sorted(set(tokens) - set(plain))
        self.plain = ByLength.of(pieces, plain)
        missing = [chr(b) for b in b' "{}[]:,-.0123456789abcdefghijklmnopqrstuvwxyz' if b not in self.root.children]
        if missing:
            raise ValueError(f"json_schema: this tokenizer has no token for {missing[0]!r}, so it cannot spell "
                             "every JSON text; structured output is unavailable for this model")
        self._memo: OrderedDict[object, _Memo] = OrderedDict()  # a constraint's root → its states
        self._memo_ids = 0
        self.memo_hits = self.memo_misses = 0
        # (state, eos, size, device) → mask, least recently used first; each key also in its root's _Memo
        self._masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._insides: OrderedDict[tuple, _Inside] = OrderedDict()  # a pattern loop's characters → its tokens
        # the memos are read and changed under this lock; a walk runs outside it, so a constraint's
        # first mask may be made on a request's own thread (``Engine.warm_constraints``) while the
        # serving loop reads others' masks (two threads walking one state do the same work twice)
        self._lock = threading.RLock()

    def _inside(self, chars: tuple[tuple[int, int], ...]) -> _Inside:
        """The plain tokens all of whose characters are in ``chars`` (a pattern's loop: they keep it
        where it is), by length, and a trie of every other token — built once per set of characters
        (a few per pattern), the least recently used of ``INSIDE_SETS`` kept."""
        with self._lock:
            got = self._insides.get(chars)
            if got is not None:
                self._insides.move_to_end(chars)
                return got
        # built outside the lock (it reads the vocabulary's trie, never changes it): up to a second
        # at a 150 000-token vocabulary, which the serving loop must not wait for
        ids = self.plain.ids.tolist()
        left_out = _ascii_left_out(chars)
        if left_out == b"":  # every character (token-level free text): every plain token
            made = _Inside(self.plain, self.rest)
        else:
            if left_out is not None:  # a few ASCII characters left out (free text's triggers): a bytes search
                holds = re.compile(b"[" + re.escape(left_out) + b"]").search
                keep = [k for k, i in enumerate(ids) if not holds(self.pieces[i])]
            else:
                keep = [k for k, i in enumerate(ids) if _all_within(self.pieces[i].decode(), chars)]
            inside = self.plain.take(keep)
            kept = set(keep)
            outside = [i for k, i in enumerate(ids) if k not in kept]
            # the other tokens' trie: built afresh when they are few, else from the vocabulary's
            others = _trie(self.pieces, self.rest_ids + outside) if len(self.rest_ids) + len(outside) <= len(keep) \
                else _without(self.root, self.pieces, self.tokens, inside.ids.tolist())
            made = _Inside(inside, others)
        with self._lock:
            got = self._insides.setdefault(chars, made)
            while len(self._insides) > INSIDE_SETS:
                self._insides.popitem(last=False)
        return got

    def check_tokens(self, tokens: list[object], where: str = "structural_tag") -> None:
        """ValueError naming the first of ``tokens`` (a token-level format's texts or ids) that is not
        a special or added token of this vocabulary: a mark no token writes would leave the answer
        nowhere to go."""
        for t in tokens:
            if token_mark(t, where) not in self.marked:
                raise ValueError(f"{where}: token {t!r} is not a special or added token of this model's tokenizer "
                                 "(or is its end of sequence); a token format names one of those — write text "
                                 "as a const_string")

    def clear_memo(self) -> None:
        with self._lock:
            self._memo.clear()
            self._memo_ids = 0
            self._masks.clear()

    @property
    def memo_roots(self) -> int:
        """Constraints whose states are memoized now (at most ``MEMO_ROOTS``)."""
        return len(self._memo)

    def _group(self, state: State) -> _Memo:
        """The memo of ``state``'s constraint, made the most recently used (made if new; the least
        recently used constraints out past ``MEMO_ROOTS``)."""
        root = _root_of(state)
        group = self._memo.get(root)
        if group is not None:
            self._memo.move_to_end(root)
            return group
        group = self._memo[root] = _Memo()
        while len(self._memo) > MEMO_ROOTS:
            self._drop_oldest()
        return group

    def _drop_oldest(self) -> None:
        _, group = self._memo.popitem(last=False)
        self._memo_ids -= group.size
        for key in group.masks:
            self._masks.pop(key, None)

    def mask(self, state: State, eos: tuple[int, ...], size: int, device: torch.device) -> torch.Tensor:
        """``allowed(state)`` and ``eos`` as a [size] boolean mask on ``device``, memoized (least
        recently used out past MASK_BYTES): a decode step reads it where it lies instead of copying
        the ids there every step (inside a string, nearly the whole vocabulary: 1.2 MB a row)."""
        key = (state, eos, size, str(device))
        with self._lock:
            got = self._masks.get(key)
            if got is not None:
                self._masks.move_to_end(key)
                self._group(state)  # its constraint recently used too
                return got
        ids = self.allowed(state)
        if eos:
            ids = torch.cat([ids, torch.tensor(eos, dtype=torch.long)])
        got = token_mask(ids, size, device)
        with self._lock:
            self._masks[key] = got
            self._group(state).masks.add(key)
            while len(self._masks) * size > MASK_BYTES and len(self._masks) > 1:
                old, _ = self._masks.popitem(last=False)
                group = self._memo.get(_root_of(old[0]))
                if group is not None:
                    group.masks.discard(old)
        return got

    def allowed(self, state: State) -> torch.Tensor:
        """Ids of the tokens whose bytes the matcher reads from ``state`` (CPU, int64)."""
        with self._lock:
            got = self._group(state).ids.get(state)
            if got is not None:
                self.memo_hits += 1
                return got
            self.memo_misses += 1
        ids: list[int] = []
        room = free_string_room(state)
        trie, taken = self.root, None  # the tokens walked; the ones taken as a list
        if room is not None:
            trie, taken = self.rest, self.plain.upto_length(room)
        elif (loop := string_loop(state) or char_loop(state) or free_text_loop(state)) is not None:
            # a pattern's loop, a grammar's, or structural tags' free text
            inside = self._inside(loop[0])
            trie, taken = inside.others, inside.tokens.upto_length(loop[1])
        # the walk meets few distinct states (inside a loop, one per depth at most), so each state is
        # numbered and advanced at most once per byte: ``advance`` costs microseconds, the lookup
        # a tenth of that (a pattern's first state walked nearly the whole trie: 3.5 s at 150 000)
        known, seen, steps = {state: 0}, [state], {}
        todo = [(trie, 0), (self.mark_trie, 0)]
        while todo:
            node, k = todo.pop()
            for b, child in node.children.items():
                j = steps.get(key := k << 8 | b)
                if j is None:
                    nxt = advance(seen[k], b)
                    j = -1 if nxt is None else known.setdefault(nxt, len(seen))
                    if j == len(seen):
                        seen.append(nxt)
                    steps[key] = j
                if j >= 0:
                    ids += child.ids
                    if child.children:
                        todo.append((child, j))
        if taken is not None and len(taken):
            # the list taken (nearly the vocabulary inside a string, in length order) joined by a boolean
            # row: ≈ 0.2 ms at 151 000 tokens where concatenating and sorting took ≈ 2 ms
            row = torch.zeros(self.id_bound, dtype=torch.bool)
            row[taken] = True
            if ids:
                row[torch.tensor(ids, dtype=torch.long)] = True
            got = row.nonzero().squeeze(1)
        else:
            got = torch.tensor(sorted(set(ids) if self.marks else ids), dtype=torch.long)  # (by text and id: once)
        with self._lock:
            group = self._group(state)  # (again: the walk may have outlasted its place in the memo)
            if state in group.ids:  # walked meanwhile on another thread
                return group.ids[state]
            # full: the least recently used constraints out, this one's states too if it alone fills it
            while self._memo_ids + len(got) > MEMO_IDS and self._memo:
                if next(iter(self._memo.values())) is group:
                    self._memo_ids -= group.size
                    group.ids.clear()
                    group.size = 0
                    break
                self._drop_oldest()
            group.ids[state] = got
            group.size += len(got)
            self._memo_ids += len(got)
        return got


class JsonConstraint:
    """One request's structured output: the tokens allowed next, and the text read so far."""

    def __init__(self, vocab: TokenVocab, node: Node, eos: set[int]) -> None:
        self.vocab, self.state, self.eos = vocab, start(node), eos
        self.finished = False

    def allowed(self) -> torch.Tensor:
        """Ids allowed next (CPU): tokens that keep the text a prefix of an accepted value, and the
        end-of-sequence tokens once it is a whole one. Empty only when nothing can follow."""
        ids = self.vocab.allowed(self.state)
        if self.eos and accepting(self.state):
            ids = torch.cat([ids, torch.tensor(sorted(self.eos), dtype=torch.long)])
        return ids

    def allowed_mask(self, size: int, device: torch.device) -> torch.Tensor:
        """What ``allowed`` holds as a [size] boolean mask on ``device`` (memoized per state); an
        empty id tensor when nothing can follow (told on the host: the draw is then left free)."""
        eos = tuple(sorted(self.eos)) if self.eos and accepting(self.state) else ()
        if not eos and not len(self.vocab.allowed(self.state)):
            return torch.empty(0, dtype=torch.long)
        return self.vocab.mask(self.state, eos, size, device)

    def accept(self, token: int) -> bool:
        """Read a drawn token; False when it does not fit (the caller ends the output before it)."""
        if token in self.eos:
            return accepting(self.state)
        data = self.vocab.pieces.get(token)
        nxt = None if data is None else advance_bytes(self.state, data)
        for mark in self.vocab.marks.get(token, ()) if nxt is None else ():  # a token-level format's token
            nxt = advance_bytes(self.state, mark)
            if nxt is not None:
                break
        if nxt is None:
            return False
        self.state = nxt
        self.finished = finished(nxt)
        return True
