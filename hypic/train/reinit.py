"""Re-initialise collapsed value embeddings in a training checkpoint.

Why (docs/training.md, session 6): the bundled model learned to look up 13 of 19 relations but
answered home, birthplace, hq, colour, job and pet with the uniform prior over the value kind. Its
tied embeddings for those values had collapsed onto one direction (mean pairwise cosine: colours
0.95, cities 0.89), so the value a document states reaches the answer position as "some city",
not as "Orlwick". The collapse is self-sustaining — a model that predicts the kind's prior pushes
every value's output row the same way — and from step 12165 short-prompt training no longer
broke it (391 CPU steps of single-hop prompts: 0–7%, pet 40%; 290 had sufficed at step 9465). Giving those
values distinct random directions with the norm of healthy value embeddings and training the
same way for 256 steps took all six relations to 97–100% at difficulty 0.

``python -m hypic.train.reinit --ckpt DIR [--kinds city,colour,job,pet] [--report]``: rewrites the
embedding rows of the kinds' single-token values (their shard replaced whole, by a rename); the
optimizer moments, the loop state and every other tensor stay as they are. ``--report`` only
prints each value kind's mean pairwise cosine, the diagnostic that found the collapse.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from hypic.engine.request import check_seed
from hypic.eval.world import VALUES
from hypic.train.args import OneLineParser
from hypic.train.atomic import replace_file

EMBED = "model.embed_tokens.weight"
REFERENCE_KIND = "instrument"  # a value kind the model did learn to copy: the norm to match


def value_token_ids(tok: Tokenizer, kind: str) -> list[int]:
    """Token ids of the kind's values that are one token after a space (as they read in documents);
    multi-token values share their pieces with other words and are left alone."""
    if kind not in VALUES:
        raise ValueError(f"unknown value kind {kind!r}; kinds are {sorted(VALUES)}")
    ids = []
    for value in VALUES[kind]:
        enc = tok.encode(" " + value, add_special_tokens=False).ids
        if len(enc) == 1:
            ids.append(enc[0])
    return ids


def mean_cosine(rows: torch.Tensor) -> float:
    """Mean pairwise cosine similarity of the rows (1.0: all point the same way)."""
    if rows.shape[0] < 2:
        return float("nan")
    unit = torch.nn.functional.normalize(rows.float(), dim=1)
    sim = unit @ unit.T
    n = rows.shape[0]
    return float((sim.sum() - sim.diagonal().sum()) / (n * (n - 1)))


def _embedding_file(ckpt: Path) -> Path:
    index = ckpt / "model.safetensors.index.json"
    if not index.exists():
        raise ValueError(f"{ckpt}: not a training checkpoint (no model.safetensors.index.json)")
    where = json.loads(index.read_text())["weight_map"]
    if EMBED not in where:
        raise ValueError(f"{ckpt}: no {EMBED} in the checkpoint's index")
    return ckpt / where[EMBED]


def _tokenizer(ckpt: Path) -> Tokenizer:
    if not (ckpt / "tokenizer.json").exists():
        raise ValueError(f"{ckpt}: no tokenizer.json beside the checkpoint")
    return Tokenizer.from_file(str(ckpt / "tokenizer.json"))


def report(ckpt: Path) -> dict[str, float]:
    """Mean pairwise cosine of each value kind's single-token embeddings."""
    tok = _tokenizer(ckpt)
    table = load_file(str(_embedding_file(ckpt)))[EMBED]
    ids = {kind: value_token_ids(tok, kind) for kind in VALUES}
    return {kind: mean_cosine(table[ids[kind]]) for kind in VALUES if len(ids[kind]) >= 2}


def reinit(ckpt: Path, kinds: list[str], seed: int = 0) -> list[int]:
    """Rewrite the embedding rows of ``kinds``' values: independent random directions scaled to the
    mean norm of the reference kind's rows. Returns the token ids rewritten."""
    tok = _tokenizer(ckpt)
    ids = list(dict.fromkeys(i for kind in kinds for i in value_token_ids(tok, kind)))  # kinds' order
    reference = value_token_ids(tok, REFERENCE_KIND)
    if not ids or not reference:
        raise ValueError(f"no single-token values of {kinds} or {REFERENCE_KIND!r} in this tokenizer")
    file = _embedding_file(ckpt)
    shard = load_file(str(file))
    table = shard[EMBED]
    norm = table[reference].float().norm(dim=1).mean()
    gen = torch.Generator().manual_seed(seed)
    for i in ids:  # one draw per row, in the kinds' order: the bundled model's run (session 6) drew so
        fresh = torch.randn(table.shape[1], generator=gen)
        table[i] = (fresh / fresh.norm() * norm).to(table.dtype)
    # a new file renamed over the old: a rewrite cut short in place would leave a broken shard
    replace_file(file, lambda tmp: save_file(shard, str(tmp), metadata={"format": "pt"}))
    return ids


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="hypic.train.reinit", description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="a training checkpoint folder (rewritten in place)")
    p.add_argument("--kinds", default="city,colour,job,pet", help="value kinds to re-initialise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", action="store_true", help="only print each kind's mean pairwise cosine")
    args = p.parse_args(argv)
    ckpt = Path(args.ckpt)
    try:
        if args.report:
            for kind, cos in report(ckpt).items():
                print(f"{kind:12s} {cos:.3f}")
            return 0
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        if not kinds:  # read as "no single-token values of [] or 'instrument' in this tokenizer"
            raise ValueError(f"--kinds: expected a comma list of value kinds, got {args.kinds!r}")
        check_seed(args.seed, "--seed")
        ids = reinit(ckpt, kinds, args.seed)
    except (ValueError, OSError) as e:  # one line naming what is wrong, not a traceback (a missing shard)
        print(f"hypic.train.reinit: {e}", file=sys.stderr)
        return 2
    print(f"re-initialised {len(ids)} value embeddings in {ckpt}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
