"""Words a request never generates (``SamplingParams.bad_words``, vLLM's meaning).

A word is banned as token sequences: how the tokenizer spells it alone, after a space (a word in
the middle of a text is usually one token with its space) and with no space before it (a text's
first word: a tokenizer that adds a prefix space spells "word" alone as " word"). A sequence's last token is banned
at a step when the output so far ends with the tokens before it — a one-token word at every step —
so the sequence is never completed; its first tokens stay free (they may begin other words). Only
the generated tokens count, not the prompt's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from hypic.models.tokenize import encode


@dataclass(frozen=True)
class BadWords:
    sequences: tuple[tuple[int, ...], ...]

    @cached_property
    def always(self) -> tuple[int, ...]:
        """The one-token words' tokens: banned at every step (read every step: computed once)."""
        return tuple(sorted({s[0] for s in self.sequences if len(s) == 1}))

    def banned(self, output: list[int]) -> list[int]:
        """The tokens banned after ``output`` (the generated tokens so far)."""
        out = set(self.always)
        for s in self.sequences:
            n = len(s) - 1
            if n and len(output) >= n and tuple(output[len(output) - n:]) == s[:-1]:
                out.add(s[-1])
        return sorted(out)


def bad_words(tokenizer: Any, words: tuple[str, ...]) -> BadWords | None:
    """The words' token sequences under ``tokenizer`` (a ``tokenizers.Tokenizer``); None for none."""
    if not words:
        return None
    return _sequences(tokenizer, words)


@lru_cache(maxsize=256)
def _sequences(tokenizer: Any, words: tuple[str, ...]) -> BadWords:
    found: dict[tuple[int, ...], None] = {}

    def ids(text: str) -> tuple[int, ...]:
        return tuple(encode(tokenizer, text).ids)

    newline = ids("\n")
    for word in words:
        word = word.lstrip()
        spellings = [ids(word), ids(" " + word)]
        # A tokenizer that adds a prefix space (the bundled one, GPT-2's) spells a word alone as
        # " word", so its space-less form — a text's first word, one after a newline or a quote — is
        # read after a newline, where every byte-level or SentencePiece tokenizer starts a new piece
        after = ids("\n" + word)
        if newline and after[:len(newline)] == newline and tokenizer.decode(list(after[len(newline):])) == word:
            spellings.append(after[len(newline):])
        for seq in spellings:
            if seq:
                found[seq] = None
    return BadWords(tuple(found))
