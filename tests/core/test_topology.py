"""Topology: hand-built layouts and their paths, predictions checked against hand-computed
numbers, the file form and its errors, the probe's link classes, the `commsched topology`
command; one 2-rank probe on real processes."""

import json
import math
import subprocess
import sys

import pytest

from commsched import LinkCost, Topology, predict_exchange
from commsched.cli import main as cli_main
from commsched.cluster.costmodel import check_probe_rounds
from commsched.cluster.topology import (
    SWITCH,
    fit_link_classes,
    host_names,
    probe_rounds,
    used_classes,
)
from commsched.config import read_env
from tests.mp import run_ranks

INTRA = LinkCost(gamma=2e-6, theta=1 / 100e9)  # 2 us, 100 GB/s
INTER = LinkCost(gamma=20e-6, theta=1 / 1e9)   # 20 us, 1 GB/s
NIC0_OUT = (("nic", "host0"), SWITCH)
NIC1_IN = (SWITCH, ("nic", "host1"))


def grid(hosts=2, per_host=2):
    return Topology.grid(hosts, per_host, intra=INTRA, inter=INTER)


def all_to_all(P, nb):
    return [[0 if a == b else nb for b in range(P)] for a in range(P)]


# --------------------------------------------------------------------------- layout and paths
def test_hosts_classes_and_paths_of_a_2x2_layout():
    t = grid()
    assert t.world_size == 4 and t.hosts == ("host0", "host1")
    assert [t.host_of(r) for r in range(4)] == ["host0", "host0", "host1", "host1"]
    assert t.ranks_of("host1") == [2, 3]
    assert t.link_class(0, 1) == "intra" and t.link_class(1, 2) == "inter"
    assert t.path(0, 1) == [(("rank", 0), ("bus", "host0")), (("bus", "host0"), ("rank", 1))]
    assert t.path(1, 3) == [(("rank", 1), ("nic", "host0")), NIC0_OUT, NIC1_IN,
                            (("nic", "host1"), ("rank", 3))]
    g = t.graph
    assert g.edges[NIC0_OUT]["cls"] == "inter" and g.edges[NIC0_OUT]["rate_Bps"] == pytest.approx(1e9)
    assert g.edges[(("rank", 1), ("nic", "host0"))]["rate_Bps"] == math.inf  # attach: no limit
    assert t.link_cost(NIC0_OUT) == INTER and t.link_cost(t.path(1, 3)[0]) is None
    assert t.pair_cost(0, 1) == INTRA and t.pair_cost(3, 0) == INTER
    # every path the queries give is a path of the graph
    for a in range(4):
        for b in range(4):
            if a != b:
                assert all(g.has_edge(*link) for link in t.path(a, b))


def test_layouts_have_only_the_links_they_use():
    one_host = Topology.grid(1, 3)
    assert dict(one_host.links).keys() == {"intra"} and SWITCH not in one_host.graph
    spread = Topology.from_hosts(["a", "b", "c"])
    assert dict(spread.links).keys() == {"inter"}
    assert not any(n[0] == "bus" for n in spread.graph)
    assert used_classes(["a", "a", "b"]) == ["intra", "inter"]
    with pytest.raises(ValueError, match="no cost for link class 'inter'"):
        Topology(("a", "b"), {"intra": INTRA})


@pytest.mark.parametrize("call,msg", [
    (lambda t: t.host_of(4), "rank in 0..3"),
    (lambda t: t.path(1, 1), "crosses no link"),
    (lambda t: t.link_class(0, -1), "dst must be a rank"),
    (lambda t: t.ranks_of("nowhere"), "no host 'nowhere'"),
    (lambda t: t.link_cost((("rank", 0), ("rank", 1))), "not a link"),
])
def test_bad_queries_say_what_is_wrong(call, msg):
    with pytest.raises(ValueError, match=msg):
        call(grid())


def test_host_names_from_gathered_names_and_node_indices():
    # real machines: the host name alone
    assert host_names([("a", 0), ("a", 0), ("b", 1)]) == ("a", "a", "b")
    # emulated hosts share the machine's name: the node index tells them apart
    assert host_names([("vm", 0), ("vm", 0), ("vm", 1)]) == ("vm#0", "vm#0", "vm#1")
    assert host_names([("vm", None), ("vm", None)]) == ("vm", "vm")
    assert read_env({"GROUP_RANK": "2"}).group_rank == 2 and read_env({}).group_rank is None


