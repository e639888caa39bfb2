"""A thinking model's reasoning apart from its answer: ``<think>…</think>`` → ``reasoning_content``.

Qwen3 and its hybrid successors (Qwen3-Next, Qwen3.5) think before they answer, inside
``<think>…</think>``; OpenAI-compatible servers hand the thinking back as the message's
``reasoning_content`` (vLLM's ``--reasoning-parser``), so clients show or drop it and tool parsing
reads the answer only. Off unless the server is started with ``--reasoning-parser think``.

Two openings occur: the model writes ``<think>`` itself (Qwen3), or the chat template ends the
generation prompt with it (the thinking-only variants, Qwen3.5), so the output starts inside the
reasoning and only ``</think>`` appears — the caller says which (``opened``, read off the prompt).
A template switched to not thinking (``enable_thinking: false``) closes an empty block in the prompt:
then nothing is opened and the whole output is the answer.

``ThinkSplit`` reads an answer piece by piece — the stream and the whole answer go through the same
code, so they agree: text is held back only while it could still be a tag.
"""

from __future__ import annotations

from hypic.engine.request import SamplingParams
from hypic.server.text import partial_tag

OPEN, CLOSE = "<think>", "</think>"


def opened_by(prompt: str) -> bool:
    """Whether a generation prompt leaves the model inside ``<think>``."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN)


class ThinkSplit:
    """An answer's text → (reasoning, content) pieces, as they can be told apart."""

    def __init__(self, opened: bool) -> None:
        self.state = "reasoning" if opened else "start"
        self.held = ""

    def push(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) that can go out now."""
        self.held += piece
        reasoning = content = ""
        if self.state == "start":  # whitespace, then either <think> or the answer
            head = self.held.lstrip()
            if not head or (OPEN.startswith(head) and head != OPEN):
                return "", ""
            if head.startswith(OPEN):
                self.state, self.held = "reasoning", head[len(OPEN):]
            else:
                self.state = "content"
        if self.state == "reasoning":
            at = self.held.find(CLOSE)
            if at < 0:
                cut = len(self.held) - partial_tag(self.held, CLOSE)
                reasoning, self.held = self.held[:cut], self.held[cut:]
                return reasoning, ""
            reasoning, self.held, self.state = self.held[:at], self.held[at + len(CLOSE):], "after"
        if self.state == "after":  # the blank lines between the reasoning and the answer are neither
            self.held = self.held.lstrip("\n")
            if not self.held:
                return reasoning, ""
            self.state = "content"
        content, self.held = self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held at the end: a reasoning cut short stays reasoning; anything else is content."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return held, ""
        return "", "" if self.state == "after" else held


def split(text: str, opened: bool) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    s = ThinkSplit(opened)
    r1, c1 = s.push(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2


# The reasoning's frame as structured output reads it (xgrammar's format trees): free text up to
# ``</think>``, then the blank lines ``ThinkSplit`` drops, then what the answer is held to.
_THOUGHT = [{"type": "any_text", "excludes": [CLOSE]}, {"type": "const_string", "value": CLOSE},
            {"type": "regex", "pattern": "\n*"}]


def after_reasoning(params: SamplingParams, opened: bool) -> SamplingParams:
    """``params`` with its constraint held to the answer only — after the reasoning, as vLLM's
    reasoning parsers have structured output wait for the reasoning's end: a thinking model asked for
    JSON thinks first, then writes it (held from the first byte, it could not think at all, or
    thought inside its JSON). ``opened``: the prompt opened the reasoning (else the model may open it,
    after whitespace, or answer at once). A structural tag is left as it is: its text is free around
    its tags, and a format that wants reasoning says so itself (a ``<think>`` tag)."""
    kinds = params.constraint_kinds
    if not kinds or kinds == ["structural_tag"]:
        return params
    if params.json_schema is not None:
        answer = {"type": "json_schema", "json_schema": {} if params.json_schema is True else params.json_schema}
    elif params.regex is not None:
        answer = {"type": "regex", "pattern": params.regex}
    elif params.choice is not None:
        answer = {"type": "or", "elements": [{"type": "const_string", "value": c} for c in params.choice]}
    else:
        answer = {"type": "grammar", "grammar": params.grammar}
    thought = _THOUGHT if opened else [{"type": "optional", "content": {"type": "sequence", "elements": [
        {"type": "regex", "pattern": r"\s*"}, {"type": "const_string", "value": OPEN}, *_THOUGHT]}}]
    return params.clone(json_schema=None, regex=None, choice=None, grammar=None, structural_tag={
        "type": "structural_tag", "format": {"type": "sequence", "elements": [*thought, answer]}})
