"""Chat templating that keeps segments apart: each message (each text part) stays its own segment.

The model's own Jinja chat template renders the whole conversation once, exactly as it would
for any server, so the tokens the model sees are the template's. To find where segments begin,
every text part's content is prefixed with an unguessable marker before rendering:

- a message's segment starts where the template starts wrapping it, found by rendering the
  conversation up to that message (``messages[:i]``) and checking it is a prefix of the whole;
  a template that is not prefix-stable, or that refuses a partial conversation, falls back to the
  message's content start (its opening wrapper then ends the previous segment);
- a message whose content is a list of text parts gives one segment per part, joined by a
  newline, and its opening wrapper (``<|im_start|>user\\n``) becomes a short segment of its own:
  the part segments are then the same tokens wherever a retriever puts them, so they hit the cache.

So ``[system, user: doc A, user: doc B, user: question]`` under ChatML gives the segments
``<|im_start|>system\\n…<|im_end|>\\n``, ``<|im_start|>user\\nA<|im_end|>\\n``, … and the
generation prompt ends the last (query) segment. The segments' text is the template's render of
the unmarked conversation (a template that trims content would trim nothing behind a marker, so
cut positions are mapped across such whitespace). A model without a template gets ChatML.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PART_SEPARATOR = "\n"
_DEVELOPER = re.compile(r"""["']developer["']""")  # a template that names the role handles it


# The library's chat (``LLM.chat``) reads these too: kept free of the server's pydantic models.
ROLES = ("system", "developer", "user", "assistant", "tool")
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def needs_content(role: str, tool_calls: object) -> bool:
    """OpenAI's rule: every message has content but an assistant's that makes tool calls."""
    return not (role == "assistant" and tool_calls)


def no_content(role: str) -> str:
    """Why a ``role`` message without content is refused (``needs_content``)."""
    article = "an" if role == "assistant" else "a"  # the roles: system, developer, user, assistant, tool
    return f"{article} {role} message needs content (only an assistant's tool calls go without)"


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    taken = sorted(set(kwargs or {}) & TEMPLATE_VARIABLES)
    if taken:
        raise ValueError(f"chat_template_kwargs: {taken[0]!r} is not set through them (messages, tools and "
                         "add_generation_prompt have fields of their own; bos and eos tokens are the model's)")


@dataclass(frozen=True)
class ChatSegment:
    text: str
    message: int  # the message it comes from


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _token_text(value: Any) -> str:
    """tokenizer_config's bos/eos: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    """transformers' ``tojson`` filter, its arguments all (Kimi's templates pass ``separators``)."""
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


class ChatTemplate:
    def __init__(self, template: str | None = None, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self.source = template or CHATML
        self._template = env.from_string(self.source)
        self._extra = {"bos_token": bos_token, "eos_token": eos_token}
        self.bos_token, self.eos_token = bos_token, eos_token
        self._mark = f"\ue000{secrets.token_hex(8)}\ue001"  # private-use chars: never whitespace, never trimmed
        # OpenAI's ``developer`` is its newer name for ``system``; a template without a branch of its own
        # for it (Qwen3's) renders such a message as nothing, so it reaches those as ``system``
        self.developer_role = "developer" if _DEVELOPER.search(self.source) else "system"

    @classmethod
    def from_model(cls, tokenizer_config: dict[str, Any], folder: Any = None) -> ChatTemplate:
        """The template of a model folder: ``chat_template.jinja``, else tokenizer_config's
        ``chat_template`` (a string, or a list of named templates: "default"), else ChatML."""
        template = tokenizer_config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if folder is not None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        return cls(template if isinstance(template, str) else None,
                   bos_token=_token_text(tokenizer_config.get("bos_token")),
                   eos_token=_token_text(tokenizer_config.get("eos_token")))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               context: dict[str, Any] | None = None) -> str:
        """The template's text; ``context``: ``tools`` and the request's chat_template_kwargs."""
        try:
            return self._template.render(**{"tools": None, **self._extra, **(context or {})}, messages=messages,
                                         add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 — whatever the model's template raises on these messages
            # a template's own error on these messages (a filter's arguments, a missing field, a
            # division by a count): the request's, a 400 — it was a 500 when it was not one of jinja's
            raise ValueError(f"messages: the chat template refused them: {type(e).__name__}: {e}") from None

    def _message_start(self, marked: list[dict[str, Any]], i: int, full: str, lo: int, hi: int,
                       context: dict[str, Any] | None) -> int:
        """Where the template starts wrapping message i: the length of the render of messages[:i]
        when that is a prefix of the whole; else the message's content start ``hi``."""
        try:
            prefix = self.render(marked[:i], add_generation_prompt=False, context=context)
        except ValueError:
            return hi
        return len(prefix) if lo <= len(prefix) <= hi and full.startswith(prefix) else hi

    def segments(self, messages: list[tuple[str, list[str]]], context: dict[str, Any] | None = None,
                 extras: list[dict[str, Any]] | None = None, *, add_generation_prompt: bool = True,
                 continue_final_message: bool = False) -> list[ChatSegment]:
        """(role, text parts) per message → the rendered prompt as segments, the query last.
        ``context`` (``tools``: OpenAI's function definitions; the request's chat_template_kwargs,
        e.g. ``enable_thinking``) and each message's ``extras`` (an assistant's ``tool_calls``, a tool
        answer's ``tool_call_id``) go to the template as they are; a ``developer`` message goes as
        ``system`` unless the template names that role. ``add_generation_prompt``: the template's
        opening of the answer ends the prompt (vLLM's default); ``continue_final_message`` (vLLM's,
        not with it): the prompt ends where the last message's content does — the answer continues
        that message (a prefilled start of the reply) instead of beginning a new one."""
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message: not with add_generation_prompt (set it false)")
            if not "".join(messages[-1][1]):
                raise ValueError("continue_final_message: the last message has no content to continue")
        return self._segments(messages, context, extras, add_generation_prompt, continue_final_message)

    def _segments(self, messages: list[tuple[str, list[str]]], context: dict[str, Any] | None,
                  extras: list[dict[str, Any]] | None, add_generation_prompt: bool,
                  continue_final: bool = False) -> list[ChatSegment]:
        mark = self._mark
        extras = extras or [{} for _ in messages]
        messages = [(self.developer_role if role == "developer" else role, parts) for role, parts in messages]
        marked = [{**extra, "role": role, "content": PART_SEPARATOR.join(mark + p for p in parts)}
                  for (role, parts), extra in zip(messages, extras, strict=True)]
        plain_messages = [{**extra, "role": role, "content": PART_SEPARATOR.join(parts)}
                          for (role, parts), extra in zip(messages, extras, strict=True)]
        plain = self.render(plain_messages, add_generation_prompt=add_generation_prompt, context=context)
        full = self.render(marked, add_generation_prompt=add_generation_prompt, context=context)
        marks = [m.start() for m in re.finditer(re.escape(mark), full)]
        if len(marks) != sum(len(parts) for _, parts in messages):
            # the template cuts or repeats content (Qwen3 keeps an assistant's text after </think>
            # only, dropping the mark): cut where the plain render's message prefixes end instead
            return self._by_message(plain_messages, plain, context, continue_final)
        cuts: dict[int, int] = {0: 0}  # position in ``full`` → message index
        first = 0
        for i, (_, parts) in enumerate(messages):
            own = marks[first:first + len(parts)]
            if i > 0:
                cuts.setdefault(self._message_start(marked, i, full, marks[first - 1] + len(mark), own[0], context),
                                i)
            if len(parts) > 1:
                for pos in own:
                    cuts.setdefault(pos, i)
            first += len(parts)
        # Positions without the marks, then in the plain render (a template that trims content
        # trims nothing behind a mark: ``_align`` maps across the whitespace it would have removed).
        bounds = sorted((c - len(mark) * sum(m < c for m in marks), cuts[c]) for c in cuts)
        # continuing the last message: the prompt ends where its last part does, found by its mark
        # (a search for the text would also find it inside the template's own tokens: "im" in <|im_end|>)
        end = _part_end(full, marks[-1] + len(mark), messages[-1][1][-1]) if continue_final else len(full)
        end -= len(mark) * sum(m < end for m in marks)
        text = full.replace(mark, "")
        at = [b for b, _ in bounds] + [end]
        try:
            mapped = at if text == plain else _align(text, plain, at)
        except ValueError:  # the template changes content beyond whitespace
            return self._by_message(plain_messages, plain, context, continue_final)
        positions, stop = mapped[:-1], mapped[-1]
        ends = [*positions[1:], stop]
        return [ChatSegment(plain[a:min(b, stop)], m) for a, b, (_, m) in zip(positions, ends, bounds, strict=True)
                if min(b, stop) > a]

    def _by_message(self, plain_messages: list[dict[str, Any]], plain: str,
                    context: dict[str, Any] | None, continue_final: bool = False) -> list[ChatSegment]:
        """Segments of the plain render cut where the render of each leading run of messages ends,
        when that is a prefix of it (a message's parts are not told apart): what can still be cached
        when the template rewrites content; the prompt as one segment when nothing lines up."""
        if continue_final:
            raise ValueError("continue_final_message: the chat template rewrites the messages' content, so where "
                             "the last one ends cannot be found")
        cuts = [(0, 0)]
        for i in range(1, len(plain_messages)):
            try:
                prefix = self.render(plain_messages[:i], add_generation_prompt=False, context=context)
            except ValueError:
                continue
            if cuts[-1][0] < len(prefix) < len(plain) and plain.startswith(prefix):
                cuts.append((len(prefix), i))
        ends = [c for c, _ in cuts[1:]] + [len(plain)]
        return [ChatSegment(plain[a:b], m) for (a, m), b in zip(cuts, ends, strict=True) if b > a]


def _part_end(full: str, start: int, part: str) -> int:
    """Where a message's last part, rendered from ``start``, ends: the part whole, or without the
    trailing whitespace a template's ``trim`` took (transformers continues such a message the same way)."""
    for kept in (part, part.rstrip()):
        if kept and full.startswith(kept, start):
            return start + len(kept)
    raise ValueError("continue_final_message: the chat template changes the last message's content; cannot "
                     "continue it")


def _align(marked: str, plain: str, cuts: list[int]) -> list[int]:
    """Map sorted positions of ``marked`` onto ``plain``, which differs only by whitespace the
    template stripped next to a part's start."""
    out, i, j, k = [], 0, 0, 0
    while True:
        while k < len(cuts) and cuts[k] == i:
            out.append(j)
            k += 1
        if i == len(marked) and j == len(plain):
            return out
        if i < len(marked) and j < len(plain) and marked[i] == plain[j]:
            i, j = i + 1, j + 1
        elif i < len(marked) and marked[i].isspace():
            i += 1
        elif j < len(plain) and plain[j].isspace():
            j += 1
        else:
            raise ValueError("messages: the chat template changes message content; cannot keep segments apart")
