"""Choosing the next token: greedy, or temperature with min-p, top-k and nucleus (top-p) sampling in
vLLM's (V1) order, seeded per request, after the logit adjustments a request asked for; plus the
top-n log-probabilities: ``log_softmax`` of the adjusted logits at temperature 1, before min-p,
top-k and top-p — not vLLM's default raw logprobs (taken before the adjustments), nor those of the
tempered, truncated distribution the token is drawn from.

Adjustments, in order (vLLM's meanings): the logit bias; the repetition penalty over the prompt's
and the generated tokens; the presence and frequency penalties over the generated tokens; and,
before ``min_tokens`` tokens, the stop tokens (and EOS, unless ignored) made impossible; last, for
structured output, every token the grammar does not allow (``hypic.engine.structured``).

The draw runs on the logits' device for every row at once: one uniform number per row from the
request's own (CPU) generator, then the inverse of the row's cumulative distribution, in fp64, so a
seed gives the same tokens alone or in any batch. (Each row was drawn by ``torch.multinomial`` on
the CPU: its whole vocabulary's probabilities copied to the host, a stall per row per step.)"""

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


def _column(values: list[float], like: Tensor) -> Tensor:
    return to_device(values, like.device, dtype=like.dtype).unsqueeze(1)


def _filter(probs: Tensor, params: list[SamplingParams]) -> Tensor:
    """Tempered probabilities [M, vocab], each row cut as vLLM (V1) cuts it for its request: min-p
    first (what is less likely than min_p × the likeliest), then top-k (every token as likely as the
    k-th: ties all kept), then top-p over what is left, renormalised (the smallest prefix reaching
    top_p). Left unnormalised; the draw normalises. Rows asking for no cut are left as they are."""
    vocab = probs.shape[-1]
    if any(p.min_p > 0.0 for p in params):
        floor = _column([p.min_p for p in params], probs) * probs.max(-1, keepdim=True).values
        probs = torch.where(probs >= floor, probs, 0.0)  # min_p 0: a floor of 0 keeps every token
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
    if all(k == vocab for k in ks) and all(t == float("inf") for t in top_p):
        return probs
    sorted_p, order = probs.sort(-1, descending=True)  # what min-p dropped sorts last, as zeros
    kth = sorted_p.gather(1, to_device([k - 1 for k in ks], probs.device).unsqueeze(1))
    sorted_p = torch.where(sorted_p >= kth, sorted_p, 0.0)  # the k-th's ties stay
    norm = sorted_p / sorted_p.sum(-1, keepdim=True)
    keep = norm.cumsum(-1) - norm < _column(top_p, probs)  # the smallest prefix reaching top_p (inf: all)
    return torch.zeros_like(probs).scatter(1, order, torch.where(keep, norm, 0.0))


def _draw(probs: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """One token per row of unnormalised probabilities [M, vocab]: a uniform number per row from its
    generator (CPU; None: the global one), found in the row's cumulative sum (fp64, on the device)."""
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    # below the total (u·total may round onto it): the first sum past the point then grew at that
    # token, so the token drawn always has a probability above zero
    point = torch.minimum(to_device(u, probs.device).unsqueeze(1) * total, torch.nextafter(total, cdf.new_zeros(())))
    return torch.searchsorted(cdf, point, right=True).squeeze(1)


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
    # greedy below 1e-5: a tinier temperature would overflow the softmax into NaN
    drawn = [i for i, p in enumerate(params) if p.temperature >= 1e-5]
    if len(drawn) < len(params):
        chosen = logprobs.argmax(-1)
    if drawn:
        rows = logprobs[drawn] if len(drawn) < len(params) else logprobs
        temperature = _column([params[i].temperature for i in drawn], rows)
        probs = _filter(torch.softmax(rows / temperature, dim=-1), [params[i] for i in drawn])
        picked = _draw(probs, [generators[i] for i in drawn])
        chosen = picked if len(drawn) == len(params) else chosen.index_copy(
            0, to_device(drawn, chosen.device), picked)
    tokens: list[int] = chosen.tolist()  # one read-back for the batch, not one per row
    if drawn and max(tokens) >= logits.shape[-1]:  # the draw's cumulative sum was NaN: never an id past the vocabulary
        raise RuntimeError("sampling: a sampled row's logits are not finite (NaN or infinity)")
    tops: list[dict[int, float] | None] = []
    for row, p, tok in zip(logprobs, params, tokens, strict=True):
        if p.logprobs is not None:  # 0: the sampled token's alone
            values, ids = row.topk(p.logprobs)
            # tokens made impossible (a grammar's mask, min_tokens) are not alternatives: no −inf
            top = {i: v for i, v in zip(ids.tolist(), values.tolist(), strict=True) if v != float("-inf")}
            top.setdefault(tok, float(row[tok]))
            tops.append(top)
        else:
            tops.append(None)
    return tokens, tops
