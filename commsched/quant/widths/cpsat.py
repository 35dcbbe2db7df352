"""The bit-width assignment as CP-SAT models (OR-Tools), in two formulations.

Rounds are independent (T and V are sums over rounds and no variable is shared), so
each ring round is its own CP-SAT model, solved one after another or in threads: the
search of one round never waits on another's, and the bound is the sum of the rounds'.

``threshold`` (the default) exploits the structure of a channel. Two groups of one
channel with the same (count, dim) cost the same bytes at every width, so swapping
their widths keeps the channel's time and, when the larger beta gets the wider width,
never raises the variance. Hence some optimum gives, within each such *class* sorted by
beta (largest first), non-increasing widths, and a class is described by W - 1 integer
thresholds m_j = the number of its groups at width >= bits[j] (m_1 >= m_2 >= ...). The
variance removed is then a concave prefix sum P_j(m_j), modelled exactly by secant
lines z_j <= line(m_j) (every other segment's secant suffices, see ``_secant_lines``).
The model has a few integer variables per class instead of W Booleans per group, no
symmetry among groups, and its LP relaxation is the continuous knapsack relaxation.
The secants start as a window around the greedy hint plus a coarse sample elsewhere
(a relaxation, so its bound stays valid); where the solution lands outside what the
window covers exactly, ``solve_round`` adds the secants there and solves again.

``per-group`` is the plain model (one Boolean per group and width, exactly one per
group). It is the slow twin the tests compare the threshold model with.

Integer scaling. CP-SAT needs integer coefficients. The normalised objective is
multiplied by ``OBJECTIVE_SCALE``; variance coefficients are rounded to the nearest
integer (error <= 1/2 unit per coefficient). The round time is an integer variable in
steps of q seconds, q chosen so that one step costs exactly ``TIME_COST`` units; channel
times are expressed in 1/``TIME_SUBSTEPS`` of a step with every coefficient rounded *up*,
so a model-feasible round time is never below the true one and exceeds it by less than
one step plus (1 + terms) / TIME_SUBSTEPS of a step. ``rounding_errors`` turns this into
``tol_var`` and ``tol_time`` (normalised units) with

    F(x) - tol_var <= M(x) <= F(x) + tol_var + tol_time      for every assignment x,

F the true objective, M the scaled model's (divided by OBJECTIVE_SCALE). Hence the true
objective of the model's optimum is within ``tolerance = 2 tol_var + tol_time`` of the
true optimum, and ``bound - tol_var - tol_time`` is a valid lower bound on it. With the
constants below: about 6e-8 per round plus 6e-14 per group, i.e. below 1e-6 for up to
15 rounds and a million groups.

Legend: G = groups of one channel, W = candidate widths, n = groups of one class.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..._lazy import require
from .problem import AssignmentProblem, ChannelArrays, variance_factor

if TYPE_CHECKING:  # OR-Tools is imported when a model is built (the gnn extra)
    from ortools.sat.python import cp_model

OBJECTIVE_SCALE = 2**44  # integer objective units per unit of the normalised objective
TIME_COST = 2**20  # objective units per step of a round-time variable (fixes the step q)
TIME_SUBSTEPS = 2**16  # channel-time coefficients are in 1/TIME_SUBSTEPS of a step, rounded up
SECANT_WINDOW = 64  # groups either side of the hinted threshold whose secants start in the model

FORMULATIONS = ("threshold", "per-group")


def _cp_model():
    """OR-Tools' ``cp_model`` (the ``gnn`` extra), imported when a model is built."""
    return require("ortools.sat.python.cp_model", "the CP-SAT bit-width solver (solver='cp-sat')")


@dataclass(frozen=True)
class RoundingErrors:
    tol_var: float  # |variance part of M - F| <= tol_var
    tol_time: float  # 0 <= time part of M - F <= tol_time

    @property
    def tolerance(self) -> float:
        """The true objective of the model's optimum is within this of the true optimum."""
        return 2 * self.tol_var + self.tol_time


