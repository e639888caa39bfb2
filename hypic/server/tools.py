"""Tool calling in chat: OpenAI's ``tools`` and ``tool_choice`` on top of structured output.

The tools are handed to the model's chat template (``tools``, as transformers' ``apply_chat_template``
passes them: Qwen's templates list them in the system turn), so the model knows what it may call.
Then, by ``tool_choice``:

- ``required`` or a named function: decoding is constrained (``SamplingParams.json_schema``) to
  calls ``{"name": …, "arguments": {…}}`` whose arguments the function's ``parameters`` schema
  accepts — a list of them for ``required`` with parallel calls, else one — model-agnostic, as vLLM
  does it; the answer is those calls (``finish_reason: tool_calls``);
- ``auto`` (the default with tools): decoding is free and the text is searched for calls in the
  formats the supported families' templates teach — Hermes JSON (``<tool_call>{"name": …, "arguments":
  …}</tool_call>``, Qwen2.5 / Qwen3), XML (``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>…``,
  Qwen3-Coder / Qwen3.5; a value is JSON unless its parameter is declared a string), MiniMax-M1's
  block of JSON calls, one a line (``<tool_calls>\n{"name": …, "arguments": …}\n…</tool_calls>``), and
  Kimi's section of calls between special tokens (``<|tool_calls_section_begin|><|tool_call_begin|>
  functions.NAME:0<|tool_call_argument_begin|>{…}<|tool_call_end|>…``: its answer is detokenized with
  special tokens kept, ``ToolCalling.special_text``); calls found become ``tool_calls``, the rest
  stays ``content``;
- ``auto`` with a function marked ``strict`` (OpenAI's promise that a call's arguments match its
  schema): decoding is free until the model opens a call in its template's format (``call_style``),
  then constrained to a call of a listed function — a strict one's arguments its ``parameters``
  accept, another's any object — and free again after it: a structural tag (``strict_calls``), as
  SGLang serves ``strict``. Kimi's calls are written in special tokens: its tag names them with
  xgrammar's token-level formats (``token_triggered_tags``), so each marker is that one token;
- ``none``: plain text.

With ``parallel_tool_calls`` (OpenAI's default) ``required`` is constrained to a list of one call or
more (vLLM's shape) and ``auto`` returns every well-formed block; with it false, one call (the
first). A named function is one call of it. Streamed, an ``auto`` answer's text flows as it comes —
held back only where it could be the start of a ``<tool_call>`` or ``<tool_calls>`` tag, and from a
tag on to the end (``StreamedCalls``) — and its calls come whole in the last chunk; a forced call
comes whole in one chunk (a call is not useful in pieces).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from hypic.engine.structured import compile_schema, compile_tags
from hypic.server.text import partial_tag

KIMI_OPEN = "<|tool_calls_section_begin|>"
# one call (Qwen), a block of calls a line each (MiniMax-M1), a section of calls (Kimi)
OPENS = ("<tool_call>", "<tool_calls>", KIMI_OPEN)
BLOCK = re.compile(r"<(tool_calls?)>\s*(.*?)\s*(?:</\1>|$)"
                   r"|<\|tool_calls_section_begin\|>(.*?)(?:<\|tool_calls_section_end\|>|$)", re.DOTALL)
KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*((?:functions\.)?([^:<\s]+):\d+)\s*<\|tool_call_argument_begin\|>"
                       r"(.*?)(?:<\|tool_call_end\|>|$)", re.DOTALL)
THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)
XML_CALL = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>\s*$|$)", re.DOTALL)
XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCalling:
    """How one chat request calls tools: ``forced`` (required or named: constrained to ``schema``)
    or ``auto`` (free text, searched for calls); ``names`` the functions it may call."""

    forced: bool
    names: tuple[str, ...]
    schema: dict | None  # the call's JSON schema when forced
    parameters: dict[str, dict] = field(default_factory=dict)  # name → its parameters schema (XML values' types)
    special_text: bool = False  # the answer is read with special tokens kept (Kimi's call markers are ones)
    # Kimi's ids, functions.NAME:IDX with IDX counting the conversation's calls, for a forced call: its
    # template writes ids back into the next prompt, and the model was trained on that form
    kimi_index: int | None = None
    tag: dict | None = None  # auto with strict functions: the structural tag its calls are held to
    parallel: bool = True  # parallel_tool_calls: more than one call per answer

    def message(self, text: str, finish: str) -> tuple[dict[str, Any], str]:
        """The assistant message and finish reason for a generated ``text``."""
        if self.forced:
            # a whole value has the call's shape (the matcher saw to it); a stop string may have cut it
            calls = (_forced_calls(text, self.names) or []) if finish == "stop" else []
            if self.kimi_index is not None:
                for k, call in enumerate(calls):
                    call["id"] = f"functions.{call['function']['name']}:{self.kimi_index + k}"
            content = None if calls else text
        else:
            calls, content = parse_calls(text, self.names, self.parameters)
            if not self.parallel:  # one call at most: the first
                calls = calls[:1]
        if not calls:
            return {"role": "assistant", "content": text}, finish
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def plan(tools: list[dict[str, Any]] | None, choice: str | dict | None, style: str | None = "hermes",
         parallel: bool = True) -> ToolCalling | None:
    """The request's tool calling, or None (no tools, or ``none``); ValueError naming the field.
    ``style``: how the model writes a call (``call_style`` of its template); None: strict functions
    are not enforced (the request constrains its answer otherwise). ``parallel`` (parallel_tool_calls,
    OpenAI's default): ``required`` is a list of one call or more (vLLM's), ``auto`` keeps every
    call; else one call, the first."""
    names = tuple(t["function"]["name"] for t in tools or [])
    if len(set(names)) != len(names):
        raise ValueError("tools: two tools share a name")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: needs tools")
        return None
    if choice == "none":
        return None
    parameters = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    if choice in (None, "auto"):
        strict = any(t["function"].get("strict") for t in tools) and style is not None
        return ToolCalling(False, names, None, parameters, parallel=parallel,
                           tag=strict_calls(tools, style, parallel) if strict else None)
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise ValueError(f"tool_choice: no tool is named {name!r}")
    options, defs = [], {}
    for k, t in enumerate(tools):  # "required": every tool; a named one: that one
        f = t["function"]
        if isinstance(choice, dict) and f["name"] != choice["function"]["name"]:
            continue
        schema = f.get("parameters") or {"type": "object", "properties": {}}
        option = {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": schema},
                  "required": ["name", "arguments"], "additionalProperties": False}
        try:  # named where the request holds it
            compile_schema(schema)
            option, own = _hoisted(option, f"tools.{k}.")
            compile_schema({**option, "$defs": own})  # the call around the arguments nests them one deeper
        except ValueError as e:
            raise ValueError(f"tools[{k}].function.parameters{str(e).removeprefix('json_schema')}") from None
        options.append(option)
        defs |= own
    forced = options[0] if len(options) == 1 else {"anyOf": options}
    if parallel and choice == "required":  # calls in a list (a named function: that one call)
        forced = {"type": "array", "items": forced, "minItems": 1}
    return ToolCalling(True, names, {**forced, "$defs": defs} if defs else forced, parameters, parallel=parallel)


# How a family's template teaches calls, told apart by a marker only that format has (Kimi's first:
# its template also names <tool_call>-like words; MiniMax-M1's <tool_calls> before Qwen's <tool_call>)
STYLE_MARKERS = (("kimi", "tool_calls_section_begin"), ("minimax", "<tool_calls>"), ("qwen_xml", "<function="))


def call_style(template: str) -> str:
    """The call format a chat template teaches: ``qwen_xml`` (Qwen3-Coder / Qwen3.5), ``minimax``
    (M1's block of JSON lines), ``kimi`` (special tokens), else ``hermes`` (Qwen2.5 / Qwen3; what a
    template that teaches none — ChatML — is given)."""
    return next((style for style, marker in STYLE_MARKERS if marker in template), "hermes")


def call_tags(tools: list[dict[str, Any]], style: str) -> list[dict]:
    """One xgrammar ``tag`` per function: a call of it written as ``style`` writes one (for
    ``minimax`` the call inside its block; for ``kimi`` what lies between its call markers). A
    strict function's arguments are held to its ``parameters``; another's to any object (its call
    must still parse to be a call)."""
    tags = []
    for t in tools:
        f = t["function"]
        schema = (f.get("parameters") or {"type": "object", "properties": {}}) if f.get("strict") \
            else {"type": "object"}
        if style == "kimi":  # functions.NAME:IDX, then the arguments; the markers around are the caller's
            tags.append({"type": "sequence", "elements": [
                {"type": "const_string", "value": f"functions.{f['name']}:"},
                {"type": "regex", "pattern": "[0-9]{1,6}"},
                _token("<|tool_call_argument_begin|>"), {"type": "json_schema", "json_schema": schema}]})
        elif style == "qwen_xml":
            tags.append({"type": "tag", "begin": f"<tool_call>\n<function={f['name']}>\n",
                         "content": {"type": "json_schema", "json_schema": schema, "style": "qwen_xml"},
                         "end": "\n</function>\n</tool_call>"})
        else:
            head = "" if style == "minimax" else "<tool_call>\n"
            tail = "" if style == "minimax" else "\n</tool_call>"
            tags.append({"type": "tag", "begin": f'{head}{{"name": {json.dumps(f["name"])}, "arguments": ',
                         "content": {"type": "json_schema", "json_schema": schema}, "end": f"}}{tail}"})
    return tags


def strict_calls(tools: list[dict[str, Any]], style: str, parallel: bool = True) -> dict:
    """``auto``'s structural tag with strict functions: free text, and each call opened in ``style``
    held to ``call_tags`` — without ``parallel`` calls the answer ends with the first (xgrammar's
    ``stop_after_first``); ValueError naming ``tools[k].function.parameters`` when a strict schema
    cannot be served."""
    tags = call_tags(tools, style)
    for k, tag in enumerate(tags):  # each on its own first: an error names the tool
        try:
            compile_tags({"type": "structural_tag", "format": tag})
        except ValueError as e:
            _, inside, rest = str(e).partition(".json_schema")
            if not inside:  # about the tag's whole text (not JSON, a lone surrogate): its reason, not nothing
                rest = ": " + str(e).partition(": ")[2]
            raise ValueError(f"tools[{k}].function.parameters{rest}") from None
    if style == "kimi":  # a section of calls, every marker a special token of Kimi's
        call = {"type": "tag", "begin": _token("<|tool_call_begin|>"), "end": _token("<|tool_call_end|>"),
                "content": tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}}
        section = {"type": "tag", "begin": _token(KIMI_OPEN), "end": _token("<|tool_calls_section_end|>"),
                   "content": {"type": "plus", "content": call} if parallel else call}
        fmt = {"type": "token_triggered_tags", "trigger_tokens": [KIMI_OPEN], "tags": [section],
               "stop_after_first": not parallel}
    elif style == "minimax":  # one block, the calls in it one a line
        block = {"type": "tag", "begin": "<tool_calls>\n", "end": "\n</tool_calls>",
                 "content": {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                             "stop_after_first": not parallel}}
        fmt = {"type": "triggered_tags", "triggers": ["<tool_calls>"], "tags": [block],
               "stop_after_first": not parallel}
    else:
        trigger = "<tool_call>\n<function=" if style == "qwen_xml" else "<tool_call>"
        fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "stop_after_first": not parallel}
    return {"type": "structural_tag", "format": fmt}


def _token(text: str) -> dict:
    return {"type": "token", "token": text}


# where a JSON Schema holds schemas (the rest — enum, const, default, examples … — is data)
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")


def _hoisted(schema: dict, prefix: str) -> tuple[dict, dict]:
    """A tool's schema made to stand inside the forced call's: a ``$ref`` names the root of the
    document it is in, and the call's root is not the parameters' any more. So the parameters'
    definitions move up under names of their own (``prefix`` + section + name: two tools' ``Address``
    stay apart) and every reference is rewritten → (the schema without them, the definitions)."""
    defs: dict = {}
    args = schema["properties"]["arguments"]
    for section in ("$defs", "definitions"):
        for name, sub in (args.get(section) or {}).items() if isinstance(args, dict) else ():
            defs[f"{prefix}{section.lstrip('$')}.{name}"] = sub

    def rename(ref: str) -> str:
        for section in ("$defs", "definitions"):
            head = f"#/{section}/"
            if ref.startswith(head):
                return f"#/$defs/{prefix}{section.lstrip('$')}.{ref[len(head):]}"
        return ref

    def walk(node: object) -> object:
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                out[key] = rename(value)
            elif key in ("$defs", "definitions") and node is args:
                continue  # moved up
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {name: walk(sub) for name, sub in value.items()}
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                out[key] = [walk(sub) for sub in value]
            elif key in _SCHEMA_ONES:
                out[key] = walk(value)
            else:
                out[key] = value
        return out

    return walk(schema), {name: walk(sub) for name, sub in defs.items()}


def parse_calls(text: str, names: tuple[str, ...], parameters: dict[str, dict] | None = None
                ) -> tuple[list[dict[str, Any]], str | None]:
    """Calls in free text (module docstring) → (calls, the text left, None when nothing is). A
    block that is not a call of a known function stays in the text, as the model wrote it. The text
    left is what a stream of the answer sends (``StreamedCalls``): all before the first tag as it is
    (vLLM's content too), and what is left of the rest unless that is only whitespace."""
    first = _first_open(text)
    if first is None:
        return [], text
    calls, rest = _split(text, names, parameters or {}, first)
    if not calls:
        return [], text
    kept = text[:first] + (rest if rest.strip() else "")
    return calls, kept if kept.strip() else None


def _first_open(text: str) -> int | None:
    """Where the first call tag (``OPENS``) begins in ``text``; None without one."""
    return min((at for at in (text.find(t) for t in OPENS) if at >= 0), default=None)


def _split(text: str, names: tuple[str, ...], parameters: dict[str, dict], start: int = 0
           ) -> tuple[list[dict[str, Any]], str]:
    """The calls in ``text[start:]`` and the text around them there, as it is. A block inside
    ``<think>…</think>`` (reasoning not split off: no ``--reasoning-parser``) is the model thinking
    about a call, not making one (MiniMax-M1 drafts calls there) — read over the whole text, as a
    ``<think>`` may open before ``start``."""
    calls, kept, at = [], [], start
    thinking = [m.span() for m in THINK.finditer(text)]
    for m in BLOCK.finditer(text, start):
        if any(a <= m.start() < b for a, b in thinking):
            continue
        if m.group(3) is not None:  # Kimi's section: name and arguments apart
            # the model's own id (functions.NAME:IDX): Kimi's template writes ids back into the prompt
            found = [_call(name, a, call_id) if name in names and isinstance(a := _json(args), dict) else None
                     for call_id, name, args in KIMI_CALL.findall(m.group(3))]
        else:
            inner = [m.group(2)] if m.group(1) == "tool_call" else [x for x in m.group(2).splitlines() if x.strip()]
            found = [_parsed(x.strip(), names, parameters) for x in inner]
        if not found or None in found:  # a block is calls only when every one in it is
            continue
        calls += found
        kept.append(text[at:m.start()])
        at = m.end()
    kept.append(text[at:])
    return calls, "".join(kept)


def _parsed(text: str, names: tuple[str, ...], parameters: dict[str, dict]) -> dict[str, Any] | None:
    """A call of a known function — JSON ``{"name": …, "arguments": {…}}`` or XML ``<function=…>`` —
    in OpenAI's shape; else None."""
    xml = XML_CALL.match(text)
    if xml is not None:
        name = xml.group(1)
        if name not in names:
            return None
        props = (parameters.get(name) or {}).get("properties") or {}
        args = {k: _xml_value(v, props.get(k)) for k, v in XML_PARAMETER.findall(xml.group(2))}
        return _call(name, args)
    return _call_of(_json(text), names)


def _forced_calls(text: str, names: tuple[str, ...]) -> list[dict[str, Any]] | None:
    """A forced answer's calls: one call's JSON, or a list of them; None when it is neither."""
    value = _json(text)
    found = [_call_of(v, names) for v in (value if isinstance(value, list) else [value])]
    return None if not found or None in found else found


def _call_of(value: object, names: tuple[str, ...]) -> dict[str, Any] | None:
    """A JSON call ``{"name": …, "arguments": {…}}`` (or vLLM's ``parameters``) of a known function, in
    OpenAI's shape; else None."""
    args = value.get("arguments", value.get("parameters")) if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("name") not in names or not isinstance(args, dict):
        return None
    return _call(value["name"], args)


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's stack ("[[[…")
        return None  # not a call's arguments: the block stays text


def _xml_value(text: str, schema: object) -> object:
    """An XML parameter's value: the text itself for a declared string, else its JSON when it is JSON."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _call(name: str, arguments: object, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


class StreamedCalls:
    """One streamed answer with tools: which text may go out now, and the last chunk's delta."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling, self.text, self.sent = calling, "", 0

    def push(self, piece: str) -> str:
        """The content that can go out now: none for a forced call; for ``auto`` the text up to a
        ``<tool_call>`` tag, or up to a suffix that could still grow into one."""
        self.text += piece
        if self.calling.forced:
            return ""
        end = _first_open(self.text)
        if end is None:
            end = len(self.text) - max(partial_tag(self.text, t) for t in OPENS)
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self, finish: str) -> tuple[dict[str, Any], str]:
        """The last chunk's delta (what was held: calls, or the rest of the text) and finish reason."""
        message, reason = self.calling.message(self.text, finish)
        if "tool_calls" not in message:
            return {"content": self.text[self.sent:]}, reason
        calls = [{**call, "index": k} for k, call in enumerate(message["tool_calls"])]  # a streamed call's index
        rest = "" if self.calling.forced else _split(self.text, self.calling.names, self.calling.parameters,
                                                          self.sent)[1]
        return ({"content": rest} if rest.strip() else {}) | {"tool_calls": calls}, reason
