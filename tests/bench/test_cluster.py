"""``commsched bench moe-train|gnn|moe-infer --cluster NAME``: the variants' command lines,
parsed by each front-end's own parser (no processes)."""

from __future__ import annotations

import pytest

from commsched.bench.emulation import bench_context
from commsched.bench.runner import parse_workload_args
from commsched.bench.workloads import load_workload
from commsched.cluster.presets import load_preset

TOOLS = {"ip": "/usr/sbin/ip", "tc": "/usr/sbin/tc"}.get


def _variants(workload: str, argv: list[str]):
    wl = load_workload(workload)
    ctx, rest = bench_context(wl, argv, euid=0, which=TOOLS, gpus=0)
    a = parse_workload_args(wl, rest, ctx.cluster)
    a.hosts, a.bandwidth, a.rate_bps = ctx.hosts, ctx.bandwidth, ctx.rate_bps
    a.link_model, a.reduce_address = ctx.link_model, ctx.reduce_address
    return {v.name: v for v in wl.variants(a)}, a


@pytest.mark.parametrize("name", ["a100x16-ib100", "a100x8-ib100"])
def test_moe_train_variants_on_the_emulated_cluster(tmp_path, name):
    from commsched.moe.train.cli import build_parser, config_from_args

    p = load_preset(name)
    vs, a = _variants("moe-train", ["--cluster", name, "--steps", "4"])
    assert a.nproc == p.ranks_per_host and a.hosts == p.hosts
    # DeepSpeed's engine cannot run on the emulated device: left out (the summary says so)
    assert "deepspeed" not in vs and {"fifo", "lina", "lina-overlap", "lina-hier"} <= set(vs)
    for v in vs.values():
        c = config_from_args(build_parser().parse_args([*v.argv, "--out", str(tmp_path)]))
        assert (c.compute, c.device_model, c.dilation) == ("emulated", p.device_model, p.dilation)
        assert c.model.num_experts == p.ranks and c.model.d_model == p.moe.d_model
        assert (c.model.n_layers, c.model.seq_len, c.batch_size, c.dtype) == (
            p.moe.n_layers, p.moe.seq_len, p.moe.batch_size, p.moe.dtype)
        assert c.run_device == "cpu" and c.steps == 4
        # the schedules sized for the modelled job: DDP's 25 MiB buckets, 4 MiB micro-ops
        size = getattr(c.schedule, "bucket_bytes", None) or getattr(c.schedule, "microop_bytes", None)
        assert size == (25 << 20 if c.schedule.policy == "fifo" else 4 << 20), (v.name, size)
    # schedule + compression on emulated hosts: the hierarchical reduction with its phase across
    # hosts compressed, and with the 8-bit all-to-all as well
    vs, _ = _variants("moe-train", ["--cluster", name, "--grad-bits", "8", "--a2a-bits", "8"])
    for n, bits in (("lina-hier-g8", (32, 8)), ("lina-hier-q8-g8", (8, 8))):
        c = config_from_args(build_parser().parse_args([*vs[n].argv, "--out", str(tmp_path)]))
        assert c.schedule.hier_reduce and (c.dispatch.a2a_bits, c.grad_bits) == bits
    # an explicit option still wins over the preset's
    vs, _ = _variants("moe-train", ["--cluster", name, "--d-model", "256", "--heads", "4"])
    c = config_from_args(build_parser().parse_args([*vs["fifo"].argv, "--out", str(tmp_path)]))
    assert c.model.d_model == 256 and c.dilation == p.dilation


def test_moe_train_without_cluster_is_unchanged(tmp_path):
    wl = load_workload("moe-train")
    from commsched.bench.runner import build_parser

    names = [v.name for v in wl.variants(build_parser(wl).parse_args([]))]
    assert names[:4] == ["deepspeed", "fifo", "lina", "lina-overlap"]
    assert all("--compute" not in v.argv for v in wl.variants(build_parser(wl).parse_args([])))


def test_gnn_variants_on_the_emulated_cluster(tmp_path):
    from commsched.gnn.train.cli import build_parser, config_from_args

    p = load_preset("a100x8-eth100")
    vs, a = _variants("gnn", ["--cluster", p.name, "--epochs", "3"])
    assert set(vs) == {f"{m}-{x}" for m in ("gcn", "sage") for x in ("vanilla", "adaqp-q", "adaqp-p", "adaqp")}
    for v in vs.values():
        c = config_from_args(build_parser().parse_args([*v.argv, "--out", str(tmp_path)]))
        assert (c.compute, c.device_model, c.dilation) == ("emulated", "a100", p.dilation)
        assert (c.layers, c.hidden, c.epochs) == (p.gnn.layers, p.gnn.hidden, 3)
        assert "--syn-nodes" in v.argv and str(p.gnn.syn_nodes) in v.argv
    vs, _ = _variants("gnn", ["--cluster", p.name, "--modes", "vanilla", "--models", "gcn"])
    assert list(vs) == ["gcn-vanilla"]
    # the emulated device computes zeros: time to accuracy is refused, not measured on noise
    with pytest.raises(ValueError, match="time-to-acc needs accuracies"):
        _variants("gnn", ["--cluster", p.name, "--metric", "time-to-acc"])


