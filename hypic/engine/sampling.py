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

import math
from collections.abc import Collection

import torch
from torch import Tensor

from hypic.engine.request import SamplingParams
from hypic.ops.transfer import to_device


class TokenCounts:
    """A run's generated tokens counted on the device ([vocab] fp32) and, for a repetition penalty, its
    prompt's tokens as a mask: made once when the run starts, one add per drawn token, so a step
    reads no history from the host (a device ``bincount`` stalls to size its output, and a prompt's
    set of tokens rebuilt each step cost milliseconds a row on a RAG prompt)."""

    def __init__(self, vocab: int, device: torch.device, prompt: list[int] | None = None) -> None:
        self.counts = torch.zeros(vocab, device=device)
        self.prompt = None if prompt is None else token_mask(sorted(set(prompt)), vocab, device)

    def add(self, token: int) -> None:
        self.counts[token] += 1  # a kernel, no read-back

    @classmethod
    def of(cls, history: list[int], vocab: int, device: torch.device,
           prompt: list[int] | None = None) -> TokenCounts:
        counts = cls(vocab, device, prompt)
        for t in history:
            counts.add(t)
        return counts

    def seen(self) -> Tensor:
        """The tokens a repetition penalty reads: generated so far, or in the prompt."""
        return self.counts > 0 if self.prompt is None else (self.counts > 0) | self.prompt


def token_mask(ids: Tensor | list[int], size: int, device: torch.device) -> Tensor:
    """Token ids as a [size] boolean mask on ``device``, set by a scalar fill (assigning ``True``
    through an index copies the scalar to the device: a stall)."""
    mask = torch.zeros(size, dtype=torch.bool, device=device)
    if len(ids):
        mask.index_fill_(0, to_device(ids, device), True)
    return mask


def _select(t: Tensor, index: list[int]) -> tuple[Tensor, Tensor | None]:
    """The rows ``index`` of ``t`` and their device index (None: every row, in order) — picked by a
    device tensor: a Python list of rows is a blocking copy."""
    if index == list(range(len(t))):
        return t, None
    at = to_device(index, t.device)
    return t.index_select(0, at), at


def _adjusts(p: SamplingParams, generated: int) -> bool:
    return bool(p.logit_bias or (p.penalized and generated) or p.repetition_penalty != 1.0
                or generated < p.min_tokens)


LOGIT_LIMIT = 1e30  # what a penalty can push a logit to, at most (``adjust``)


