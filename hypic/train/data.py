"""Training batches from the task suite: packed varlen sequences with a curriculum.

A training sequence is the prompt as the engine sees it (segments tokenized on their own, then
concatenated) followed by the answer and ``<|end|>``. Loss weights: 1 on the answer tokens,
``doc_weight`` on everything else (a little language modelling keeps the model reading). The
curriculum raises the difficulty (document count and length) with the step; easier examples stay
in the mix. Examples are generated on the fly by worker processes.
"""

from __future__ import annotations

import multiprocessing as mp
import random
from dataclasses import dataclass

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
              max_tokens: int) -> list[tuple[list[int], int]]:
    """(tokens, answer start) for ``count`` examples; difficulty uniform in [0, max_difficulty]."""
    tok = Tokenizer.from_str(tok_json)
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        family = rng.choice(families)
        ex = generate(family, 1, rng.randrange(2**31), difficulty=rng.uniform(0.0, max_difficulty))[0]
        enc = encode_example(tok, ex)
        prompt = [t for s in enc.segments for t in s]
        if len(prompt) + len(enc.target) <= max_tokens:
            out.append((prompt + enc.target, len(prompt)))
    return out


def pack(items: list[tuple[list[int], int]], doc_weight: float) -> Batch:
    ids, labels, weights, lengths, answers = [], [], [], [], 0
    for tokens, answer_start in items:
        ids += tokens[:-1]
        labels += tokens[1:]
        # position i predicts token i + 1: answer tokens are predicted from answer_start − 1 on
        weights += [1.0 if i + 1 >= answer_start else doc_weight for i in range(len(tokens) - 1)]
        lengths.append(len(tokens) - 1)
        answers += len(tokens) - answer_start
    return Batch(torch.tensor(ids), torch.tensor(labels), torch.tensor(weights), lengths, answers)


class Stream:
    """Batches of about ``batch_tokens`` tokens from a pool of worker processes."""

    def __init__(self, tokenizer: Tokenizer, *, batch_tokens: int, seed: int, ramp_steps: int, doc_weight: float,
                 workers: int = 4, max_tokens: int = 12288, families: tuple[str, ...] = tuple(FAMILIES)) -> None:
        self.tok_json, self.batch_tokens, self.seed = tokenizer.to_str(), batch_tokens, seed
        self.ramp_steps, self.doc_weight, self.max_tokens, self.families = ramp_steps, doc_weight, max_tokens, families
        self.pool = mp.get_context("spawn").Pool(workers) if workers > 0 else None
        self._pending: list = []
        self._buffer: list[tuple[list[int], int]] = []

    def _request(self, step: int) -> None:
        args = (self.tok_json, self.seed * 1_000_003 + step, difficulty_at(step, self.ramp_steps), 64,
                self.families, self.max_tokens)
        self._pending.append(self.pool.apply_async(sequences, args) if self.pool else args)

    def batch(self, step: int) -> Batch:
        while len(self._pending) < 4:
            self._request(step + len(self._pending))
        items, total = [], 0
        while total < self.batch_tokens:
            if not self._buffer:
                job = self._pending.pop(0)
                # sorted by length: a batch then holds similar lengths, and little is padded to whole chunks
                self._buffer = sorted(job.get() if self.pool else sequences(*job), key=lambda it: len(it[0]))
                self._request(step + 4)
            item = self._buffer.pop()
            items.append(item)
            total += len(item[0])
        return pack(items, self.doc_weight)

    def close(self) -> None:
        if self.pool:
            self.pool.terminate()
