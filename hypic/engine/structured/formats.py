"""xgrammar's structural-tag formats: ``{"type": "structural_tag", "format": {...}}``, a tree of
format objects, each matching one chunk of the answer, compiled to the frames the structured-output
matcher already runs — one mechanism under JSON schemas, regexes, grammars and tags:

| format | fields | frames |
|---|---|---|
| ``const_string`` | value | a ``Word`` |
| ``json_schema`` | json_schema, style | the schema's nodes, its number handing back (``tags.json_value``); |
| | | style ``qwen_xml``: an object's properties as ``<parameter=…>`` (``qwen_xml.py``) |
| ``grammar`` | grammar (GBNF or Lark) | the grammar's start rule |
| ``regex`` | pattern | a ``Text``, the pattern matching the chunk whole |
| ``any_text`` | excludes, max_chars | free text holding none of them (``tags.Tagged`` with no triggers) |
| ``sequence`` / ``or`` | elements | ``Seq`` / ``Alt`` |
| ``optional`` / ``plus`` / ``star`` / ``repeat`` | content (min, max) | ``Rep`` |
| ``tag`` | begin, content, end (a string or a list; either may be a ``token``) | ``Seq`` of them |
| ``triggered_tags`` | triggers, tags, excludes, at_least_one, stop_after_first | ``Tagged`` |
| ``token`` | token (its text or id) | a ``Word`` of the token's mark (``tags.token_mark``) |
| ``token_triggered_tags`` | trigger_tokens, tags (token begins), exclude_tokens, at_least_one, | ``Tagged``, |
| | stop_after_first | token-level |
| ``any_tokens`` | exclude_tokens | ``Tagged`` with no triggers, token-level |
| ``dispatch`` | rules ([pattern, format] pairs), loop, excludes | ``Tagged``, each pattern a trigger |
| ``tags_with_separator`` | tags, separator, at_least_one, stop_after_first | ``Seq`` / ``Rep`` of the tags |

Text without a bound of its own (``any_text``, the free text of ``triggered_tags`` and ``dispatch``)
inside a tag stops at the tag's end: the end is among what that text excludes (xgrammar's rule, the
enclosing end as its stop condition), handed down to a sequence's last element, each option of an ``or`` and a
repetition's content. A token-level format's tokens are the tokenizer's special and added ones, each
read as its mark — written by that token alone, so no text can spell it — and its free text is any
text and any such token but the excluded ones; which tokens a tag names is checked against the
model's tokenizer when a request is taken (``named_tokens``). ``exclude_token``, ``token_tag_dispatch``,
other XML styles, ``any_order`` and ``any_text``'s ``max_tokens`` are refused by name; every refusal names the field, as
``structural_tag.format.elements[1].content.end``.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from hypic.engine.structured.grammar import MAX_REPEAT, Rep, Seq, Word, compile_grammar, settle_repeats
from hypic.engine.structured.matcher import MAX_HOPS
from hypic.engine.structured.qwen_xml import compile_qwen_xml
from hypic.engine.structured.schema import MAX_CHAIN, Alt, check_depth
from hypic.engine.structured.tags import (
    MAX_TRIGGER_BYTES,
    MAX_TRIGGERS,
    Tagged,
    _entries,
    _triggers,
    free_text,
    json_value,
    marker,
    then_end,
    token_mark,
    triggered,
)
from hypic.engine.structured.text import compile_text

MAX_FORMATS = 2048  # format objects in one tag (each a few frames; tools run to hundreds, not thousands)
MAX_NESTING = 32  # formats inside formats
# every free text's trigger and exclude prefixes, summed over the tree (each text's own ≤ 64 marks of
# ≤ 128 bytes: 512 KiB; 400 of them would hold ~ 1 GB of sets in memory)
MAX_PREFIX_BYTES = 1 << 20
HOPS_EACH = 4  # hops a byte takes to cross a chunk that reads nothing (a grammar's: Seq, Ref, Rep, back)
NOT_SERVED = {
    "exclude_token": "one token by what it is not: a token, any_tokens and token_triggered_tags are served",
    "token_dispatch": "token_triggered_tags is served",
    "token_tag_dispatch": "token_triggered_tags is served",
}

Ends = tuple[str | bytes, ...]  # the enclosing tag's ends, where the text being compiled may stop (bytes: a token's)


class _Compiler:
    """One format tree being compiled: the objects met (their frames), how deep they nest, the hops of
    chunks inside a format that may be left out (``passes``: qwen_xml's optional parameters) and the
    prefixes its free texts watch for."""

    def __init__(self) -> None:
        self.count = self.depth = self.deepest = self.passes = self.prefix_bytes = 0
        self.nodes: list[object] = []  # each format object's frames

    def format(self, fmt: object, where: str, ends: Ends = ()) -> object:
        self.count += 1
        if self.count > MAX_FORMATS:
            raise ValueError(f"{where}: more than {MAX_FORMATS} format objects in one structural tag")
        if self.depth >= MAX_NESTING:
            raise ValueError(f"{where}: formats nested more than {MAX_NESTING} deep")
        self.depth += 1
        self.deepest = max(self.deepest, self.depth)
        try:
            node = self._format(fmt, where, ends)
        finally:
            self.depth -= 1
        self.nodes.append(node)
        if isinstance(node, Tagged):  # free text reads against every prefix of its marks, a set held
            self.prefix_bytes += sum(map(len, node.prefixes))
            if self.prefix_bytes > MAX_PREFIX_BYTES:
                raise ValueError(f"{where}: the triggers and excludes of this structural tag's free texts come to "
                                 f"more than {MAX_PREFIX_BYTES >> 10} KiB of prefixes to watch for")
        return node

    def check_hops(self, empty: set[int], where: str) -> None:
        """The matcher hands a byte on at most MAX_HOPS times: past it, a byte that a long run of
        chunks that may be empty leads to would be refused though the format accepts it. Each such
        chunk costs a few hops (a grammar's: its rule and repetition frames; a repetition of them as
        much: a byte enters one iteration), each level of nesting a few."""
        passes = self.passes + HOPS_EACH * sum(id(n) in empty for n in self.nodes)
        if passes + HOPS_EACH * self.deepest + MAX_CHAIN > MAX_HOPS:
            room = (MAX_HOPS - MAX_CHAIN) // HOPS_EACH - self.deepest
            raise ValueError(f"{where}: more than {room} formats that may be empty (a byte may cross each unread, "
                             "and the matcher follows it so far)")

    def _format(self, fmt: object, where: str, ends: Ends) -> object:
        if not isinstance(fmt, dict):
            raise ValueError(f"{where}: expected an object (a format), got {type(fmt).__name__}")
        kind = fmt.get("type")
        if not isinstance(kind, str):
            raise ValueError(f"{where}.type: expected a string naming the format, got {kind!r}")
        if kind in NOT_SERVED:
            raise ValueError(f"{where}.type: {kind!r} is not served ({NOT_SERVED[kind]})")
        if kind not in KINDS:
            raise ValueError(f"{where}.type: expected one of {sorted(KINDS)}, got {kind!r}")
        required, optional, build = KINDS[kind]
        missing = sorted(required - set(fmt))
        if missing:
            raise ValueError(f"{where}.{missing[0]}: required for {kind}")
        unknown = sorted(set(fmt) - required - optional - {"type"})
        if unknown:
            raise ValueError(f"{where}: unknown field {unknown[0]!r} for {kind}")
        return build(self, fmt, where, ends)

    def const_string(self, fmt: dict, where: str, ends: Ends) -> object:
        value = fmt["value"]
        if not isinstance(value, str):
            raise ValueError(f"{where}.value: expected a string, got {type(value).__name__}")
        return Word(value.encode()) if value else Seq(())

    def json_schema(self, fmt: dict, where: str, ends: Ends) -> object:
        style = fmt.get("style", "json")
        if style not in ("json", "qwen_xml"):
            raise ValueError(f"{where}.style: {style!r} is not served (json or qwen_xml)")
        if fmt.get("any_order", False) is not False:
            raise ValueError(f"{where}.any_order: not served (properties come in their declared order)")
        if style == "qwen_xml":
            node, optional = compile_qwen_xml(fmt["json_schema"], f"{where}.json_schema")
            self.passes += HOPS_EACH * optional  # each parameter that may be left out is crossed unread
            return node
        try:
            return json_value(fmt["json_schema"])
        except ValueError as e:  # "json_schema.properties.a: why" or "json_schema: why": the path continued
            text = str(e)
            raise ValueError(f"{where}.{text}" if text.startswith("json_schema.")
                             else f"{where}.json_schema: {text.removeprefix('json_schema: ')}") from None

    def grammar(self, fmt: dict, where: str, ends: Ends) -> object:
        try:
            return compile_grammar(fmt["grammar"])
        except ValueError as e:
            raise ValueError(f"{where}.grammar: {str(e).removeprefix('grammar: ')}") from None

    def regex(self, fmt: dict, where: str, ends: Ends) -> object:
        pattern = fmt["pattern"]
        if not isinstance(pattern, str):
            raise ValueError(f"{where}.pattern: expected a string, got {type(pattern).__name__}")
        try:
            return compile_text(regex=pattern)
        except ValueError as e:
            raise ValueError(f"{where}.pattern: {str(e).removeprefix('regex: ')}") from None

    def any_text(self, fmt: dict, where: str, ends: Ends) -> object:
        if fmt.get("max_tokens") is not None:
            raise ValueError(f"{where}.max_tokens: not served (max_chars is; the request's max_tokens bounds "
                             "the answer)")
        limit = fmt.get("max_chars")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or not 0 <= limit < 2**31):
            raise ValueError(f"{where}.max_chars: expected a non-negative integer below 2**31, got {limit!r}")
        return free_text((), (), _excludes(fmt.get("excludes", []), ends, f"{where}.excludes"), max_chars=limit)

    def sequence(self, fmt: dict, where: str, ends: Ends) -> object:
        elements = self._elements(fmt, where)
        last = len(elements) - 1
        items = tuple(self.format(e, f"{where}.elements[{i}]", ends if i == last else ())
                      for i, e in enumerate(elements))
        return items[0] if len(items) == 1 else Seq(items)

    def one_of(self, fmt: dict, where: str, ends: Ends) -> object:
        elements = self._elements(fmt, where)
        options = tuple(self.format(e, f"{where}.elements[{i}]", ends) for i, e in enumerate(elements))
        return options[0] if len(options) == 1 else Alt(options)

    def _elements(self, fmt: dict, where: str) -> list:
        elements = fmt["elements"]
        if not isinstance(elements, list) or not elements:
            raise ValueError(f"{where}.elements: expected a non-empty list of formats")
        return elements

    def repeat(self, fmt: dict, where: str, ends: Ends) -> object:
        low, high = {"optional": (0, 1), "plus": (1, -1), "star": (0, -1)}.get(fmt["type"], (None, None))
        if low is None:
            low, high = fmt["min"], fmt["max"]
            for name, n in (("min", low), ("max", high)):
                if not isinstance(n, int) or isinstance(n, bool) or n < (0 if name == "min" else -1):
                    raise ValueError(f"{where}.{name}: expected a non-negative integer{' or -1' * (name == 'max')}, "
                                     f"got {n!r}")
            if high != -1 and high < low:
                raise ValueError(f"{where}: max {high} is below min {low}")
            if max(low, high) > MAX_REPEAT:
                raise ValueError(f"{where}: a bound above {MAX_REPEAT} (each count is a state of its own)")
        content = self.format(fmt["content"], f"{where}.content", ends)
        return Rep(content, low, None if high == -1 else high)

    def token(self, fmt: dict, where: str, ends: Ends) -> object:
        return Word(token_mark(fmt["token"], f"{where}.token"))

    def any_tokens(self, fmt: dict, where: str, ends: Ends) -> object:
        return free_text((), (), _excludes(_marks(fmt.get("exclude_tokens", []), f"{where}.exclude_tokens", True),
                                           ends, f"{where}.exclude_tokens"), tokens=True)

    def token_triggered_tags(self, fmt: dict, where: str, ends: Ends) -> object:
        at_least_one, stop_after_first = _flags(fmt, where)
        triggers = _marks(fmt["trigger_tokens"], f"{where}.trigger_tokens")
        if len(triggers) > MAX_TRIGGERS:
            raise ValueError(f"{where}.trigger_tokens: at most {MAX_TRIGGERS}")
        items = []
        for w, t, own in self._tags(fmt, where):
            if not isinstance(t["begin"], dict):
                raise ValueError(f"{w}.begin: expected a token (a token trigger opens it), got a string")
            begin = _token_format(t["begin"], f"{w}.begin")
            items.append((w, begin, self.format(t["content"], f"{w}.content", own), own))
        excludes = _excludes(_marks(fmt.get("exclude_tokens", []), f"{where}.exclude_tokens", True), ends,
                             f"{where}.exclude_tokens")
        return triggered(triggers, items, excludes, at_least_one, stop_after_first, where, tokens=True)

    def tag(self, fmt: dict, where: str, ends: Ends) -> object:
        begin = fmt["begin"]
        data = _token_format(begin, f"{where}.begin") if isinstance(begin, dict) else marker(begin, f"{where}.begin")
        own = _ends(fmt["end"], f"{where}.end")
        body = then_end(self.format(fmt["content"], f"{where}.content", own), own, f"{where}.end")
        return Seq((Word(data), body)) if data else body

    def triggered_tags(self, fmt: dict, where: str, ends: Ends) -> object:
        at_least_one, stop_after_first = _flags(fmt, where)
        triggers = _triggers(fmt["triggers"], f"{where}.triggers")
        items = [(w, t["begin"], self.format(t["content"], f"{w}.content", own), own)
                 for w, t, own in self._tags(fmt, where)]
        excludes = _excludes(fmt.get("excludes", []), ends, f"{where}.excludes")
        return triggered(triggers, items, excludes, at_least_one, stop_after_first, where)

    def dispatch(self, fmt: dict, where: str, ends: Ends) -> object:
        """Free text in which each rule's pattern, once written, is followed by its format — the
        triggered_tags frame with each pattern a trigger and its whole begin; ``loop`` false: the
        dispatch ends with the first format."""
        loop = fmt.get("loop", True)
        if not isinstance(loop, bool):
            raise ValueError(f"{where}.loop: expected a boolean, got {loop!r}")
        rules = fmt["rules"]
        if not isinstance(rules, list) or not rules or len(rules) > MAX_TRIGGERS:
            raise ValueError(f"{where}.rules: expected a non-empty list of at most {MAX_TRIGGERS} [pattern, format] "
                             "pairs")
        items = []
        for i, rule in enumerate(rules):
            w = f"{where}.rules[{i}]"
            if not isinstance(rule, list) or len(rule) != 2 or not isinstance(rule[0], str) or not rule[0]:
                raise ValueError(f"{w}: expected [pattern, format], the pattern a non-empty string")
            items.append((w, rule[0], self.format(rule[1], f"{w}[1]"), ("",)))
        triggers = _triggers([r[0] for r in rules], f"{where}.rules")
        excludes = _excludes(fmt.get("excludes", []), ends, f"{where}.excludes")
        return triggered(triggers, items, excludes, stop_after_first=not loop, where=where)

    def tags_with_separator(self, fmt: dict, where: str, ends: Ends) -> object:
        at_least_one, stop_after_first = _flags(fmt, where)
        separator = marker(fmt["separator"], f"{where}.separator")
        tags = [self.tag({"begin": t["begin"], "content": t["content"], "end": t["end"]}, w, ())
                for w, t, _ in self._tags(fmt, where)]
        one = tags[0] if len(tags) == 1 else Alt(tuple(tags))
        more = one if stop_after_first else Seq((one, Rep(Seq((Word(separator), one)) if separator else one, 0, None)))
        return more if at_least_one else Rep(more, 0, 1)

    def _tags(self, fmt: dict, where: str) -> list[tuple[str, dict, Ends]]:
        out = []
        for w, t in _entries(fmt["tags"], f"{where}.tags", {"begin", "content", "end"}, {"type"}):
            if t.get("type", "tag") != "tag":
                raise ValueError(f"{w}.type: expected 'tag', got {t['type']!r}")
            out.append((w, t, _ends(t["end"], f"{w}.end")))
        return out


def _token_format(fmt: dict, where: str) -> bytes:
    """A tag's begin or end given as a ``token`` format: its mark."""
    if fmt.get("type", "token") != "token" or set(fmt) - {"type", "token"} or "token" not in fmt:
        raise ValueError(f"{where}: expected a string or a token format ({{\"type\": \"token\", \"token\": …}})")
    return token_mark(fmt["token"], f"{where}.token")


def _marks(tokens: object, where: str, may_be_empty: bool = False) -> tuple[bytes, ...]:
    """A list of tokens (texts or ids) as their marks."""
    if not isinstance(tokens, list) or not (tokens or may_be_empty):
        raise ValueError(f"{where}: expected a {'' if may_be_empty else 'non-empty '}list of tokens (texts or ids)")
    return tuple(dict.fromkeys(token_mark(t, f"{where}[{i}]") for i, t in enumerate(tokens)))


def _ends(end: object, where: str) -> Ends:
    """A tag's end: a string, a non-empty list of them (any one closes it), or a token format."""
    if isinstance(end, str):
        return (end,)
    if isinstance(end, list) and end and all(isinstance(e, str) for e in end):
        return tuple(end)
    if isinstance(end, dict):
        return (_token_format(end, where),)
    raise ValueError(f"{where}: expected a string, a non-empty list of strings or a token format")


def _excludes(given: object, ends: Ends, where: str) -> tuple[bytes, ...]:
    """What free text may not hold: the strings given (or tokens' marks) and the enclosing tag's non-empty ends."""
    if not isinstance(given, (list, tuple)) or not all(isinstance(e, (str, bytes)) and e for e in given):
        raise ValueError(f"{where}: expected a list of non-empty strings")
    marks = tuple(dict.fromkeys([marker(e, where) for e in given] + [marker(e, where) for e in ends if e]))
    if len(marks) > MAX_TRIGGERS or any(len(m) > MAX_TRIGGER_BYTES for m in marks):
        # free text is read against every prefix of each (a set built at compile time)
        raise ValueError(f"{where}: at most {MAX_TRIGGERS} strings (the enclosing tag's ends among them), each at "
                         f"most {MAX_TRIGGER_BYTES} bytes, where free text stops")
    return marks


def _flags(fmt: dict, where: str) -> tuple[bool, bool]:
    flags = tuple(fmt.get(name, False) for name in ("at_least_one", "stop_after_first"))
    for name, flag in zip(("at_least_one", "stop_after_first"), flags, strict=True):
        if not isinstance(flag, bool):
            raise ValueError(f"{where}.{name}: expected a boolean, got {flag!r}")
    return flags  # type: ignore[return-value]


Build = Callable[[_Compiler, dict, str, Ends], object]
KINDS: dict[str, tuple[set[str], set[str], Build]] = {
    "const_string": ({"value"}, set(), _Compiler.const_string),
    "json_schema": ({"json_schema"}, {"style", "any_order"}, _Compiler.json_schema),
    "grammar": ({"grammar"}, set(), _Compiler.grammar),
    "regex": ({"pattern"}, set(), _Compiler.regex),
    "any_text": (set(), {"excludes", "max_tokens", "max_chars"}, _Compiler.any_text),
    "sequence": ({"elements"}, set(), _Compiler.sequence),
    "or": ({"elements"}, set(), _Compiler.one_of),
    "optional": ({"content"}, set(), _Compiler.repeat),
    "plus": ({"content"}, set(), _Compiler.repeat),
    "star": ({"content"}, set(), _Compiler.repeat),
    "repeat": ({"content", "min", "max"}, set(), _Compiler.repeat),
    "tag": ({"begin", "content", "end"}, set(), _Compiler.tag),
    "triggered_tags": ({"triggers", "tags"}, {"excludes", "at_least_one", "stop_after_first"},
                       _Compiler.triggered_tags),
    "dispatch": ({"rules"}, {"loop", "excludes"}, _Compiler.dispatch),
    "tags_with_separator": ({"tags", "separator"}, {"at_least_one", "stop_after_first"},
                            _Compiler.tags_with_separator),
    "token": ({"token"}, set(), _Compiler.token),
    "any_tokens": (set(), {"exclude_tokens"}, _Compiler.any_tokens),
    "token_triggered_tags": ({"trigger_tokens", "tags"}, {"exclude_tokens", "at_least_one", "stop_after_first"},
                             _Compiler.token_triggered_tags),
}


def named_tokens(spec: object) -> list[object]:
    """The tokens (texts or ids) a structural tag's token-level formats name — read off its JSON
    (already compiled: well formed), not off schemas, grammars or patterns inside it — for the
    engine to check against its tokenizer (``TokenVocab.check_tokens``)."""
    if isinstance(spec, str):
        spec = json.loads(spec)
    out: list[object] = []

    def walk(node: object) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if node.get("type") == "token" and "token" in node:
                out.append(node["token"])
            for key, value in node.items():
                if key in ("trigger_tokens", "exclude_tokens") and isinstance(value, list):
                    out.extend(value)
                elif key in ("begin", "end") and isinstance(value, dict) and "token" in value:
                    out.append(value["token"])
                elif key not in ("json_schema", "schema", "grammar", "pattern", "value"):
                    walk(value)

    walk(spec)
    return out


def compile_format(fmt: object, where: str) -> Seq | Tagged:
    """The frames of a format tree (module doc), under a ``Seq`` (the matcher reads it as text, no
    whitespace skipped) — or a free text's frame alone, which the matcher reads as text too and whose
    first mask then takes the vocabulary's list of its characters' tokens; ValueError naming the
    field that is wrong."""
    compiler = _Compiler()
    node = compiler.format(fmt, where)
    root = node if isinstance(node, Tagged) else Seq((node,))
    compiler.check_hops(settle_repeats(root), where)
    check_depth(root, "structural_tag.format", "a format that cannot end")
    return root
