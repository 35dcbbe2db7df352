"""Adaptive bit-width assignment (AdaQP's bi-objective problem), solved with CP-SAT.

    rounds = [[Channel(theta, gamma, groups) for each device pair] for each ring round]
    a = assign_bitwidths(rounds, lam=0.5)
    a.bits[r][c][g]        # width of group g of channel c in round r

The pieces, in order: the problem and its checker (``assign_problem``: dataclasses,
``evaluate``, ``group_messages``), the greedy baseline (``assign_greedy``), the CP-SAT
model (``assign_cpsat``), and here the entry points that tie them together:
``assign_bitwidths`` for one problem and ``assign_many`` for independent problems (one
per layer and direction) in a thread pool. See docs/assign.md.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Sequence

from .cpsat import (
    FORMULATIONS,
    OBJECTIVE_SCALE,
    SECANT_WINDOW,
    rounding_errors,
    solve_rounds,
)
from .greedy import greedy_assignment
from .problem import (
    DEFAULT_BITS,
    AssignmentProblem,
    Channel,
    Evaluation,
    MessageGroup,
    check_lam,
    evaluate,
    expand_group_bits,
    group_messages,
    meta_bytes,
)

log = logging.getLogger(__name__)

evaluate_assignment = evaluate  # the checker, under a name that reads well from commsched.quant

# BitwidthAssignment.status values
OPTIMAL = "optimal"  # CP-SAT closed the gap (to within the rounding tolerance)
FEASIBLE = "feasible"  # CP-SAT's best within its limits; ``gap`` says how far from proven
FALLBACK = "greedy-fallback"  # CP-SAT found nothing in time: the greedy answer (logged)
GREEDY = "greedy"  # solver="greedy" was asked for
CLOSED_FORM = "closed-form"  # lam = 0 or 1, or nothing to trade: optimal without a solver

SOLVERS = ("cp-sat", "greedy")


@dataclass(frozen=True)
class BitwidthAssignment:
    """The chosen widths and what the checker says about them.

    bits[r][c][g]: width of group g of channel c in round r. objective, time_s (T),
    variance (V), round_times_s, t_max_s and v_max are the checker's figures. bound is a
    lower bound on the optimal objective (CP-SAT's, less the rounding tolerance; None
    without a solver bound), gap = (objective - bound) / objective. tolerance: how far the
    scaled integer model's optimum may be from the true one. status: one of "optimal",
    "feasible", "greedy-fallback", "greedy", "closed-form"; solver_status: CP-SAT's own
    status name (or None); wall_s: seconds spent in ``assign_bitwidths``.
    """

    bits: tuple[tuple[tuple[int, ...], ...], ...]
    lam: float
    objective: float
    time_s: float
    variance: float
    round_times_s: tuple[float, ...]
    t_max_s: float
    v_max: float
    bound: float | None
    gap: float | None
    tolerance: float
    status: str
    solver_status: str | None
    wall_s: float
    stats: dict

    @property
    def counts(self) -> dict[int, int]:
        """Groups per width over the whole problem."""
        out: dict[int, int] = {}
        for row in self.bits:
            for bc in row:
                for b in bc:
                    out[b] = out.get(b, 0) + 1
        return dict(sorted(out.items()))


def _result(problem: AssignmentProblem, bits, lam: float, *, status: str, t0: float,
            bound: float | None = None, tolerance: float = 0.0, solver_status: str | None = None,
            stats: dict | None = None) -> BitwidthAssignment:
    ev: Evaluation = evaluate(problem, bits, lam)
    if bound is not None:
        gap = (ev.objective - bound) / ev.objective if ev.objective > 0 else 0.0
    else:
        gap = None
    return BitwidthAssignment(
        bits=tuple(tuple(tuple(bc) for bc in row) for row in bits), lam=lam,
        objective=ev.objective, time_s=ev.time_s, variance=ev.variance,
        round_times_s=ev.round_times_s, t_max_s=ev.t_max_s, v_max=ev.v_max, bound=bound,
        gap=gap, tolerance=tolerance, status=status, solver_status=solver_status,
        wall_s=time.perf_counter() - t0, stats=stats or {})


def _check_options(time_limit_s, seed, workers, rel_gap, solver, formulation) -> None:
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, numbers.Real) \
            or not (math.isfinite(time_limit_s) and time_limit_s > 0):
        raise ValueError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an integer, got {seed!r}")
    if isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if isinstance(rel_gap, bool) or not isinstance(rel_gap, numbers.Real) or not 0 <= rel_gap < 1:
        raise ValueError(f"rel_gap must be in [0, 1), got {rel_gap!r}")
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")


def solve_problem(problem: AssignmentProblem, *, lam: float, time_limit_s: float = 10.0,
                  seed: int = 0, workers: int = 1, rel_gap: float = 1e-4,
                  solver: str = "cp-sat", formulation: str = "threshold",
                  secant_window: int | None = SECANT_WINDOW) -> BitwidthAssignment:
    """``assign_bitwidths`` on an already validated ``AssignmentProblem``.

    secant_window: see ``assign_cpsat.ThresholdModel`` (None: every secant from the start).
    """
    t0 = time.perf_counter()
    lam = check_lam(lam)
    _check_options(time_limit_s, seed, workers, rel_gap, solver, formulation)
    if secant_window is not None and (isinstance(secant_window, bool) or
                                      not isinstance(secant_window, numbers.Integral) or
                                      secant_window < 1):
        raise ValueError(f"secant_window must be an integer >= 1 or None, got {secant_window!r}")
    w_time, w_var = problem.weights(lam)
    # Closed forms: with no variance term the cheapest widths are optimal (T only grows
    # with bytes), with no time term the widest (V only shrinks with bits).
    if w_var == 0:
        return _result(problem, problem.uniform(problem.bits[0]), lam, status=CLOSED_FORM, t0=t0)
    if w_time == 0:
        return _result(problem, problem.uniform(problem.bits[-1]), lam, status=CLOSED_FORM, t0=t0)
    greedy = greedy_assignment(problem, lam)
    if solver == "greedy":
        return _result(problem, greedy, lam, status=GREEDY, t0=t0)
    outs = solve_rounds(problem, lam, time_limit_s=max(time_limit_s - (time.perf_counter() - t0), 0.01),
                        seed=seed, workers=workers, rel_gap=rel_gap, formulation=formulation,
                        hint=greedy, window=secant_window)
    err = rounding_errors(problem, lam, formulation)
    stats = {"formulation": formulation, "build_s": sum(o.build_s for o in outs),
             "solve_s": sum(o.solve_s for o in outs),
             "conflicts": sum(o.conflicts for o in outs),
             "branches": sum(o.branches for o in outs),
             "round_status": [o.status for o in outs],
             "solves": sum(o.solves for o in outs)}
    failed = [r for r, o in enumerate(outs) if o.bits is None]
    bits = tuple(greedy[r] if o.bits is None else o.bits for r, o in enumerate(outs))
    solver_status = ("OPTIMAL" if all(o.status == "OPTIMAL" for o in outs) else
                     "FEASIBLE" if not failed else outs[failed[0]].status)
    if failed:
        log.warning("CP-SAT found no assignment for round(s) %s within %.3g s (status %s); "
                    "using the greedy widths there", failed, time_limit_s, solver_status)
        return _result(problem, bits, lam, status=FALLBACK, t0=t0, tolerance=err.tolerance,
                       solver_status=solver_status, stats=stats)
    bound = sum(o.bound for o in outs) - err.tol_var - err.tol_time
    res = _result(problem, bits, lam, status=FEASIBLE, t0=t0, bound=bound,
                  tolerance=err.tolerance, solver_status=solver_status, stats=stats)
    if res.objective - res.bound <= err.tolerance:  # proven, up to the rounding tolerance
        res = replace(res, status=OPTIMAL)
    return res


def assign_bitwidths(rounds: Sequence[Sequence[Channel]], *, lam: float,
                     bits: Sequence[int] = DEFAULT_BITS, time_limit_s: float = 10.0,
                     seed: int = 0, workers: int = 1, rel_gap: float = 1e-4,
                     solver: str = "cp-sat", formulation: str = "threshold"
                     ) -> BitwidthAssignment:
    """Choose a width from ``bits`` for every message group (see the module doc).

    rounds[r][c]: channel c (a device pair) of ring round r. lam in [0, 1] weighs the
    normalised variance against the normalised time (0: fastest, 1: most precise).
    time_limit_s bounds the whole call; the solver stops earlier once its relative gap
    is at most rel_gap. Rounds are independent and are solved as separate CP-SAT models,
    ``workers`` of them at a time in threads, each with one CP-SAT worker and ``seed``:
    the answer does not depend on ``workers`` unless the time limit cuts a solve short.
    solver="greedy" skips CP-SAT. If CP-SAT finds nothing in time, the greedy answer is
    returned with status "greedy-fallback" and a logged warning.
    """
    problem = AssignmentProblem(rounds, bits)
    return solve_problem(problem, lam=lam, time_limit_s=time_limit_s, seed=seed,
                         workers=workers, rel_gap=rel_gap, solver=solver,
                         formulation=formulation)


# lam bisection steps of solve_within_variance (the lam found is within 2^-steps of the
# threshold where the variance meets the budget)
BUDGET_STEPS = 8


def solve_within_variance(problem: AssignmentProblem, v_budget: float, *,
                          time_limit_s: float = 10.0, seed: int = 0, rel_gap: float = 1e-4,
                          solver: str = "cp-sat", steps: int = BUDGET_STEPS) -> BitwidthAssignment:
    """The assignment of least modelled time T among those found whose variance V is at
    most ``v_budget``: bisection over lam in [0, 1] (V falls as lam grows), one
    :func:`solve_problem` per step, each with ``time_limit_s / (steps + 1)``. lam = 1 (every
    group at the widest) has the least V, so a budget below it is a ValueError. The
    result's ``lam`` is the one of the assignment returned; ``stats["v_budget"]`` the budget.
    This trades a time-vs-variance weight for a variance cap: "as precise as that
    assignment, as fast as possible" (the lam that meets the cap is a supported point of
    the trade-off, not the exact constrained optimum)."""
    if not (v_budget >= 0 and math.isfinite(v_budget)):
        raise ValueError(f"v_budget must be a finite variance >= 0, got {v_budget!r}")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    per = time_limit_s / (steps + 1)

    def at(lam: float) -> BitwidthAssignment:
        return solve_problem(problem, lam=lam, time_limit_s=per, seed=seed, workers=1,
                             rel_gap=rel_gap, solver=solver)

    slack = 1e-9 * max(v_budget, 1e-300)
    best = at(1.0)
    if best.variance > v_budget + slack:
        raise ValueError(f"v_budget {v_budget:.6g} is below the least variance of this problem "
                         f"({best.variance:.6g}, every group at {max(problem.bits)} bits)")
    lo, hi = 0.0, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        a = at(mid)
        if a.variance <= v_budget + slack:
            hi = mid
            if a.time_s < best.time_s:
                best = a
        else:
            lo = mid
    return replace(best, stats={**best.stats, "v_budget": v_budget})


def assign_many(problems: Sequence[Sequence[Sequence[Channel]]], *, lam: float,
                bits: Sequence[int] = DEFAULT_BITS, time_limit_s: float = 10.0, seed: int = 0,
                rel_gap: float = 1e-4, max_threads: int | None = None,
                solver: str = "cp-sat",
                variance_budgets: Sequence[float] | None = None) -> list[BitwidthAssignment]:
    """Solve independent problems (e.g. each layer and direction) in a thread pool.

    Each problem is ``rounds`` as for ``assign_bitwidths`` and is solved with one CP-SAT
    worker (deterministic); CP-SAT releases the GIL while it searches, so the solves run
    in parallel. Results come back in the order of ``problems``. With
    ``variance_budgets`` (one per problem) each is solved by :func:`solve_within_variance`
    instead (lam is then unused): the fastest assignment found within that variance.
    """
    parsed = [AssignmentProblem(rounds, bits) for rounds in problems]
    lam = check_lam(lam)
    if variance_budgets is not None and len(variance_budgets) != len(parsed):
        raise ValueError(f"variance_budgets has {len(variance_budgets)} entries for "
                         f"{len(parsed)} problems; give one per problem")
    _check_options(time_limit_s, seed, 1, rel_gap, solver, "threshold")
    if max_threads is not None and (isinstance(max_threads, bool) or
                                    not isinstance(max_threads, numbers.Integral) or max_threads < 1):
        raise ValueError(f"max_threads must be an integer >= 1 or None, got {max_threads!r}")
    if not parsed:
        return []
    threads = min(len(parsed), max_threads or len(parsed))

    budgets = list(variance_budgets) if variance_budgets is not None else [None] * len(parsed)

    def one(i: int) -> BitwidthAssignment:
        if budgets[i] is not None:
            return solve_within_variance(parsed[i], float(budgets[i]), time_limit_s=time_limit_s,
                                         seed=seed, rel_gap=rel_gap, solver=solver)
        return solve_problem(parsed[i], lam=lam, time_limit_s=time_limit_s, seed=seed, workers=1,
                             rel_gap=rel_gap, solver=solver)

    if threads == 1:
        return [one(i) for i in range(len(parsed))]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="assign") as pool:
        return list(pool.map(one, range(len(parsed))))


__all__ = [
    "AssignmentProblem", "BitwidthAssignment", "Channel", "Evaluation", "MessageGroup",
    "OBJECTIVE_SCALE", "assign_bitwidths", "assign_many", "evaluate", "evaluate_assignment",
    "expand_group_bits",
    "greedy_assignment", "group_messages", "meta_bytes", "rounding_errors", "solve_problem",
    "solve_within_variance", "BUDGET_STEPS",
]