# --------------------------------------------------------------------------- prediction
def test_all_to_all_on_2x2_loads_each_nic_with_two_ranks_times_two_peers():
    nb = 1 << 20
    p = predict_exchange(grid(), all_to_all(4, nb))
    # NIC of host0 carries ranks 0 and 1, each to 2 remote peers
    assert p.link_bytes[NIC0_OUT] == 4 * nb and p.link_bytes[NIC1_IN] == 4 * nb
    assert p.link_bytes[(("rank", 0), ("bus", "host0"))] == nb  # one local peer
    assert p.link_bytes[(("rank", 0), ("nic", "host0"))] == 2 * nb
    expect = 20e-6 + 4 * nb / 1e9
    assert p.link_time_s[NIC0_OUT] == pytest.approx(expect)
    assert p.link_time_s[(("rank", 0), ("bus", "host0"))] == pytest.approx(2e-6 + nb / 100e9)
    assert p.busiest[0][0] == "nic" or p.busiest[1][0] == "nic"
    assert p.time_s == pytest.approx(expect)
    assert p.pair_time_s == pytest.approx(20e-6 + nb / 1e9)


def test_uneven_exchange_by_hand():
    t = Topology.from_hosts(["a", "a", "a", "b"], intra=INTRA, inter=INTER)
    # 0, 1, 2 on host a each send 3 MB to rank 3; rank 3 sends 1 MB to 0; 0 -> 1 sends 50 MB
    b = [[0, 50e6, 0, 3e6], [0, 0, 0, 3e6], [0, 0, 0, 3e6], [1e6, 0, 0, 0]]
    p = predict_exchange(t, b)
    a_out, b_in = (("nic", "a"), SWITCH), (SWITCH, ("nic", "b"))
    assert p.link_bytes[a_out] == 9e6 and p.link_bytes[b_in] == 9e6
    assert p.link_bytes[(SWITCH, ("nic", "a"))] == 1e6
    assert p.link_bytes[(("rank", 0), ("bus", "a"))] == 50e6
    # busiest: host a's NIC out (20 us + 9 ms) beats the fabric (2 us + 0.5 ms)
    assert p.busiest in (a_out, b_in)
    assert p.time_s == pytest.approx(20e-6 + 9e6 / 1e9)
    assert p.link_time_s[(("rank", 0), ("bus", "a"))] == pytest.approx(2e-6 + 50e6 / 100e9)


def test_a_slow_probed_pair_bounds_the_prediction():
    slow = LinkCost(gamma=5e-6, theta=1 / 1e8)  # this pair alone: 100 MB/s, 10x its class
    t = Topology(grid().hosts_P, {"intra": INTRA, "inter": INTER}, {(0, 1): slow})
    b = [[0, 1e6, 0, 0], [0] * 4, [0] * 4, [0] * 4]
    p = predict_exchange(t, b)
    assert p.slowest_pair == (0, 1) and p.time_s == pytest.approx(5e-6 + 1e6 / 1e8)
    assert predict_exchange(grid(), b).time_s == pytest.approx(2e-6 + 1e6 / 100e9)


def test_nothing_sent_takes_no_time_and_the_diagonal_is_local():
    p = predict_exchange(grid(), [[7e6 if a == b else 0 for b in range(4)] for a in range(4)])
    assert p.time_s == 0 and p.busiest is None and set(p.link_bytes.values()) == {0.0}


@pytest.mark.parametrize("bytes_PP,msg", [
    ([[0, 1], [1, 0]], "must be 4 x 4"),
    ([[0] * 4] * 3 + [[0, 0, 0]], "must be 4 x 4"),
    ([[0, -1, 0, 0]] + [[0] * 4] * 3, r"bytes_PP\[0\]\[1\] must be a finite"),
    ([[0, float("nan"), 0, 0]] + [[0] * 4] * 3, "finite byte count"),
    ([["x"] * 4] * 4, "table of byte counts"),
])
def test_predict_rejects_bad_tables(bytes_PP, msg):
    with pytest.raises(ValueError, match=msg):
        predict_exchange(grid(), bytes_PP)


# --------------------------------------------------------------------------- probe -> classes
@pytest.mark.parametrize("hosts,per_host", [(2, 2), (3, 2), (1, 4), (4, 1), (2, 3)])
def test_probe_rounds_time_every_pair_alone(hosts, per_host):
    t = Topology.grid(hosts, per_host)
    rounds = probe_rounds(t)
    P = t.world_size
    flat = [ab for rnd in rounds for ab in rnd]
    assert sorted(flat) == [(a, b) for a in range(P) for b in range(P) if a != b]
    check_probe_rounds(rounds, P)  # each rank in one pair a round at most
    for rnd in rounds:
        # no limiting link carries two of a round's pairs
        p = predict_exchange(t, [[1 if (a, b) in rnd else 0 for b in range(P)] for a in range(P)])
        assert all(nb <= 1 for link, nb in p.link_bytes.items() if t.link_cost(link) is not None)
    if hosts == 2 and per_host == 2:
        # 8 inter pairs, 2 a round (one each way), use all 4 ranks; then 4 intra pairs, 2 a
        # round: 6 rounds, the fewest possible
        assert len(rounds) == 6


