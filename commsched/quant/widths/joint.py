"""One assignment over every technique (the ``adaptive`` GNN mode's solver): each message
group picks how it crosses the wire -- dropped, 1-bit sign + scale with error feedback,
2/4/8-bit stochastic, or raw float32 -- so that the predicted exchange time summed over
every (layer, direction) of a period is smallest, under a per-exchange error budget.

Legend: G groups, T techniques (:data:`TECHNIQUES`), K keys (one per layer and
direction), L links, Q rank pairs.

* **Techniques** (their wire bytes per row of D values, :func:`row_bytes`, and their
  error, :func:`row_errors`): ``0`` dropped (0 bytes; the receiver adds zeros, as
  BNS-GCN's unsampled rows: error ``c * |x|^2``), ``1`` sign + scale (ceil(D / 8) + 4
  bytes; error the measured error-feedback residual of the last period, or the closed form
  ``c * (|x|^2 - |x|_1^2 / D)`` of a row not sent that way), ``2/4/8`` AdaQP's stochastic
  rounding (ceil(D b / 8) + META_BYTES bytes; variance ``c * D * range^2 / 6 / (2^b -
  1)^2``, AdaQP's bound), ``32`` raw float32 (4 D bytes, exact). ``c`` weighs a row by how
  much of it reaches the receivers' outputs (AdaQP's squared aggregation coefficients
  forward, 1 backward).
* **Time** of a key: the busiest link's ``gamma + theta * bytes`` over the links that its
  groups' pairs cross (the topology's per-link costs, as ``predict_exchange`` charges
  them), and every pair's own cost alone (its virtual link); a period's time is the sum
  over its keys. Per-link costs therefore change the answer: bytes are taken off the
  links that bind.
* **Budget**: per key, the summed error at most ``budget_K[k]`` (the caller sets it as a
  share of the exchange's full-precision energy, ``sum c |x|^2``: the gradient-norm
  budget of AdaQP's analysis made relative). All-float32 is always feasible.

:func:`greedy_joint` is a Lagrangian heuristic in numpy (per key, each group takes the
technique of least ``cost * bytes + mu * error``, mu bisected to the budget, the link
prices moved toward the binding links); :func:`solve_joint` is one CP-SAT model over all
keys, hinted with the greedy answer, whose result is never worse than the greedy one.
Pure: no process group (DESIGN.md rule 1).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..._lazy import require
from ..wire import META_BYTES, payload_bytes

TECHNIQUES: tuple[int, ...] = (0, 1, 2, 4, 8, 32)
DROP, SIGN, RAW = 0, 1, 32
STOCHASTIC = (2, 4, 8)
TECHNIQUE_NAMES = {0: "drop", 1: "sign", 2: "2-bit", 4: "4-bit", 8: "8-bit", 32: "fp32"}
SCALE = 10_000  # the integer model's resolution (time and error, per key)
# a key's error may exceed its budget by this share (the integer model rounds each group's
# error to 1 / (10 SCALE) of the budget)
BUDGET_TOL = 1e-3


def parse_techniques(spec) -> tuple[int, ...]:
    """The techniques of a comma-separated ``spec`` (``drop,sign,2,4,8,fp32``; ``2-bit``
    and ``32`` are accepted too), or of a sequence of technique ids, in :data:`TECHNIQUES`
    order. float32 is always among them (it keeps every budget feasible)."""
    names = {v: k for k, v in TECHNIQUE_NAMES.items()}
    names.update({str(t): t for t in TECHNIQUES})
    items = [x.strip() for x in spec.split(",")] if isinstance(spec, str) else list(spec)
    out = set()
    for x in items:
        if x == "":
            continue
        t = names.get(x) if isinstance(x, str) else (int(x) if x in TECHNIQUES else None)
        if t is None:
            raise ValueError(f"unknown technique {x!r}: pick from drop, sign, 2, 4, 8, fp32 "
                             "(comma-separated)")
        out.add(t)
    out.add(RAW)
    return tuple(t for t in TECHNIQUES if t in out)


def row_bytes(technique: int, dim: int) -> int:
    """Wire bytes of one row of ``dim`` values sent with ``technique``."""
    if technique == DROP:
        return 0
    if technique == SIGN:
        return (dim + 7) // 8 + 4
    if technique in STOCHASTIC:
        return payload_bytes(dim, technique) + META_BYTES
    if technique == RAW:
        return 4 * dim
    raise ValueError(f"technique must be one of {TECHNIQUES}, got {technique!r}")


def row_errors(drop_R, sign_R, beta_R, techniques: Sequence[int] = TECHNIQUES, *,
               period: int = 1) -> np.ndarray:
    """err_RT [R, T]: the modelled error of each row under each technique (module doc),
    from its weighted energy ``drop_R`` (c |x|^2), its weighted 1-bit residual ``sign_R``
    and its AdaQP variance weight ``beta_R`` (c D range^2 / 6), as the error of the sum of
    the ``period`` epochs' messages of the row, per epoch: stochastic rounding is unbiased
    and independent from epoch to epoch (``period * v / period = v``); a dropped row
    misses the same values every epoch, so its errors add up coherently (``period^2 *
    c |x|^2 / period``); error feedback carries a sign message's residual into the next
    one, so the period's sum misses only the first and the last residual (``2 * sign /
    period``)."""
    if not (isinstance(period, int) and period >= 1):
        raise ValueError(f"period must be an integer >= 1, got {period!r}")
    e2 = np.asarray(drop_R, dtype=np.float64).reshape(-1)
    s1 = np.asarray(sign_R, dtype=np.float64).reshape(-1)
    bt = np.asarray(beta_R, dtype=np.float64).reshape(-1)
    if not (e2.shape == s1.shape == bt.shape):
        raise ValueError(f"drop_R, sign_R and beta_R must have one entry per row, got "
                         f"{e2.shape}, {s1.shape}, {bt.shape}")
    cols = []
    for t in techniques:
        if t == DROP:
            cols.append(e2 * period)
        elif t == SIGN:
            cols.append(s1 * (2.0 / period) if period > 1 else s1)
        elif t in STOCHASTIC:
            cols.append(bt / float((1 << t) - 1) ** 2)
        elif t == RAW:
            cols.append(np.zeros_like(e2))
        else:
            raise ValueError(f"technique must be one of {TECHNIQUES}, got {t!r}")
    return np.stack(cols, axis=1) if cols else np.zeros((e2.size, 0))


@dataclass(frozen=True, eq=False)
class JointProblem:
    """The period's problem as arrays (see the module doc).

    key_G, pair_G: each group's key and pair index; count_G: its rows; bytes_GT,
    err_GT: its bytes and error under each technique (``err`` inf: not offered);
    budget_K: each key's error budget; pairs: the (src, dst) of each pair index;
    gamma_L, theta_L: each link's cost; on_QL: which links each pair crosses (its own
    virtual link among them); link_names: one label per link (reports)."""

    keys: tuple
    key_G: np.ndarray
    pair_G: np.ndarray
    count_G: np.ndarray
    bytes_GT: np.ndarray
    err_GT: np.ndarray
    budget_K: np.ndarray
    pairs: tuple[tuple[int, int], ...]
    gamma_L: np.ndarray
    theta_L: np.ndarray
    on_QL: np.ndarray
    link_names: tuple[str, ...] = ()
    techniques: tuple[int, ...] = TECHNIQUES
    offered_GT: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        G, T = self.bytes_GT.shape
        if self.err_GT.shape != (G, T) or len(self.techniques) != T:
            raise ValueError(f"bytes_GT {self.bytes_GT.shape} and err_GT {self.err_GT.shape} must "
                             f"both be [groups, {len(self.techniques)} techniques]")
        if RAW not in self.techniques:
            raise ValueError("the techniques must include raw float32 (32): it keeps every "
                             "budget feasible")
        for name in ("key_G", "pair_G", "count_G"):
            if getattr(self, name).shape != (G,):
                raise ValueError(f"{name} must have one entry per group ({G})")
        if self.on_QL.shape != (len(self.pairs), self.gamma_L.size) or self.theta_L.shape != self.gamma_L.shape:
            raise ValueError("on_QL must be [pairs, links] and theta_L / gamma_L one per link")
        if G and (self.key_G.min() < 0 or self.key_G.max() >= len(self.keys)):
            raise ValueError("key_G holds a key index out of range")
        if (self.budget_K < 0).any() or not np.isfinite(self.budget_K).all():
            raise ValueError("budget_K must be finite and >= 0")
        object.__setattr__(self, "offered_GT", _non_dominated(self.bytes_GT, self.err_GT))

    @property
    def raw_index(self) -> int:
        return self.techniques.index(RAW)


def _non_dominated(bytes_GT: np.ndarray, err_GT: np.ndarray) -> np.ndarray:
    """offered[g, t]: t is offered (finite error) and no other technique of g has both
    fewer-or-equal bytes and less-or-equal error with one of them strictly less."""
    G, T = bytes_GT.shape
    finite = np.isfinite(err_GT)
    keep = finite.copy()
    for t in range(T):
        for u in range(T):
            if u == t:
                continue
            dom = (finite[:, u] & (bytes_GT[:, u] <= bytes_GT[:, t]) & (err_GT[:, u] <= err_GT[:, t])
                   & ((bytes_GT[:, u] < bytes_GT[:, t]) | (err_GT[:, u] < err_GT[:, t])))
            keep[:, t] &= ~dom
    # ties (equal bytes and error): keep the first one only
    for t in range(T):
        for u in range(t):
            same = keep[:, u] & (bytes_GT[:, u] == bytes_GT[:, t]) & (err_GT[:, u] == err_GT[:, t])
            keep[:, t] &= ~same
    return keep


@dataclass(frozen=True)
class JointEvaluation:
    time_K: np.ndarray  # predicted seconds of each key's exchange
    err_K: np.ndarray  # its summed error
    feasible: bool  # every key within its budget
    bytes_K: np.ndarray  # bytes each key sends (all pairs)

    @property
    def time_s(self) -> float:
        return float(self.time_K.sum())


def evaluate_joint(problem: JointProblem, choice_G) -> JointEvaluation:
    """The checker: each key's predicted time (busiest link), error and bytes for the
    technique indices ``choice_G`` (into ``problem.techniques``)."""
    ch = np.asarray(choice_G, dtype=np.int64)
    G = problem.key_G.size
    if ch.shape != (G,):
        raise ValueError(f"choice_G must hold one technique index per group ({G}), got {ch.shape}")
    if G and (ch.min() < 0 or ch.max() >= len(problem.techniques)):
        raise ValueError("choice_G holds a technique index out of range")
    K = len(problem.keys)
    b_G = problem.bytes_GT[np.arange(G), ch]
    e_G = problem.err_GT[np.arange(G), ch]
    err_K = np.bincount(problem.key_G, weights=e_G, minlength=K)
    bytes_K = np.bincount(problem.key_G, weights=b_G, minlength=K)
    time_K = _key_times(problem, b_G)
    feasible = bool(np.isfinite(e_G).all()
                    and (err_K <= problem.budget_K * (1 + BUDGET_TOL) + 1e-300).all())
    return JointEvaluation(time_K, err_K, feasible, bytes_K)


def _link_loads(problem: JointProblem, b_G: np.ndarray) -> np.ndarray:
    """load_KL: bytes each key puts on each link."""
    K, Q = len(problem.keys), len(problem.pairs)
    pair_load = np.zeros((K, Q))
    np.add.at(pair_load, (problem.key_G, problem.pair_G), b_G)
    return pair_load @ problem.on_QL.astype(np.float64)


def _key_times(problem: JointProblem, b_G: np.ndarray) -> np.ndarray:
    load = _link_loads(problem, b_G)
    t = np.where(load > 0, problem.gamma_L[None, :] + problem.theta_L[None, :] * load, 0.0)
    return t.max(axis=1) if t.size else np.zeros(len(problem.keys))


def _pick(cost_G: np.ndarray, bytes_GT, err_GT, offered, mu: float) -> np.ndarray:
    score = cost_G[:, None] * bytes_GT + mu * np.where(np.isfinite(err_GT), err_GT, 0.0)
    score = np.where(offered, score, np.inf)
    return score.argmin(axis=1)


def greedy_joint(problem: JointProblem, *, rounds: int = 4) -> np.ndarray:
    """A feasible assignment (technique index per group) by Lagrangian relaxation: per key,
    each group takes the technique of least ``cost_g * bytes + mu * error``, with ``mu``
    bisected to the smallest value that meets the key's budget and ``cost_g`` the summed
    theta of the links g's pair crosses weighted by how close each link is to the key's
    busiest one (re-weighted ``rounds`` times; the best feasible answer is kept)."""
    G = problem.key_G.size
    best = np.full(G, problem.raw_index, dtype=np.int64)
    if G == 0:
        return best
    best_t = evaluate_joint(problem, best).time_K.copy()
    on = problem.on_QL.astype(np.float64)
    K, L = len(problem.keys), problem.gamma_L.size
    weight_KL = np.ones((K, L))
    groups_of = [np.flatnonzero(problem.key_G == k) for k in range(K)]
    for _ in range(rounds):
        choice = best.copy()
        for k, idx in enumerate(groups_of):
            if idx.size == 0:
                continue
            cost = (on[problem.pair_G[idx]] * (problem.theta_L * weight_KL[k])[None, :]).sum(axis=1)
            bt, et, off = problem.bytes_GT[idx], problem.err_GT[idx], problem.offered_GT[idx]
            budget = problem.budget_K[k]
            e_fin = np.where(np.isfinite(et), et, 0.0)
            scale = max(float((cost[:, None] * bt).max()), 1e-300) / max(float(e_fin.max()), 1e-300)
            lo, hi = -30.0, 30.0  # log10 of mu / scale
            pick_hi = _pick(cost, bt, et, off, scale * 10 ** hi)
            if e_fin[np.arange(idx.size), pick_hi].sum() > budget:
                continue  # keep raw for this key (always feasible)
            pick = pick_hi
            for _ in range(40):
                mid = 0.5 * (lo + hi)
                p = _pick(cost, bt, et, off, scale * 10 ** mid)
                if e_fin[np.arange(idx.size), p].sum() <= budget:
                    hi, pick = mid, p
                else:
                    lo = mid
            choice[idx] = _fill_budget(pick, cost, bt, e_fin, off, budget)
        ev = evaluate_joint(problem, choice)
        if ev.feasible:
            better = ev.time_K < best_t - 1e-15
            for k in np.flatnonzero(better):
                best[groups_of[k]] = choice[groups_of[k]]
                best_t[k] = ev.time_K[k]
        # move weight toward the links that bind each key
        b_G = problem.bytes_GT[np.arange(G), choice]
        load = _link_loads(problem, b_G)
        t = np.where(load > 0, problem.gamma_L[None, :] + problem.theta_L[None, :] * load, 0.0)
        top = t.max(axis=1, keepdims=True)
        share = np.where(top > 0, t / np.where(top > 0, top, 1.0), 0.0)
        weight_KL = 0.5 * weight_KL + 0.5 * (share ** 4 + 1e-3)
    return best


def _fill_budget(pick, cost, bytes_GT, err_GT, offered, budget) -> np.ndarray:
    """Spend what the bisection left of the budget: move groups to their best cheaper
    technique (bytes saved per unit of error added, best first) while the budget holds."""
    pick = pick.copy()
    n = pick.size
    rows = np.arange(n)
    for _ in range(3):
        used = float(err_GT[rows, pick].sum())
        cur_b = bytes_GT[rows, pick]
        cur_e = err_GT[rows, pick]
        saved = (cur_b[:, None] - bytes_GT) * cost[:, None]
        added = np.maximum(err_GT - cur_e[:, None], 0.0)
        ok = offered & (saved > 0)
        ratio = np.where(ok, saved / np.maximum(added, 1e-300), -np.inf)
        t_best = ratio.argmax(axis=1)
        r_best = ratio[rows, t_best]
        cand = np.flatnonzero(np.isfinite(r_best))
        if cand.size == 0:
            break
        cand = cand[np.argsort(-r_best[cand], kind="stable")]
        add = added[cand, t_best[cand]]
        fits = np.cumsum(add) <= budget - used
        take = cand[fits] if fits.all() else cand[: int(np.argmin(fits))]
        if take.size == 0:
            break
        pick[take] = t_best[take]
    return pick


@dataclass(frozen=True)
class JointAssignment:
    """What :func:`solve_joint` chose: ``choice_G`` (technique index per group),
    ``techniques_G`` (the technique itself), the checker's figures, the solver status
    (``optimal``, ``feasible``, ``greedy``: CP-SAT found nothing better in time) and wall
    seconds."""

    choice_G: np.ndarray
    techniques_G: np.ndarray
    evaluation: JointEvaluation
    greedy_time_s: float
    status: str
    wall_s: float
    stats: dict


def solve_joint(problem: JointProblem, *, time_limit_s: float = 0.5, seed: int = 0,
                workers: int = 2, solver: str = "cp-sat") -> JointAssignment:
    """One CP-SAT model over every key (module doc), hinted with :func:`greedy_joint`;
    the better of the two by the checker (never worse than the greedy answer).
    ``solver="greedy"``: the greedy answer alone."""
    if not (isinstance(time_limit_s, (int, float)) and math.isfinite(time_limit_s) and time_limit_s > 0):
        raise ValueError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}")
    if solver not in ("cp-sat", "greedy"):
        raise ValueError(f"solver must be 'cp-sat' or 'greedy', got {solver!r}")
    t0 = time.perf_counter()
    hint = greedy_joint(problem)
    ev_h = evaluate_joint(problem, hint)
    stats: dict = {"groups": int(problem.key_G.size)}
    choice, status = hint, "greedy"
    if solver == "cp-sat" and problem.key_G.size:
        got = _cpsat(problem, hint, time_limit_s=time_limit_s, seed=seed, workers=workers, stats=stats)
        if got is not None:
            ev = evaluate_joint(problem, got[0])
            if ev.feasible and ev.time_s <= ev_h.time_s:
                choice, status = got[0], got[1]
    ev = evaluate_joint(problem, choice)
    techs = np.asarray(problem.techniques, dtype=np.int64)[choice]
    return JointAssignment(choice, techs, ev, ev_h.time_s, status, time.perf_counter() - t0, stats)


def _cpsat(problem: JointProblem, hint: np.ndarray, *, time_limit_s: float, seed: int,
           workers: int, stats: dict):
    cp_model = require("ortools.sat.python.cp_model", "the CP-SAT joint assignment")

    G, T = problem.bytes_GT.shape
    K, L = len(problem.keys), problem.gamma_L.size
    m = cp_model.CpModel()
    x: dict[tuple[int, int], object] = {}
    for g in range(G):
        opts = [t for t in range(T) if problem.offered_GT[g, t]]
        if hint[g] not in opts:
            opts.append(int(hint[g]))
        lits = []
        for t in opts:
            v = m.NewBoolVar("")
            x[(g, t)] = v
            lits.append(v)
            m.AddHint(v, int(t == hint[g]))
        m.AddExactlyOne(lits)
    raw = problem.raw_index
    on = problem.on_QL
    times = []
    for k in range(K):
        idx = np.flatnonzero(problem.key_G == k)
        if idx.size == 0:
            continue
        # the time unit of this key: its all-raw time / SCALE
        b_raw = problem.bytes_GT[idx, raw]
        load_raw = (np.bincount(problem.pair_G[idx], weights=b_raw, minlength=len(problem.pairs))
                    @ on.astype(np.float64))
        t_raw = float(np.max(np.where(load_raw > 0, problem.gamma_L + problem.theta_L * load_raw, 0.0)))
        unit = max(t_raw, 1e-12) / SCALE
        tk = m.NewIntVar(0, 4 * SCALE + 1, f"T{k}")
        for link in range(L):
            gs = [g for g in idx if on[problem.pair_G[g], link]]
            if not gs or load_raw[link] <= 0:
                continue
            terms = []
            for g in gs:
                for t in range(T):
                    if (g, t) in x:
                        c = int(math.ceil(problem.theta_L[link] * problem.bytes_GT[g, t] / unit))
                        if c:
                            terms.append(c * x[(g, t)])
            m.Add(tk >= int(math.ceil(problem.gamma_L[link] / unit)) + sum(terms))
        budget = float(problem.budget_K[k])
        if budget > 0:
            eunit = budget / (10 * SCALE)
            cap = 10 * SCALE + 1
            eterms = []
            for g in idx:
                for t in range(T):
                    if (g, t) in x:
                        e = problem.err_GT[g, t]
                        c = cap if not np.isfinite(e) else min(cap, int(round(e / eunit)))
                        if c:
                            eterms.append(c * x[(g, t)])
            m.Add(sum(eterms) <= 10 * SCALE + idx.size)
        else:  # no budget: exact techniques only
            for g in idx:
                for t in range(T):
                    if (g, t) in x and problem.err_GT[g, t] > 0:
                        m.Add(x[(g, t)] == 0)
        # weigh keys by their real seconds (the objective sums seconds, not per-key units)
        times.append((tk, unit))
    u0 = min(u for _, u in times)
    m.Minimize(sum(int(round(u / u0 * 1000)) * tk for tk, u in times))
    s = cp_model.CpSolver()
    s.parameters.max_time_in_seconds = float(time_limit_s)
    s.parameters.num_workers = int(workers)
    s.parameters.random_seed = int(seed)
    st = s.Solve(m)
    stats["cpsat_status"] = s.StatusName(st)
    stats["cpsat_wall_s"] = s.WallTime()
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    choice = np.array([next(t for t in range(T) if (g, t) in x and s.Value(x[(g, t)]))
                       for g in range(G)], dtype=np.int64)
    return choice, ("optimal" if st == cp_model.OPTIMAL else "feasible")


__all__ = ["BUDGET_TOL", "DROP", "JointAssignment", "JointEvaluation", "JointProblem", "RAW",
           "SIGN", "STOCHASTIC", "TECHNIQUES", "TECHNIQUE_NAMES", "evaluate_joint", "greedy_joint",
           "parse_techniques", "row_bytes", "row_errors", "solve_joint"]
