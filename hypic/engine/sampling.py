"""Choosing the next token: greedy, or temperature with min-p, top-k and nucleus (top-p) sampling in
vLLM's (V1) order, seeded per request, after the logit adjustments a request asked for; plus the
top-n log-probabilities: ``log_softmax`` of the adjusted logits at temperature 1, before min-p,
top-k and top-p — not vLLM's default raw logprobs (taken before the adjustments), nor those of the
tempered, truncated distribution the token is drawn from.

Adjustments, in order (vLLM's meanings): the logit bias; the repetition penalty over the prompt's
and the generated tokens; the presence and frequency penalties over the generated tokens; and,
before ``min_tokens`` tokens, the stop tokens (and EOS, unless ignored) made impossible; last, for
structured output, every token the grammar does not allow (``hypic.engine.structured``)."""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor

from hypic.engine.request import SamplingParams
from hypic.ops.transfer import to_device


def _adjusts(p: SamplingParams, history: list[int]) -> bool:
    return bool(p.logit_bias or (p.penalized and history) or p.repetition_penalty != 1.0
                or len(history) < p.min_tokens)


def adjust(logits: Tensor, params: list[SamplingParams], histories: list[list[int]],
           prompts: list[list[int] | None] | None = None, eos: Collection[int] = (),
           allowed: list[Tensor | None] | None = None) -> Tensor:
    """Each row's logits with its request's adjustments (module docstring): ``histories`` are the
    tokens each row has generated, ``prompts`` its prompt's tokens (read for a repetition penalty
    only), ``eos`` the model's end tokens, ``allowed`` per row the only token ids it may draw
    (structured output; None: all). Rows asking for none (the default) cost nothing; the input is
    left as it is."""
    allowed = allowed or [None] * len(params)
    rows = [i for i, p in enumerate(params) if _adjusts(p, histories[i]) or allowed[i] is not None]
    if not rows:
        return logits
    out = logits.float().clone()
    for i in rows:
        p, history = params[i], histories[i]
        if p.logit_bias:
            ids = to_device(list(p.logit_bias), out.device)
            out[i].index_add_(0, ids, to_device(list(p.logit_bias.values()), out.device, dtype=out.dtype))
        if p.repetition_penalty != 1.0:
            prompt = (prompts[i] if prompts is not None else None) or []
            seen = to_device(sorted(set(prompt) | set(history)), out.device)
            if len(seen):
                vals = out[i, seen]
                out[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.penalized and history:
            counts = torch.bincount(to_device(history, out.device), minlength=out.shape[-1]).to(out.dtype)
            out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
        if len(history) < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
            if stops:
                out[i, to_device(sorted(stops), out.device)] = float("-inf")
        if allowed[i] is not None and len(allowed[i]):  # last: a bias cannot undo the grammar's choice
            keep = to_device(allowed[i], out.device)
            row = torch.full_like(out[i], float("-inf"))
            row[keep] = out[i, keep]
            out[i] = row
    return out


def _filter(probs: Tensor, p: SamplingParams) -> Tensor:
    """One row's tempered probabilities cut as vLLM (V1) cuts them: min-p first (what is less likely
    than min_p × the likeliest), then top-k (every token as likely as the k-th: ties all kept), then
    top-p over what is left, renormalised (the smallest prefix reaching top_p). The result is left
    unnormalised; the draw normalises."""
    zero = torch.zeros_like(probs)
    if p.min_p > 0.0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, zero)
    if 0 < p.top_k < probs.shape[-1]:
        probs = torch.where(probs >= probs.topk(p.top_k).values[-1], probs, zero)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        sorted_p = sorted_p / sorted_p.sum()
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # the smallest prefix reaching top_p
        probs = zero.scatter(0, order[keep], sorted_p[keep])
    return probs


def sample(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories: list[list[int]] | None = None, prompts: list[list[int] | None] | None = None,
           eos: Collection[int] = (), allowed: list[Tensor | None] | None = None
           ) -> tuple[list[int], list[dict[int, float] | None]]:
    """logits [N, vocab] fp32 → one token per row, and each row's top-n log-probabilities;
    ``histories``: each row's generated tokens so far (None: none yet); ``prompts``, ``eos`` and
    ``allowed`` as ``adjust`` reads them."""
    logits = adjust(logits, params, histories if histories is not None else [[] for _ in params], prompts, eos,
                    allowed)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    greedy = logprobs.argmax(-1).tolist()  # one read-back for the batch, not one per row
    tokens: list[int] = []
    tops: list[dict[int, float] | None] = []
    for row, p, gen, best in zip(logprobs, params, generators, greedy, strict=True):
        if p.temperature < 1e-5:  # greedy; a tinier temperature would overflow the softmax into NaN
            tok = best
        else:
            probs = _filter(torch.softmax(row / p.temperature, dim=-1), p)
            tok = int(torch.multinomial(probs.cpu(), 1, generator=gen))
        tokens.append(tok)
        if p.logprobs:
            values, ids = row.topk(p.logprobs)
            # tokens made impossible (a grammar's mask, min_tokens) are not alternatives: no −inf
            top = {i: v for i, v in zip(ids.tolist(), values.tolist(), strict=True) if v != float("-inf")}
            top.setdefault(tok, float(row[tok]))
            tops.append(top)
        else:
            tops.append(None)
    return tokens, tops