def adjust(logits: Tensor, params: list[SamplingParams], generated: list[int],
           counts: list[TokenCounts | None] | None = None, eos: Collection[int] = (),
           allowed: list[Tensor | None] | None = None) -> Tensor:
    """Each row's logits with its request's adjustments (module docstring), every row asking for one
    together, with no read-back: ``generated`` is how many tokens each row has generated, ``counts``
    its tokens (``TokenCounts``; needed by the penalties), ``eos`` the model's end tokens, ``allowed``
    per row what it may draw (structured output: a boolean mask over the vocabulary on the logits'
    device, or the ids; empty ids: nothing can, the draw is left free; None: all). Rows asking for none
    (the default) cost nothing; the input is left as it is."""
    allowed = allowed or [None] * len(params)
    rows = [i for i, p in enumerate(params) if _adjusts(p, generated[i]) or allowed[i] is not None]
    if not rows:
        return logits
    out = logits.float().clone()
    device = out.device

    def each(index: list[int], change) -> None:  # rows ``index`` replaced by change(their logits)
        at = to_device(index, device)
        out.index_copy_(0, at, change(out.index_select(0, at)))

    bias = [(i, t, b) for i in rows for t, b in (params[i].logit_bias or {}).items()]
    if bias:
        r, t, b = zip(*bias, strict=True)
        out.index_put_((to_device(r, device), to_device(t, device)), to_device(b, device, dtype=out.dtype),
                       accumulate=True)
    repeat = [i for i in rows if params[i].repetition_penalty != 1.0]
    if repeat:
        seen = torch.stack([counts[i].seen() for i in repeat])
        penalty = _column([params[i].repetition_penalty for i in repeat], out)
        # clamped: a penalty near zero (1e-300 reads as 0 in fp32) would divide a logit into +inf
        # and NaN the row's softmax; ±LOGIT_LIMIT is past any logit and still finite at the
        # smallest temperature drawn (``sample``: 1e-5)
        each(repeat, lambda v: torch.where(seen, torch.where(v > 0, v / penalty, v * penalty), v)
             .clamp(-LOGIT_LIMIT, LOGIT_LIMIT))
    penalized = [i for i in rows if params[i].penalized and generated[i]]
    if penalized:
        c = torch.stack([counts[i].counts for i in penalized])
        frequency = _column([params[i].frequency_penalty for i in penalized], out)
        presence = _column([params[i].presence_penalty for i in penalized], out)
        each(penalized, lambda v: v - frequency * c - presence * (c > 0).to(v.dtype))
    banned = [(i, t) for i in rows if generated[i] < params[i].min_tokens
              for t in sorted(set(params[i].stop_token_ids) | (set() if params[i].ignore_eos else set(eos)))]
    if banned:
        r, t = zip(*banned, strict=True)
        out.index_put_((to_device(r, device), to_device(t, device)), out.new_full((), float("-inf")))  # a fill
    masked = [i for i in rows if allowed[i] is not None and len(allowed[i])]
    if masked:  # last: a bias cannot undo the grammar's choice
        vocab = out.shape[-1]
        keep = torch.stack([allowed[i] if allowed[i].dtype == torch.bool else token_mask(allowed[i], vocab, device)
                            for i in masked])
        each(masked, lambda v: v.masked_fill(~keep, float("-inf")))
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
    keep[:, 0] = True  # that prefix always holds the likeliest, even for a top_p fp32 reads as 0
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
           generated: list[int] | None = None, counts: list[TokenCounts | None] | None = None,
           eos: Collection[int] = (), allowed: list[Tensor | None] | None = None, *, isolate: bool = False
           ) -> tuple[list[int], list[dict[int, float] | None]]:
    """logits [N, vocab] fp32 → one token per row, and each row's top-n log-probabilities, read back
    in one copy; ``generated`` (None: none yet), ``counts``, ``eos`` and ``allowed`` as ``adjust``
    reads them. A row whose logits are not finite (its chosen token's log-probability is NaN, or
    its draw ran past the vocabulary) is a RuntimeError — or, with ``isolate``, the token -1 for
    that row alone (the caller fails its request, the others go on)."""
    logits = adjust(logits, params, generated if generated is not None else [0] * len(params), counts, eos, allowed)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    # greedy below 1e-5: a tinier temperature would overflow the softmax into NaN
    drawn = [i for i, p in enumerate(params) if p.temperature >= 1e-5]
    if len(drawn) < len(params):
        chosen = logprobs.argmax(-1)
    if drawn:
        rows, at = _select(logprobs, drawn)
        temperature = _column([params[i].temperature for i in drawn], rows)
        probs = _filter(torch.softmax(rows / temperature, dim=-1), [params[i] for i in drawn])
        picked = _draw(probs, [generators[i] for i in drawn])
        chosen = picked if at is None else chosen.index_copy(0, at, picked)
    # the log-probabilities asked for ride in the same read-back as the tokens (ids are exact in fp64);
    # one top-k per distinct k, so the alternatives a row gets among tied values are its own, whatever
    # the other rows ask for
    vocab = logits.shape[-1]
    chosen_lp = logprobs.gather(1, chosen.clamp(max=vocab - 1).unsqueeze(1)).double().flatten()  # NaN: broken
    parts, groups = [chosen.double(), chosen_lp], {}
    for i, p in enumerate(params):
        if p.logprobs is not None:
            groups.setdefault(p.logprobs, []).append(i)
    for k, rows_asking in groups.items():
        rows, at = _select(logprobs, rows_asking)
        mine = (chosen if at is None else chosen.index_select(0, at)).clamp(max=vocab - 1)  # NaN: raised below
        values, ids = rows.topk(k, dim=-1)
        parts += [rows.gather(1, mine.unsqueeze(1)).double().flatten(), values.double().flatten(),
                  ids.double().flatten()]
    back = torch.cat(parts).tolist()  # one read-back for the batch, not one per row
    n_rows = len(params)
    tokens = [int(t) for t in back[:n_rows]]
    # a NaN cumulative sum draws past the vocabulary; a greedy NaN row takes its NaN's index
    broken = [i for i in range(n_rows) if tokens[i] >= vocab or not math.isfinite(back[n_rows + i])]
    if broken and not isolate:
        raise RuntimeError("sampling: a sampled row's logits are not finite (NaN or infinity)")
    tops: list[dict[int, float] | None] = [None] * n_rows
    at = 2 * n_rows
    for k, rows_asking in groups.items():
        n = len(rows_asking)
        own, values, ids = back[at:at + n], back[at + n:at + n + n * k], back[at + n + n * k:at + n + 2 * n * k]
        at += n + 2 * n * k
        for j, i in enumerate(rows_asking):  # k 0: the sampled token's alone
            # tokens made impossible (a grammar's mask, min_tokens) are not alternatives: no −inf
            top = {int(t): v for t, v in zip(ids[j * k:(j + 1) * k], values[j * k:(j + 1) * k], strict=True)
                   if v != float("-inf")}
            top.setdefault(tokens[i], own[j])
            tops[i] = top
    for i in broken:
        tokens[i], tops[i] = -1, None
    return tokens, tops
