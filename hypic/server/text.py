"""Token ids → text as they arrive: incremental detokenization with stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens) and
for tokenizers that strip a leading space per ``decode`` call; decoding everything each step is
quadratic. So, as vLLM does, each step decodes a short window twice — with and without the new
tokens — and emits the difference, waiting while the window ends in an incomplete character
(U+FFFD). Concatenated, the pieces equal decoding the whole output at once, which is what the
offline ``LLM.generate`` returns. Stop strings are searched in the text — and in the complete
characters ahead of an incomplete one (a byte-level token can end a stop string and begin a
multi-byte character: the stop is seen at once, not when the character completes); the last
``len(longest stop) − 1`` characters are held back so a stop split across tokens is never sent.
With ``min_tokens`` (vLLM's meaning) a stop string counts only once it ends in the text of a token
after the first ``min_tokens``: as EOS and the stop tokens, it cannot end a shorter output.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stops: list[str] | None = None, stop_ids: tuple[int, ...] = (), *,
                 keep_special: bool = False, min_tokens: int = 0, include_stop: bool = False) -> None:
        """``include_stop``: the text ends after the stop string found instead of before it."""
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.stop_string: str | None = None  # the stop string found (the first in the text; of those, the first given)
        self.keep_special = keep_special  # special tokens in the text (Kimi's tool-call markers are ones)
        self.stops = [s for s in (stops or []) if s]
        self.stop_ids = set(stop_ids)  # stop tokens: they end the output and are not part of its text
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.min_tokens = min_tokens
        self.pushed = 0  # generated tokens seen, stop tokens included
        self.tokens: list[int] = []
        self.text = ""  # decoded so far (complete characters)
        self.exempt = 0  # characters of ``text`` (the first min_tokens tokens') in which no stop string may end
        self.sent = 0  # characters of ``text`` handed out
        self.stopped = False  # a stop string was found: generation should end
        self._prefix = self._read = 0  # the decode window: tokens[_prefix:_read] were already read
        self._pending = ""  # complete characters past ``text`` while the window waits on an incomplete one

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not self.keep_special)

    def _advance(self, final: bool) -> None:
        before = self._decode(self.tokens[self._prefix:self._read])
        after = self._decode(self.tokens[self._prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.tokens)
            self._pending = ""
        else:
            self._pending = after[len(before):].rstrip("\ufffd")

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        if self.stops:
            seen = self.text + self._pending
            hits = [(i, s) for s in self.stops
                    if (i := seen.find(s, max(0, self.sent - self.hold, self.exempt - len(s) + 1))) >= 0]
            if hits:
                at = min(i for i, _ in hits)
                self.stop_string = next(s for i, s in hits if i == at)
                self.stopped = True
                self.text = seen[:at + (len(self.stop_string) if self.include_stop else 0)]
                final = True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out

    def push(self, token: int) -> str:
        """Add a generated token; returns the text now safe to send (maybe empty)."""
        self.pushed += 1
        if self.stopped or token in self.stop_ids:
            return ""
        self.tokens.append(token)
        self._advance(final=False)
        if self.pushed <= self.min_tokens:
            self.exempt = len(self.text) + len(self._pending)
        return self._release(final=False)

    def finish(self) -> str:
        """The output ended: everything not sent yet (an incomplete character is sent as is)."""
        if self.stopped:
            return ""
        if len(self.tokens) > self._read:
            self._advance(final=True)
        return self._release(final=True)


def answer_text(tokenizer: Any, params: Any, eos: Collection[int], *, stops: list[str] | None = None,
                keep_special: bool = False) -> TextStream:
    """The text of an answer to ``params`` (a SamplingParams) as it is generated, with vLLM's meanings,
    for the library and the server alike: the stop strings (``params.stop``, or ``stops``); the stop
    tokens and EOS (unless ignored) out of the text unless ``include_stop_str_in_output``; special
    tokens in it when ``skip_special_tokens`` is off or ``keep_special`` (a tool-call dialect's markers)."""
    stop_ids = () if params.include_stop_str_in_output else \
        params.stop_token_ids + (() if params.ignore_eos else tuple(sorted(eos)))
    return TextStream(tokenizer, list(params.stop if stops is None else stops), stop_ids,
                      keep_special=keep_special or not params.skip_special_tokens, min_tokens=params.min_tokens,
                      include_stop=params.include_stop_str_in_output)


def stop_reason(text: TextStream | None, token_ids: list[int], finish_reason: str | None,
                stop_token_ids: Collection[int]) -> str | int | None:
    """What stopped an output, as vLLM reports it: the stop string found, else the stop token it
    ended on (one of ``stop_token_ids``: EOS is not one, unless listed), else None."""
    if text is not None and text.stop_string is not None:
        return text.stop_string
    if finish_reason == "stop" and token_ids and token_ids[-1] in stop_token_ids:
        return token_ids[-1]
    return None


def text_offsets(tokenizer: Any, ids: list[int]) -> list[int]:
    """Where each token's text starts in the decoding of ``ids`` (special tokens kept): where the
    incrementally decoded text stood before it, so the parts of a split character start where it does."""
    stream, out = TextStream(tokenizer, keep_special=True), []
    for t in ids:
        out.append(len(stream.text))
        stream.push(t)
    return out


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``: what a stream
    holds back while it could still become the tag (a reasoning block's end, a tool call's start)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)
