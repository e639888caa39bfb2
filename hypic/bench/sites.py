"""Which of hypic's source lines issued something (an aten op, a host sync): the innermost stack
frame in one of the package's own files.

A file is the package's when it lies under the package's own directory, not when ``/hypic/``
appears somewhere in its path: a checkout cloned into a folder named ``hypic`` (``git clone …/hypic``)
with its ``.venv`` inside puts torch's files under ``/hypic/`` too, and every op of a request was
counted at torch's ``_dynamo/eval_frame.py``.
"""

from __future__ import annotations

import os

import hypic

PACKAGE_DIR = os.path.join(os.path.dirname(hypic.__file__), "")  # as frames name its files; ends in a separator


def package_path(filename: str) -> str | None:
    """``filename`` relative to the package (``engine/engine.py``), or None when it is not one of
    the package's files."""
    if not filename.startswith(PACKAGE_DIR):
        return None
    return filename[len(PACKAGE_DIR):].replace(os.sep, "/")
