"""Choosing the next token: greedy, or temperature with nucleus (top-p) sampling, seeded per
request, after the logit bias and the presence and frequency penalties a request asked for; plus
the top-n log-probabilities (of the adjusted distribution, the one the token is drawn from)."""

from __future__ import annotations

import torch
from torch import Tensor

from hypic.engine.request import SamplingParams
from hypic.ops.transfer import to_device


def adjust(logits: Tensor, params: list[SamplingParams], histories: list[list[int]]) -> Tensor:
    """Each row's logits with its request's ``logit_bias`` added and its penalties over the tokens it
    has generated taken off: ``− frequency_penalty · count[t] − presence_penalty · [count[t] > 0]``.
    Rows asking for neither (the default) cost nothing; the input is left as it is."""
    rows = [i for i, p in enumerate(params) if p.logit_bias or (p.penalized and histories[i])]
    if not rows:
        return logits
    out = logits.float().clone()
    for i in rows:
        p = params[i]
        if p.logit_bias:
            ids = to_device(list(p.logit_bias), out.device)
            out[i].index_add_(0, ids, to_device(list(p.logit_bias.values()), out.device, dtype=out.dtype))
        if p.penalized and histories[i]:
            counts = torch.bincount(to_device(histories[i], out.device), minlength=out.shape[-1]).to(out.dtype)
            out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    return out


def sample(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories: list[list[int]] | None = None) -> tuple[list[int], list[dict[int, float] | None]]:
    """logits [N, vocab] fp32 → one token per row, and each row's top-n log-probabilities;
    ``histories``: each row's generated tokens so far (the penalties' counts; None: none yet)."""
    logits = adjust(logits, params, histories if histories is not None else [[] for _ in params])
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    greedy = logprobs.argmax(-1).tolist()  # one read-back for the batch, not one per row
    tokens: list[int] = []
    tops: list[dict[int, float] | None] = []
    for row, p, gen, best in zip(logprobs, params, generators, greedy, strict=True):
        if p.temperature < 1e-5:  # greedy; a tinier temperature would overflow the softmax into NaN
            tok = best
        else:
            probs = torch.softmax(row / p.temperature, dim=-1)
            if p.top_p < 1.0:
                sorted_p, order = probs.sort(descending=True)
                keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # the smallest prefix reaching top_p
                probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
            tok = int(torch.multinomial(probs.cpu(), 1, generator=gen))
        tokens.append(tok)
        if p.logprobs:
            values, ids = row.topk(p.logprobs)
            top = dict(zip(ids.tolist(), values.tolist(), strict=True))
            top.setdefault(tok, float(row[tok]))
            tops.append(top)
        else:
            tops.append(None)
    return tokens, tops