def rounding_errors(problem: AssignmentProblem, lam: float, formulation: str = "threshold"
                    ) -> RoundingErrors:
    """Bounds on how far the scaled models' objective is from the checker's (see module doc).

    Per group at most W - 1 rounded variance coefficients count (one in the per-group
    model), each off by <= 1/2 unit, plus 1/2 unit for each round's rounded constant; per
    round the time is over-estimated by < 1 step plus (1 + terms) / TIME_SUBSTEPS steps,
    ``terms`` being the most rounded-up time coefficients one channel sums.
    """
    w_time, w_var = problem.weights(lam)
    W = len(problem.bits)
    R = len(problem.rounds)
    per_group = (W - 1) if formulation == "threshold" else 1
    tol_var = (per_group * problem.num_groups + R) / 2 / OBJECTIVE_SCALE if w_var > 0 else 0.0
    if w_time > 0:
        terms = max(len(ch.groups) for chans in problem.rounds for ch in chans) * per_group
        steps = 1 + (1 + terms) / TIME_SUBSTEPS
        tol_time = R * steps * TIME_COST / OBJECTIVE_SCALE
    else:
        tol_time = 0.0
    return RoundingErrors(tol_var, tol_time)


def _secant_lines(P: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lines whose minimum equals the concave sequence P at 0..n: (anchor, slope, intercept).

    The secant of segment i passes through (i, P[i]) and (i+1, P[i+1]) and, P being
    concave, lies above P everywhere else; so any set of secants over-estimates P, and
    the secants of every other segment (plus the last) are tight at every integer point.
    Consecutive segments of equal slope give one line. Sorted by anchor (the segment).
    """
    n = len(P) - 1
    seg = list(range(0, n, 2))
    if n >= 2 and n % 2 == 0:
        seg.append(n - 1)
    seg = np.array(seg, dtype=np.int64)
    slope = P[seg + 1] - P[seg]
    icept = P[seg] - slope * seg
    keep = np.ones(len(seg), dtype=bool)
    keep[1:] = slope[1:] != slope[:-1]  # slopes are non-increasing: equal ones are adjacent
    return seg[keep], slope[keep], icept[keep]


@dataclass
class _Concave:
    """z <= P(m): the variance one threshold m removes, with the secants added so far."""

    z: object
    m: object
    P: np.ndarray  # int64 [n + 1]
    anchor: np.ndarray
    slope: np.ndarray
    icept: np.ndarray
    added: np.ndarray  # bool, which secants are in the model

    def over(self, value: int) -> bool:
        """Whether the secants in the model over-estimate P at m = value."""
        a = self.added
        return bool((self.slope[a] * value + self.icept[a]).min() > self.P[value])


def _classes(a: ChannelArrays) -> list[np.ndarray]:
    """Group indices of one channel split by (count, dim), each sorted by beta, largest first."""
    G = len(a.count_G)
    if G == 0:
        return []
    order = np.lexsort((np.arange(G), -a.beta_G, a.dim_G, a.count_G))
    key_c, key_d = a.count_G[order], a.dim_G[order]
    cut = np.flatnonzero((key_c[1:] != key_c[:-1]) | (key_d[1:] != key_d[:-1])) + 1
    return np.split(order, cut)


class RoundModel:
    """The CP-SAT model of one ring round (rounds are independent: T and V are sums).

    Shared by both formulations: the weights, the time step q, the round-time variable
    and the objective with its constant. ``decode(solver)`` gives the round's widths,
    ``bits[c][g]``.
    """

    def __init__(self, problem: AssignmentProblem, lam: float, r: int):
        self.problem, self.r = problem, r
        self.arrays = problem.arrays[r]
        self.w_time, self.w_var = problem.weights(lam)
        self.f_W = np.array([variance_factor(b) for b in problem.bits])
        self.cp = _cp_model()
        self.model = self.cp.CpModel()
        self.obj_vars: list = []
        self.obj_coefs: list[int] = []
        # seconds per round-time step: one step costs exactly TIME_COST units
        self.q = TIME_COST / (OBJECTIVE_SCALE * self.w_time) if self.w_time > 0 else None
        self.chans: list[tuple[int, list, int, int]] = []  # (const, [(coef, var)], max, hinted)
        self.hint_vars: list = []  # decision variables besides the objective's z (for refine)
        self.offset = 0

    def substeps(self, seconds: float) -> int:
        """ceil(seconds in 1/TIME_SUBSTEPS of a step)."""
        return math.ceil(seconds * TIME_SUBSTEPS / self.q)

    def add_channel_time(self, a: ChannelArrays, terms: list, max_sum: int, hinted: int) -> None:
        """Channel time in substeps = const + sum coef * var, with const from gamma and the
        bytes at the smallest width; ``hinted`` is the sum at the hint."""
        if self.w_time > 0:
            const = self.substeps(a.gamma + a.theta * int(a.bytes_GW[:, 0].sum()))
            self.chans.append((const, terms, max_sum, const + hinted))

    def finish(self, hint: bool) -> None:
        m = self.model
        if self.w_time > 0:
            lo = max(c for c, _, _, _ in self.chans)
            hi = max(c + mx for c, _, mx, _ in self.chans)
            tau = m.new_int_var(-(-lo // TIME_SUBSTEPS), -(-hi // TIME_SUBSTEPS), f"tau{self.r}")
            for const, terms, _, _ in self.chans:
                if terms:
                    expr = self.cp.LinearExpr.weighted_sum([v for _, v in terms],
                                                            [k for k, _ in terms])
                    m.add(expr + const <= TIME_SUBSTEPS * tau)
            self.obj_vars.append(tau)
            self.obj_coefs.append(TIME_COST)
            self.hint_vars.append(tau)
            if hint:
                m.add_hint(tau, -(-max(h for _, _, _, h in self.chans) // TIME_SUBSTEPS))
        # the variance of this round at the smallest widths, a constant
        v_min = sum(float(a.beta_G.sum()) for a in self.arrays) * self.f_W[0]
        self.offset = round(OBJECTIVE_SCALE * self.w_var * v_min)
        expr = self.cp.LinearExpr.weighted_sum(self.obj_vars, self.obj_coefs) if self.obj_vars else 0
        m.minimize(expr + self.offset)


def _hint_indices(problem: AssignmentProblem, r: int, hint) -> list[np.ndarray] | None:
    if hint is None:
        return None
    index = {w: i for i, w in enumerate(problem.bits)}
    return [np.array([index[x] for x in bc], dtype=np.int64) for bc in hint[r]]


class ThresholdModel(RoundModel):
    """Per (channel, class) the thresholds m_j; the variance removed by concave secants.

    window=None puts every secant in the model. With a window (and a hint) the model
    starts with the secants within ``window`` groups of the hinted threshold and every
    ``window``-th one elsewhere: a relaxation (secants over-estimate the removed
    variance), so its bound stays valid; ``refine`` adds the secants around a solution
    where the relaxation was not tight, and ``solve_round`` repeats until it is.
    """

    def __init__(self, problem: AssignmentProblem, lam: float, r: int, hint=None,
                 window: int | None = None):
        super().__init__(problem, lam, r)
        self.window = window if hint is not None else None
        self.concave: list[_Concave] = []
        m = self.model
        W = len(problem.bits)
        hint_w = _hint_indices(problem, r, hint)
        self.layout = []  # per channel: list of (members, [m_j vars])
        for c, a in enumerate(self.arrays):
            terms, mx, hsum, lchan = [], 0, 0, []
            for k, members in enumerate(_classes(a)):
                n = len(members)
                bytes_W = a.bytes_GW[members[0]]
                mvars = []
                for j in range(1, W):
                    mj = m.new_int_var(0, n, f"m{r}_{c}_{k}_{j}")
                    self.hint_vars.append(mj)
                    if mvars:
                        m.add(mj <= mvars[-1])
                    mvars.append(mj)
                    hint_m = int((hint_w[c][members] >= j).sum()) if hint_w is not None else 0
                    if hint_w is not None:
                        m.add_hint(mj, hint_m)
                    if self.w_time > 0:
                        coef = self.substeps(a.theta * float(bytes_W[j] - bytes_W[j - 1]))
                        if coef > 0:
                            terms.append((coef, mj))
                            mx += coef * n
                            hsum += coef * hint_m
                    if self.w_var > 0:
                        d_n = np.rint(OBJECTIVE_SCALE * self.w_var * a.beta_G[members]
                                      * (self.f_W[j - 1] - self.f_W[j])).astype(np.int64)
                        P = np.concatenate([[0], np.cumsum(d_n)])
                        if P[-1] > 0:
                            z = m.new_int_var(0, int(P[-1]), f"z{r}_{c}_{k}_{j}")
                            anchor, slope, icept = _secant_lines(P)
                            cv = _Concave(z, mj, P, anchor, slope, icept,
                                          np.zeros(len(anchor), dtype=bool))
                            self.concave.append(cv)
                            if self.window is None:
                                self._add_lines(cv, np.ones(len(anchor), dtype=bool))
                            else:
                                pick = np.abs(anchor - hint_m) <= self.window
                                pick[::max(self.window // 2, 1)] = True
                                pick[-1] = True
                                self._add_lines(cv, pick)
                            self.obj_vars.append(z)
                            self.obj_coefs.append(-1)
                            if hint_w is not None:
                                m.add_hint(z, int(P[hint_m]))
                lchan.append((members, mvars))
            self.layout.append(lchan)
            self.add_channel_time(a, terms, mx, hsum)
        self.finish(hint_w is not None)

    def _add_lines(self, cv: _Concave, pick: np.ndarray) -> int:
        new = pick & ~cv.added
        for s, i0 in zip(cv.slope[new], cv.icept[new]):
            self.model.add_linear_constraint(cv.z - int(s) * cv.m, -self.cp.INT_MAX, int(i0))
        cv.added |= new
        return int(new.sum())

    def exact_objective(self, solver: cp_model.CpSolver) -> int:
        """The objective of the solver's solution with the exact removed variance P(m)."""
        obj = self.offset
        for v, k in zip(self.obj_vars, self.obj_coefs):
            obj += k * solver.value(v)
        for cv in self.concave:
            obj += solver.value(cv.z) - int(cv.P[solver.value(cv.m)])
        return obj

    def refine(self, solver: cp_model.CpSolver) -> int:
        """Add the secants within ``window`` of the solution wherever the model
        over-estimated P there; hint that solution (with exact z). Returns lines added."""
        added = 0
        for cv in self.concave:
            value = solver.value(cv.m)
            if cv.over(value):
                added += self._add_lines(cv, np.abs(cv.anchor - value) <= (self.window or 0))
        self.model.clear_hints()
        for v in self.hint_vars:
            self.model.add_hint(v, solver.value(v))
        for cv in self.concave:
            self.model.add_hint(cv.z, int(cv.P[solver.value(cv.m)]))
        return added

    def decode(self, solver: cp_model.CpSolver) -> tuple[tuple[int, ...], ...]:
        row = []
        for lchan, a in zip(self.layout, self.arrays):
            w_G = np.zeros(len(a.count_G), dtype=np.int64)
            for members, mvars in lchan:
                rank = np.arange(len(members))
                for mj in mvars:
                    w_G[members] += rank < solver.value(mj)
            row.append(tuple(self.problem.bits[i] for i in w_G))
        return tuple(row)


class PerGroupModel(RoundModel):
    """The plain model: x[g, w] Booleans, exactly one per group."""

    def __init__(self, problem: AssignmentProblem, lam: float, r: int, hint=None):
        super().__init__(problem, lam, r)
        m = self.model
        W = len(problem.bits)
        hint_w = _hint_indices(problem, r, hint)
        self.layout = []
        for c, a in enumerate(self.arrays):
            G = len(a.count_G)
            xs = [[m.new_bool_var(f"x{r}_{c}_{g}_{w}") for w in range(W)] for g in range(G)]
            terms, mx, hsum = [], 0, 0
            for g in range(G):
                m.add_exactly_one(xs[g])
                hw = int(hint_w[c][g]) if hint_w is not None else -1
                gmax = 0
                for w in range(W):
                    if hint_w is not None:
                        m.add_hint(xs[g][w], w == hw)
                    if w == 0:
                        continue
                    if self.w_var > 0:
                        gain = int(round(OBJECTIVE_SCALE * self.w_var * a.beta_G[g]
                                         * (self.f_W[0] - self.f_W[w])))
                        if gain:
                            self.obj_vars.append(xs[g][w])
                            self.obj_coefs.append(-gain)
                    if self.w_time > 0:
                        coef = self.substeps(a.theta * float(a.bytes_GW[g, w] - a.bytes_GW[g, 0]))
                        if coef > 0:
                            terms.append((coef, xs[g][w]))
                            gmax = max(gmax, coef)
                            hsum += coef if w == hw else 0
                mx += gmax
            self.layout.append(xs)
            self.add_channel_time(a, terms, mx, hsum)
        self.finish(hint_w is not None)

    def decode(self, solver: cp_model.CpSolver) -> tuple[tuple[int, ...], ...]:
        bits = self.problem.bits
        return tuple(tuple(bits[next(w for w, x in enumerate(xw) if solver.boolean_value(x))]
                           for xw in xs) for xs in self.layout)


MODELS = {"threshold": ThresholdModel, "per-group": PerGroupModel}


@dataclass(frozen=True)
class RoundOutcome:
    """One round's solve (objective and bound in normalised units: model units / scale)."""

    bits: tuple | None  # bits[c][g]; None when CP-SAT found no solution
    status: str  # CP-SAT's status name (of the last solve)
    objective: float | None  # the model's objective of ``bits`` (exact secants)
    bound: float | None  # CP-SAT's lower bound on the model's optimum
    build_s: float
    solve_s: float
    conflicts: int
    branches: int
    solves: int = 1  # CP-SAT calls (more than one when secants were added)


def solve_round(problem: AssignmentProblem, lam: float, r: int, *, deadline: float,
                seed: int = 0, rel_gap: float = 1e-4, formulation: str = "threshold",
                hint=None, window: int | None = SECANT_WINDOW) -> RoundOutcome:
    """Build and solve round r with one CP-SAT worker, stopping by ``deadline``
    (a ``time.perf_counter()`` value) or once the relative gap is at most ``rel_gap``.

    The threshold model starts with a window of secants around the hint (see
    ``ThresholdModel``); while its solution's exact objective is further than rel_gap
    from the bound and secants were missing there, it adds them and solves again.
    """
    t0 = time.perf_counter()
    if formulation == "threshold":
        rm = ThresholdModel(problem, lam, r, hint, window=window)
    else:
        rm = PerGroupModel(problem, lam, r, hint)
    t1 = time.perf_counter()
    conflicts = branches = solves = 0
    best = None  # (exact objective, bound, bits, status) of the best solution so far
    while True:
        solver = rm.cp.CpSolver()
        p = solver.parameters
        p.max_time_in_seconds = max(deadline - time.perf_counter(), 0.001)
        p.num_workers = 1
        p.random_seed = seed
        p.relative_gap_limit = rel_gap
        if formulation == "threshold":
            # The presolve's search for dominated constraints is quadratic in the number
            # of secant lines and finds nothing here: the model is built tight.
            p.cp_model_presolve = False
        status = solver.solve(rm.model)
        solves += 1
        conflicts += solver.num_conflicts
        branches += solver.num_branches
        if status not in (rm.cp.OPTIMAL, rm.cp.FEASIBLE):
            if best is None:
                best = (None, None, None, solver.status_name(status))
            break  # a later solve that found nothing keeps the earlier solution
        # Every relaxation's bound is a valid bound; later ones (more secants) are tighter.
        bound = max(solver.best_objective_bound, best[1] if best else -math.inf)
        if formulation == "threshold":
            obj = rm.exact_objective(solver)
        else:
            obj = solver.objective_value
        if best is None or obj <= best[0]:
            best = (obj, bound, rm.decode(solver), solver.status_name(status))
        else:
            best = (best[0], bound, best[2], best[3])
        if formulation != "threshold" or best[0] - bound <= rel_gap * abs(best[0]) \
                or time.perf_counter() >= deadline or rm.refine(solver) == 0:
            break
    obj, bound, bits, status_name = best
    return RoundOutcome(
        bits=bits, status=status_name,
        objective=obj / OBJECTIVE_SCALE if bits is not None else None,
        bound=bound / OBJECTIVE_SCALE if bits is not None else None,
        build_s=t1 - t0, solve_s=time.perf_counter() - t1,
        conflicts=conflicts, branches=branches, solves=solves)


def solve_rounds(problem: AssignmentProblem, lam: float, *, time_limit_s: float = 10.0,
                 seed: int = 0, workers: int = 1, rel_gap: float = 1e-4,
                 formulation: str = "threshold", hint=None,
                 window: int | None = SECANT_WINDOW) -> list[RoundOutcome]:
    """Solve every round, ``workers`` rounds at a time in threads (each with one CP-SAT
    worker, so the answer does not depend on ``workers``). Rounds that run one after
    another share what is left of ``time_limit_s`` equally."""
    if formulation not in MODELS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    t0 = time.perf_counter()
    end = t0 + time_limit_s
    R = len(problem.rounds)
    waves = -(-R // workers)  # rounds each thread runs in sequence

    def one(r: int) -> RoundOutcome:
        left = max(end - time.perf_counter(), 0.0)
        share = left / max(waves - r // workers, 1)
        return solve_round(problem, lam, r, deadline=time.perf_counter() + share, seed=seed,
                           rel_gap=rel_gap, formulation=formulation, hint=hint, window=window)

    if workers == 1 or R == 1:
        return [one(r) for r in range(R)]
    with ThreadPoolExecutor(max_workers=min(workers, R), thread_name_prefix="cpsat-round") as pool:
        return list(pool.map(one, range(R)))
