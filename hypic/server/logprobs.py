"""Log-probabilities in OpenAI's shapes: the completions API's ``tokens``, ``token_logprobs``,
``top_logprobs`` and ``text_offset``, and chat's ``content`` entries (``token``, ``logprob``, ``bytes``,
``top_logprobs``).

A token is spelled from its own bytes (``hypic.engine.structured.token_bytes``: the vocabulary as the
tokenizer's decoder reads it), not by decoding it alone: byte-level BPE splits a character over
tokens, and each part decoded alone is U+FFFD. So:

- chat's ``bytes`` are the token's real bytes, which a client joins to rebuild a split character;
- a token whose bytes are not UTF-8 by themselves is named ``bytes:\\xe2\\x80`` (each byte as
  ``\\xNN``, OpenAI's spelling of such tokens in its completions API); a special token by its text;
- a completions ``top_logprobs`` dict never holds two tokens under one key: a name a likelier token
  already has is spelled ``token_id:N`` instead (vLLM's spelling of a token by its id);
- with vLLM's ``return_tokens_as_token_ids`` every token is named ``token_id:N`` (chat's ``bytes`` then
  spell that name, as vLLM's do; ``text_offset`` still indexes the text);
- ``text_offset`` indexes the choice's text (a stream's chunks joined): a generated token starts where
  the incrementally decoded text stood before it (``TextStream``; the parts of a split character start
  where it does; after bytes that never make a character, the next token starts at their U+FFFD,
  which decoding releases with it), past the echoed prompt, whose tokens ``prompts.echo_text`` places
  in the prompt as sent.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from hypic.engine.structured import token_bytes


class Scored(NamedTuple):
    """A generated token and what its log-probabilities are spelled from."""

    id: int
    logprobs: dict[int, float] | None  # its own and the likeliest tokens' (None: none reported)
    offset: int  # where its text starts in the generated text (TextStream.text before it)


class TokenTexts:
    """A tokenizer's tokens as bytes, and the names log-probabilities give them (the first made for a
    tokenizer reads the whole vocabulary: make it off the event loop)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.pieces = token_bytes(tokenizer)  # read once per tokenizer; special tokens are not in it
        self.as_ids = as_ids  # vLLM's return_tokens_as_token_ids: every token named "token_id:N"

    def bytes(self, t: int) -> bytes:
        data = self.pieces.get(t)
        return data if data is not None else self.tokenizer.decode([t], skip_special_tokens=False).encode()

    def name(self, t: int) -> str:
        if self.as_ids:
            return f"token_id:{t}"
        data = self.bytes(t)
        try:
            return data.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def keyed(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """Tokens (likeliest first) → log-probability, each under a key of its own."""
        out: dict[str, float] = {}
        for t, lp in top:
            name = self.name(t)
            out[f"token_id:{t}" if name in out else name] = lp
        return out


def _likeliest(lp: dict[int, float] | None, n: int | None = None) -> list[tuple[int, float]]:
    return sorted((lp or {}).items(), key=lambda kv: -kv[1])[:n]


def _with_own(s: Scored, top: int) -> list[tuple[int, float]]:
    """The ``top`` likeliest and the sampled token, if it is not among them: OpenAI's completions
    "always return the logprob of the sampled token, so there may be up to logprobs+1 elements" (and
    vLLM's) — the echoed prompt's entries hold their own token so too."""
    best = _likeliest(s.logprobs, top)
    if s.logprobs and s.id in s.logprobs and all(t != s.id for t, _ in best):
        best.append((s.id, s.logprobs[s.id]))
    return best


def completion_logprobs(texts: TokenTexts, tokens: list[Scored], top: int, shift: int, end: int) -> dict:
    """Generated tokens' ``logprobs`` object: offsets moved past ``shift`` characters (an echoed
    prompt) and at most ``end`` (a stop string cuts the text the last tokens' offsets point into)."""
    return {"tokens": [texts.name(s.id) for s in tokens],
            "token_logprobs": [(s.logprobs or {}).get(s.id, 0.0) for s in tokens],
            "top_logprobs": [texts.keyed(_with_own(s, top)) for s in tokens],
            "text_offset": [shift + min(s.offset, end) for s in tokens]}


def chat_logprobs(texts: TokenTexts, tokens: list[Scored], top: int) -> dict:
    def entry(t: int, lp: float) -> dict:
        name = texts.name(t)  # named by id, its bytes are the name's (as vLLM's)
        return {"token": name, "logprob": lp, "bytes": list(name.encode() if texts.as_ids else texts.bytes(t))}
    return {"content": [{**entry(s.id, (s.logprobs or {}).get(s.id, 0.0)),
                         "top_logprobs": [entry(a, b) for a, b in _likeliest(s.logprobs, top)]} for s in tokens]}


def prompt_logprobs(texts: TokenTexts, ids: list[int], scores: list[dict[int, float] | None],
                    offsets: list[int]) -> dict:
    """The echoed prompt's part of a completion's ``logprobs``: the first token has none (null), as in
    OpenAI's; ``offsets``: where each token starts in the echoed text."""
    return {"tokens": [texts.name(t) for t in ids],
            "token_logprobs": [None if lp is None else lp[t] for t, lp in zip(ids, scores, strict=True)],
            "top_logprobs": [None if lp is None else texts.keyed(_likeliest(lp)) for lp in scores],
            "text_offset": list(offsets)}


def trimmed(scores: list[dict[int, float] | None], ids: list[int], top: int) -> list[dict[int, float] | None]:
    """Prompt rows scored with more alternatives than asked (a round scored for its largest ``top``):
    each cut to its ``top`` likeliest and its own token."""
    return [None if lp is None else {**dict(_likeliest(lp, top)), t: lp[t]} for t, lp in zip(ids, scores, strict=True)]


def vllm_prompt_logprobs(texts: TokenTexts, ids: list[int], scores: list[dict[int, float] | None],
                         ranks: list[int | None]) -> list[dict[str, dict] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first: null), its own and the likeliest
    alternatives' log-probabilities keyed by token id, each with its rank in the position's
    distribution (1: the likeliest) and its text."""
    out: list[dict[str, dict] | None] = []
    for t, lp, rank in zip(ids, scores, ranks, strict=True):
        if lp is None:
            out.append(None)
            continue
        # the row holds the position's likeliest tokens, so their order is their rank; the prompt's own
        # token, which may lie below them, is ranked over the whole vocabulary by the scoring
        row = {str(a): {"logprob": v, "rank": i, "decoded_token": texts.name(a)}
               for i, (a, v) in enumerate(_likeliest(lp), 1)}
        own = row.pop(str(t))
        out.append({str(t): {**own, "rank": rank}, **row})  # its own token first, as vLLM's
    return out


def joined(head: dict, tail: dict | None) -> dict:
    """Two completions ``logprobs`` objects as one (``tail``'s offsets already past ``head``'s text)."""
    if tail is None:
        return head
    return {key: head[key] + tail[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
