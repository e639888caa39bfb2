"""`hypic bench scatter` on the CPU: its rows, its exactness column, its prompt sets."""

import pytest
import torch

from hypic.bench.scatter import prompts, report, run
from hypic.bench.shapes import SHAPES
from hypic.engine.engine import Engine
from hypic.models.random_init import random_model


def test_prompt_sets() -> None:
    uniform = prompts("uniform", 6, 100, 500, 2)
    assert [len(d) for d in uniform[0][1:-1]] == [100] * 6 and len(uniform) == 2
    skewed = prompts("skewed", 12, 256, 500, 2)
    lengths = [len(d) for d in skewed[0][1:-1]]
    assert lengths == [len(d) for d in skewed[1][1:-1]] and len(set(lengths)) > 1
    assert skewed[0][1] != skewed[1][1]  # fresh documents every prompt: every request is cold
    with pytest.raises(ValueError, match="kind"):
        prompts("zipf", 4, 10, 500, 1)


def test_rows_agree_with_one_device() -> None:
    engine = Engine(random_model(SHAPES["tiny"], device="cpu", dtype=torch.float32), seam=4)
    with pytest.raises(ValueError, match="no cold workers"):
        run(engine, "uniform")
    engine = Engine(engine.loaded, seam=4, cold_workers=1)
    try:
        res = run(engine, "skewed", docs=6, doc_tokens=128, reps=1)
    finally:
        engine.close()
    for row in ("one device", "scatter, lpt", "scatter, round_robin"):
        p50, lo, hi, diff = res[row]
        assert 0 < lo <= p50 <= hi and diff < 1e-4
    assert res["makespan_lpt"] <= res["makespan_round_robin"]
    assert engine.pool is None and "| skewed | scatter, lpt |" in report([res], "t")
