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
