"""A prompt's own log-probabilities: each token's, given the tokens before it.

Position-independent reuse never computes logits at a cached document's tokens — that is where its
speed comes from — so scoring a prompt is a ``full`` forward over all of it, whatever the mode its
generation runs in. Who asks: the completions API's ``echo`` with ``logprobs`` (how lm-eval and
similar harnesses score a continuation given a context), and ``SamplingParams.prompt_logprobs``.
The language-model head runs over chunks of rows, so a long prompt never holds its
[tokens × vocabulary] logits at once (at the 9B shape's 248 320-token vocabulary, 1 GiB per 1 000
rows): at most 128 MiB of them, beside a serving store that keeps the device nearly full.
"""

from __future__ import annotations

import torch

from hypic.engine.request import check_top
from hypic.models.context import SequenceContext, SequenceState
from hypic.models.hybrid import HybridLM
from hypic.ops.transfer import to_device

ROWS = 512  # rows of logits at once, at most …
CHUNK_BYTES = 128 << 20  # … and at most this many bytes of fp32 logits (the 9B shape's vocabulary: 135 rows)


@torch.no_grad()
def score_prompt(model: HybridLM, device: torch.device, ids: list[int], top: int) -> list[dict[int, float] | None]:
    """Per token of ``ids``: None for the first (nothing before it); else its log-probability and
    those of the ``top`` likeliest tokens at its position, token → log-probability (fp32 softmax)."""
    check_top(top)
    if not ids:
        raise ValueError("prompt: expected at least one token")
    outside = [t for t in ids if not 0 <= t < model.vocab_size]
    if outside:
        raise ValueError(f"prompt: token id {outside[0]} is outside the vocabulary [0, {model.vocab_size})")
    ctx = SequenceContext([SequenceState()], [len(ids)], device)
    hidden = model.hidden_states(to_device(ids, device), ctx)
    ctx.finish()
    nxt = to_device(ids[1:], device)
    out: list[dict[int, float] | None] = [None]
    rows = max(1, min(ROWS, CHUNK_BYTES // (4 * model.vocab_size)))
    for a in range(0, len(ids) - 1, rows):
        b = min(a + rows, len(ids) - 1)
        # gathered and ranked where the logits are: only [rows × (1 + top)] numbers leave the device
        logp = model.lm_head(hidden[a:b]).float().log_softmax(-1)
        actual = logp.gather(1, nxt[a:b, None])[:, 0].tolist()
        values, indices = (logp.topk(top, dim=-1) if top else (logp[:, :0], logp[:, :0].long()))
        for token, lp, vs, ix in zip(ids[a + 1:b + 1], actual, values.tolist(), indices.tolist(), strict=True):
            row = dict(zip(ix, vs, strict=True))
            row[token] = lp
            out.append(row)
    return out
