"""The ``adaptive`` mode's pure planning: the per-technique wire layout, the link model of
a probed topology, and rank 0's period problem from every rank's trace
(:mod:`commsched.quant.assign_joint` solves it).

Legend: P ranks, T rows one rank sends in one exchange, D row width, Q = P (P - 1)
ordered rank pairs, L links.

No process group here (DESIGN.md rule 1); :mod:`commsched.gnn.adaptive` runs the
exchange that uses it.

* :func:`technique_segments`: the segments one technique's rows travel in (the layout is
  :func:`~commsched.gnn.adaqp_plan.width_layout` over :data:`TECHNIQUES`).
* :func:`link_model`: the links of the time model. ``topology``: every link of the probed
  :class:`~commsched.topology.Topology` that has a cost (a host's NIC in each direction,
  each rank's port onto its host's fabric), and each pair alone (its probed cost), so the
  pairs that share the inter-host NIC add up on it, as ``predict_exchange`` charges them;
  ``averaged``: each pair alone, every pair at the mean pair cost (what a system that
  does not know the topology assumes); ``ring``: each pair alone at the sender's ring
  probe of that peer.
* :func:`build_period_problem` / :func:`solve_period`: the rows' errors from the traces,
  grouped per channel, one :class:`~commsched.quant.assign_joint.JointProblem` over every
  (layer, direction), and back to a technique per row of every channel.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..quant.assign_joint import (
    DROP,
    RAW,
    SIGN,
    STOCHASTIC,
    TECHNIQUE_NAMES,
    TECHNIQUES,
    JointProblem,
    expand_techniques,
    group_rows,
    row_bytes,
    row_errors,
    solve_joint,
)
from ..quant.wire import META_BYTES, payload_bytes
from ..topology import INTER, INTRA, Topology

LINK_MODELS = ("topology", "averaged", "ring")


def technique_segments(dim: int, technique: int) -> tuple[int, ...]:
    """Per-row bytes of the segments one technique's rows travel in: none (dropped), one
    sign record, payload and metadata (2/4/8 bits), or the float32 row."""
    if technique == DROP:
        return ()
    if technique == SIGN:
        return (row_bytes(SIGN, dim),)
    if technique in STOCHASTIC:
        return (payload_bytes(dim, technique), META_BYTES)
    if technique == RAW:
        return (4 * dim,)
    raise ValueError(f"technique must be one of {TECHNIQUES}, got {technique!r}")


@dataclass(frozen=True)
class LinkModel:
    """The links of the time model: ``pairs[q]`` crosses the links ``on_QL[q]``; link l
    costs ``gamma_L[l] + theta_L[l] * bytes``; ``names[l]`` labels it."""

    pairs: tuple[tuple[int, int], ...]
    gamma_L: np.ndarray
    theta_L: np.ndarray
    on_QL: np.ndarray
    names: tuple[str, ...]

    def scaled(self, ratio: float) -> "LinkModel":
        """The same links with every theta times ``ratio`` (measured / predicted)."""
        return LinkModel(self.pairs, self.gamma_L, self.theta_L * float(ratio), self.on_QL, self.names)


def link_model(P: int, source: str, *, topology: Topology | None = None,
               peer_costs: list[dict[int, tuple[float, float]]] | None = None) -> LinkModel:
    """The :class:`LinkModel` of ``source`` (module doc): ``topology`` and ``averaged``
    need the probed ``topology``, ``ring`` every rank's ``peer_costs`` {peer: (theta,
    gamma)}."""
    if source not in LINK_MODELS:
        raise ValueError(f"link model must be one of {', '.join(LINK_MODELS)}, got {source!r}")
    pairs = tuple((a, b) for a in range(P) for b in range(P) if a != b)
    gam, th, names = [], [], []
    if source in ("topology", "averaged"):
        if topology is None or topology.world_size != P:
            raise ValueError(f"link model {source!r} needs the probed topology of the {P} ranks")
        if source == "averaged":
            costs = [topology.pair_cost(a, b) for a, b in pairs]
            m_g = float(np.mean([c.gamma for c in costs])) if costs else 0.0
            m_t = float(np.mean([c.theta for c in costs])) if costs else 0.0
            gam, th = [m_g] * len(pairs), [m_t] * len(pairs)
        else:
            for a, b in pairs:
                c = topology.pair_cost(a, b)
                gam.append(c.gamma)
                th.append(c.theta)
    else:
        if peer_costs is None or len(peer_costs) != P:
            raise ValueError("link model 'ring' needs every rank's probed peer costs")
        for a, b in pairs:
            theta, gamma = peer_costs[a].get(b, (1e-8, 0.0))
            gam.append(float(gamma))
            th.append(float(theta))
    names = [f"pair {a}->{b}" for a, b in pairs]
    on = [[q == i for i in range(len(pairs))] for q in range(len(pairs))]
    if source == "topology":
        links: dict = {}
        for q, (a, b) in enumerate(pairs):
            for link in topology.path(a, b):
                c = topology.link_cost(link)
                if c is None:
                    continue
                links.setdefault(link, (c, set()))[1].add(q)
        for link, (c, qs) in sorted(links.items(), key=lambda kv: str(kv[0])):
            gam.append(c.gamma)
            th.append(c.theta)
            names.append(f"{link[0]}->{link[1]}")
            for q in range(len(pairs)):
                on[q].append(q in qs)
    return LinkModel(pairs, np.asarray(gam, dtype=np.float64), np.asarray(th, dtype=np.float64),
                     np.asarray(on, dtype=bool).reshape(len(pairs), len(names)), tuple(names))


@dataclass(frozen=True)
class PeriodProblem:
    """The period's :class:`JointProblem` and, per group, where its rows are: ``members[g]``
    = (key index, src, dst, rows of the channel, row indices of the group)."""

    problem: JointProblem
    channels: tuple[tuple[int, int, int, int], ...]  # (key index, src, dst, n)
    members: tuple[tuple[int, np.ndarray], ...]  # (channel index, rows) per group


MAX_GROUPS_PER_CHANNEL = 16  # keeps the period problem near a thousand groups at 4 ranks


def build_period_problem(per_rank: list[dict], links: LinkModel, *, error_budget: float,
                         group_size: int, period: int = 1,
                         max_groups: int = MAX_GROUPS_PER_CHANNEL) -> PeriodProblem:
    """From every rank's report -- ``stats`` {(layer, dir): (drop [T], sign [T], beta [T])},
    the rows' weighted energy, 1-bit error and AdaQP variance weight in exchange order
    (peer by peer) -- and ``counts`` (send counts, recv counts): one group list per
    channel (rows sorted by energy, ``group_size`` a group, at most ``max_groups`` groups), each
    row's errors those of its ``period``'s summed messages (``row_errors``), each key's
    budget ``error_budget`` times its rows' summed energy."""
    if not error_budget >= 0:
        raise ValueError(f"error_budget must be >= 0, got {error_budget}")
    P = len(per_rank)
    keys = tuple(sorted({k for r in per_rank for k in r["stats"]}))
    pair_index = {p: q for q, p in enumerate(links.pairs)}
    key_G, pair_G, count_G, bytes_l, err_l = [], [], [], [], []
    channels, members = [], []
    energy = np.zeros(len(keys))
    for ki, key in enumerate(keys):
        for src in range(P):
            st = per_rank[src]["stats"].get(key)
            if st is None:
                continue
            drop, sign, beta = (np.asarray(a, dtype=np.float64) for a in st)
            send_c, recv_c = per_rank[src]["counts"]
            out_c = send_c if key[1] == "forward" else recv_c
            D = int(per_rank[src]["dims"][key])
            if drop.size != sum(out_c):
                raise ValueError(f"rank {src}'s trace of {key} has {drop.size} rows, its book "
                                 f"{sum(out_c)}")
            off = 0
            for dst in range(P):
                n = int(out_c[dst])
                if n == 0 or dst == src:
                    off += n
                    continue
                sl = slice(off, off + n)
                off += n
                err_RT = row_errors(drop[sl], sign[sl], beta[sl], period=period)
                energy[ki] += float(drop[sl].sum())
                b_GT, e_GT, mem = group_rows(err_RT, D, group_size, max_groups=max_groups)
                ci = len(channels)
                channels.append((ki, src, dst, n))
                for mm in mem:
                    key_G.append(ki)
                    pair_G.append(pair_index[(src, dst)])
                    count_G.append(len(mm))
                    members.append((ci, mm))
                bytes_l.append(b_GT)
                err_l.append(e_GT)
    T = len(TECHNIQUES)
    prob = JointProblem(
        keys=keys, key_G=np.asarray(key_G, dtype=np.int64), pair_G=np.asarray(pair_G, dtype=np.int64),
        count_G=np.asarray(count_G, dtype=np.int64),
        bytes_GT=np.concatenate(bytes_l) if bytes_l else np.zeros((0, T)),
        err_GT=np.concatenate(err_l) if err_l else np.zeros((0, T)),
        budget_K=error_budget * energy, pairs=links.pairs, gamma_L=links.gamma_L,
        theta_L=links.theta_L, on_QL=links.on_QL, link_names=links.names)
    return PeriodProblem(prob, tuple(channels), tuple(members))


