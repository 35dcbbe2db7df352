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
