"""Precision allocation: one choice per linear under a size budget or an error budget (multiple-choice knapsack).

Each linear i has options j with a storage cost c[i][j] (bits on disk, exact) and an estimated error e[i][j]
(additive over linears: the KL each one adds to the model's output). `allocate` solves

    minimise sum e[i][j_i]  subject to  sum c[i][j_i] <= budget          (size budget), or
    minimise sum c[i][j_i]  subject to  sum e[i][j_i] <= max_error        (error budget)

by dynamic programming over the cost above each linear's cheapest option, in whole units of `unit` bits. Costs
are rounded *up* to units and the capacity *down*, so a plan never exceeds the budget; the price of the rounding
is at most one unit per linear of budget left unused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Units the extra-cost range is cut into: at least this many (rounding then costs well under 0.1% of a model's
# budget), more for few linears, bounded so the walk-back table stays under ~100 MB.
RESOLUTION = 20000
TABLE_CELLS = 5 * 10**7


@dataclass(frozen=True)
class Allocation:
    picks: list[int]  # per linear, the index of its chosen option
    cost: float  # sum of the chosen costs (exact, not rounded)
    error: float  # sum of the chosen errors


def _table(costs: list[list[float]], errors: list[list[float]], capacity_bits: float):
    """min total error for each rounded extra cost 0..C, and the argmin choices to walk back."""
    base = [min(c) for c in costs]
    spread = sum(max(c) - b for c, b in zip(costs, base))
    capacity = max(0.0, min(capacity_bits, spread))
    slots_max = max(RESOLUTION, min(10**6, TABLE_CELLS // max(1, len(costs))))
    unit = capacity / (slots_max - 1) if capacity > 0 else 1.0
    if all(float(x).is_integer() for c in costs for x in c):
        unit = max(1.0, unit)  # whole bits: a unit of one bit is exact
    slots = int(math.floor(capacity / unit + 1e-9)) + 1
    best = np.full(slots, np.inf)
    best[0] = 0.0
    back = np.zeros((len(costs), slots), dtype=np.int16)
    for i, (c, e) in enumerate(zip(costs, errors)):
        new = np.full(slots, np.inf)
        arg = np.zeros(slots, dtype=np.int16)
        for j, (cj, ej) in enumerate(zip(c, e)):
            shift = int(math.ceil((cj - base[i]) / unit - 1e-9))
            if shift >= slots:
                continue
            cand = np.full(slots, np.inf)
            cand[shift:] = best[: slots - shift] + ej
            better = cand < new
            new[better], arg[better] = cand[better], j
        best, back[i] = new, arg
    return best, back, unit, base


def _walk(back: np.ndarray, costs: list[list[float]], base: list[float], unit: float, slot: int) -> list[int]:
    picks = [0] * len(costs)
    for i in range(len(costs) - 1, -1, -1):
        j = int(back[i, slot])
        picks[i] = j
        slot -= int(math.ceil((costs[i][j] - base[i]) / unit - 1e-9))
    return picks


def allocate(costs: list[list[float]], errors: list[list[float]], budget: float | None = None,
             max_error: float | None = None) -> Allocation:
    """One option per linear (see the module docstring). Exactly one of `budget` (total cost) and `max_error`.
    Raises ValueError when no plan meets the budget (the cheapest plan costs more, or the most accurate plan errs
    more)."""
    if (budget is None) == (max_error is None):
        raise ValueError("give exactly one of budget and max_error")
    if not costs or any(len(c) != len(e) or not c for c, e in zip(costs, errors)) or len(costs) != len(errors):
        raise ValueError("every linear needs at least one option, with a cost and an error each")
    cheapest = sum(min(c) for c in costs)
    if budget is not None:
        if budget < cheapest:
            raise ValueError(f"the budget {budget:.6g} is below the cheapest plan's cost {cheapest:.6g}")
        best, back, unit, base = _table(costs, errors, budget - cheapest)
        slot = int(np.argmin(best))  # the least error within the capacity (ties: the cheaper slot)
    else:
        best, back, unit, base = _table(costs, errors, math.inf)
        # The cheapest slot whose least error meets the bound (a prefix-min is not needed: any slot reaching it
        # is a valid plan, and the lowest such slot is the cheapest).
        reach = np.nonzero(best <= max_error)[0]
        if len(reach) == 0:
            raise ValueError(f"no plan meets the error bound {max_error:.6g}: the most accurate one errs "
                             f"{float(np.min(best)):.6g}")
        slot = int(reach[0])
    picks = _walk(back, costs, base, unit, slot)
    return Allocation(picks, sum(c[j] for c, j in zip(costs, picks)), sum(e[j] for e, j in zip(errors, picks)))