def solve_period(per_rank: list[dict], links: LinkModel, *, error_budget: float, group_size: int,
                 time_limit_s: float, seed: int = 0, solver: str = "cp-sat", period: int = 1,
                 hosts_P=None) -> tuple[dict, dict]:
    """Rank 0's part of the re-assignment: :func:`build_period_problem`, ``solve_joint``,
    each group's technique expanded to its rows. Returns ({(layer, dir): {(src, dst):
    techniques [n]}}, info: solve time, status, predicted seconds per exchange (and the
    greedy answer's), rows per technique, per key the error used against its budget, and
    given ``hosts_P`` the bytes per link class)."""
    t0 = time.perf_counter()
    pp = build_period_problem(per_rank, links, error_budget=error_budget, group_size=group_size,
                              period=period)
    res = solve_joint(pp.problem, time_limit_s=time_limit_s, seed=seed, solver=solver)
    tech_of_group: dict[int, list] = {}
    for g, (ci, mm) in enumerate(pp.members):
        tech_of_group.setdefault(ci, []).append((mm, int(res.techniques_G[g])))
    table: dict = {k: {} for k in pp.problem.keys}
    hist = {TECHNIQUE_NAMES[t]: 0 for t in TECHNIQUES}
    classes: dict = {}
    for ci, (ki, src, dst, n) in enumerate(pp.channels):
        got = tech_of_group.get(ci, [])
        tech = expand_techniques([m for m, _ in got], [t for _, t in got], n)
        table[pp.problem.keys[ki]][(src, dst)] = tech
        for t in TECHNIQUES:
            hist[TECHNIQUE_NAMES[t]] += int((tech == t).sum())
        if hosts_P is not None:
            cls = INTRA if hosts_P[src] == hosts_P[dst] else INTER
            D = int(per_rank[src]["dims"][pp.problem.keys[ki]])
            c = classes.setdefault(cls, {"rows": 0, "bytes_per_epoch": 0,
                                         "rows_per_technique": {TECHNIQUE_NAMES[t]: 0 for t in TECHNIQUES}})
            c["rows"] += n
            for t in TECHNIQUES:
                k = int((tech == t).sum())
                c["rows_per_technique"][TECHNIQUE_NAMES[t]] += k
                c["bytes_per_epoch"] += k * row_bytes(t, D)
    ev = res.evaluation
    info = {"solve_s": res.wall_s, "wall_build_s": time.perf_counter() - t0 - res.wall_s,
            "status": res.status, "groups": int(pp.problem.key_G.size),
            "predicted_s": ev.time_s, "greedy_predicted_s": res.greedy_time_s,
            "rows_per_technique": hist,
            "keys": [{"layer": k[0], "direction": k[1], "predicted_s": float(ev.time_K[i]),
                      "error": float(ev.err_K[i]), "budget": float(pp.problem.budget_K[i]),
                      "bytes": float(ev.bytes_K[i])} for i, k in enumerate(pp.problem.keys)],
            **({"cpsat": res.stats} if res.stats else {})}
    if hosts_P is not None:
        info["link_classes"] = classes
    return table, info


__all__ = ["LINK_MODELS", "LinkModel", "PeriodProblem", "build_period_problem", "link_model",
           "solve_period", "technique_segments"]
