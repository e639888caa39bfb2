"""Encoding text with Python's lock released.

``tokenizers``' ``Tokenizer.encode`` holds the GIL for the whole call, so running it on a worker
thread does not free the server: a 4 MB prompt took 5 s to tokenize (to be refused, past the
context), and every stream, the serving loop and ``GET /health`` waited that long (a helper's
fuzzing, session 37; a 30 MB ``/tokenize`` held ``/health`` 51 s). ``encode_batch`` releases the
lock while it works, and one text in a batch of one encodes the same.
"""

from __future__ import annotations

from typing import Any


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool = False) -> Any:
    """``tokenizer.encode(text, add_special_tokens=...)`` (its ``Encoding``: ids, offsets), other
    threads running meanwhile."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
