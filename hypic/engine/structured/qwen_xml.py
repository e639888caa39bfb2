"""xgrammar's ``qwen_xml`` style of a ``json_schema`` format: an object's properties written as the XML
parameters the Qwen3-Coder and Qwen3.5 chat templates teach, one after another in declared order::

    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>

A string property's value is its raw text — anything without ``</parameter>``; an ``enum``'s or
``const``'s strings exactly; a ``pattern`` as a regular expression over the raw text (a string's
length and ``format`` bounds are not held in this style) — and any other value compact JSON its
schema accepts (``$defs`` / ``definitions`` of the root resolve inside it). A newline may follow
the opening tag, precede the closing one and follow a parameter, as the templates write them.
Required properties must appear, the others may be left out; with no declared properties any
parameter name (``[A-Za-z_][A-Za-z0-9_]*``) takes raw text.
"""

from __future__ import annotations

from hypic.engine.structured.grammar import Chars, Rep, Seq, Word
from hypic.engine.structured.tags import free_text, json_value
from hypic.engine.structured.text import compile_text

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
    if not isinstance(props, dict) or not isinstance(required, list):
        raise ValueError(f"{where}: properties must be an object and required a list")
    missing = [k for k in required if k not in props]
    if props and missing:
        raise ValueError(f"{where}.required: {missing[0]!r} is not among the properties")
    if not props:  # any parameters, raw text each
        return Rep(_parameter(Seq((Word(OPEN), NAME, Word(b">"))), RAW), 0, None), 1
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    items = []
    for key, sub in props.items():
        if not key or any(c in key for c in "<>\n"):
            raise ValueError(f"{where}.properties: {key!r} cannot be a parameter's name")
        param = _parameter(Word(OPEN + key.encode() + b">"), _value(sub, defs, f"{where}.properties.{key}"))
        items.append(param if key in required else Rep(param, 0, 1))
    return (items[0] if len(items) == 1 else Seq(tuple(items))), len(props) - len(set(required))


def _parameter(opening: object, value: object) -> Seq:
    return Seq((opening, NEWLINE, value, NEWLINE, Word(CLOSE), NEWLINE))


def _value(schema: object, defs: dict, where: str) -> object:
    """A string's raw text (its enum, const or pattern held), else the value as JSON."""
    if isinstance(schema, dict):
        kinds = schema.get("type")
        words = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
        if words is not None and all(isinstance(w, str) for w in words):
            return compile_text(choice=tuple(words))
        if kinds == "string" or isinstance(kinds, list) and "string" in kinds:
            if "pattern" in schema:
                try:
                    return compile_text(regex=schema["pattern"])
                except ValueError as e:
                    raise ValueError(f"{where}.pattern: {str(e).removeprefix('regex: ')}") from None
            return RAW
    try:
        return json_value({**schema, **defs} if isinstance(schema, dict) else schema)
    except ValueError as e:
        raise ValueError(f"{where}: {str(e).removeprefix('json_schema: ')}") from None
