"""The ``adaptive`` mode's pure planning: the per-technique wire layout, the link model of
a probed topology, and rank 0's period problem from every rank's trace
(:mod:`commsched.quant.widths.joint` solves it).

Legend: P ranks, T rows one rank sends in one exchange, D row width, Q = P (P - 1)
ordered rank pairs, L links.

No process group here (DESIGN.md rule 1); :mod:`commsched.gnn.exchange.adaptive` runs the
exchange that uses it.

* :func:`technique_segments`: the segments one technique's rows travel in (the layout is
  :func:`~commsched.gnn.exchange.adaqp_plan.width_layout` over :data:`TECHNIQUES`).
* :func:`link_model`: the links of the time model. ``topology``: every link of the probed
  :class:`~commsched.cluster.topology.Topology` that has a cost (a host's NIC in each direction,
  each rank's port onto its host's fabric), and each pair alone (its probed cost), so the
  pairs that share the inter-host NIC add up on it, as ``predict_exchange`` charges them;
  ``averaged``: each pair alone, every pair at the mean pair cost (what a system that
  does not know the topology assumes); ``ring``: each pair alone at the sender's ring
  probe of that peer.
* :func:`build_period_problem` / :func:`solve_period`: the rows' errors from the traces,
  grouped per channel, one :class:`~commsched.quant.widths.joint.JointProblem` over every
  (layer, direction), and back to a technique per row of every channel.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ...cluster.topology import INTER, INTRA, Topology
from ...quant.widths.joint import (
    DROP,
    RAW,
    SIGN,
    STOCHASTIC,
    TECHNIQUE_NAMES,
    TECHNIQUES,
    JointProblem,
    parse_techniques,
    row_bytes,
    row_errors,
    solve_joint,
)
from ...quant.wire import META_BYTES, payload_bytes

LINK_MODELS = ("topology", "averaged", "ring")


# rank 0's CP-SAT runs only where it fits in this share of a period's measured time (the
# solve thread shares the cores with training; at a short limit CP-SAT rarely beats the
# greedy: docs/results.md), and never below
# CPSAT_MIN_S seconds
CPSAT_SHARE = 0.02
CPSAT_MIN_S = 0.1  # about what CP-SAT takes to prove an 8-group-a-channel problem optimal at 4 ranks


def solve_budget(limit_s: float, solver: str, period: int, last_epoch_s: float | None) -> tuple[str, float]:
    """(solver, CP-SAT time limit) of one period's solve: the configured limit, at most half
    the last epoch and :data:`CPSAT_SHARE` of the period's time; the greedy alone when that
    share is under :data:`CPSAT_MIN_S` (before any epoch is timed: the configured ones)."""
    if not last_epoch_s:
        return solver, limit_s
    cap = CPSAT_SHARE * period * last_epoch_s
    if solver == "cp-sat" and cap < CPSAT_MIN_S:
        solver = "greedy"
    return solver, max(0.02, min(limit_s, 0.5 * last_epoch_s, max(cap, CPSAT_MIN_S)))


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


MAX_GROUPS_PER_CHANNEL = 8  # about 500 groups at 4 ranks: CP-SAT proves optimality in ~0.1 s


def channel_groups(drop_R, sign_R, beta_R, *, group_size: int,
                   max_groups: int = MAX_GROUPS_PER_CHANNEL) -> tuple[np.ndarray, np.ndarray]:
    """One channel's rows cut into groups on the sender: sorted by weighted energy
    (``drop_R``, largest first, ties in row order), ``group_size`` a group (more when that
    would make more than ``max_groups``). Returns (the group of each row, uint8 [n]; each
    group's summed (energy, 1-bit error, variance weight), float64 [G, 3]): the errors of
    :func:`~commsched.quant.widths.joint.row_errors` are linear in these, so the group's
    are those of its sums. Only these cross to rank 0, not the rows' figures."""
    if not 1 <= max_groups <= 255 or group_size < 1:
        raise ValueError(f"group_size must be >= 1 and max_groups in 1..255, got {group_size}, "
                         f"{max_groups}")
    d = np.asarray(drop_R, dtype=np.float64).reshape(-1)
    n = d.size
    size = max(group_size, -(-n // max_groups)) if n else group_size
    order = np.argsort(-d, kind="stable")
    gid = np.empty(n, dtype=np.uint8)
    gid[order] = (np.arange(n) // size).astype(np.uint8)
    G = -(-n // size) if n else 0
    stats = np.stack([d, np.asarray(sign_R, dtype=np.float64).reshape(-1),
                      np.asarray(beta_R, dtype=np.float64).reshape(-1)], axis=1)
    sums = np.zeros((G, 3))
    np.add.at(sums, gid.astype(np.int64), stats)
    return gid, sums


def sender_report(stats: dict, out_counts: dict, *, group_size: int,
                  max_groups: int = MAX_GROUPS_PER_CHANNEL) -> dict:
    """{(layer, dir): {dst: (gid [n], sums [G, 3])}} of one rank: ``stats`` {(layer, dir):
    (energy [T], 1-bit error [T], variance weight [T])} in exchange order (peer by peer),
    ``out_counts`` {direction: rows sent to each peer}."""
    out: dict = {}
    for key, (d, s1, b) in stats.items():
        counts = out_counts[key[1]]
        if len(d) != sum(counts):
            raise ValueError(f"the trace of {key} has {len(d)} rows, the book {sum(counts)}")
        off, per = 0, {}
        for dst, n in enumerate(counts):
            n = int(n)
            if n:
                sl = slice(off, off + n)
                per[dst] = channel_groups(d[sl], s1[sl], b[sl], group_size=group_size,
                                          max_groups=max_groups)
            off += n
        out[key] = per
    return out


@dataclass(frozen=True)
class PeriodProblem:
    """The period's :class:`JointProblem` and, per group, its channel and index there:
    ``groups[g]`` = (key index, src, dst, group index within the channel)."""

    problem: JointProblem
    groups: tuple[tuple[int, int, int, int], ...]
    dims: tuple[int, ...]  # row width of each key


def build_period_problem(per_rank: list[dict], links: LinkModel, *, error_budget: float,
                         period: int = 1, techniques=TECHNIQUES) -> PeriodProblem:
    """From every rank's report -- ``groups``: :func:`sender_report`, ``dims`` {(layer,
    dir): row width} -- one problem: each group's errors those of its ``period``'s summed
    messages (``row_errors`` of its sums), each key's budget ``error_budget`` times its
    rows' summed energy; a technique not in ``techniques`` is not offered (its error
    infinite; float32 always is)."""
    if not error_budget >= 0:
        raise ValueError(f"error_budget must be >= 0, got {error_budget}")
    off_T = np.array([t not in parse_techniques(techniques) for t in TECHNIQUES])
    keys = tuple(sorted({k for r in per_rank for k in r["groups"]}))
    pair_index = {p: q for q, p in enumerate(links.pairs)}
    key_G, pair_G, count_G, bytes_l, err_l, where = [], [], [], [], [], []
    energy = np.zeros(len(keys))
    dims = []
    for ki, key in enumerate(keys):
        D = max(int(r["dims"].get(key, 1)) for r in per_rank)
        dims.append(D)
        rb = np.array([row_bytes(t, D) for t in TECHNIQUES], dtype=np.float64)
        for src, rep in enumerate(per_rank):
            for dst, (gid, sums) in sorted(rep["groups"].get(key, {}).items()):
                if dst == src or not len(gid):
                    continue
                sums = np.asarray(sums, dtype=np.float64).reshape(-1, 3)
                cnt = np.bincount(np.asarray(gid, dtype=np.int64), minlength=sums.shape[0])
                err = row_errors(sums[:, 0], sums[:, 1], sums[:, 2], period=period)
                err[:, off_T] = np.inf
                err_l.append(err)
                bytes_l.append(cnt[:, None] * rb[None, :])
                energy[ki] += float(sums[:, 0].sum())
                for g in range(sums.shape[0]):
                    key_G.append(ki)
                    pair_G.append(pair_index[(src, dst)])
                    count_G.append(int(cnt[g]))
                    where.append((ki, src, dst, g))
    T = len(TECHNIQUES)
    prob = JointProblem(
        keys=keys, key_G=np.asarray(key_G, dtype=np.int64), pair_G=np.asarray(pair_G, dtype=np.int64),
        count_G=np.asarray(count_G, dtype=np.int64),
        bytes_GT=np.concatenate(bytes_l) if bytes_l else np.zeros((0, T)),
        err_GT=np.concatenate(err_l) if err_l else np.zeros((0, T)),
        budget_K=error_budget * energy, pairs=links.pairs, gamma_L=links.gamma_L,
        theta_L=links.theta_L, on_QL=links.on_QL, link_names=links.names)
    return PeriodProblem(prob, tuple(where), tuple(dims))


def solve_period(per_rank: list[dict], links: LinkModel, *, error_budget: float,
                 time_limit_s: float, seed: int = 0, solver: str = "cp-sat", period: int = 1,
                 hosts_P=None, workers: int = 2, techniques=TECHNIQUES) -> tuple[dict, dict]:
    """Rank 0's part of the re-assignment: :func:`build_period_problem` (over the offered
    ``techniques``), ``solve_joint``.
    Returns ({(layer, dir): {(src, dst): technique of each group, uint8 [G]}} -- a row's
    technique is ``table[key][(src, dst)][gid]`` with the sender's ``gid`` --, info: solve
    time, status, predicted seconds of the period's exchanges (and the greedy answer's),
    rows per technique, per key the error used against its budget, and given ``hosts_P``
    the rows and bytes per link class)."""
    t0 = time.perf_counter()
    pp = build_period_problem(per_rank, links, error_budget=error_budget, period=period,
                              techniques=techniques)
    res = solve_joint(pp.problem, time_limit_s=time_limit_s, seed=seed, solver=solver,
                      workers=workers)
    table: dict = {k: {} for k in pp.problem.keys}
    for g, (ki, src, dst, _) in enumerate(pp.groups):
        chans = table[pp.problem.keys[ki]]
        if (src, dst) not in chans:
            chans[(src, dst)] = []
        chans[(src, dst)].append(int(res.techniques_G[g]))
    table = {k: {c: np.asarray(v, dtype=np.uint8) for c, v in chans.items()} for k, chans in table.items()}
    hist = {TECHNIQUE_NAMES[t]: 0 for t in TECHNIQUES}
    classes: dict = {}
    for g, (ki, src, dst, _) in enumerate(pp.groups):
        t = int(res.techniques_G[g])
        n = int(pp.problem.count_G[g])
        hist[TECHNIQUE_NAMES[t]] += n
        if hosts_P is not None:
            cls = INTRA if hosts_P[src] == hosts_P[dst] else INTER
            c = classes.setdefault(cls, {"rows": 0, "bytes_per_epoch": 0,
                                         "rows_per_technique": {TECHNIQUE_NAMES[u]: 0 for u in TECHNIQUES}})
            c["rows"] += n
            c["rows_per_technique"][TECHNIQUE_NAMES[t]] += n
            c["bytes_per_epoch"] += n * row_bytes(t, pp.dims[ki])
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


__all__ = ["CPSAT_MIN_S", "CPSAT_SHARE", "LINK_MODELS", "LinkModel", "MAX_GROUPS_PER_CHANNEL", "PeriodProblem",
           "build_period_problem", "channel_groups", "link_model", "sender_report", "solve_budget",
           "solve_period", "technique_segments"]