def test_gnn_pick_on_the_emulated_cluster_names_the_fastest_epoch_without_an_accuracy():
    from commsched.bench.gnn.compare import pick_line

    rows = {"gcn-vanilla": {"model": "gcn", "mode": "vanilla", "epoch_time_s": 4.0, "test_acc": None},
            "gcn-adaqp": {"model": "gcn", "mode": "adaqp", "epoch_time_s": 1.6, "test_acc": None},
            "gcn-nocomm": {"model": "gcn", "mode": "nocomm", "epoch_time_s": 0.5, "test_acc": None}}
    line = pick_line(rows, "500mbit")
    assert "**adaqp** (2.50x Vanilla's)" in line and "no accuracy was measured" in line
    # with accuracies the rule is unchanged: the fastest mode within 1 pp of Vanilla's
    rows = {k: dict(r, test_acc=0.8) for k, r in rows.items()}
    rows["gcn-adaqp"]["test_acc"] = 0.7
    assert "pick **vanilla**" in pick_line(rows, "500mbit")


def test_moe_infer_variants_on_the_emulated_cluster(tmp_path):
    from commsched.moe.infer.cli import build_parser, config_from_args

    p = load_preset("a100x16-ib100")
    vs, a = _variants("moe-infer", ["--cluster", p.name, "--batches", "4", "--warmup", "1"])
    assert {"static", "lina", "oracle", "eplb-hier", "lina-node"} <= set(vs)  # 4 hosts: the host-aware ones too
    for v in vs.values():
        c = config_from_args(build_parser().parse_args([*v.argv, "--out", str(tmp_path)]))
        em = c.emulation
        assert (em.device_model, em.dilation) == ("a100", p.dilation)
        assert em.gpu().name == "a100"
        # loads from the A100's host link (no set --load-ms); every expert of a layer resident (80 GB)
        assert em.load_ms is None and c.resident == 16
    # an explicit --load-ms and --resident still win
    vs, _ = _variants("moe-infer", ["--cluster", p.name, "--load-ms", "2", "--resident", "6"])
    c = config_from_args(build_parser().parse_args([*vs["lina"].argv, "--out", str(tmp_path)]))
    assert (c.emulation.load_ms, c.resident) == (2.0, 6)
    # without a cluster or a GPU model the bench's set figure
    vs, _ = _variants("moe-infer", ["--batches", "4"])
    c = config_from_args(build_parser().parse_args([*vs["lina"].argv, "--out", str(tmp_path)]))
    assert (c.emulation.load_ms, c.resident) == (1.0, None)


def _emulated_metrics(step: float, a2a: float, alone: float, share: float) -> dict:
    return {"impl": "commsched", "world_size": 8, "loss": [None] * 4, "step_time_s": step, "a2a_time_s": a2a,
            "a2a_alone_time_s": alone, "allreduce_time_s": step / 2, "step_times_s": [step] * 4,
            "sizes": {"non_expert_grad_bytes": 4 << 20, "a2a_payload_bytes_per_step": 1 << 20},
            "bench_cpu_share": 0.4,
            "emulation": {"host_cpu_share": [0.03] * 7 + [share], "peak_rss_mib": [700.0] * 8, "startup_s": 30.0}}


def test_moe_train_summary_on_the_emulated_cluster(tmp_path, monkeypatch):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # the limit: 0.5 x 2 cores / 8 ranks
    p = load_preset("a100x8-ib100")
    wl = load_workload("moe-train")
    _, a = _variants("moe-train", ["--cluster", p.name])
    runs = {"fifo": [_emulated_metrics(10.0, 3.4, 1.85, 0.05)], "lina": [_emulated_metrics(8.0, 2.0, 1.9, 0.2)]}
    s = wl.summarize(runs, a, tmp_path)
    c = s["cluster"]
    assert c["dilation"] == 200 and c["fifo"]["predicted_s"] == pytest.approx(0.05)
    assert not c["fifo"]["host_bound"] and c["lina"]["host_bound"]   # 0.2 > 0.125
    f = c["faithfulness"]
    assert f["a2a_share_fifo"] == pytest.approx(0.34) and f["a2a_share_within_band"]
    assert f["contention_fifo"] == pytest.approx(3.4 / 1.85) and f["contention_within_band"]
    table = s["extra_tables"]["Emulated cluster"]
    assert "k = 200" in table and "deepspeed left out" in table and "host-bound" in table
    assert "Loss curves" not in s["extra_tables"]  # an emulated run has no loss values


def _summary(hosts: int, nproc: int, k: float, times: dict[str, float], key: str = "step_time_s") -> dict:
    return {"baseline": "fifo", "median": {v: {key: t} for v, t in times.items()},
            "cluster": {"dilation": k}, "meta": {"hosts": hosts, "nproc": nproc, "emulation": {"cluster": f"c{hosts * nproc}"}}}


