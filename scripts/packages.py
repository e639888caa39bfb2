"""Running one benchmark script's measurement in several checkouts side by side: each package (this
tree, or ``label=path`` of another checkout) in a process of its own, one after the other, its
measurement read back as the last line of JSON it prints (the script's ``--child`` mode)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any


def add_package_args(ap: argparse.ArgumentParser) -> None:
    """``--package label=path`` (repeatable) and the hidden ``--child`` a package's process runs with."""
    ap.add_argument("--package", action="append", default=[], help="label=path of another checkout")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def child_done(args: argparse.Namespace, measure: Callable[[], Any]) -> bool:
    """In a package's process (``--child``): print ``measure()`` as JSON and say so."""
    if args.child:
        print(json.dumps(measure()))
    return args.child


def run_packages(script: str, child_args: list[str], packages: list[str]) -> dict[str, Any]:
    """``script --child *child_args`` under each of ``packages`` (``label=path``) and then this tree
    (``this``), with PYTHONPATH pointing at it: label → the JSON it printed last."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {}
    for label, path in [*(p.split("=", 1) for p in packages), ("this", here)]:
        done = subprocess.run([sys.executable, os.path.abspath(script), "--child", *child_args],
                              env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, check=True)
        runs[label] = json.loads(done.stdout.strip().splitlines()[-1])
    return runs
