"""The options of ``python -m hypic.train`` and their checks, made before anything is built or written.

Why: bad values failed late or not at all. ``--log-every 0`` divided by zero after the first step,
with nothing saved; ``--batch-tokens 0`` died inside the data stream; ``--doc-weight -1`` was accepted
and gave the answers' loss a negative coefficient (the model trained away from them); a nan family
weight failed inside a data worker; ``--resume`` on a missing folder created it and then failed in
the tokenizer without naming a file. Each is now one line naming the option, exit status 2
(``OneLineParser`` for argparse's own errors, the entry points' ``except ValueError`` for these).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import NoReturn

from hypic.engine.request import check_seed
from hypic.eval.tasks import FAMILIES
from hypic.models.loader import resolve_device
from hypic.train.atomic import check_replaceable
from hypic.train.checkpoint import shard_of
from hypic.train.data import EASY_MAX


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors as one line, ``PROG: message``, exit status 2 (not the usage first)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(2)


def parser(description: str) -> OneLineParser:
    p = OneLineParser(prog="hypic.train", description=description)
    p.add_argument("--out", required=True, help="checkpoint folder (also a loadable model folder)")
    p.add_argument("--tokenizer", help="folder with tokenizer.json (first run)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--overwrite", action="store_true",
                   help="a first run may replace the checkpoint that --out holds (refused otherwise)")
    p.add_argument("--preset", default="default", choices=["default", "tiny"])
    p.add_argument("--device")
    p.add_argument("--minutes", type=float, default=8.0)
    p.add_argument("--total-steps", type=int, default=6000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--ramp-steps", type=int, default=3000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-tokens", type=int, default=65536)
    p.add_argument("--doc-weight", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra-questions", type=int, default=0,
                   help="more questions about the same documents after each QA answer (dense supervision)")
    p.add_argument("--extra-multi", type=int, default=0,
                   help="more two-hop questions about the same documents after each QA answer")
    p.add_argument("--family-weights", default="",
                   help="sampling weights of task families, e.g. multi_hop=2,report_summary=0.5 (others 1)")
    p.add_argument("--easy-share", type=float, default=0.0,
                   help="share of examples at low difficulty (uniform in [0, --easy-max]) whatever the curriculum")
    p.add_argument("--easy-max", type=float, default=EASY_MAX,
                   help="top of the easy share's difficulty range (0: one or two documents)")
    p.add_argument("--standalone-every", type=int, default=0,
                   help="every K-th step computes the segments before the query standalone, as hypic does (0: never)")
    p.add_argument("--standalone-seam", type=int, default=0,
                   help="hypic's seam w in those steps: each segment's first w tokens recomputed in context")
    p.add_argument("--blind-every", type=int, default=0,
                   help="the last of every K steps (when not a standalone one) lets the query attend only to "
                        "itself: the documents reach it through the linear layers (0: never; hypic.train.blind)")
    p.add_argument("--schedule-start", type=int, default=0,
                   help="step where this learning-rate schedule (warm-up, cosine to --total-steps) begins")
    return p


def parse_weights(text: str) -> dict[str, float]:
    """``name=weight,...`` → {name: weight}, each weight finite and ≥ 0; a clear error for anything else."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        try:
            weight = float(value) if eq else -1.0
        except ValueError:
            weight = -1.0
        if not (math.isfinite(weight) and weight >= 0):  # nan and inf passed `weight < 0`
            raise ValueError(f"--family-weights: expected name=weight (a finite weight ≥ 0), got {part!r}")
        out[name.strip()] = weight
    return out


