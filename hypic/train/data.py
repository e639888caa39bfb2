"""Training batches from the task suite: packed varlen sequences with a curriculum.

A training sequence is the prompt as the engine sees it (segments tokenized on their own, then
concatenated) followed by the answer and ``<|end|>``. Loss weights: 1 on the answer tokens,
``doc_weight`` on everything else (a little language modelling keeps the model reading). The
curriculum raises the difficulty (document count and length) with the step; easier examples stay
in the mix. Examples are generated on the fly by worker processes.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import random
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from hypic.eval.tasks import FAMILIES, generate
from hypic.eval.tokenizer import encode_example


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T]
    labels: torch.Tensor  # [T] next token
    weights: torch.Tensor  # [T] loss weight per position
    lengths: list[int]  # one per sequence
    answer_tokens: int


def difficulty_at(step: int, ramp_steps: int) -> float:
    return min(1.0, step / max(1, ramp_steps))


def sequences(tok_json: str, seed: int, max_difficulty: float, count: int, families: tuple[str, ...],
              max_tokens: int) -> list[tuple[np.ndarray, int]]:
    """(tokens, answer start) for ``count`` examples; difficulty drawn in [0, max_difficulty] with density
    rising linearly (max · √u): easy examples keep appearing, but the long many-document ones the
    evaluation uses (difficulty 1) get twice the weight of the middle of the range.
    Tokens come back as int32 arrays: they cross the process boundary and become tensors cheaply."""
    tok = Tokenizer.from_str(tok_json)
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        family = rng.choice(families)
        ex = generate(family, 1, rng.randrange(2**31), difficulty=max_difficulty * math.sqrt(rng.random()))[0]
        enc = encode_example(tok, ex)
        prompt = [t for s in enc.segments for t in s]
        if len(prompt) + len(enc.target) <= max_tokens:
            out.append((np.asarray(prompt + enc.target, dtype=np.int32), len(prompt)))
    return out


def pack(items: list[tuple[np.ndarray | list[int], int]], doc_weight: float) -> Batch:
    ids, labels, weights, lengths, answers = [], [], [], [], 0
    for tokens, answer_start in items:
        t = torch.as_tensor(tokens).long()
        ids.append(t[:-1])
        labels.append(t[1:])
        # position i predicts token i + 1: answer tokens are predicted from answer_start − 1 on
        w = torch.full((len(tokens) - 1,), doc_weight)
        w[max(0, answer_start - 1):] = 1.0
        weights.append(w)
        lengths.append(len(tokens) - 1)
        answers += len(tokens) - answer_start
    return Batch(torch.cat(ids), torch.cat(labels), torch.cat(weights), lengths, answers)


class Stream:
    """Batches of about ``batch_tokens`` tokens from a pool of worker processes.

    Examples are pooled (``pool_batches`` batches' worth), sorted by length and cut into batches of
    neighbours, which then come out in shuffled order: a batch holds similar lengths, so the chunked
    kernel pads little (a batch spanning short and long examples was measured 3× padded).
    """

    def __init__(self, tokenizer: Tokenizer, *, batch_tokens: int, seed: int, ramp_steps: int, doc_weight: float,
                 workers: int = 4, max_tokens: int = 12288, families: tuple[str, ...] = tuple(FAMILIES),
                 pool_batches: int = 8) -> None:
        self.tok_json, self.batch_tokens, self.seed = tokenizer.to_str(), batch_tokens, seed
        self.ramp_steps, self.doc_weight, self.max_tokens, self.families = ramp_steps, doc_weight, max_tokens, families
        self.pool_batches = pool_batches
        self.pool = mp.get_context("spawn").Pool(workers) if workers > 0 else None
        self.ahead = max(4, 2 * workers)
        self._pending: list = []
        self._jobs = 0
        self._ready: list[Batch] = []

    def _request(self, step: int) -> None:
        args = (self.tok_json, self.seed * 1_000_003 + self._jobs, difficulty_at(step, self.ramp_steps), 64,
                self.families, self.max_tokens)
        self._jobs += 1
        self._pending.append(self.pool.apply_async(sequences, args) if self.pool else args)

    def _refill(self, step: int) -> None:
        items: list[tuple[np.ndarray, int]] = []
        while sum(len(t) for t, _ in items) < self.pool_batches * self.batch_tokens:
            while len(self._pending) < self.ahead:
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
