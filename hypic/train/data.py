"""Training batches from the task suite: packed varlen sequences with a curriculum.

A training sequence is the prompt as the engine sees it (segments tokenized on their own, then
concatenated) followed by the answer and ``<|end|>``, then (``extra``) more questions about the
same documents with their answers: one question per few thousand document tokens is too sparse a
signal for retrieval (a first run reached 90% teacher-forced answer tokens but exact answers to
single-hop questions only 1 in 3). Loss weights: 1 on the answer tokens,
``doc_weight`` on everything else (a little language modelling keeps the model reading). The
curriculum raises the difficulty (document count and length) with the step; easier examples stay
in the mix. Examples are generated on the fly by worker processes.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing as mp
import random
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from hypic.eval.tasks import FAMILIES, Example, generate
from hypic.eval.tokenizer import END, encode_example


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T]
    labels: torch.Tensor  # [T] next token
    weights: torch.Tensor  # [T] loss weight per position
    lengths: list[int]  # one per sequence
    answer_tokens: int
    segments: list[list[int]]  # per sequence: head, documents, then everything from the query on
    # [T] True where a label is an answer's first token: the retrieval decision (the rest of an
    # answer mostly follows from it, so token accuracy overstates how often answers are right)
    first: torch.Tensor


def difficulty_at(step: int, ramp_steps: int) -> float:
    return min(1.0, step / max(1, ramp_steps))


# One training sequence as it crosses the worker boundary: token ids, a 0/1 mark on every token the
# model must produce (answers and their end markers), and the lengths of the prompt's segments
# before the query (head, documents), which the standalone pass (``hypic.train.pic``) cuts at.
Item = tuple[np.ndarray, np.ndarray, np.ndarray]


def encode_item(tok: Tokenizer, ex: Example, extra: int, extra_multi: int = 0) -> Item:
    """The prompt, the answer, then up to ``extra`` more single-hop and ``extra_multi`` two-hop
    questions about the same documents with their answers (alternating while both last): each
    query tokenized as its own segment, as the engine would see it."""
    enc = encode_example(tok, ex)
    end = tok.token_to_id(END)
    spans = [(ids, 0) for ids in enc.segments] + [(enc.target, 1)]  # (token ids, produced by the model)
    for query, answer in _alternate(list(ex.extra[:extra]), list(ex.extra_multi[:extra_multi])):
        spans += [(tok.encode(query, add_special_tokens=False).ids, 0),
                  (tok.encode(answer, add_special_tokens=False).ids + [end], 1)]
    tokens = np.concatenate([np.asarray(ids, np.int32) for ids, _ in spans])
    marks = np.concatenate([np.full(len(ids), m, np.uint8) for ids, m in spans])
    return tokens, marks, np.asarray([len(s) for s in enc.segments[:-1]], np.int32)


def _alternate(a: list, b: list) -> list:
    out = [x for pair in zip(a, b, strict=False) for x in pair]
    n = min(len(a), len(b))
    return out + a[n:] + b[n:]


EASY_MAX = 0.25  # the top of the easy share's difficulty range: up to 10 documents of up to 152 tokens


def sequences(tok_json: str, seed: int, max_difficulty: float, count: int, families: tuple[str, ...],
              max_tokens: int, extra: int = 0, extra_multi: int = 0,
              weights: tuple[float, ...] | None = None, easy_share: float = 0.0,
              easy_max: float = EASY_MAX) -> list[Item]:
    """``count`` training items; difficulty drawn in [0, max_difficulty] with density rising linearly
    (max · √u): easy examples keep appearing, but the long many-document ones the evaluation uses
    (difficulty 1) get twice the weight of the middle of the range. ``easy_share`` of the items
    instead draw their difficulty uniformly from [0, ``easy_max``]: short prompts teach a lookup in a
    few hundred steps that long ones did not teach in thousands (docs/training.md, session 5).
    Arrays, not lists: they cross the process boundary and become tensors cheaply."""
    tok = Tokenizer.from_str(tok_json)
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        family = rng.choice(families) if weights is None else rng.choices(families, weights)[0]
        if easy_share > 0 and rng.random() < easy_share:  # no draw at 0: earlier runs' streams stay as they were
            difficulty = min(max_difficulty, easy_max) * rng.random()
        else:
            difficulty = max_difficulty * math.sqrt(rng.random())
        ex = generate(family, 1, rng.randrange(2**31), difficulty=difficulty)[0]
        item = encode_item(tok, ex, extra, extra_multi)
        if len(item[0]) <= max_tokens:
            out.append(item)
    return out


def pack(items: list[Item], doc_weight: float) -> Batch:
    ids, labels, weights, lengths, segments, firsts, answers = [], [], [], [], [], [], 0
    for tokens, answer, segs in items:
        t = torch.as_tensor(tokens).long()
        ids.append(t[:-1])
        labels.append(t[1:])
        # position i predicts token i + 1: its weight is 1 when token i + 1 is to be produced
        w = torch.full((len(tokens) - 1,), doc_weight)
        mark = torch.as_tensor(answer).bool()
        w[mark[1:]] = 1.0
        weights.append(w)
        firsts.append(mark[1:] & ~mark[:-1])
        lengths.append(len(tokens) - 1)
        segs = [int(n) for n in segs]
        segments.append([*segs, len(tokens) - 1 - sum(segs)])  # the last: query onward, minus the final token
        answers += int(answer.sum())
    return Batch(torch.cat(ids), torch.cat(labels), torch.cat(weights), lengths, answers, segments, torch.cat(firsts))


# Lots of examples requested ahead of the one being consumed. A lot's difficulty is the curriculum's
# at the step it is requested, so this is part of the stream's definition: it was max(4, 2 * workers),
# and during the ramp the same checkpoint and flags drew other examples at another --workers (a
# throughput setting). 32 keeps up to 16 workers busy; past the ramp (difficulty 1) it changes nothing.
AHEAD = 32


def job_seed(seed: int, start: int, job: int) -> int:
    """The seed of the ``job``-th lot of examples of a stream that served its first batch at step
    ``start``. The start is part of it because a resumed run restarts its job count at 0: seeded by
    (seed, job) alone, every resumed run drew its predecessors' examples again in the same order
    (runs 12, 14 and 15 trained on one set of examples; docs/training.md, session 8). Two runs from
    the same checkpoint still draw the same examples, whatever their ``--workers`` (``AHEAD``)."""
    digest = hashlib.blake2b(f"{seed}/{start}/{job}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Stream:
    """Batches of about ``batch_tokens`` tokens from a pool of worker processes.

    Examples are pooled (``pool_batches`` batches' worth), sorted by length and cut into batches of
    neighbours, which then come out in shuffled order: a batch holds similar lengths, so the chunked
    kernel pads little (a batch spanning short and long examples was measured 3× padded).
    """

    def __init__(self, tokenizer: Tokenizer, *, batch_tokens: int, seed: int, ramp_steps: int, doc_weight: float,
                 workers: int = 4, max_tokens: int = 18432, families: tuple[str, ...] = tuple(FAMILIES),
                 pool_batches: int = 8, extra: int = 0, extra_multi: int = 0,
                 family_weights: dict[str, float] | None = None, easy_share: float = 0.0,
                 easy_max: float = EASY_MAX) -> None:
        if not 0.0 <= easy_share <= 1.0:
            raise ValueError(f"easy_share must be in [0, 1], got {easy_share}")
        if not 0.0 <= easy_max <= 1.0:
            raise ValueError(f"easy_max must be in [0, 1], got {easy_max}")
        self.easy_share, self.easy_max = easy_share, easy_max
        self.tok_json, self.batch_tokens, self.seed = tokenizer.to_str(), batch_tokens, seed
        self.ramp_steps, self.doc_weight, self.max_tokens, self.families = ramp_steps, doc_weight, max_tokens, families
        self.pool_batches, self.extra, self.extra_multi = pool_batches, extra, extra_multi
        unknown = set(family_weights or {}) - set(families)
        if unknown:
            raise ValueError(f"family weights for unknown families {sorted(unknown)}; families are {list(families)}")
        self.weights = None if not family_weights else tuple(float(family_weights.get(f, 1.0)) for f in families)
        self.pool = mp.get_context("spawn").Pool(workers) if workers > 0 else None
        self._pending: list = []
        self._jobs = 0
        self._start: int | None = None  # the step of the first batch served (job_seed)
        self._ready: list[Batch] = []

    def _request(self, step: int) -> None:
        if self._start is None:
            self._start = step
        args = (self.tok_json, job_seed(self.seed, self._start, self._jobs), difficulty_at(step, self.ramp_steps), 64,
                self.families, self.max_tokens, self.extra, self.extra_multi, self.weights, self.easy_share,
                self.easy_max)
        self._jobs += 1
        self._pending.append(self.pool.apply_async(sequences, args) if self.pool else args)

    def _refill(self, step: int) -> None:
        items: list[Item] = []
        while sum(len(it[0]) for it in items) < self.pool_batches * self.batch_tokens:
            while len(self._pending) < AHEAD:
                self._request(step)
            job = self._pending.pop(0)
            items += job.get() if self.pool else sequences(*job)
        items.sort(key=lambda it: len(it[0]))
        batches, current, total = [], [], 0
        for item in items:
            current.append(item)
            total += len(item[0])
            if total >= self.batch_tokens:
                batches.append(current)
                current, total = [], 0
        if current and (not batches or total >= self.batch_tokens // 2):
            batches.append(current)
        elif current:  # a short remainder joins the last (longest) batch
            batches[-1] += current
        random.Random(self.seed * 7919 + step).shuffle(batches)
        self._ready = [pack(b, self.doc_weight) for b in batches]

    def batch(self, step: int) -> Batch:
        if not self._ready:
            self._refill(step)
        return self._ready.pop()

    def close(self) -> None:
        if self.pool:
            self.pool.terminate()