def test_scaling_report_orders_sizes_and_gives_time_and_ratio_per_cell(tmp_path):
    from commsched.bench.plots import scaling_main, scaling_report

    runs = {"r16": _summary(4, 4, 500.0, {"fifo": 50.0, "lina": 40.0}),
            "r4": _summary(2, 2, 200.0, {"fifo": 10.0, "lina": 12.5, "lina-hier": 5.0})}
    table, png = scaling_report(runs, tmp_path)
    assert png.exists() and png.stat().st_size > 0
    lines = table.splitlines()
    assert lines[0].index("4 GPUs (c4)") < lines[0].index("16 GPUs (c16)")  # sizes in order
    row = {ln.split(" | ")[0].strip("| "): ln for ln in lines[2:5]}
    # fifo at 4 GPUs: 10 s / k 200 = 50 ms; lina 62.5 ms, 0.8x; at 16 GPUs 100 ms and 80 ms, 1.25x
    assert "50 / 1.00x" in row["fifo"] and "100 / 1.00x" in row["fifo"]
    assert "62.5 / 0.80x" in row["lina"] and "80 / 1.25x" in row["lina"]
    assert "25 / 2.00x" in row["lina-hier"] and row["lina-hier"].rstrip(" |").endswith("-")
    # two runs of one size merge: a variant from the first that has it, against its own run's baseline
    t, _ = scaling_report({**runs, "r4b": _summary(2, 2, 200.0, {"fifo": 20.0, "fifo-g8": 10.0})}, tmp_path)
    assert t.splitlines()[0].count("4 GPUs") == 1 and "50 / 2.00x" in t and "62.5 / 0.80x" in t
    # a GNN run's epochs; a summary that is not an emulated cluster's is refused with a reason
    t, _ = scaling_report({"g": _summary(2, 4, 200.0, {"vanilla": 2.0, "adaqp": 1.0}, "epoch_time_s")}, tmp_path,
                          baseline="vanilla")
    assert "2.00x" in t and "epoch_time" in t
    # bench gnn records a baseline per variant: each ratio against its own
    g = _summary(2, 4, 200.0, {"gcn-vanilla": 2.0, "gcn-adaqp": 1.0, "gcn-adaptive": 0.5}, "epoch_time_s")
    g["baseline"] = {"gcn-adaqp": "gcn-vanilla", "gcn-adaptive": "gcn-vanilla"}
    t, _ = scaling_report({"g": g}, tmp_path)
    assert "gcn-vanilla / it" in t and "5 / 2.00x" in t and "2.5 / 4.00x" in t and "10 / 1.00x" in t
    with pytest.raises(ValueError, match="emulated cluster"):
        scaling_report({"x": {"median": {"fifo": {"step_time_s": 1.0}}, "meta": {}}}, tmp_path, baseline="fifo")
    # the command: unreadable folder -> status 2 with the path; a good one writes scaling.md
    assert scaling_main([str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    for name, s in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(__import__("json").dumps(s))
    assert scaling_main([str(tmp_path / "r4"), str(tmp_path / "r16"), "--out", str(tmp_path / "o")]) == 0
    assert "lina-hier" in (tmp_path / "o" / "scaling.md").read_text()


def test_gnn_cluster_summary_gives_adaqp_on_its_assigned_widths(tmp_path):
    """Vanilla / AdaQP and the overlap's gain, on the median epoch and on the epochs from
    AdaQP's first plan on (before it, every mode sends 8-bit messages)."""
    import argparse

    from commsched.bench.gnn.compare import summarize

    def run(ep, assigned=None):
        return {"epoch_time_s": ep, "epoch_time_s_assigned": assigned, "test_acc": None, "loss": [0.0],
                "bytes_sent_per_epoch": 1.0, "peak_rss_mib_per_rank": [500.0, 510.0],
                "emulated": {"host_cpu_share_per_rank": [0.05, 0.06], "setup_s": 1.0}}

    runs = {"gcn-vanilla": [run(4.0)], "gcn-adaqp-q": [run(1.6, 1.2)], "gcn-adaqp": [run(1.5, 1.0)]}
    a = argparse.Namespace(bits=4, bandwidth="500mbit", metric="epoch", target_acc=None, compute="emulated",
                           cluster=None, dilation=200.0, device_model="a100", nproc=2, hosts=1)
    res = summarize(runs, a, tmp_path)
    g = res["cluster"]["gcn_gains"]
    assert g["vanilla_over_adaqp"] == pytest.approx(4.0 / 1.5)
    assert g["vanilla_over_adaqp_assigned"] == pytest.approx(4.0)
    assert g["overlap_gain_adaqp_q_over_adaqp"] == pytest.approx(1.6 / 1.5)
    assert g["overlap_gain_assigned"] == pytest.approx(1.2)
    assert "| gcn | 2.67x | 4x | 1.07x | 1.2x |" in res["extra_tables"]["Emulated cluster"]
