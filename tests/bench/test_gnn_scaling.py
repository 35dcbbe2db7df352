"""The scaling bench (commsched.bench.gnn.scaling): its pure parts on hand-made records
(growth exponents, the linearity verdict, the summary), the degree skew written by
``commsched partition``, and one tiny end-to-end run (two sizes, two ranks, one epoch)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from commsched.bench.gnn import scaling
from commsched.gnn.graph.partition import degree_stats


def test_growth_exponent_and_per_node_ratio():
    lin = scaling.growth(1000, 2.0, 10_000, 20.0)
    assert lin["exponent"] == pytest.approx(1.0) and lin["per_node_ratio"] == pytest.approx(1.0)
    assert lin["linear"] is True
    quad = scaling.growth(1000, 2.0, 10_000, 200.0)
    assert quad["exponent"] == pytest.approx(2.0) and quad["per_node_ratio"] == pytest.approx(10.0)
    assert quad["linear"] is False
    flat = scaling.growth(100, 5.0, 400, 5.0)  # constant: exponent 0, a quarter per node
    assert flat["exponent"] == pytest.approx(0.0) and flat["per_node_ratio"] == pytest.approx(0.25)
    # just inside / outside the slack
    assert scaling.growth(10, 1.0, 100, 10 ** (1 + scaling.LINEAR_SLACK * 0.9))["linear"] is True
    assert scaling.growth(10, 1.0, 100, 10 ** (1 + scaling.LINEAR_SLACK * 1.1))["linear"] is False
    with pytest.raises(ValueError, match="0 < n0 < n1"):
        scaling.growth(100, 1.0, 100, 2.0)
    with pytest.raises(ValueError, match="positive"):
        scaling.growth(100, 0.0, 200, 2.0)


def _rec(nodes, rss, ep, gen):
    meta = {"graph": {"num_edges": 20 * nodes}, "times_s": {"load": gen, "partition": gen / 2, "write": 0.1},
            "peak_rss_mib": 1000.0, "degrees": {"max_over_mean": 50.0, "tail_exponent": 1.6}, "edge_cut": 7}
    runs = {"vanilla": {"epoch_time_s": ep, "bytes_sent_per_epoch": 2e6, "peak_rss_mib_per_rank": rss,
                        "load_time_s_per_rank": [0.5, 0.7], "partitioning": {"dir": "p"}}}
    return scaling.size_record(nodes, meta, runs)


def test_summary_from_hand_made_records():
    small = _rec(1000, [100.0, 300.0], 1.0, 2.0)
    big = _rec(8000, [800.0, 2400.0], 64.0, 16.0)  # memory linear, epoch time quadratic
    m = small["modes"]["vanilla"]
    assert m["peak_rss_mib_max"] == 300.0 and m["peak_rss_mib_total"] == 400.0
    assert m["load_s_max"] == 0.7 and m["bytes_per_epoch_MB"] == pytest.approx(2.0) and m["loaded_part_only"]
    s = scaling.summarize([big, small])  # any order in, sorted by size out
    assert [r["nodes"] for r in s["sizes"]] == [1000, 8000]
    g = s["growth"]
    assert g["vanilla:peak_rss_mib_max"]["exponent"] == pytest.approx(1.0)
    assert g["vanilla:peak_rss_mib_total"]["linear"] is True
    assert g["vanilla:epoch_time_s"]["exponent"] == pytest.approx(2.0)
    assert g["vanilla:epoch_time_s"]["linear"] is False
    assert g["generate_s"]["exponent"] == pytest.approx(1.0)
    assert g["partition_peak_rss_mib"]["exponent"] == pytest.approx(0.0)
    md = scaling.summary_markdown(s)
    assert "| 8,000 | 160,000 | 50 | 1.60 |" in md
    assert "| vanilla: epoch time | 2.00 | 8.00 | no | 2.00 |" in md
    # a bend between neighbouring sizes shows in the steepest step, not in the end points
    mid = _rec(2000, [200.0, 600.0], 8.0, 4.0)  # epoch time x8 from 1000 to 2000: exponent 3
    g3 = scaling.summarize([small, mid, big])["growth"]["vanilla:epoch_time_s"]
    assert g3["exponent"] == pytest.approx(2.0) and g3["steepest_step"] == pytest.approx(3.0)
    assert g3["linear"] is False
    assert scaling.summarize([small])["growth"] == {}  # one size: nothing to compare


def test_parse_nodes():
    assert scaling.parse_nodes("4000, 2000") == [2000, 4000]
    assert scaling.parse_nodes("2e5") == [200_000]
    for bad in ("", "a,b", "100,100", "1"):
        with pytest.raises(ValueError, match="--nodes"):
            scaling.parse_nodes(bad)


def test_bad_nodes_is_one_line_and_exit_2(capsys):
    assert scaling.main(["--nodes", "10,x", "--out", "unused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--nodes" in err[0]


def test_degree_stats_hand_worked_and_pareto():
    d = degree_stats(np.array([1, 1, 2, 4]))
    assert d["mean"] == 2.0 and d["max"] == 4 and d["max_over_mean"] == 2.0
    # k = 3 (at most N - 1): log(4/1) + log(2/1) + log(1/1) = log 8 -> alpha = 3 / log 8
    assert d["tail_nodes"] == 3 and d["tail_exponent"] == pytest.approx(3 / np.log(8))
    rng = np.random.default_rng(0)
    pareto = (1.0 - rng.random(200_000)) ** (-1 / 1.6)  # P[X > x] = x^-1.6
    assert degree_stats(pareto)["tail_exponent"] == pytest.approx(1.6, rel=0.1)
    assert degree_stats(np.full(50, 3))["tail_exponent"] is None  # no tail to fit


def test_partition_records_its_cost_and_degree_skew(tmp_path, capsys):
    from commsched.gnn.graph.cli import partition_main

    out = tmp_path / "p"
    assert partition_main(["--syn-nodes", "600", "--syn-edges", "3000", "--parts", "2",
                           "--method", "random", "--out", str(out)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert set(meta["times_s"]) == {"load", "partition", "write"}
    assert all(t >= 0 for t in meta["times_s"].values())
    assert meta["peak_rss_mib"] > 0
    deg = meta["degrees"]
    assert deg["mean"] == pytest.approx(meta["graph"]["num_edges"] / 600)
    assert deg["max_over_mean"] > 1 and deg["tail_exponent"] > 0


@pytest.mark.slow
def test_scaling_end_to_end_two_sizes(tmp_path):
    out = tmp_path / "sc"
    assert scaling.main(["--nodes", "1500,3000", "--nproc", "2", "--epochs", "1", "--hidden", "8",
                         "--modes", "vanilla", "--edges-per-node", "5", "--features", "8",
                         "--timeout", "300", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert [r["nodes"] for r in s["sizes"]] == [1500, 3000]
    for r in s["sizes"]:
        assert r["directed_edges"] > 0 and r["generate_s"] is not None and r["degrees"]["max"] > 0
        m = r["modes"]["vanilla"]
        # each rank loaded its own part from the partition folder and reported its memory
        assert m["loaded_part_only"] is True and len(m["load_s_per_rank"]) == 2
        assert len(m["peak_rss_mib_per_rank"]) == 2 and m["epoch_time_s"] > 0
    assert "vanilla:peak_rss_mib_total" in s["growth"]
    assert (out / "scaling.png").stat().st_size > 0 and "Growth from 1,500" in (out / "summary.md").read_text()
    # --collect rebuilds the same sizes from the folders, running nothing
    assert scaling.main(["--collect", "--out", str(out)]) == 0
    assert [r["nodes"] for r in json.loads((out / "summary.json").read_text())["sizes"]] == [1500, 3000]