@pytest.mark.parametrize("rounds,msg", [
    ([[(0, 1), (1, 2)]], "rank 1 is in two pairs"),
    ([[(0, 0)]], "two different ranks"),
    ([[(0, 3)]], "two different ranks in 0..2"),
    ([[(0, 1)], [(0, 1)]], "probed twice"),
    ([[0, 1]], "a pair is"),
])
def test_probe_rounds_are_checked(rounds, msg):
    with pytest.raises(ValueError, match=msg):
        check_probe_rounds(rounds, 3)


def test_link_classes_are_the_median_of_their_pairs():
    hosts = ("host0", "host0", "host1", "host1")
    alone = {(a, b): (INTER if (a < 2) != (b < 2) else INTRA) for a in range(4) for b in range(4) if a != b}
    alone[(0, 2)] = LinkCost(1.0, 1.0)  # one outlier pair does not move the median
    t = Topology.from_pair_costs(hosts, alone)
    assert t.links["inter"] == INTER and t.links["intra"] == INTRA
    assert t.pair_cost(0, 2) == LinkCost(1.0, 1.0) and t.pair_cost(2, 0) == INTER
    assert t.source == "probe" and len(t.pairs) == 12
    assert fit_link_classes(("a", "b"), {(0, 1): INTER, (1, 0): INTER}) == {"inter": INTER}
    with pytest.raises(ValueError, match="no cost for link class 'intra'"):
        Topology.from_pair_costs(hosts, {(0, 2): INTER})


# --------------------------------------------------------------------------- files
def test_file_round_trip_and_a_hand_written_file(tmp_path):
    t = Topology(grid().hosts_P, {"intra": INTRA, "inter": INTER}, {(2, 0): LinkCost(1e-5, 2e-9)},
                 source="probe")
    back = Topology.load(t.save(tmp_path / "t.json"))
    assert back.hosts_P == t.hosts_P and back.source == "probe"
    for k in ("intra", "inter"):
        assert back.links[k].gamma == pytest.approx(t.links[k].gamma)
        assert back.links[k].theta == pytest.approx(t.links[k].theta)
    assert back.pairs[(2, 0)].theta == pytest.approx(2e-9)
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"ranks": ["gpu-a"] * 2 + ["gpu-b"] * 2, "links": {
        "intra": {"latency_us": 2, "rate": "800gbit"}, "inter": {"latency_us": 20, "rate": "8gbit"}}}))
    mine = Topology.load(f)
    assert mine.links["inter"] == LinkCost(gamma=pytest.approx(20e-6), theta=pytest.approx(1e-9))
    assert predict_exchange(mine, all_to_all(4, 1e6)).time_s == pytest.approx(20e-6 + 4e6 / 1e9)


@pytest.mark.parametrize("doc,msg", [
    ("[1, 2]", "<top>: expected an object"),
    ('{"ranks": ["a"], "hosts": 2}', "hosts: unknown key"),
    ('{"links": {}}', "ranks: missing"),
    ('{"ranks": ["a", 3]}', r"ranks\[1\]: expected a non-empty host name"),
    ('{"ranks": ["a", "a"]}', "no cost for link class 'intra'"),
    ('{"ranks": ["a", "b"], "links": {"wan": {"rate": "1gbit"}}}', "links.wan: unknown link class"),
    ('{"ranks": ["a", "b"], "links": {"inter": {"rate": "fast"}}}', "links.inter.rate: cannot read rate"),
    ('{"ranks": ["a", "b"], "links": {"inter": {"rate": 5}}}', "links.inter.rate: expected a string"),
    ('{"ranks": ["a", "b"], "links": {"inter": {"latency_us": 1}}}', "links.inter: give exactly one"),
    ('{"ranks": ["a", "b"], "links": {"inter": {"rate_Bps": -1}}}', "links.inter.rate_Bps: expected"),
    ('{"ranks": ["a", "b"], "links": {"inter": {"rate": "1gbit", "latency_us": -2}}}',
     "links.inter.latency_us"),
    ('{"ranks": ["a", "b"], "links": {"inter": {"rate": "1gbit", "mtu": 9000}}}', "links.inter.mtu: unknown"),
    ('{"ranks": ["a", "b"], "links": {"inter": {"rate": "1gbit"}}, "pairs": [{"src": 0, "dst": 2, '
     '"rate": "1gbit"}]}', r"pairs\[0\].dst: expected a rank in 0..1"),
    ('{"ranks": ["a", "b"], "links": {"inter": {"rate": "1gbit"}}, "pairs": [{"src": 1, "dst": 1, '
     '"rate": "1gbit"}]}', "both rank 1"),
    ("{not json", "not valid JSON"),
])
def test_malformed_files_name_the_field(tmp_path, doc, msg):
    f = tmp_path / "bad.json"
    f.write_text(doc)
    with pytest.raises(ValueError, match=msg) as e:
        Topology.load(f)
    assert str(f) in str(e.value)


