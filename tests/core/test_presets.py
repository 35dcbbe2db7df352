"""Cluster presets (pure, milliseconds): the rule for k, the dilated link rates, the
registry, and what ``--cluster`` does to a bench command line (no processes)."""

from __future__ import annotations

import math

import pytest

from commsched.bench.emulation import bench_context, cluster_table, host_cpu_limit
from commsched.cluster.device import DEVICE_MODELS
from commsched.cluster.presets import (
    CLUSTERS,
    GBIT,
    INTRA_CAP_BPS,
    LINK_BUDGET_BPS,
    PRESETS,
    dilation_for,
    load_preset,
)

TOOLS = {"ip": "/usr/sbin/ip", "tc": "/usr/sbin/tc"}.get


def test_dilation_rule_is_the_smallest_125_value_within_the_budget():
    assert dilation_for(4, 100 * GBIT, budget_bps=1 * GBIT) == 500     # 400 needed -> 500
    assert dilation_for(2, 100 * GBIT, budget_bps=1 * GBIT) == 200     # exactly 200
    assert dilation_for(1, 0.5 * GBIT, budget_bps=1 * GBIT) == 1       # already carried
    assert dilation_for(3, 100 * GBIT, budget_bps=1 * GBIT) == 500     # 300 -> 500
    assert dilation_for(1, 150 * GBIT, budget_bps=1 * GBIT) == 200
    assert dilation_for(1, 11 * GBIT, budget_bps=1 * GBIT) == 20
    for hosts in (1, 2, 4, 6):
        for nic in (10 * GBIT, 25 * GBIT, 100 * GBIT, 400 * GBIT):
            k = dilation_for(hosts, nic)
            assert hosts * nic / k <= LINK_BUDGET_BPS * (1 + 1e-9)
            assert k / 10 ** math.floor(math.log10(k)) in (1, 2, 5)
            assert k == 1 or hosts * nic / (k / 2.5 if str(int(k))[0] == "5" else k / 2) > LINK_BUDGET_BPS
    with pytest.raises(ValueError):
        dilation_for(0, GBIT)


def test_registry_has_the_papers_clusters_at_8_and_16_gpus():
    assert {"a100x16-ib100", "a100x8-eth100", "a100x8-ib100"} <= set(CLUSTERS)
    assert sorted({p.ranks for p in PRESETS.values()}) == [4, 8, 16]
    four = load_preset("a100x4-ib100")  # the scaling series' smallest point: the NIC still the bottleneck
    assert (four.hosts, four.ranks_per_host, four.dilation) == (2, 2, 200)
    assert four.intra_carried_bps > four.nic_emulated_bps
    lina = load_preset("a100x16-ib100")
    assert (lina.hosts, lina.ranks_per_host, lina.ranks, lina.device_model) == (4, 4, 16, "a100")
    assert lina.nic_bps == 100 * GBIT and "InfiniBand" in lina.nic_kind
    assert load_preset("a100x8-eth100").nic_kind == "Ethernet"
    for p in PRESETS.values():
        assert p.device_model in DEVICE_MODELS
        assert p.sources["cluster"] and p.sources["intra_bps"] and p.moe.source and p.gnn.source


def test_dilated_rates():
    p = load_preset("a100x16-ib100")
    k = p.dilation
    assert k == 500
    assert p.nic_emulated_bps == 200_000_000                      # 100 Gb/s / 500
    assert p.intra_emulated_bps == round(p.intra_bps / k)
    assert p.intra_carried_bps == min(p.intra_emulated_bps, INTRA_CAP_BPS)
    assert p.intra_carried_bps > p.nic_emulated_bps                # the NIC stays the bottleneck
    assert p.predicted(10.0) == pytest.approx(0.02)
    assert p.predicted(None) is None
    p8 = load_preset("a100x8-ib100")
    assert p8.dilation == 200 and p8.nic_emulated_bps == 500_000_000
    assert "k = 200" in p8.describe() and "capped" in p8.describe()


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError) as e:
        load_preset("a100x32")
    for name in CLUSTERS:
        assert name in str(e.value)


