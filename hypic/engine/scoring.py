"""A prompt's own log-probabilities: each token's, given the tokens before it.

Position-independent reuse never computes logits at a cached document's tokens — that is where its
speed comes from — so scoring a prompt is a ``full`` forward over all of it, whatever the mode its
generation runs in. Who asks: the completions API's ``echo`` with ``logprobs`` (how lm-eval and
similar harnesses score a continuation given a context), and ``SamplingParams.prompt_logprobs``.
The language-model head runs over chunks of rows, so a long prompt never holds its
[tokens × vocabulary] logits at once (at the 9B shape's 248 320-token vocabulary, 1 GiB per 1 000
rows): at most 128 MiB of them, beside a serving store that keeps the device nearly full.

The forward runs in pieces of ``PIECE`` tokens, each continuing the last's state, under the lock
the caller names: between pieces the engine serves its other requests (a 15 000-token prompt held
every stream's decoding for 10 s on a CPU), and a scorer whose client left or whose time ran out
stops there (``stop``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import torch

from hypic.engine.request import check_top
from hypic.models.context import SequenceContext, SequenceState
from hypic.models.hybrid import HybridLM
from hypic.ops.transfer import to_device

ROWS = 512  # rows of logits at once, at most …
CHUNK_BYTES = 128 << 20  # … and at most this many bytes of fp32 logits (the 9B shape's vocabulary: 135 rows)
PIECE = 2048  # prompt tokens per forward


class ScoringStopped(Exception):
    """``stop`` said why between two pieces: the rest of the prompt was not scored."""


@torch.no_grad()
def score_prompt(model: HybridLM, device: torch.device, ids: list[int], top: int, *,
                 lock: threading.Lock | threading.RLock | None = None,
                 stop: Callable[[], str | None] | None = None) -> list[dict[int, float] | None]:
    """Per token of ``ids``: None for the first (nothing before it); else its log-probability and
    those of the ``top`` likeliest tokens at its position, token → log-probability (fp32 softmax).
    Each piece's forward holds ``lock``; before each, ``stop()`` (a reason, or None to go on) may end
    the scoring with ``ScoringStopped``."""
    check_top(top)
    if not ids:
        raise ValueError("prompt: expected at least one token")
    outside = [t for t in ids if not 0 <= t < model.vocab_size]
    if outside:
        raise ValueError(f"prompt: token id {outside[0]} is outside the vocabulary [0, {model.vocab_size})")
    state, out = SequenceState(), [None]
    rows = max(1, min(ROWS, CHUNK_BYTES // (4 * model.vocab_size)))
    for p in range(0, len(ids), PIECE):
        reason = stop() if stop is not None else None
        if reason is not None:
            raise ScoringStopped(reason)
        piece = ids[p:p + PIECE]
        with lock if lock is not None else contextlib.nullcontext():
            ctx = SequenceContext([state], [len(piece)], device)
            hidden = model.hidden_states(to_device(piece, device), ctx)
            ctx.finish()
            scored = min(len(piece), len(ids) - 1 - p)  # rows predicting a next token: all but the prompt's last
            nxt = to_device(ids[p + 1:p + 1 + scored], device)
            for a in range(0, scored, rows):
                b = min(a + rows, scored)
                # gathered and ranked where the logits are: only [rows × (1 + top)] numbers leave the device
                logp = model.lm_head(hidden[a:b]).float().log_softmax(-1)
                actual = logp.gather(1, nxt[a:b, None])[:, 0].tolist()
                values, indices = (logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long()))
                for token, lp, vs, ix in zip(ids[p + a + 1:p + b + 1], actual, values.tolist(), indices.tolist(),
                                             strict=True):
                    row = dict(zip(ix, vs, strict=True))
                    row[token] = lp
                    out.append(row)
    return out
