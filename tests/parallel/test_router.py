"""The router's assignment: LPT's makespan bound against brute force, and its input checks."""

import itertools
import random

import pytest

from hypic.parallel.router import assign, makespan


def _optimum(lengths: list[int], workers: int) -> int:
    return min(makespan(lengths, list(o), workers) for o in itertools.product(range(workers), repeat=len(lengths)))


@pytest.mark.parametrize("workers", [2, 3])
def test_lpt_is_within_its_bound_of_the_optimum(workers):
    rng = random.Random(0)
    worse = 0
    for _ in range(60):
        lengths = [rng.choice([64, 128, 300, 512, 1024, 2048, 4096]) for _ in range(rng.randint(1, 7))]
        owner = assign(lengths, workers)
        assert sorted(set(owner)) <= list(range(workers))
        opt, got = _optimum(lengths, workers), makespan(lengths, owner, workers)
        assert got <= (4 / 3 - 1 / (3 * workers)) * opt + 1e-9  # Graham's bound for LPT
        worse += got > opt
    assert worse < 60  # the bound is not vacuous here: most cases are optimal


def test_lpt_beats_round_robin_on_skewed_lengths():
    lengths = [4096, 64, 64, 64, 4096, 64, 64, 64]
    lpt, rr = assign(lengths, 2), assign(lengths, 2, "round_robin")
    assert rr == [0, 1, 0, 1, 0, 1, 0, 1]
    assert makespan(lengths, lpt, 2) == 4096 + 3 * 64 < makespan(lengths, rr, 2) == 2 * 4096 + 2 * 64


def test_lpt_is_deterministic_and_ties_go_to_the_lowest_rank():
    assert assign([100, 100, 100], 3) == [0, 1, 2]
    assert assign([7, 3, 9, 3], 2) == assign([7, 3, 9, 3], 2)


def test_starting_loads_move_work_to_the_unloaded_worker():
    assert assign([100, 100], 2, loads=[150, 0]) == [1, 1]
    assert assign([100, 100], 2) == [0, 1]
    assert assign([100] * 4, 2, loads=[0, 200]) == [0, 0, 0, 1]  # rank 1 starts 2 segments behind
    assert assign([1, 2], 2, "round_robin", loads=[9, 0]) == [0, 1]  # blind to cost by design


@pytest.mark.parametrize("args, match", [
    (([1, 2], 2, "random"), "policy"),
    (([1, 2], 0), "workers"),
    (([1, -2], 2), "lengths"),
    (([1, 2], 2, "lpt", [0.0]), "loads"),
    (([1, 2], 2, "lpt", [0.0, float("nan")]), "loads"),
])
def test_bad_arguments_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        assign(*args)


def test_the_pool_charges_a_worker_its_arrival_delay_in_tokens():
    from types import SimpleNamespace

    from hypic.parallel.pool import ColdPool

    pool = SimpleNamespace(handicap=[0.0, 0.0, 0.0])
    late = {"started": 0.0, "computed": 0.5, "waited_from": 0.1, "answered": 0.55, "tokens": 10_000}  # 50 ms late
    hidden = {"started": 0.0, "computed": 0.3, "waited_from": 0.5, "answered": 0.5, "tokens": 6_000}  # in time
    ColdPool._learn(pool, {1: late, 2: hidden})
    assert pool.handicap == [0.0, pytest.approx(0.5 * 1_000), 0.0]  # 50 ms at 20 tokens/ms, half weight
    ColdPool._learn(pool, {1: late})
    assert pool.handicap[1] == pytest.approx(750)
    busy = {**hidden, "waited_from": 0.8, "answered": 0.81}  # rank 0's own work is not the worker's delay
    ColdPool._learn(pool, {2: busy})
    assert pool.handicap[2] == pytest.approx(0.5 * 0.01 * 6_000 / 0.3)

