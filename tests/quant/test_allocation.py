"""The precision allocator against exhaustive search on small problems."""

from __future__ import annotations

import itertools
import random

import pytest

from quantkit.quant.allocation import allocate


def _instance(seed: int, n: int = 6, k: int = 3):
    rng = random.Random(seed)
    costs, errors = [], []
    for _ in range(n):
        c = sorted(rng.randint(10, 100) for _ in range(k))
        # more bits, less error (as quantisation choices behave), but not in lockstep
        e = sorted((rng.random() for _ in range(k)), reverse=True)
        costs.append(c)
        errors.append(e)
    return costs, errors


def _all_plans(costs, errors):
    for picks in itertools.product(*[range(len(c)) for c in costs]):
        yield (sum(c[j] for c, j in zip(costs, picks)), sum(e[j] for e, j in zip(errors, picks)), picks)


@pytest.mark.parametrize("seed", range(8))
def test_size_budget_is_met_and_the_error_is_the_least_possible(seed):
    costs, errors = _instance(seed)
    cheapest, dearest = sum(min(c) for c in costs), sum(max(c) for c in costs)
    for budget in (cheapest, (cheapest + dearest) // 2, cheapest + 7, dearest):
        got = allocate(costs, errors, budget=budget)
        assert got.cost <= budget
        assert got.cost == sum(c[j] for c, j in zip(costs, got.picks))
        best = min(e for c, e, _ in _all_plans(costs, errors) if c <= budget)
        assert got.error == pytest.approx(best, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_error_budget_is_met_at_the_least_cost(seed):
    costs, errors = _instance(seed)
    floor = sum(min(e) for e in errors)
    for bound in (floor, floor * 1.2, floor * 2, 1e9):
        got = allocate(costs, errors, max_error=bound)
        assert got.error <= bound + 1e-12
        cheapest = min(c for c, e, _ in _all_plans(costs, errors) if e <= bound + 1e-12)
        assert got.cost == cheapest


def test_uneven_option_counts_pick_only_offered_options():
    costs = [[4], [4, 8], [4, 6, 8, 9]]
    errors = [[1.0], [1.0, 0.1], [3.0, 1.0, 0.5, 0.0]]
    got = allocate(costs, errors, budget=20)
    assert all(0 <= j < len(c) for j, c in zip(got.picks, costs))
    # 12 bits at the cheapest, 8 to spend: the 4 for linear 1's second option and the 4 for linear 2's third
    # (1 + 0.1 + 0.5) beat spending 5 on linear 2's best alone (1 + 1 + 0)
    assert got.cost <= 20 and got.picks == [0, 1, 2] and got.error == pytest.approx(1.6)


def test_impossible_budgets_are_refused():
    costs, errors = [[4, 8], [4, 8]], [[1.0, 0.0], [1.0, 0.0]]
    with pytest.raises(ValueError, match="below the cheapest"):
        allocate(costs, errors, budget=7)
    with pytest.raises(ValueError, match="most accurate"):
        allocate([[4, 8]], [[1.0, 0.5]], max_error=0.1)
    with pytest.raises(ValueError):
        allocate(costs, errors)


def test_large_costs_keep_the_budget_exactly():
    # Costs of real linears (hundreds of millions of bits): rounding to units must never overshoot the budget.
    rng = random.Random(3)
    costs = [[w * 4125 // 1000, w * 4250 // 1000, w * 8125 // 1000] for w in (rng.randint(10**5, 10**7) for _ in range(60))]
    errors = [[rng.random(), rng.random() / 2, rng.random() / 10] for _ in costs]
    weights = sum(c[0] * 1000 // 4125 for c in costs)
    for bits in (4.2, 4.25, 4.6):
        got = allocate(costs, errors, budget=bits * weights)
        assert got.cost <= bits * weights
        # and little of it is left unused: at most one rounding unit per linear
        assert bits * weights - got.cost < 0.01 * weights or got.picks == [2] * len(costs)
