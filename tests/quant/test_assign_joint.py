"""The ``adaptive`` mode's solver (``commsched.quant.widths.joint``) and its GNN-side
problem builder (``commsched.gnn.exchange.adaptive_plan``): hand-worked bytes and errors, the
checker, the greedy and CP-SAT answers against brute force and the budget, and the
topology's per-link costs changing the answer. Pure: milliseconds each."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from commsched.cluster.costmodel import LinkCost
from commsched.cluster.topology import Topology
from commsched.gnn.exchange.adaptive_plan import (
    build_period_problem,
    channel_groups,
    link_model,
    sender_report,
    solve_period,
    technique_segments,
)
from commsched.gnn.exchange.adaqp_plan import width_layout
from commsched.quant.widths.joint import (
    TECHNIQUES,
    JointProblem,
    evaluate_joint,
    greedy_joint,
    parse_techniques,
    row_bytes,
    row_errors,
    solve_joint,
)


def test_bytes_and_errors_by_hand():
    assert [row_bytes(t, 10) for t in TECHNIQUES] == [0, 2 + 4, 3 + 8, 5 + 8, 10 + 8, 40]
    e = row_errors([4.0], [1.0], [9.0])  # period 1: the errors of one message
    assert e.tolist() == [[4.0, 1.0, 9.0 / 9, 9.0 / 225, 9.0 / 255 ** 2, 0.0]]
    e5 = row_errors([4.0], [1.0], [9.0], period=5)  # coherent drop, carried residual
    assert e5[0, 0] == 20.0 and e5[0, 1] == pytest.approx(0.4) and e5[0, 2:].tolist() == e[0, 2:].tolist()
    with pytest.raises(ValueError, match="one entry per row"):
        row_errors([1.0, 2.0], [1.0], [1.0])
    with pytest.raises(ValueError, match="technique must be one of"):
        row_bytes(3, 4)
    assert technique_segments(10, 0) == () and technique_segments(10, 1) == (6,)
    assert technique_segments(10, 4) == (5, 8) and technique_segments(10, 32) == (40,)


def test_channel_groups_on_the_sender():
    d = np.arange(10.0)
    gid, sums = channel_groups(d, 2 * d, 3 * d, group_size=3)
    # sorted by energy, largest first: rows 9, 8, 7 are group 0, ..., row 0 alone in group 3
    assert gid.dtype == np.uint8 and gid.tolist() == [3, 2, 2, 2, 1, 1, 1, 0, 0, 0]
    assert sums.tolist() == [[24.0, 48.0, 72.0], [15.0, 30.0, 45.0], [6.0, 12.0, 18.0], [0.0, 0.0, 0.0]]
    gid2, sums2 = channel_groups(d, d, d, group_size=3, max_groups=2)
    assert np.bincount(gid2).tolist() == [5, 5] and sums2.shape == (2, 3)
    # a group's errors are those of its sums: row_errors is linear
    assert np.allclose(row_errors(sums[:, 0], sums[:, 1], sums[:, 2], period=5)[0],
                       row_errors(d[7:], 2 * d[7:], 3 * d[7:], period=5).sum(0))
    rep = sender_report({(0, "forward"): (d, d, d)}, {"forward": (0, 4, 6)}, group_size=2)
    assert sorted(rep[(0, "forward")]) == [1, 2] and rep[(0, "forward")][2][0].size == 6
    with pytest.raises(ValueError, match="has 10 rows, the book 3"):
        sender_report({(0, "forward"): (d, d, d)}, {"forward": (0, 1, 2)}, group_size=2)


def _problem(rng, G=4, K=1, budget=0.3, theta=(1e-6,), on=None):
    T = len(TECHNIQUES)
    D = 16
    rb = np.array([row_bytes(t, D) for t in TECHNIQUES], dtype=np.float64)
    count = rng.integers(1, 20, size=G)
    drop = rng.random(G) * count
    err = np.stack([row_errors(drop[g:g + 1], 0.4 * drop[g:g + 1] * rng.random(),
                               drop[g:g + 1] * 3 * rng.random()) [0] for g in range(G)])
    key = np.arange(G) % K
    energy = np.bincount(key, weights=drop, minlength=K)
    nq = len(theta)
    return JointProblem(keys=tuple(range(K)), key_G=key, pair_G=np.arange(G) % nq,
                        count_G=count, bytes_GT=count[:, None] * rb[None, :], err_GT=err,
                        budget_K=budget * energy, pairs=tuple((0, q + 1) for q in range(nq)),
                        gamma_L=np.zeros(nq), theta_L=np.asarray(theta, dtype=np.float64),
                        on_QL=np.eye(nq, dtype=bool) if on is None else on)
    _ = T


@pytest.mark.parametrize("seed", range(6))
def test_cpsat_finds_the_brute_force_optimum_and_greedy_is_feasible(seed):
    rng = np.random.default_rng(seed)
    p = _problem(rng, G=4, K=1, budget=float(rng.choice([0.05, 0.3, 0.8])), theta=(1e-6, 3e-6))
    best = None
    for combo in itertools.product(range(len(TECHNIQUES)), repeat=4):
        ev = evaluate_joint(p, np.array(combo))
        if ev.feasible and (best is None or ev.time_s < best - 1e-15):
            best = ev.time_s
    g = greedy_joint(p)
    assert evaluate_joint(p, g).feasible
    a = solve_joint(p, time_limit_s=5.0)
    assert a.evaluation.feasible and a.evaluation.time_s <= evaluate_joint(p, g).time_s + 1e-15
    # the integer model rounds each term's time up to 1e-4 of the all-raw time
    assert a.evaluation.time_s == pytest.approx(best, rel=1e-3, abs=1e-12)
    assert a.status in ("optimal", "feasible", "greedy")


def test_budget_extremes():
    rng = np.random.default_rng(7)
    p0 = _problem(rng, G=6, budget=0.0)
    a0 = solve_joint(p0, time_limit_s=2.0)
    assert (a0.techniques_G == 32).all() and a0.evaluation.err_K.tolist() == [0.0]
    pbig = _problem(np.random.default_rng(7), G=6, budget=1e9)
    abig = solve_joint(pbig, time_limit_s=2.0)
    assert (abig.techniques_G == 0).all() and abig.evaluation.bytes_K.tolist() == [0.0]
    with pytest.raises(ValueError, match="time_limit_s"):
        solve_joint(p0, time_limit_s=0)
    with pytest.raises(ValueError, match="choice_G"):
        evaluate_joint(p0, np.zeros(3, dtype=np.int64))


def _reports(P, rows_per_pair, D=32, seed=0):
    """Every rank's adaptive trace: ``rows_per_pair`` rows to every peer, both directions
    of one layer, rows of unit weight."""
    rng = np.random.default_rng(seed)
    out = []
    for me in range(P):
        counts = tuple(0 if q == me else rows_per_pair for q in range(P))
        n = rows_per_pair * (P - 1)
        stats = {}
        for key in ((1, "forward"), (1, "backward")):
            e2 = rng.random(n) + 0.5
            stats[key] = (e2, 0.5 * e2, e2 * D * 0.5)
        groups = sender_report(stats, {"forward": counts, "backward": counts}, group_size=20)
        out.append({"groups": groups, "dims": {k: D for k in stats}, "costs": {}})
    return out


def test_topology_moves_bytes_off_the_slow_link():
    """2 hosts x 2 ranks, the inter-host link 10x slower: with the per-link model the
    inter-host channels get cheaper techniques than the intra-host ones at the same budget;
    the averaged model treats every pair alike, and its answer is slower on the real links."""
    fast, slow = LinkCost(gamma=1e-5, theta=1e-9), LinkCost(gamma=1e-5, theta=1e-8)
    topo = Topology(("h0", "h0", "h1", "h1"), {"intra": fast, "inter": slow})
    reps = _reports(4, 200)
    per_link = link_model(4, "topology", topology=topo)
    flat = link_model(4, "averaged", topology=topo)
    t_topo, i_topo = solve_period(reps, per_link, error_budget=0.3, time_limit_s=2.0,
                                  hosts_P=topo.hosts_P)
    t_avg, _ = solve_period(reps, flat, error_budget=0.3, time_limit_s=2.0, hosts_P=topo.hosts_P)
    cls = i_topo["link_classes"]
    per_row = {c: v["bytes_per_epoch"] / v["rows"] for c, v in cls.items()}
    assert per_row["inter"] < per_row["intra"]
    # the same tables judged on the real (per-link) model: topology-aware is faster
    pp = build_period_problem(reps, per_link, error_budget=0.3)

    def real_time(table):
        choice = []
        for ki, src, dst, j in pp.groups:
            t = table[pp.problem.keys[ki]][(src, dst)][j]
            choice.append(TECHNIQUES.index(int(t)))
        ev = evaluate_joint(pp.problem, np.array(choice))
        assert ev.feasible
        return ev.time_s

    assert real_time(t_topo) < 0.9 * real_time(t_avg)
    assert i_topo["predicted_s"] <= i_topo["greedy_predicted_s"] + 1e-12
    for k in i_topo["keys"]:
        assert k["error"] <= k["budget"] * (1 + 1e-3)


def test_link_model_shapes_and_errors():
    topo = Topology.grid(2, 2)
    m = link_model(4, "topology", topology=topo)
    assert len(m.pairs) == 12 and m.on_QL.shape[0] == 12
    # an inter-host pair crosses its own virtual link and two NIC edges (attach: no cost)
    q = m.pairs.index((0, 2))
    assert m.on_QL[q].sum() == 3
    q = m.pairs.index((0, 1))
    assert m.on_QL[q].sum() == 3  # virtual, rank->bus, bus->rank
    a = link_model(4, "averaged", topology=topo)
    assert a.on_QL.shape == (12, 12) and np.allclose(a.theta_L, a.theta_L[0])
    r = link_model(2, "ring", peer_costs=[{1: (2e-9, 1e-5)}, {0: (3e-9, 1e-5)}])
    assert r.theta_L.tolist() == [2e-9, 3e-9]
    with pytest.raises(ValueError, match="needs the probed topology"):
        link_model(4, "topology")
    with pytest.raises(ValueError, match="link model must be one of"):
        link_model(4, "mesh")


def test_layout_over_techniques():
    D = 10
    lay = width_layout([np.array([0, 1, 32, 4, 1]), np.zeros(0, np.int64)], D, widths=TECHNIQUES,
                       row_segments=technique_segments)
    # peer 0: drop (no segment), 2 sign records, no 2-bit, one 4-bit row, no 8-bit, one raw row
    assert lay.segments.sizes[0] == (2 * 6, 0, 0, 5, 8, 0, 0, 40)
    assert lay.seg_of == ((), (0,), (1, 2), (3, 4), (5, 6), (7,))
    assert lay.rows_per_width() == {0: 1, 1: 2, 2: 0, 4: 1, 8: 0, 32: 1}
    with pytest.raises(ValueError, match="widths for peer 0"):
        width_layout([np.array([3])], D, widths=TECHNIQUES, row_segments=technique_segments)


def test_offered_techniques_bound_the_answer():
    """``techniques`` restricts every group's choice (float32 always offered); at a budget
    that drops everything when drops are offered, without them nothing is dropped and the
    cheapest offered technique carries the rows; bad names are refused by name."""
    assert parse_techniques("drop,sign") == (0, 1, 32)
    assert parse_techniques("8, 2-bit, 4") == (2, 4, 8, 32)
    assert parse_techniques([32]) == (32,)
    with pytest.raises(ValueError, match="unknown technique '3'"):
        parse_techniques("2,3")
    fast = LinkCost(gamma=1e-5, theta=1e-9)
    topo = Topology(("h0", "h0", "h1", "h1"), {"intra": fast, "inter": fast})
    reps = _reports(4, 200)
    links = link_model(4, "averaged", topology=topo)
    t_all, i_all = solve_period(reps, links, error_budget=1e6, time_limit_s=1.0)
    assert i_all["rows_per_technique"]["drop"] == sum(i_all["rows_per_technique"].values())
    t_q, i_q = solve_period(reps, links, error_budget=1e6, time_limit_s=1.0, techniques="2,4,8")
    used = {int(t) for chans in t_q.values() for v in chans.values() for t in v}
    assert used == {2}
    assert i_q["rows_per_technique"]["2-bit"] == sum(i_q["rows_per_technique"].values())
    _, i_f = solve_period(reps, links, error_budget=0.0, time_limit_s=1.0, techniques="drop,sign")
    assert i_f["rows_per_technique"]["fp32"] == sum(i_f["rows_per_technique"].values())