def _workload(name: str):
    from commsched.bench.workloads import load_workload

    return load_workload(name)


def test_cluster_flag_sets_the_emulated_hosts_and_links():
    ctx, rest = bench_context(_workload("moe-train"), ["--cluster", "a100x16-ib100", "--steps", "3"],
                              euid=0, which=TOOLS, gpus=0)
    p = load_preset("a100x16-ib100")
    assert ctx.cluster is p and ctx.hosts == 4 and ctx.rate_bps == p.nic_emulated_bps
    assert ctx.info["host_rate_bps"] == p.intra_carried_bps and ctx.info["cluster"] == p.name
    assert rest == ["--steps", "3", "--nproc", "4"]
    assert ctx.flags == ("--cluster", "a100x16-ib100")
    with pytest.raises(ValueError, match="sets --bandwidth"):
        bench_context(_workload("moe-train"), ["--cluster", "a100x8-ib100", "--bandwidth", "1gbit"],
                      euid=0, which=TOOLS, gpus=0)
    with pytest.raises(ValueError, match="4 ranks per host"):
        bench_context(_workload("gnn"), ["--cluster", "a100x8-eth100", "--nproc", "2"], euid=0, which=TOOLS, gpus=0)
    with pytest.raises(ValueError, match="no --cluster"):
        bench_context(_workload("all2all"), ["--cluster", "a100x8-eth100"], euid=0, which=TOOLS, gpus=0)
    with pytest.raises(ValueError, match="choose one of"):
        bench_context(_workload("gnn"), ["--cluster", "nope"], euid=0, which=TOOLS, gpus=0)


def test_cluster_table_flags_a_host_bound_run():
    p = load_preset("a100x8-ib100")
    limit = host_cpu_limit(2, 8)
    assert limit == pytest.approx(0.125)
    md, out = cluster_table({"fifo": {"time_s": 4.0, "host_cpu_share": [0.05] * 8, "peak_rss_mib": [300.0] * 8,
                                      "startup_s": 2.0},
                             "lina": {"time_s": 2.0, "host_cpu_share": [0.05] * 7 + [0.2]}},
                            cluster=p, dilation=p.dilation, ranks=p.ranks, cores=2)
    assert out["fifo"]["predicted_s"] == pytest.approx(4.0 / 200) and not out["fifo"]["host_bound"]
    assert out["lina"]["host_bound"] and out["lina"]["host_cpu_share_max"] == 0.2
    assert "| lina | 2 | 0.01 | 0.200 | 1/8 **host-bound** |" in md
    assert "k = 200" in md


def test_resident_experts_fill_a_share_of_the_gpu_memory():
    from commsched.cluster.presets import EXPERT_MEMORY_SHARE, resident_experts

    # 80 GB, half for experts: 40 GB / (12 layers x 9.4 MB) = 353 per layer, capped at the 16 experts
    gpt2 = 2 * (2 * 768 * 3072 + 3072 + 768)
    assert EXPERT_MEMORY_SHARE == 0.5
    assert resident_experts(80e9, 16, 12, gpt2) == 16
    # a small memory limits it: 1 GB / 2 / (12 x 9.44 MB) = 4
    assert resident_experts(1e9, 16, 12, gpt2) == 4
    assert resident_experts(1e9, 16, 12, gpt2, share=1.0) == 8
    assert resident_experts(1e6, 16, 12, gpt2) == 1  # at least one
    for kw, msg in ((dict(memory_bytes=0), "memory_bytes"), (dict(expert_bytes=-1), "expert_bytes"),
                    (dict(share=1.5), "share"), (dict(experts=0), "experts and layers")):
        args = dict(memory_bytes=80e9, experts=16, layers=12, expert_bytes=gpt2)
        args.update(kw)
        with pytest.raises(ValueError, match=msg):
            resident_experts(**args)
