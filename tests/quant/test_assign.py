"""Bit-width assignment: checker on a hand-worked example, CP-SAT against brute force,
limits of lam, monotonicity, greedy against CP-SAT, determinism, validation.

Every solve uses one worker, a fixed seed and a time limit.
"""

from __future__ import annotations

import itertools
import logging
import math

import numpy as np
import pytest

import commsched.quant.widths.assign as A
from commsched.quant.widths.assign import (
    AssignmentProblem,
    Channel,
    MessageGroup,
    assign_bitwidths,
    assign_many,
    evaluate,
    expand_group_bits,
    greedy_assignment,
    group_messages,
    rounding_errors,
    solve_problem,
    solve_within_variance,
)
from commsched.quant.widths.cpsat import OBJECTIVE_SCALE, PerGroupModel, ThresholdModel
from commsched.quant.widths.problem import variance_factor

LIMIT = dict(time_limit_s=20.0, seed=0, workers=1)


def random_rounds(seed: int, rounds: int, channels: int, groups: tuple[int, int], *,
                  mixed: bool = True, zeros: bool = False):
    """Random instances; ``mixed`` varies (count, dim) within a channel, ``zeros`` adds
    zero betas, empty groups and tied betas."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rounds):
        chans = []
        for _ in range(channels):
            n = int(rng.integers(groups[0], groups[1] + 1))
            gs = []
            for _ in range(n):
                count = int(rng.choice([3, 5, 5])) if mixed else 5
                dim = int(rng.choice([4, 6, 6])) if mixed else 6
                beta = float(rng.lognormal(0.0, 1.5))
                if zeros:
                    kind = rng.integers(5)
                    beta = 0.0 if kind == 0 else (1.0 if kind == 1 else beta)
                    count = 0 if kind == 2 else count
                gs.append(MessageGroup(count, dim, beta))
            chans.append(Channel(float(rng.uniform(1e-3, 3e-3)), float(rng.uniform(0, 0.05)), gs))
        out.append(chans)
    return out


def tiny_problem(seed: int, **kw) -> AssignmentProblem:
    """A random instance of 2 rounds x 2 channels with at most 10 groups (for brute force)."""
    for k in range(100):
        p = AssignmentProblem(random_rounds(1000 * seed + k, 2, 2, (1, 4), **kw), meta=8)
        if 6 <= p.num_groups <= 10:
            return p
    raise AssertionError("no tiny instance drawn")


def brute_force(problem: AssignmentProblem, lam: float):
    """Every assignment, vectorised: (optimal objective, one optimal bits)."""
    w_time, w_var = problem.weights(lam)
    combos, T, V = brute_tv(problem)
    obj = w_time * T + w_var * V
    k = int(np.argmin(obj))
    it = iter(combos[k])
    bits = tuple(tuple(tuple(problem.bits[next(it)] for _ in range(len(a.count_G))) for a in row)
                 for row in problem.arrays)
    return float(obj[k]), bits


def brute_tv(problem: AssignmentProblem):
    """Every assignment (width indices [K, slots]) with its time T [K] and variance V [K]."""
    slots = [(r, c, g) for r, row in enumerate(problem.arrays) for c, a in enumerate(row)
             for g in range(len(a.count_G))]
    W = len(problem.bits)
    combos = np.array(list(itertools.product(range(W), repeat=len(slots))), dtype=np.int64)
    combos = combos.reshape(len(combos), len(slots))
    f_W = np.array([variance_factor(b) for b in problem.bits])
    T = np.zeros(len(combos))
    V = np.zeros(len(combos))
    col = 0
    for row in problem.arrays:
        round_t = np.full(len(combos), -np.inf)
        for a in row:
            n = len(a.count_G)
            w = combos[:, col:col + n]
            nbytes = a.bytes_GW[np.arange(n)[None, :], w].sum(axis=1) if n else 0
            round_t = np.maximum(round_t, a.gamma + a.theta * nbytes)
            V += (a.beta_G[None, :] * f_W[w]).sum(axis=1) if n else 0
            col += n
        T += round_t
    return combos, T, V


# --------------------------------------------------------------------------- checker
def hand_problem():
    # bytes(count, dim, b) = count * (ceil(dim * b / 8) + 8):
    #   A.g0 (2, 4): 18 / 20 / 24 at 2 / 4 / 8 bits
    #   B.g0 (1, 8): 10 / 12 / 16;  B.g1 (3, 2): 27 / 27 / 30
    a = Channel(0.001, 0.01, [MessageGroup(2, 4, 9.0)])
    b = Channel(0.002, 0.0, [MessageGroup(1, 8, 225.0), MessageGroup(3, 2, 0.0)])
    return AssignmentProblem([[a, b]], meta=8)


def test_checker_matches_hand_worked_example():
    p = hand_problem()
    ev = evaluate(p, [[[4], [2, 8]]], lam=0.5)
    # A: 0.01 + 0.001 * 20 = 0.03; B: 0.002 * (10 + 30) = 0.08; the round takes the max
    assert ev.channel_times_s[0] == pytest.approx((0.03, 0.08))
    assert ev.time_s == pytest.approx(0.08)
    assert ev.variance == pytest.approx(9 / 15**2 + 225 / 3**2 + 0.0)  # 0.04 + 25
    # T_max: max(0.01 + 0.024, 0.002 * 46) = 0.092; V_max: 9/9 + 225/9 = 26
    assert ev.t_max_s == pytest.approx(0.092)
    assert ev.v_max == pytest.approx(26.0)
    assert ev.objective == pytest.approx(0.5 * 25.04 / 26 + 0.5 * 0.08 / 0.092)
    assert evaluate(p, [[[4], [2, 8]]], lam=0.0).objective == pytest.approx(0.08 / 0.092)
    assert evaluate(p, [[[4], [2, 8]]], lam=1.0).objective == pytest.approx(25.04 / 26)


def test_checker_drops_a_term_whose_normaliser_is_zero():
    # all betas 0: V_max = 0, only time counts; theta = gamma = 0: T_max = 0
    p = AssignmentProblem([[Channel(0.001, 0.0, [MessageGroup(1, 8, 0.0)])]], meta=8)
    assert evaluate(p, [[[8]]], lam=0.5).objective == pytest.approx(0.5 * 16 * 0.001 / (16 * 0.001))
    q = AssignmentProblem([[Channel(0.0, 0.0, [MessageGroup(1, 8, 3.0)])]], meta=8)
    assert evaluate(q, [[[2]]], lam=0.5).objective == pytest.approx(0.5)
    assert evaluate(q, [[[2]]], lam=0.0).objective == 0.0


def test_bytes_use_the_codec_metadata_size():
    import commsched.quant as Q
    from commsched.quant import codec, reference
    from commsched.quant.widths.problem import ALLOWED_BITS, meta_bytes

    assert meta_bytes() == codec.META_BYTES == Q.META_BYTES == 8
    assert ALLOWED_BITS is reference.BITS is codec.BITS  # one definition of the widths
    p = AssignmentProblem([[Channel(1.0, 0.0, [MessageGroup(3, 5, 1.0)])]])
    assert p.arrays[0][0].bytes_GW[0].tolist() == [3 * (math.ceil(5 * b / 8) + Q.META_BYTES)
                                                    for b in (2, 4, 8)]


# --------------------------------------------------------------------------- grouping
def test_group_messages_sorts_by_beta_and_cuts():
    groups, members = group_messages([1.0, 5.0, 3.0, 5.0, 2.0], dim=16, group_size=2)
    assert [m.tolist() for m in members] == [[1, 3], [2, 4], [0]]
    assert groups == [MessageGroup(2, 16, 10.0), MessageGroup(2, 16, 5.0), MessageGroup(1, 16, 1.0)]
    assert expand_group_bits(members, [8, 4, 2], 5).tolist() == [2, 8, 4, 8, 4]
    assert group_messages([], dim=4, group_size=3) == ([], [])
    with pytest.raises(ValueError, match="group_size"):
        group_messages([1.0], dim=4, group_size=0)
    with pytest.raises(ValueError, match="beta_K"):
        group_messages([1.0, float("nan")], dim=4, group_size=1)
    with pytest.raises(ValueError, match="cover"):
        expand_group_bits(members[:2], [8, 4], 5)


# --------------------------------------------------------------------------- brute force
CASES = [(seed, lam) for seed in range(6) for lam in (0.0, 0.3, 0.5, 0.8, 1.0)]


@pytest.mark.parametrize("seed,lam", CASES)
def test_cpsat_matches_brute_force(seed, lam):
    p = tiny_problem(seed, zeros=seed % 2 == 1)
    best, _ = brute_force(p, lam)
    for formulation in ("threshold", "per-group"):
        a = solve_problem(p, lam=lam, rel_gap=0.0, formulation=formulation, **LIMIT)
        assert a.status in ("optimal", "closed-form"), (formulation, a.status)
        assert a.objective == pytest.approx(evaluate(p, a.bits, lam).objective, abs=1e-15)
        assert best - 1e-12 <= a.objective <= best + a.tolerance + 1e-12, formulation
        if a.bound is not None:
            assert a.bound <= best + 1e-12
    g = solve_problem(p, lam=lam, solver="greedy")
    assert g.objective >= best - 1e-12


@pytest.mark.parametrize("bits", [(4, 8), (2, 8), (2, 4), (8,)])
def test_brute_force_with_fewer_widths(bits):
    p = AssignmentProblem(random_rounds(7, 2, 2, (2, 3)), bits=bits, meta=8)
    best, _ = brute_force(p, 0.4)
    a = solve_problem(p, lam=0.4, rel_gap=0.0, **LIMIT)
    assert best - 1e-12 <= a.objective <= best + a.tolerance + 1e-12
    assert {b for row in a.bits for bc in row for b in bc} <= set(bits)


@pytest.mark.parametrize("seed", range(4))
def test_within_variance_meets_the_budget_and_trades_time(seed):
    p = tiny_problem(seed)
    _, T, V = brute_tv(p)
    # the budget: the variance of the lam = 0.5 answer under other link costs (as AdaQP's
    # equal-variance mode takes it from the averaged-cost problem)
    rng = np.random.default_rng(seed)
    other = AssignmentProblem([[Channel(c.theta * float(rng.uniform(0.2, 5)), c.gamma, c.groups)
                                for c in row] for row in p.rounds], meta=8)
    budget = solve_problem(other, lam=0.5, **LIMIT).variance
    a = solve_within_variance(p, budget, time_limit_s=20.0)
    assert a.variance <= budget * (1 + 1e-9)
    assert a.stats["v_budget"] == budget
    assert evaluate(p, a.bits, a.lam).time_s == pytest.approx(a.time_s)
    t_opt = T[V <= budget * (1 + 1e-9)].min()  # the constrained optimum, by brute force
    assert t_opt - 1e-12 <= a.time_s
    if budget > V.min() * (1 + 1e-6):  # room to trade: faster than every group at 8 bits
        assert a.time_s < solve_problem(p, lam=1.0, **LIMIT).time_s
    with pytest.raises(ValueError, match="below the least variance"):
        solve_within_variance(p, V.min() * 0.5 - 1e-9 if V.min() > 0 else -1.0)
    many = assign_many([p.rounds, other.rounds], lam=0.5, time_limit_s=20.0,
                       variance_budgets=[budget, None])
    assert many[0].bits == a.bits
    assert many[1].bits == solve_problem(other, lam=0.5, **LIMIT).bits
    with pytest.raises(ValueError, match="variance_budgets has 1 entries for 2 problems"):
        assign_many([p.rounds, other.rounds], lam=0.5, variance_budgets=[budget])


def test_model_objective_is_within_the_stated_rounding_errors():
    """F(x) - tol_var <= M(x) <= F(x) + tol_var + tol_time for fixed assignments x."""
    from ortools.sat.python import cp_model

    rng = np.random.default_rng(3)
    p = AssignmentProblem(random_rounds(3, 3, 3, (2, 6), zeros=True), meta=8)
    for lam in (0.1, 0.5, 0.9):
        for trial in range(4):
            # a random assignment, made non-increasing within each (count, dim) class by
            # beta so that the threshold model can express it too
            bits = []
            for row in p.arrays:
                brow = []
                for a in row:
                    w = rng.integers(0, 3, len(a.count_G))
                    order = np.lexsort((np.arange(len(w)), -a.beta_G, a.dim_G, a.count_G))
                    for key in {(c, d) for c, d in zip(a.count_G, a.dim_G)}:
                        idx = [i for i in order if (a.count_G[i], a.dim_G[i]) == key]
                        w[idx] = np.sort(w[idx])[::-1]
                    brow.append(tuple(p.bits[i] for i in w))
                bits.append(tuple(brow))
            F = evaluate(p, bits, lam).objective
            for cls, form in ((ThresholdModel, "threshold"), (PerGroupModel, "per-group")):
                err = rounding_errors(p, lam, form)
                M = 0.0
                for r in range(len(p.rounds)):
                    rm = cls(p, lam, r, hint=bits)
                    solver = cp_model.CpSolver()
                    solver.parameters.fix_variables_to_their_hinted_value = True
                    solver.parameters.num_workers = 1
                    solver.parameters.max_time_in_seconds = 10
                    assert solver.solve(rm.model) == cp_model.OPTIMAL, form
                    assert rm.decode(solver) == bits[r]
                    M += solver.objective_value / OBJECTIVE_SCALE
                assert F - err.tol_var - 1e-12 <= M <= F + err.tol_var + err.tol_time + 1e-12, \
                    (form, lam, trial)


def test_stated_tolerance_is_small_at_the_benchmark_size():
    p = AssignmentProblem([[Channel(1e-9, 1e-4, [MessageGroup(100, 256, 1.0)] * 2000)] * 4] * 3)
    err = rounding_errors(p, 0.5)
    assert err.tolerance < 1e-6
    assert err.tol_time > 0 and err.tol_var > 0


# --------------------------------------------------------------------------- lam
def test_lam_limits_give_smallest_and_largest_widths():
    rounds = random_rounds(11, 3, 3, (5, 9), zeros=True)
    lo = assign_bitwidths(rounds, lam=0.0, **LIMIT)
    hi = assign_bitwidths(rounds, lam=1.0, **LIMIT)
    assert lo.counts == {2: lo.counts[2]} and hi.counts == {8: hi.counts[8]}
    assert lo.status == hi.status == "closed-form"
    # and they are optimal: CP-SAT at lam close to the limits gets no better objective
    for lam, ref in ((1e-9, lo), (1 - 1e-9, hi)):
        near = assign_bitwidths(rounds, lam=lam, rel_gap=0.0, **LIMIT)
        p = AssignmentProblem(rounds)
        assert evaluate(p, ref.bits, lam).objective <= near.objective + 1e-6
    narrow = assign_bitwidths(rounds, lam=0.0, bits=(4, 8), **LIMIT)
    assert set(narrow.counts) == {4}


def test_raising_lam_never_raises_the_variance():
    for seed in (0, 1, 2):
        p = tiny_problem(20 + seed)
        prev = None
        for lam in np.linspace(0, 1, 11):
            a = solve_problem(p, lam=float(lam), rel_gap=0.0, **LIMIT)
            assert a.status in ("optimal", "closed-form")
            if prev is not None:
                assert a.variance <= prev.variance * (1 + 1e-9), (seed, lam)
                assert a.time_s >= prev.time_s * (1 - 1e-9), (seed, lam)
            prev = a
    # the same on a larger instance where both ends are far apart
    rounds = random_rounds(5, 3, 4, (20, 30))
    v = [assign_bitwidths(rounds, lam=lam, rel_gap=1e-5, time_limit_s=10.0).variance
         for lam in (0.0, 0.2, 0.5, 0.8, 1.0)]
    assert all(x >= y for x, y in zip(v, v[1:])), v
    assert v[0] > 10 * v[-1]


# --------------------------------------------------------------------------- greedy vs CP-SAT
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_is_never_better_than_cpsat_and_both_pass_the_checker(seed):
    rounds = random_rounds(100 + seed, 3, 4, (20, 60), zeros=seed == 2)
    p = AssignmentProblem(rounds)
    for lam in (0.2, 0.5, 0.8):
        cp = solve_problem(p, lam=lam, rel_gap=1e-5, time_limit_s=10.0, seed=0, workers=1)
        gr = solve_problem(p, lam=lam, solver="greedy")
        for a in (cp, gr):
            ev = evaluate(p, a.bits, lam)
            assert (a.objective, a.time_s, a.variance) == (ev.objective, ev.time_s, ev.variance)
            assert a.round_times_s == ev.round_times_s
        assert cp.objective <= gr.objective + cp.tolerance
        assert cp.bound <= cp.objective and cp.gap is not None and 0 <= cp.gap < 1e-2
        assert greedy_assignment(p, lam) == gr.bits


def test_fallback_to_greedy_is_logged(monkeypatch, caplog):
    import commsched.quant.widths.cpsat as C

    real = C.solve_round

    def fail_round_one(problem, lam, r, **kw):
        out = real(problem, lam, r, **kw)
        return C.RoundOutcome(None, "UNKNOWN", None, None, 0.0, 0.0, 0, 0) if r == 1 else out

    monkeypatch.setattr(C, "solve_round", fail_round_one)
    rounds = random_rounds(1, 3, 2, (3, 4))
    with caplog.at_level(logging.WARNING, logger="commsched.quant.widths.assign"):
        a = assign_bitwidths(rounds, lam=0.5, **LIMIT)
    assert a.status == "greedy-fallback" and a.solver_status == "UNKNOWN" and a.bound is None
    greedy = greedy_assignment(AssignmentProblem(rounds), 0.5)
    assert a.bits[1] == greedy[1]
    assert "greedy" in caplog.text and "[1]" in caplog.text


# --------------------------------------------------------------------------- determinism
def test_same_answer_twice_and_in_threads():
    problems = [random_rounds(200 + k, 3, 4, (20, 40)) for k in range(3)]
    first = [assign_bitwidths(r, lam=0.5, rel_gap=1e-5, time_limit_s=20.0) for r in problems]
    again = [assign_bitwidths(r, lam=0.5, rel_gap=1e-5, time_limit_s=20.0) for r in problems]
    threaded = assign_many(problems, lam=0.5, rel_gap=1e-5, time_limit_s=20.0, max_threads=3)
    for a, b, c in zip(first, again, threaded):
        assert a.bits == b.bits == c.bits
        assert a.objective == b.objective == c.objective
    assert assign_many([], lam=0.5) == []


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize("make,exc,field", [
    (lambda: MessageGroup(-1, 4, 1.0), ValueError, "count"),
    (lambda: MessageGroup(1.5, 4, 1.0), TypeError, "count"),
    (lambda: MessageGroup(1, 0, 1.0), ValueError, "dim"),
    (lambda: MessageGroup(1, 4, float("nan")), ValueError, "beta"),
    (lambda: MessageGroup(1, 4, -1.0), ValueError, "beta"),
    (lambda: MessageGroup(1, 4, "x"), TypeError, "beta"),
    (lambda: Channel(float("inf"), 0.0, []), ValueError, "theta"),
    (lambda: Channel(1.0, -1.0, []), ValueError, "gamma"),
    (lambda: Channel(1.0, 0.0, [(1, 4, 1.0)]), TypeError, "groups"),
    (lambda: assign_bitwidths([], lam=0.5), ValueError, "rounds"),
    (lambda: assign_bitwidths([[]], lam=0.5), ValueError, r"rounds\[0\]"),
    (lambda: assign_bitwidths([[1]], lam=0.5), TypeError, r"rounds\[0\]\[0\]"),
    (lambda: assign_bitwidths([[Channel(1, 0, [])]], lam=0.5, bits=(3, 8)), ValueError, "bits"),
    (lambda: assign_bitwidths([[Channel(1, 0, [])]], lam=0.5, bits=()), ValueError, "bits"),
    (lambda: assign_bitwidths([[Channel(1, 0, [])]], lam=0.5, bits=(4, 4)), ValueError, "bits"),
    (lambda: assign_bitwidths([[Channel(1, 0, [])]], lam=1.5), ValueError, "lam"),
    (lambda: assign_bitwidths([[Channel(1, 0, [])]], lam=float("nan")), ValueError, "lam"),
    (lambda: assign_bitwidths([[Channel(1, 0, [])]], lam=0.5, time_limit_s=0), ValueError,
     "time_limit_s"),
    (lambda: assign_bitwidths([[Channel(1, 0, [])]], lam=0.5, solver="gurobi"), ValueError,
     "solver"),
    (lambda: evaluate(hand_problem(), [[[4], [2]]], 0.5), ValueError, "channel"),
    (lambda: evaluate(hand_problem(), [[[4], [2, 3]]], 0.5), ValueError, "width 3"),
])
def test_validation_names_the_field(make, exc, field):
    with pytest.raises(exc, match=field):
        make()


def test_empty_channels_and_groups_are_fine():
    rounds = [[Channel(1e-3, 0.01, []), Channel(1e-3, 0.0, [MessageGroup(0, 4, 2.0),
                                                             MessageGroup(2, 4, 1.0)])]]
    a = assign_bitwidths(rounds, lam=0.5, **LIMIT)
    assert a.bits[0][0] == ()
    assert a.bits[0][1][0] == 8  # an empty group costs nothing: widest is free
    assert a.objective == evaluate(AssignmentProblem(rounds), a.bits, 0.5).objective


# --------------------------------------------------------------------------- secant window
def test_secant_refinement_reaches_the_full_model_optimum():
    """Starting from few secants around a poor hint, refinement adds the missing ones
    and ends at the optimum of the model with every secant."""
    from commsched.quant.widths.cpsat import solve_rounds

    rng = np.random.default_rng(8)
    rounds = [[Channel(float(rng.uniform(1e-3, 2e-3)), 0.01,
                       [MessageGroup(5, 6, float(b)) for b in rng.lognormal(0, 1.5, 40)])
               for _ in range(2)] for _ in range(2)]
    p = AssignmentProblem(rounds, meta=8)
    poor = p.uniform(2)  # the hint sits at threshold 0, far from the optimum
    full = solve_rounds(p, 0.5, rel_gap=0.0, time_limit_s=20.0, hint=poor, window=None)
    lazy = solve_rounds(p, 0.5, rel_gap=0.0, time_limit_s=20.0, hint=poor, window=4)
    assert all(o.status == "OPTIMAL" for o in full + lazy)
    assert sum(o.solves for o in lazy) > len(lazy)  # secants were added at least once
    for f, z in zip(full, lazy):
        assert z.objective == pytest.approx(f.objective, abs=1e-12)
        assert z.bound <= z.objective + 1e-12
    ev = evaluate(p, tuple(o.bits for o in lazy), 0.5).objective
    assert ev == pytest.approx(evaluate(p, tuple(o.bits for o in full), 0.5).objective, abs=1e-6)


def test_workers_do_not_change_the_answer():
    rounds = random_rounds(300, 3, 4, (40, 60))
    one = assign_bitwidths(rounds, lam=0.6, rel_gap=1e-5, time_limit_s=10.0, workers=1)
    two = assign_bitwidths(rounds, lam=0.6, rel_gap=1e-5, time_limit_s=10.0, workers=3)
    assert one.bits == two.bits and one.objective == two.objective


def test_package_exports_and_bench_workload(tmp_path):
    import commsched.quant as Q
    from commsched.bench import run_bench

    for name in ("MessageGroup", "Channel", "assign_bitwidths", "BitwidthAssignment",
                 "assign_many", "AssignmentProblem", "evaluate_assignment", "group_messages",
                 "expand_group_bits"):
        assert getattr(Q, name) is getattr(A, name)
    summary = run_bench("assign", ["--devices", "3", "--groups", "12", "--group-size", "4",
                                   "--dim", "8", "--plain-time-limit", "2", "--time-limit", "5",
                                   "--out", str(tmp_path)], progress=lambda s: None)
    med = summary["median"]
    assert set(med) == {"cp-sat", "cp-sat-1pct", "cp-sat-threads", "cp-sat-exact",
                        "all-secants", "greedy", "per-group"}
    assert med["cp-sat-exact"]["gap_to_bound"] <= 1e-6  # the exact variant proves its optimum
    assert all(m["gain_over_greedy"] >= -1e-6 for m in med.values())
    assert (tmp_path / "summary.md").exists()
