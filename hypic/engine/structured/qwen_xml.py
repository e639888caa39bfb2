"""xgrammar's ``qwen_xml`` style of a ``json_schema`` format: an object's properties written as the XML
parameters the Qwen3-Coder and Qwen3.5 chat templates teach, one after another in declared order::

    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>

A string property's value is its raw text — anything without ``</parameter>``; an ``enum``'s or
``const``'s strings exactly; a ``pattern`` found in it, as JSON Schema reads one; at most
``maxLength`` characters (the newlines around the value not counted, as the parser strips them;
``minLength`` and ``format`` are not held in this style, nor a length beside a pattern); a union
with a string among its options (pydantic's ``Optional[str]``) and a ``$ref`` to a string's schema
too — and any other value compact JSON its schema accepts (``$defs`` / ``definitions`` of the root
resolve inside it). With no declared properties, ``additionalProperties: false`` allows none. A
newline may follow the opening tag, precede the closing one and follow a parameter, as the templates
write them.
Required properties must appear, the others may be left out; with no declared properties any
parameter name (``[A-Za-z_][A-Za-z0-9_]*``) takes raw text.
"""

from __future__ import annotations

from hypic.engine.structured.grammar import Chars, Rep, Seq, Word
from hypic.engine.structured.regex import compile_regex
from hypic.engine.structured.tags import free_text, json_value
from hypic.engine.structured.text import Text, compile_text

OPEN, CLOSE = b"<parameter=", b"</parameter>"
NEWLINE = Rep(Word(b"\n"), 0, 1)
RAW = free_text((), (), (CLOSE,))  # a string's raw text: it ends where </parameter> begins
NAME = Seq((Chars(((0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)), False),
            Rep(Chars(((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)), False), 0, None)))


def compile_qwen_xml(schema: object, where: str) -> tuple[object, int]:
    """The frames of an object schema in the qwen_xml style, and how many of its parameters may be
    left out (each a chunk a byte may cross unread); ValueError naming what cannot be written so."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: expected an object schema, got {type(schema).__name__}")
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where}: the qwen_xml style writes an object's properties; got type {schema['type']!r}")
    props, required = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise ValueError(f"{where}: properties must be an object and required a list of names")
    missing = [k for k in required if k not in props]
    if missing:
        raise ValueError(f"{where}.required: {missing[0]!r} is not among the properties")
    if not props:  # any parameters, raw text each — or none
        if schema.get("additionalProperties", True) is False:
            return Seq(()), 0
        return Rep(_parameter(Seq((Word(OPEN), NAME, Word(b">"))), RAW), 0, None), 1
    items = []
    for key, sub in props.items():
        if not key or any(c in key for c in "<>\n"):
            raise ValueError(f"{where}.properties: {key!r} cannot be a parameter's name")
        param = _parameter(Word(OPEN + key.encode() + b">"), _value(sub, schema, f"{where}.properties.{key}"))
        items.append(param if key in required else Rep(param, 0, 1))
    return (items[0] if len(items) == 1 else Seq(tuple(items))), len(props) - len(set(required))


def _parameter(opening: object, value: object) -> Seq:
    return Seq((opening, NEWLINE, value, NEWLINE, Word(CLOSE), NEWLINE))


def _resolve(schema: object, root: dict) -> object:
    """``schema`` with local ``$ref``s into the root's ``$defs`` / ``definitions`` followed (pydantic
    writes an Enum field so); anything else as it is (the JSON compiler names what is wrong)."""
    for _ in range(16):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str) or not ref.startswith(("#/$defs/", "#/definitions/")):
            return schema
        section, _, name = ref.removeprefix("#/").partition("/")
        target = root.get(section, {}).get(name) if isinstance(root.get(section), dict) else None
        if target is None:
            return schema
        schema = target
    return schema


def _is_string(schema: object, root: dict, depth: int = 0) -> bool:
    """A string's schema — its type string (or a list holding it), or a union with a string among
    its options (pydantic's ``Optional[str]``): written as raw text, which says any of them. Unions
    are looked into 16 deep (a union may name itself through ``$defs``)."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or depth > 16:
        return False
    kinds = schema.get("type")
    if kinds == "string" or isinstance(kinds, list) and "string" in kinds:
        return True
    options = schema.get("anyOf", schema.get("oneOf"))
    return isinstance(options, list) and any(_is_string(o, root, depth + 1) for o in options)


def _value(schema: object, root: dict, where: str) -> object:
    """A string's raw text (its enum, const or pattern held), else the value as JSON."""
    resolved = _resolve(schema, root)
    if isinstance(resolved, dict) and ("enum" in resolved or "const" in resolved):
        words = resolved.get("enum", [resolved.get("const")])
        if not isinstance(words, list) or not words:
            raise ValueError(f"{where}: enum must be a non-empty list")
        if all(isinstance(w, str) for w in words):
            return compile_text(choice=tuple(words))
    if _is_string(resolved, root):
        pattern, longest = resolved.get("pattern"), resolved.get("maxLength")
        if pattern is None and longest is not None:
            if not isinstance(longest, int) or isinstance(longest, bool) or longest < 0:
                raise ValueError(f"{where}.maxLength: expected a non-negative integer, got {longest!r}")
            # free text counted in characters: a value's newline on either side is the parameter's
            # (NEWLINE), which the matcher may take for it, as the parser does
            return free_text((), (), (CLOSE,), max_chars=longest)
        if pattern is None:
            return RAW
        if not isinstance(pattern, str):
            raise ValueError(f"{where}.pattern: expected a string, got {type(pattern).__name__}")
        try:  # JSON Schema's pattern: found anywhere in the text (anchors say otherwise)
            return Text(compile_regex(pattern))
        except ValueError as e:
            raise ValueError(f"{where}.pattern: {str(e).removeprefix(f'pattern {pattern!r}: ')}") from None
    defs = {k: root[k] for k in ("$defs", "definitions") if k in root}
    try:
        return json_value({**schema, **defs} if isinstance(schema, dict) else schema)
    except ValueError as e:
        raise ValueError(f"{where}: {str(e).removeprefix('json_schema: ')}") from None
