"""AdaQP on a topology (issue 17), pure parts: per-pair link costs into the assigner (a
hand-built 2 hosts x 2 ranks topology, the real CP-SAT), the per-link-class report, the
bytes per link class, grouping METIS parts onto hosts (a hand-built graph) and the
bench's mode names. The multi-process case (a probed topology on 3 gloo ranks over two
hosts) shares the spawn of tests/gnn/test_adaqp.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from commsched import LinkCost, Topology
from commsched.gnn.exchange.adaqp_plan import link_class_report, peer_costs, solve_widths
from commsched.gnn.exchange.modes import AdaQPConfig
from commsched.gnn.graph import partition as part_mod
from commsched.gnn.graph.data import Graph, clean_edges
from commsched.gnn.graph.partition import group_parts, halo_rows, inter_host_rows, partition_nodes
from commsched.gnn.train.trainer import bytes_by_class
from commsched.quant.codec import META_BYTES, payload_bytes

HOSTS = ["a", "a", "b", "b"]
INTRA = LinkCost(gamma=1e-5, theta=1 / 10e9)   # 10 GB/s inside a host
INTER = LinkCost(gamma=1e-5, theta=1 / 0.5e9)  # 0.5 GB/s between hosts: 20x slower


def _topology() -> Topology:
    return Topology.from_hosts(HOSTS, intra=INTRA, inter=INTER)


# --------------------------------------------------------------------------- link costs
def test_peer_costs_topology_and_averaged_by_hand():
    t = _topology()
    own = peer_costs(t, 1, "topology")
    assert own == {0: (INTRA.theta, INTRA.gamma), 2: (INTER.theta, INTER.gamma),
                   3: (INTER.theta, INTER.gamma)}
    # 12 ordered pairs: 4 inside hosts, 8 across
    mean = (4 * INTRA.theta + 8 * INTER.theta) / 12
    avg = peer_costs(t, 1, "averaged")
    assert set(avg) == {0, 2, 3}
    assert all(th == pytest.approx(mean) and ga == pytest.approx(1e-5) for th, ga in avg.values())
    with pytest.raises(ValueError, match="rank must be in 0..3"):
        peer_costs(t, 4, "topology")
    with pytest.raises(ValueError, match="'topology' or 'averaged'"):
        peer_costs(t, 0, "ring")
    with pytest.raises(ValueError, match="--link-costs must be one of ring, topology, averaged"):
        AdaQPConfig(link_costs="measured")


def _reports(costs_of, n: int = 200, dim: int = 64) -> list[dict]:
    """Every rank sends n rows to every peer, one layer forward; the rows' variance
    weights spread over orders of magnitude (the same draw on every channel)."""
    P = len(HOSTS)
    beta = np.random.default_rng(0).lognormal(0.0, 2.0, n)
    out = []
    for r in range(P):
        c = tuple(0 if q == r else n for q in range(P))
        out.append({"trace": {(0, "forward"): [beta[:k].copy() for k in c]}, "dims": {(0, "forward"): dim},
                    "costs": costs_of(r), "counts": (c, c)})
    return out


def _mean_bits(table: dict, cls: str) -> float:
    ws = [w for (s, d), w in table[(0, "forward")].items()
          if (HOSTS[s] == HOSTS[d]) == (cls == "intra")]
    return float(np.concatenate(ws).mean())


def test_topology_costs_give_inter_host_channels_fewer_bits_cpsat():
    t = _topology()
    kw = dict(group_size=10, lam=0.5, time_limit_s=10.0, seed=0, hosts_P=HOSTS)
    table, info = solve_widths(_reports(lambda r: peer_costs(t, r, "topology")), **kw)
    intra, inter = _mean_bits(table, "intra"), _mean_bits(table, "inter")
    # a ring round that mixes classes lasts as long as its inter-host channels: the
    # intra-host ones can take more bits at no time, and do
    assert inter < intra, (inter, intra)
    for (s, d), w in table[(0, "forward")].items():
        if HOSTS[s] == HOSTS[d]:
            assert w.min() >= table[(0, "forward")][(s, (s + 2) % 4)].max()
    lc = info["link_classes"]
    assert set(lc) == {"intra", "inter"}
    assert lc["intra"]["mean_bits"] == pytest.approx(intra)
    assert lc["inter"]["mean_bits"] == pytest.approx(inter)
    assert lc["intra"]["rows"] == 4 * 200 and lc["inter"]["rows"] == 8 * 200
    table_avg, info_avg = solve_widths(_reports(lambda r: peer_costs(t, r, "averaged")), **kw)
    gap_avg = _mean_bits(table_avg, "intra") - _mean_bits(table_avg, "inter")
    assert gap_avg < intra - inter
    # one cost for all: the intra-host channels are charged as if slow and get fewer bits,
    # and the inter-host ones more (the trade is made on the average link)
    avg = info_avg["link_classes"]
    assert avg["intra"]["bytes_per_epoch"] < lc["intra"]["bytes_per_epoch"]
    assert avg["inter"]["bytes_per_epoch"] > lc["inter"]["bytes_per_epoch"]
    # equal variance: as precise as the averaged assignment (modelled), fewer inter-host bytes
    reps = _reports(lambda r: peer_costs(t, r, "topology"))
    for r, rep in enumerate(reps):
        rep["ref_costs"] = peer_costs(t, r, "averaged")
    table_ev, info_ev = solve_widths(reps, equal_variance=True, **kw)
    (prob,) = info_ev["problems"]
    (prob_avg,) = info_avg["problems"]
    assert prob["variance"] <= prob["variance_budget"] * (1 + 1e-9)
    assert prob["variance_budget"] == pytest.approx(prob_avg["variance"])
    ev = info_ev["link_classes"]
    assert ev["inter"]["bytes_per_epoch"] < avg["inter"]["bytes_per_epoch"]
    assert ev["inter"]["mean_bits"] < ev["intra"]["mean_bits"]
    with pytest.raises(ValueError, match="equal_variance needs every rank's ref_costs"):
        solve_widths(_reports(lambda r: peer_costs(t, r, "topology")), equal_variance=True, **kw)
    with pytest.raises(ValueError, match="--equal-variance .* needs --link-costs topology"):
        AdaQPConfig(link_costs="averaged", equal_variance=True)


def test_link_class_report_by_hand():
    table = {(0, "forward"): {(0, 1): np.array([2, 8]), (0, 2): np.array([4, 4, 4])},
             (1, "backward"): {(2, 3): np.array([8]), (1, 3): np.zeros(0, np.int64)}}
    dims = {(0, "forward"): 10, (1, "backward"): 3}
    rep = link_class_report(table, dims, HOSTS)
    b = lambda d, bits: payload_bytes(d, bits) + META_BYTES  # noqa: E731
    assert rep["intra"] == {"rows": 3, "rows_per_width": {"2": 1, "4": 0, "8": 2},
                            "bytes_per_epoch": b(10, 2) + b(10, 8) + b(3, 8), "mean_bits": 6.0}
    assert rep["inter"] == {"rows": 3, "rows_per_width": {"2": 0, "4": 3, "8": 0},
                            "bytes_per_epoch": 3 * b(10, 4), "mean_bits": 4.0}


def test_bytes_by_class_by_hand():
    # sent_RES[r][e][p]: 2 epochs, rank 0 sends 5 to rank 1 (intra) and 7 to rank 2 (inter)
    sent = [[[0, 5, 7, 0], [0, 5, 9, 0]], [[1, 0, 0, 0], [1, 0, 0, 0]],
            [[0, 0, 0, 2], [0, 0, 0, 2]], [[0, 0, 0, 0], [0, 0, 0, 0]]]
    # intra per epoch: 5 + 1 + 2 = 8 both epochs; inter: 7, 9 -> median 8
    assert bytes_by_class(sent, HOSTS) == {"intra": 8.0, "inter": 8.0}
    assert bytes_by_class(sent, ["x"] * 4) == {"intra": 16.0}
    with pytest.raises(ValueError, match="3 ranks' bytes for 4"):
        bytes_by_class(sent[:3], HOSTS)


# --------------------------------------------------------------------------- partitions onto hosts
def _four_clusters() -> tuple[Graph, np.ndarray]:
    """Four 8-node cliques A, B, C, D; A-C and B-D joined by 6 edges each (6 distinct
    nodes on each side), A-B and C-D by one edge each."""
    k = 8
    cl = np.repeat(np.arange(4), k)
    e = [(c * k + i, c * k + j) for c in range(4) for i in range(k) for j in range(i + 1, k)]
    e += [(0 * k + i, 2 * k + i) for i in range(6)] + [(1 * k + i, 3 * k + i) for i in range(6)]
    e += [(0 * k + 7, 1 * k + 7), (2 * k + 7, 3 * k + 7)]
    N = 4 * k
    ei = torch.from_numpy(clean_edges(np.array(e), N, directed=False))
    x = torch.zeros(N, 2)
    m = torch.ones(N, dtype=torch.bool)
    return Graph(x, torch.from_numpy(cl), ei, m, m, m, num_classes=4), cl


def test_halo_rows_and_grouping_on_a_hand_built_graph():
    g, cl = _four_clusters()
    rows = halo_rows(g, cl, 4)
    want = np.array([[0, 1, 6, 0], [1, 0, 0, 6], [6, 0, 0, 1], [0, 6, 1, 0]])
    assert rows.tolist() == want.tolist()
    assert inter_host_rows(rows, HOSTS) == 6 + 6 + 6 + 6  # A, B on a; C, D on b
    order = group_parts(rows, HOSTS)
    assert order.tolist() == [0, 2, 1, 3]  # A, C on host a; B, D on host b
    assert inter_host_rows(rows[order][:, order], HOSTS) == 4
    # the greedy + swaps path (used past EXACT_GROUPINGS) finds the same here
    saved = part_mod.EXACT_GROUPINGS
    try:
        part_mod.EXACT_GROUPINGS = 0
        greedy = group_parts(rows, HOSTS)
    finally:
        part_mod.EXACT_GROUPINGS = saved
    assert inter_host_rows(rows[greedy][:, greedy], HOSTS) == 4
    assert group_parts(rows, ["h"] * 4).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="rows_PP must be 4 x 4"):
        group_parts(rows[:3, :3], HOSTS)


def test_group_parts_exact_is_the_best_and_greedy_is_close():
    rng = np.random.default_rng(7)
    hosts = ["a"] * 3 + ["b"] * 3
    import itertools

    for _ in range(5):
        W = rng.integers(0, 50, (6, 6))
        np.fill_diagonal(W, 0)
        best = min(inter_host_rows(W[np.array(p)][:, np.array(p)], hosts)
                   for p in itertools.permutations(range(6)))
        got = group_parts(W, hosts)
        assert sorted(got.tolist()) == list(range(6))
        assert inter_host_rows(W[got][:, got], hosts) == best


def test_metis_hosts_keeps_heavy_cuts_inside_hosts():
    g, _ = _four_clusters()
    owner = partition_nodes(g, 4, "metis-hosts", 0, hosts_P=HOSTS)
    plain = partition_nodes(g, 4, "metis", 0)
    # the same parts, relabelled
    assert sorted(np.bincount(owner).tolist()) == sorted(np.bincount(plain).tolist())
    got = inter_host_rows(halo_rows(g, owner, 4), HOSTS)
    assert got == 4
    assert got <= inter_host_rows(halo_rows(g, plain, 4), HOSTS)
    with pytest.raises(ValueError, match="metis-hosts needs the host of each of the 4 ranks"):
        partition_nodes(g, 4, "metis-hosts", 0)


# --------------------------------------------------------------------------- bench names
def test_bench_mode_names():
    from commsched.bench.gnn.compare import bench_run
    from commsched.gnn.exchange.modes import mode_config
    from commsched.gnn.train.trainer import TrainConfig

    def run(mode, own=(), dtype="float32", **ex):  # the run a bench mode name stands for
        return TrainConfig(mode=mode, dtype=dtype, exchange=mode_config(mode, **ex)), own

    hp = ("--partition-method", "metis-hosts")
    assert bench_run("adaqp-topo") == run("adaqp", link_costs="topology")
    assert bench_run("adaqp-q-avg") == run("adaqp-q", link_costs="averaged")
    assert bench_run("vanilla-hp") == run("vanilla", hp)
    assert bench_run("adaqp-topo-hp") == run("adaqp", hp, link_costs="topology")
    assert bench_run("adaqp-topoev") == run("adaqp", link_costs="topology", equal_variance=True)
    assert bench_run("vanilla-bf16") == run("vanilla", dtype="bfloat16")
    assert bench_run("adaptive-wsign") == run("adaptive", warmup="sign")
    assert bench_run("adaptive-eb0.3-wsign") == run("adaptive", error_budget=0.3, warmup="sign")
    with pytest.raises(ValueError, match="-wsign sets --warmup of --mode adaptive, not of vanilla"):
        bench_run("vanilla-wsign")
    with pytest.raises(ValueError, match="-topo sets --link-costs of --mode adaqp, adaqp-q, adaptive, not"):
        bench_run("uniform-topo")


def test_bench_seeds_pool_and_class_figures():
    import argparse

    from commsched.bench.gnn.compare import (
        add_arguments,
        class_figures,
        parse_seeds,
        pool_seeds,
        variants,
    )

    assert parse_seeds(None) is None and parse_seeds("2,0") == [2, 0]
    for bad in ("1,x", "1,1", ""):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["--models", "gcn", "--modes", "vanilla,adaqp-topoev", "--seeds", "0,1"])
    vs = variants(a)
    assert [v.name for v in vs] == ["gcn-vanilla-s0", "gcn-adaqp-topoev-s0",
                                    "gcn-vanilla-s1", "gcn-adaqp-topoev-s1"]
    assert vs[3].argv[vs[3].argv.index("--seed") + 1] == "1" and vs[3].config.seed == 1
    assert "--equal-variance" in vs[3].argv
    pooled = pool_seeds({"gcn-vanilla-s0": [{"k": 0}], "gcn-vanilla-s1": [{"k": 1}], "x": [{}]})
    assert pooled == {"gcn-vanilla": [{"k": 0}, {"k": 1}], "x": [{}]}
    run = {"bytes_per_epoch_by_class": {"intra": 2e6, "inter": 5e6},
           "adaqp": {"assignments": [{"link_classes": {"intra": {"mean_bits": 8.0},
                                                      "inter": {"mean_bits": 3.5}}}]}}
    assert class_figures(run, 4) == {"intra_MB": 2.0, "inter_MB": 5.0, "intra_bits": 8.0,
                                     "inter_bits": 3.5}
    uni = {"bytes_per_epoch_by_class": {"inter": 1e6}, "adaqp": {"scheme": "uniform"}}
    assert class_figures(uni, 4) == {"inter_MB": 1.0, "inter_bits": 4.0}


def test_assigned_epoch_time_and_the_bench_compares_plans_on_it(tmp_path):
    """The median epoch from the first applied assignment on (slowest rank per epoch,
    epochs counted from the invocation's first); the bench's adaptive against
    adaptive-avg ratio uses it, so the shared warm-up epochs do not decide it."""
    import argparse

    from commsched.bench.gnn.compare import summarize as bench_summarize
    from commsched.gnn.exchange.adaqp_plan import assigned_epoch_time

    per_rank = [[1.0, 1.0, 0.2, 0.3, 0.4], [0.9, 1.1, 0.25, 0.2, 0.1]]
    assert assigned_epoch_time([{"applied_epoch": 2}, {"applied_epoch": 4}], per_rank) == (2, 0.3)
    assert assigned_epoch_time([{"epoch": 3}], per_rank) == (3, 0.35)  # AdaQP's key
    assert assigned_epoch_time([{"applied_epoch": 12}], per_rank, first_epoch=10) == (12, 0.3)
    assert assigned_epoch_time([], per_rank) is None
    assert assigned_epoch_time([{"applied_epoch": 9}], per_rank) is None  # never ran on it

    def run(plain, steady):  # the plain median can sit among the warm-up epochs
        return {"epoch_time_s": plain, "epoch_time_s_assigned": steady, "test_acc": 0.8, "loss": [1.0],
                "bytes_sent_per_epoch": 1.0}

    runs = {"gcn-adaptive": [run(1.0, 0.2)], "gcn-adaptive-avg": [run(0.9, 0.3)]}
    res = bench_summarize(runs, argparse.Namespace(bits=4, bandwidth=None, metric="epoch",
                                                   target_acc=None), tmp_path)
    row = res["gnn"]["gcn-adaptive"]
    assert row["speedup_vs_avg_on"] == "epoch_time_s_assigned"
    assert row["speedup_vs_avg"] == pytest.approx(1.5)  # on the plain medians: 0.9
    assert "speedup_vs_avg" not in res["gnn"]["gcn-adaptive-avg"]