def check(args: argparse.Namespace) -> None:
    """ValueError naming the first option out of range; touches no file."""
    at_least = {"--log-every": (args.log_every, 1), "--batch-tokens": (args.batch_tokens, 1),
                "--warmup": (args.warmup, 0), "--ramp-steps": (args.ramp_steps, 0), "--workers": (args.workers, 0),
                "--extra-questions": (args.extra_questions, 0), "--extra-multi": (args.extra_multi, 0),
                "--standalone-every": (args.standalone_every, 0), "--standalone-seam": (args.standalone_seam, 0),
                "--blind-every": (args.blind_every, 0),
                "--schedule-start": (args.schedule_start, 0)}
    for option, (value, low) in at_least.items():
        if value < low:
            raise ValueError(f"{option}: expected an integer ≥ {low}, got {value}")
    if args.total_steps <= args.schedule_start:
        raise ValueError(f"--total-steps {args.total_steps} must be after --schedule-start {args.schedule_start}")
    if not (math.isfinite(args.doc_weight) and args.doc_weight >= 0):
        raise ValueError(f"--doc-weight: expected a finite weight ≥ 0, got {args.doc_weight}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr: expected a finite learning rate > 0, got {args.lr}")
    check_seed(args.seed, "--seed")
    if not args.minutes > 0:  # inf: no time limit, --total-steps ends the run
        raise ValueError(f"--minutes: expected a time > 0, got {args.minutes}")
    for option, value in (("--easy-share", args.easy_share), ("--easy-max", args.easy_max)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{option}: expected a value in [0, 1], got {value}")
    weights = parse_weights(args.family_weights)
    unknown = sorted(set(weights) - set(FAMILIES))
    if unknown:
        raise ValueError(f"--family-weights: unknown families {unknown}; families are {list(FAMILIES)}")
    if not any(weights.get(f, 1.0) > 0 for f in FAMILIES):
        raise ValueError("--family-weights: every family's weight is 0; nothing to sample")
    if args.device is not None:
        try:
            resolve_device(args.device)  # as LLM and the bench check theirs
        except ValueError as e:  # "device: …" → "--device: …"
            raise ValueError(f"--{e}") from None


def checkpoint_files_in(folder: Path) -> list[str]:
    """The files of ``folder`` that make it a checkpoint: its state, index and shards."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name in ("train_state.json", "model.safetensors.index.json")
                  or shard_of("model", "optim")(p.name))


def check_out(args: argparse.Namespace) -> int:
    """ValueError unless ``--out`` suits the run (checked before the model is built or a file written);
    returns the step the run starts from."""
    out = Path(args.out)
    check_replaceable(out)  # the final save replaces the folder whole
    if args.resume:
        if args.overwrite:
            raise ValueError("--overwrite starts a new run in place of the checkpoint; it does not go with --resume")
        if not (out / "train_state.json").exists():
            raise ValueError(f"--resume: {out} holds no checkpoint (no train_state.json)")
        needed = ["config.json"] if args.tokenizer else ["config.json", "tokenizer.json"]
        missing = [name for name in needed if not (out / name).exists()]
        if missing:
            raise ValueError(f"--resume: {out} lacks {', '.join(missing)}")
        try:
            step = int(json.loads((out / "train_state.json").read_text())["step"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--resume: {out / 'train_state.json'} has no step ({e})") from None
    else:
        held = checkpoint_files_in(out)
        if held and not args.overwrite:
            # a forgotten --resume replaced a 17 900-step checkpoint with a fresh model's (docs/training.md)
            raise ValueError(f"--out {out} already holds a checkpoint ({', '.join(held[:3])}): pass --resume to "
                             "continue it, or --overwrite to start a new run in its place")
        tokenizer = Path(args.tokenizer) / "tokenizer.json" if args.tokenizer else out / "tokenizer.json"
        if not tokenizer.exists():
            raise ValueError(f"--tokenizer: {tokenizer} not found (a first run needs --tokenizer FOLDER, "
                             "the folder of a tokenizer.json)")
        step = 0
    if step < args.schedule_start:
        # resuming short of the schedule's start once trained 47 steps at a negative learning rate
        # (docs/training.md, run 15)
        raise ValueError(f"--schedule-start {args.schedule_start} is after the checkpoint's step "
                         f"{step}: the schedule must begin at or before the step training resumes from")
    return step
