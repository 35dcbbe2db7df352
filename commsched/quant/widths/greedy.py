"""Greedy baseline for bit-width assignment (and the solver's fallback and hint).

Per group, the useful widths are the lower convex hull of its (bytes, variance) points;
each hull edge is an *upgrade* with an efficiency (variance removed per byte added).
Within a channel, upgrades are taken in order of decreasing efficiency, which gives a
path from the cheapest to the most precise assignment. Rounds are independent (T and V
are sums over rounds), so for each round the greedy picks a time budget tau, lets
every channel walk its path as far as it fits in tau, and keeps the tau whose
resulting round (max channel time, summed variance) scores best. Candidate budgets
are the path times of every channel, so the search is exact over that family.

This is the classic multiple-choice-knapsack greedy: close to the optimum when groups
are many and small, but it may leave budget unused that a solver fills.

Legend: G = groups of one channel, W = candidate widths, U = upgrades of one channel.
"""

from __future__ import annotations

import numpy as np

from .problem import AssignmentProblem, ChannelArrays, check_lam, variance_factor


def channel_upgrades(a: ChannelArrays, f_W: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Start widths (index into bits, int64 [G]) and the channel's upgrades sorted by
    decreasing efficiency: dict of arrays [U] ``group``, ``to`` (width index after the
    upgrade), ``dbytes`` (int64), ``dvar`` (float64, > 0)."""
    G, W = a.bytes_GW.shape
    var_GW = a.beta_G[:, None] * f_W[None, :]
    rows = np.arange(G)
    # start: the cheapest option, the most precise among equally cheap ones (count = 0)
    cheapest = a.bytes_GW == a.bytes_GW[:, :1]
    start = (np.where(cheapest, np.arange(W)[None, :], -1).max(axis=1) if G
             else np.zeros(0, np.int64))
    cur = start.copy()
    groups, tos, dbs, dvs, effs, steps = [], [], [], [], [], []
    active = np.ones(G, dtype=bool)
    for step in range(W - 1):
        if not active.any():
            break
        # efficiency of moving from cur to each wider option (-inf where not an upgrade)
        db = a.bytes_GW - a.bytes_GW[rows, cur][:, None]
        dv = var_GW[rows, cur][:, None] - var_GW
        ok = (np.arange(W)[None, :] > cur[:, None]) & (db > 0) & (dv > 0) & active[:, None]
        eff = np.where(ok, dv / np.where(db > 0, db, 1), -np.inf)
        # ties: prefer the wider option (collinear middle points are skipped)
        best = W - 1 - np.argmax(eff[:, ::-1], axis=1)
        has = np.isfinite(eff[rows, best])
        g = rows[has]
        groups.append(g)
        tos.append(best[has])
        dbs.append(db[g, best[has]])
        dvs.append(dv[g, best[has]])
        effs.append(eff[g, best[has]])
        steps.append(np.full(len(g), step))
        cur = np.where(has, best, cur)
        active &= has
    if groups:
        group, to, dbytes, dvar, eff, stp = (np.concatenate(x) for x in (groups, tos, dbs, dvs, effs, steps))
    else:
        group = to = dbytes = stp = np.zeros(0, np.int64)
        dvar = eff = np.zeros(0, np.float64)
    order = np.lexsort((stp, group, -eff))
    return start.astype(np.int64), {"group": group[order], "to": to[order],
                                     "dbytes": dbytes[order].astype(np.int64), "dvar": dvar[order]}


def greedy_assignment(problem: AssignmentProblem, lam: float):
    """A good assignment without a solver: ``bits[r][c][g]`` (tuples), see the module doc."""
    lam = check_lam(lam)
    w_time, w_var = problem.weights(lam)
    f_W = np.array([variance_factor(b) for b in problem.bits])
    out = []
    for arows in problem.arrays:
        paths = []
        for a in arows:
            start, up = channel_upgrades(a, f_W)
            G = len(start)
            base_bytes = int(a.bytes_GW[np.arange(G), start].sum()) if G else 0
            base_var = float((a.beta_G * f_W[start]).sum()) if G else 0.0
            times = a.gamma + a.theta * (base_bytes + np.concatenate([[0], np.cumsum(up["dbytes"])]))
            var = base_var - np.concatenate([[0.0], np.cumsum(up["dvar"])])
            paths.append((start, up, times, var))
        floor = max(p[2][0] for p in paths)
        cand = np.unique(np.concatenate([p[2] for p in paths]))
        cand = cand[cand >= floor]
        # k[c, t]: upgrades channel c takes within budget cand[t]
        ks = [np.searchsorted(p[2], cand, side="right") - 1 for p in paths]
        round_time = np.max([p[2][k] for p, k in zip(paths, ks)], axis=0)
        round_var = np.sum([p[3][k] for p, k in zip(paths, ks)], axis=0)
        best = int(np.argmin(w_time * round_time + w_var * round_var))
        row = []
        for (start, up, _, _), k in zip(paths, ks):
            w = start.copy()
            take = k[best]
            np.maximum.at(w, up["group"][:take], up["to"][:take])
            row.append(tuple(problem.bits[i] for i in w))
        out.append(tuple(row))
    return tuple(out)