def test_missing_file_is_one_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read topology file"):
        Topology.load(tmp_path / "nope.json")


def test_topology_module_imports_without_torch():
    code = "import sys, commsched.cluster.topology; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- command
def _is_png(path):
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_cli_hand_built_layout_prints_and_draws(tmp_path, capsys):
    rc = cli_main(["topology", "--hosts", "2", "--nproc", "3", "--inter-rate", "10gbit",
                   "--inter-latency-us", "15", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "6 ranks on 2 host(s)" in out and "host1            3-5" in out
    assert "10 Gbit/s" in out and "15 us" in out
    assert _is_png(tmp_path / "topology.png")
    t = Topology.load(tmp_path / "topology.json")
    assert t.hosts_P == ("host0",) * 3 + ("host1",) * 3
    assert t.links["inter"].theta == pytest.approx(8 / 10e9)


def test_cli_from_a_file(tmp_path, capsys):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"ranks": ["n1", "n2"], "links": {"inter": {"latency_us": 5, "rate": "25gbit"}},
                             "pairs": [{"src": 0, "dst": 1, "latency_us": 7, "rate": "20gbit"}]}))
    assert cli_main(["topology", "--file", str(f), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "25 Gbit/s" in out and "20 Gbit/s; 7 us" in out
    assert _is_png(tmp_path / "o" / "topology.png")


@pytest.mark.parametrize("argv,msg", [
    ([], "exactly one of --file"),
    (["--hosts", "2"], "needs both --hosts K and --nproc N"),
    (["--hosts", "2", "--nproc", "0"], "--nproc must be an integer >= 1"),
    (["--hosts", "2", "--nproc", "2", "--file", "x.json"], "got --file and --hosts/--nproc"),
    (["--file", "x.json", "--inter-rate", "1gbit"], "applies to a hand-built layout"),
    (["--hosts", "2", "--nproc", "1", "--inter-rate", "3"], "--inter-rate: rate '3' has no unit"),
    (["--hosts", "2", "--nproc", "1", "--bogus"], "unknown arguments"),
    (["--hosts", "2", "--nproc", "1", "--repeats", "2"], "--repeats applies to --probe only"),
    (["--probe", "--sizes", "4k,1m"], "--sizes must be byte counts"),
    (["--probe", "--sizes", "4096"], "two or more distinct sizes"),
])
def test_cli_bad_arguments_exit_2_with_one_line(argv, msg, capsys):
    assert cli_main(["topology", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- on real ranks
def _probe_case(rank, world, out):
    import os

    from commsched.cluster.topology import Topology as T

    # one host: no GROUP_RANK
    assert cli_main(["topology", "--probe", "--sizes", "1024,65536,1048576", "--repeats", "1",
                     "--out", out]) == 0
    os.environ["GROUP_RANK"] = str(rank)  # as torchrun sets it on two nodes
    t = T.probe(sizes=(1 << 10, 1 << 16, 1 << 20), repeats=1)  # the library call, every rank
    return t.to_dict()


@pytest.mark.slow
def test_probe_on_two_ranks_fills_the_pairs(tmp_path):
    res = run_ranks(2, _probe_case, str(tmp_path), timeout_s=120)
    assert res[0] == res[1]  # every rank gets the same topology
    t = Topology.from_dict(res[0])
    # node indices 0 and 1 under one host name: two hosts named NAME#0, NAME#1
    assert len(t.hosts) == 2 and t.hosts[1].endswith("#1") and t.link_class(0, 1) == "inter"
    assert sorted(t.pairs) == [(0, 1), (1, 0)] and set(t.links) == {"inter"}
    # one pair each way: the class is the median of the two pairs
    thetas = sorted(c.theta for c in t.pairs.values())
    assert t.links["inter"].theta == pytest.approx(sum(thetas) / 2)
    assert all(c.theta * (1 << 20) < 1.0 for c in t.pairs.values())  # a MiB well under 1 s
    written = Topology.load(tmp_path / "topology.json")  # rank 0 wrote the command's result
    assert written.source == "probe" and len(written.hosts) == 1
    assert sorted(written.pairs) == [(0, 1), (1, 0)] and set(written.links) == {"intra"}
    assert _is_png(tmp_path / "topology.png")


def test_from_env_without_a_process_group_says_what_to_do():
    with pytest.raises(ValueError, match="call commsched.init_distributed"):
        Topology.from_env()
