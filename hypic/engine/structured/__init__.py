"""Structured output: decoding constrained to JSON a schema accepts (``SamplingParams.json_schema``),
to plain text a regular expression matches or one of a list of choices (``regex``, ``choice``:
``text``), to text a context-free grammar derives (``grammar``: GBNF, or Lark's notation read by
``lark``), or to free text whose triggers open tagged JSON structures (``structural_tag``: ``tags``).

``schema`` compiles the schema (``regex`` its patterns and formats, ``bounds`` its numeric bounds),
``grammar`` a GBNF grammar, ``matcher`` reads the text byte by byte (``strings``, ``numbers``: their
frames), ``vocab`` turns a matcher state into the tokens allowed next; the engine masks every other
token's logit before sampling.
"""

from hypic.engine.structured.grammar import compile_grammar
from hypic.engine.structured.schema import compile_schema
from hypic.engine.structured.tags import compile_tags
from hypic.engine.structured.text import compile_text
from hypic.engine.structured.vocab import JsonConstraint, TokenVocab, token_bytes, token_marks

__all__ = ["JsonConstraint", "TokenVocab", "compile_grammar", "compile_schema", "compile_tags", "compile_text",
           "token_bytes", "token_marks"]
