"""Measurements behind docs/moe_inference.md and docs/methods/moe_infer.md: planner quality,
the planner against DeepSeek's EPLB, estimation accuracy per path length, and placement
imbalance of the inference strategies on synthetic traces.

    python -m commsched.bench.moe.placement_report --out DIR [--seed S] [--quick] [--timing]
            [--only traces,planner,eplb,node,timing] [--eplb-instances N]

writes ``DIR/placement_report.json`` and ``DIR/placement_report.md`` (and prints the
markdown). The EPLB study (:func:`eplb_study`) runs ``plan_placement`` and
``eplb_placement`` on the same seeded instances (:func:`eplb_instances`) and reports
the relative difference of their maximum device loads; the node study
(:func:`node_study`) the node-aware planner against the flat one on hosts. Everything is computed from seeded synthetic data by the pure planners of
``commsched.moe.placement`` and ``popularity.py``; no process group, no timing claims beyond the
planner's own run time.

Legend: E experts, N devices, S slots per device, L layers, k experts per token.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ...moe.infer.policy import eplb_hier_layout
from ...moe.infer.popularity import DEFAULT_REPLAN_THRESHOLD, PopularityEstimator, topk_overlap
from ...moe.placement import (
    cross_rows,
    eplb_placement,
    greedy_placement,
    lower_bound,
    plan_placement,
    static_placement,
)
from ...moe.record.traces import SyntheticTraceConfig, synthetic_trace, trace_stats
from ...results import write_json

# the two trace presets: one reading of Lina's skew (busiest expert 4-5.6x the
# mean) and the paper text's (busiest 4-5.6x the *least* popular), which is milder
PRESETS: dict[str, SyntheticTraceConfig] = {
    "default": SyntheticTraceConfig(),
    "mild": SyntheticTraceConfig(zipf_s=0.6, cluster_concentration=0.5),
}


@dataclass(frozen=True)
class ReportConfig:
    seed: int = 0
    num_tokens: int = 131072          # per preset trace; 80% profiles, 20% is tested
    profile_fraction: float = 0.8
    num_devices: int = 4
    slots_per_device: int = 6         # static needs E/N = 4; two spare slots per device
    tokens_per_batch: int = 512
    max_batches: int = 40
    max_path: int = 6
    lina_path: int = 3                # Lina's l
    threshold: float = DEFAULT_REPLAN_THRESHOLD
    # the top-2k overlap moves in steps of 1/(2k): with k=2 these are all distinct rules
    thresholds: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    presets: tuple[str, ...] = ("default", "mild")
    # planner study: (E, N, S) shapes x load distributions, instances each
    planner_shapes: tuple[tuple[int, int, int], ...] = ((8, 4, 3), (16, 4, 5), (16, 4, 6),
                                                        (32, 8, 6), (64, 8, 10))
    planner_loads: tuple[str, ...] = ("zipf0.8", "zipf1.2", "lognormal1.0", "lognormal2.0")
    planner_instances: int = 100
    # EPLB study: instances (8-256 experts, 2-64 devices; Zipf 0.5-2.0, hot experts,
    # uniform) and the 256 x 64 shapes timed
    eplb_instances: int = 600
    eplb_max_experts: int = 256
    eplb_max_devices: int = 64
    eplb_timing_slots: tuple[int, ...] = (5, 6, 8)
    eplb_timing_repeats: int = 3
    # node study: instances of the EPLB generator, small enough for the full planner per host
    node_instances: int = 120
    node_max_experts: int = 64
    node_max_devices: int = 16
    node_weights: tuple[float, ...] = (0.04, 0.5)
    studies: tuple[str, ...] = ("traces", "planner", "eplb", "node")


def _random_load(kind: str, E: int, rng: np.random.Generator) -> np.ndarray:
    if kind.startswith("zipf"):
        s = float(kind[4:])
        w = np.arange(1, E + 1, dtype=np.float64) ** -s
        w = w[rng.permutation(E)]
        # a batch's token counts from that popularity (multinomial, 64 tokens per expert)
        return rng.multinomial(64 * E, w / w.sum()).astype(np.float64)
    if kind.startswith("lognormal"):
        return np.round(rng.lognormal(0.0, float(kind[9:]), E) * 100)
    raise ValueError(f"unknown load kind {kind!r}")


def planner_study(cfg: ReportConfig) -> list[dict[str, Any]]:
    """plan_placement vs the greedy vs the lower bound on random loads."""
    rows = []
    rng = np.random.default_rng(cfg.seed)
    for E, N, S in cfg.planner_shapes:
        for kind in cfg.planner_loads:
            r_plan, r_greedy, gain, t_plan = [], [], [], 0.0
            strictly = 0
            for _ in range(cfg.planner_instances):
                load = _random_load(kind, E, rng)
                lb = lower_bound(load, N, S)
                g = greedy_placement(load, N, S)
                t0 = time.perf_counter()
                p = plan_placement(load, N, S)
                t_plan += time.perf_counter() - t0
                assert p.max_load <= g.max_load + 1e-9 * max(1.0, load.sum())
                r_plan.append(p.max_load / lb)
                r_greedy.append(g.max_load / lb)
                gain.append(g.max_load / p.max_load)
                strictly += p.max_load < g.max_load * (1 - 1e-9)
            n = cfg.planner_instances
            rows.append({
                "E": E, "N": N, "S": S, "load": kind, "instances": n,
                "plan_over_lb_mean": float(np.mean(r_plan)),
                "plan_over_lb_max": float(np.max(r_plan)),
                "greedy_over_lb_mean": float(np.mean(r_greedy)),
                "greedy_over_lb_max": float(np.max(r_greedy)),
                "strictly_better_frac": strictly / n,
                "greedy_over_plan_mean": float(np.mean(gain)),
                "greedy_over_plan_max": float(np.max(gain)),
                "plan_ms_mean": 1000 * t_plan / n,
            })
    return rows


@dataclass(frozen=True)
class LoadInstance:
    """One placement problem: ``load`` [E] on ``num_devices`` x ``slots``; ``kind`` says
    how the load was drawn (``zipf1.23``, ``hot3``, ``uniform``)."""

    kind: str
    load: np.ndarray
    num_devices: int
    slots: int


_SIZES_E = (8, 16, 32, 64, 128, 256)
_SIZES_N = (2, 4, 8, 16, 32, 64)


def eplb_instances(seed: int, count: int, max_experts: int = 256,
                   max_devices: int = 64) -> list[LoadInstance]:
    """``count`` seeded instances: E from 8..max_experts and N from 2..max_devices (powers
    of two, N <= E), S = ceil(E/N) plus 0-2 spare slots; of every 10, 8 draw token counts
    (64 per expert on average) from a Zipf popularity with exponent uniform in [0.5, 2.0]
    over a random expert order, 1 from a uniform popularity with 1-3 hot experts 4-20x
    the others, 1 from a uniform popularity."""
    rng = np.random.default_rng(seed)
    Es = [e for e in _SIZES_E if e <= max_experts]
    Ns = [n for n in _SIZES_N if n <= max_devices]
    out = []
    for i in range(count):
        E = int(rng.choice(Es))
        N = int(rng.choice([n for n in Ns if n <= E]))
        S = -(-E // N) + int(rng.integers(0, 3))
        slot = i % 10
        if slot < 8:
            s = float(rng.uniform(0.5, 2.0))
            w = (np.arange(1, E + 1, dtype=np.float64) ** -s)[rng.permutation(E)]
            kind = f"zipf{s:.2f}"
        elif slot == 8:
            w = np.ones(E)
            hot = rng.choice(E, size=int(rng.integers(1, 4)), replace=False)
            w[hot] *= rng.uniform(4.0, 20.0, hot.size)
            kind = f"hot{hot.size}"
        else:
            w = np.ones(E)
            kind = "uniform"
        load = rng.multinomial(64 * E, w / w.sum()).astype(np.float64)
        out.append(LoadInstance(kind, load, N, S))
    return out


def eplb_study(cfg: ReportConfig) -> dict[str, Any]:
    """plan_placement (and the greedy) against DeepSeek's EPLB on :func:`eplb_instances`:
    relative difference of the maximum device load (positive: worse than EPLB), split by
    whether EPLB put two replicas of one expert on one device (which the even-split model
    of a Placement cannot express); and the planners' time at 256 experts x 64 devices."""
    rows: dict[str, list[float]] = {"plan": [], "greedy": []}
    dup: list[bool] = []
    kinds: list[str] = []
    t_plan = t_eplb = 0.0
    for inst in eplb_instances(cfg.seed, cfg.eplb_instances, cfg.eplb_max_experts,
                               cfg.eplb_max_devices):
        t0 = time.perf_counter()
        ep = eplb_placement(inst.load, inst.num_devices, inst.slots)
        t1 = time.perf_counter()
        p = plan_placement(inst.load, inst.num_devices, inst.slots)
        t2 = time.perf_counter()
        g = greedy_placement(inst.load, inst.num_devices, inst.slots)
        t_eplb += t1 - t0
        t_plan += t2 - t1
        rows["plan"].append(p.max_load / ep.max_load - 1.0)
        rows["greedy"].append(g.max_load / ep.max_load - 1.0)
        dup.append(ep.duplicates > 0)
        kinds.append(inst.kind.rstrip("0123456789.") or inst.kind)
    d = np.asarray(dup)
    kind_arr = np.asarray(kinds)

    def summary(x: np.ndarray) -> dict[str, Any]:
        if x.size == 0:
            return {"instances": 0}
        return {"instances": int(x.size), "worst": float(x.max()), "mean": float(x.mean()),
                "best": float(x.min()), "worse_than_0.5pct": int((x > 0.005).sum()),
                "worse": int((x > 1e-9).sum()), "better": int((x < -1e-9).sum())}

    table = []
    for name, vals in rows.items():
        v = np.asarray(vals)
        table.append({"planner": name, "subset": "all", **summary(v)})
        table.append({"planner": name, "subset": "EPLB duplicates", **summary(v[d])})
        table.append({"planner": name, "subset": "no duplicates", **summary(v[~d])})
        for k in ("zipf", "hot", "uniform"):
            table.append({"planner": name, "subset": k, **summary(v[kind_arr == k])})
    timing = []
    rng = np.random.default_rng(cfg.seed + 1)
    for S in cfg.eplb_timing_slots:
        for s in (0.8, 1.2):
            w = (np.arange(1, 257, dtype=np.float64) ** -s)[rng.permutation(256)]
            load = rng.multinomial(64 * 256, w / w.sum()).astype(np.float64)
            t: dict[str, list[float]] = {"plan": [], "greedy": [], "eplb": []}
            got: dict[str, float] = {}
            for _ in range(cfg.eplb_timing_repeats):
                for name, fn in (("plan", plan_placement), ("greedy", greedy_placement),
                                 ("eplb", eplb_placement)):
                    t0 = time.perf_counter()
                    got[name] = fn(load, 64, S).max_load
                    t[name].append(time.perf_counter() - t0)
            timing.append({"E": 256, "N": 64, "S": S, "zipf": s,
                           **{f"{k}_s": float(np.median(v)) for k, v in t.items()},
                           "plan_vs_eplb": got["plan"] / got["eplb"] - 1.0})
    n = len(dup)
    return {"instances": n, "duplicates_frac": float(d.mean()), "table": table,
            "plan_ms_mean": 1000 * t_plan / n, "eplb_ms_mean": 1000 * t_eplb / n,
            "timing": timing}


TIMING_SHAPES: tuple[tuple[int, int, int], ...] = ((16, 4, 5), (16, 4, 6), (256, 64, 5), (256, 64, 6),
                                                   (256, 64, 8))
TIMING_NODE_WEIGHT = 0.41  # the node-aware timing's weight: the 2-host bench's at 100 Mbit/s


def timing_study(cfg: ReportConfig, repeats: int = 7) -> list[dict[str, Any]]:
    """CPU time (``time.process_time``: this process only, so other jobs on the machine
    inflate it less than wall time) of ``plan_placement``, ``greedy_placement`` and
    ``eplb_placement`` on Zipf 0.8 and 1.2 token counts (64 per expert) at
    :data:`TIMING_SHAPES`; median of ``repeats`` interleaved runs each, and each planner's
    maximum device load relative to EPLB's. ``node_greedy``: the node-aware greedy (lina-node's
    online planner) on 2 hosts of N/2 devices at :data:`TIMING_NODE_WEIGHT`."""
    rng = np.random.default_rng(cfg.seed + 1)
    rows = []
    for E, N, S in TIMING_SHAPES:
        for z in (0.8, 1.2):
            w = (np.arange(1, E + 1, dtype=np.float64) ** -z)[rng.permutation(E)]
            load = rng.multinomial(64 * E, w / w.sum()).astype(np.float64)
            t: dict[str, list[float]] = {"plan": [], "greedy": [], "eplb": [], "node_greedy": []}
            got: dict[str, float] = {}
            hosts = tuple(2 * d // N for d in range(N))
            node = functools.partial(greedy_placement, device_host=hosts, cross_weight=TIMING_NODE_WEIGHT)
            for _ in range(repeats):
                for name, fn in (("plan", plan_placement), ("greedy", greedy_placement),
                                 ("eplb", eplb_placement), ("node_greedy", node)):
                    t0 = time.process_time()
                    got[name] = fn(load, N, S).max_load
                    t[name].append(time.process_time() - t0)
            rows.append({"E": E, "N": N, "S": S, "zipf": z,
                         **{f"{k}_ms": 1000 * float(np.median(v)) for k, v in t.items()},
                         "plan_vs_eplb": got["plan"] / got["eplb"] - 1.0,
                         "greedy_vs_eplb": got["greedy"] / got["eplb"] - 1.0})
    return rows


def _timing_markdown(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["### Planner time against EPLB (CPU time, one process)", "",
             "| E | N | S | Zipf | plan_placement | greedy | node-aware greedy (2 hosts) | EPLB "
             "| plan / EPLB time | plan vs EPLB max load | greedy vs EPLB max load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['E']} | {r['N']} | {r['S']} | {r['zipf']} | {r['plan_ms']:.1f} ms | "
                     f"{r['greedy_ms']:.1f} ms | {r['node_greedy_ms']:.1f} ms | {r['eplb_ms']:.1f} ms | "
                     f"{r['plan_ms'] / r['eplb_ms']:.1f}x | "
                     f"{_pct(r['plan_vs_eplb'])} | {_pct(r['greedy_vs_eplb'])} |")
    lines.append("")
    return lines


def node_study(cfg: ReportConfig) -> dict[str, Any]:
    """Node-aware placement against the flat planner and EPLB's hierarchical policy on
    :func:`eplb_instances` (up to ``node_max_experts`` experts, ``node_max_devices`` devices)
    laid out on 2 hosts (and 4 where N >= 8) of consecutive devices, tokens spread evenly
    over the devices (:func:`even_origin`): per weight, the node-aware plan's maximum
    device load and rows through the busiest host link (:func:`cross_rows`) relative to
    the flat plan's (the flat split: every expert's tokens evenly over all its replicas)."""
    rows: dict[tuple, list[tuple[float, float]]] = {}
    t_node = 0.0
    n_node = 0
    for inst in eplb_instances(cfg.seed, cfg.node_instances, cfg.node_max_experts, cfg.node_max_devices):
        N, S, load = inst.num_devices, inst.slots, inst.load
        flat = plan_placement(load, N, S)
        for H in (2, 4):
            if N < 2 * H and H > 2 or N % H:
                continue
            hosts = tuple(d * H // N for d in range(N))
            f_cross = max(x.max() for x in cross_rows(flat, load, hosts))
            hier = eplb_hier_layout(load, N, S, hosts)
            rows.setdefault((H, "eplb-hier"), []).append(
                (hier.max_load / flat.max_load, max(x.max() for x in cross_rows(hier, load, hosts)) / f_cross))
            for w in cfg.node_weights:
                t0 = time.perf_counter()
                node = plan_placement(load, N, S, device_host=hosts, cross_weight=w)
                t_node += time.perf_counter() - t0
                n_node += 1
                rows.setdefault((H, f"node w={w:g}"), []).append(
                    (node.max_load / flat.max_load, max(x.max() for x in cross_rows(node, load, hosts)) / f_cross))
    table = []
    for (H, name), v in rows.items():
        a = np.asarray(v)
        table.append({"hosts": H, "planner": name, "instances": len(v),
                      "load_mean": float(a[:, 0].mean()), "load_worst": float(a[:, 0].max()),
                      "cross_mean": float(a[:, 1].mean()), "cross_worst": float(a[:, 1].max())})
    return {"table": table, "node_ms_mean": 1000 * t_node / max(1, n_node)}


def _node_markdown(nd: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = ["### Node-aware placement against the flat planner", "",
             f"`eplb_instances(seed={cfg['seed']})`, {cfg['node_instances']} drawn, up to "
             f"{cfg['node_max_experts']} experts and {cfg['node_max_devices']} devices, on H hosts of "
             "consecutive devices; tokens spread evenly over the devices. Ratios to the flat "
             "`plan_placement` (flat split): maximum device load, and rows through the busiest "
             "host link (the larger of the rows leaving and entering a host).", "",
             "| hosts | planner | instances | max load mean | max load worst | cross rows mean | cross rows worst |",
             "|---|---|---|---|---|---|---|"]
    for r in nd["table"]:
        lines.append(f"| {r['hosts']} | {r['planner']} | {r['instances']} | {_f(r['load_mean'], 4)} | "
                     f"{_f(r['load_worst'], 4)} | {_f(r['cross_mean'], 3)} | {_f(r['cross_worst'], 3)} |")
    lines += ["", f"Mean time per node-aware plan: {nd['node_ms_mean']:.0f} ms.", ""]
    return lines


def trace_study(name: str, tcfg: SyntheticTraceConfig, cfg: ReportConfig) -> dict[str, Any]:
    """Estimation accuracy per path length and imbalance per strategy on one preset."""
    tcfg = replace(tcfg, num_tokens=cfg.num_tokens)
    N, S, k = cfg.num_devices, cfg.slots_per_device, tcfg.k
    trace = synthetic_trace(tcfg, cfg.seed)
    prof, test = trace.split(cfg.profile_fraction)
    batches = test.batches(cfg.tokens_per_batch)[:cfg.max_batches]
    est = PopularityEstimator.fit(prof, max_path=cfg.max_path)
    hist_LE = est.marginal_LE  # historical mean assignments per token (eplb's input)
    L, E = trace.num_layers, trace.num_experts
    eplb_layout = [plan_placement(hist_LE[j], N, S) for j in range(L)]

    paths = list(range(1, cfg.max_path + 1))
    acc_k: dict[int, list[float]] = {m: [] for m in paths}
    acc_2k: dict[int, list[float]] = {m: [] for m in paths}
    acc_marg_k, acc_marg_2k = [], []
    imb: dict[str, list[float]] = {s: [] for s in ("static", "eplb", "lina-phase1", "oracle-greedy",
                                                   "oracle")}
    overlap2k, oracle_imb, phase1_imb, lbs = [], [], [], []
    for b in batches:
        actual_LE = b.loads().astype(np.float64)
        for j in range(1, L):
            a = actual_LE[j]
            for m in paths:
                e = est.estimate_load(b.top1, j, m)
                acc_k[m].append(topk_overlap(e, a, k))
                acc_2k[m].append(topk_overlap(e, a, 2 * k))
            acc_marg_k.append(topk_overlap(hist_LE[j], a, k))
            acc_marg_2k.append(topk_overlap(hist_LE[j], a, 2 * k))
            e = est.estimate_load(b.top1, j, cfg.lina_path)
            p1 = plan_placement(e, N, S).with_load(a)
            orc = plan_placement(a, N, S)
            lb = lower_bound(a, N, S)
            imb["static"].append(static_placement(E, N, a).imbalance)
            imb["eplb"].append(eplb_layout[j].with_load(a).imbalance)
            imb["lina-phase1"].append(p1.imbalance)
            imb["oracle-greedy"].append(greedy_placement(a, N, S).imbalance)
            imb["oracle"].append(orc.imbalance)
            lbs.append(lb / (a.sum() / N))
            overlap2k.append(topk_overlap(e, a, 2 * k))
            phase1_imb.append(p1.imbalance)
            oracle_imb.append(orc.imbalance)
    ov = np.asarray(overlap2k)
    p1a, ora = np.asarray(phase1_imb), np.asarray(oracle_imb)
    sweep = []
    for t in cfg.thresholds:
        replan = ov < t
        two = np.where(replan, ora, p1a)
        sweep.append({"threshold": t, "replan_frac": float(replan.mean()),
                      "imbalance_mean": float(two.mean()),
                      "imbalance_p95": float(np.percentile(two, 95))})
    chosen = ov < cfg.threshold
    imb["lina"] = list(np.where(chosen, ora, p1a))
    return {
        "preset": name,
        "trace_config": asdict(tcfg),
        "seed": cfg.seed,
        "stats": trace_stats(trace, cfg.tokens_per_batch),
        "profile_tokens": prof.num_tokens,
        "test_batches": len(batches),
        "tokens_per_batch": cfg.tokens_per_batch,
        "layers_scored": f"1..{L - 1}",
        "accuracy_topk": {m: float(np.mean(v)) for m, v in acc_k.items()},
        "accuracy_top2k": {m: float(np.mean(v)) for m, v in acc_2k.items()},
        "accuracy_marginal_topk": float(np.mean(acc_marg_k)),
        "accuracy_marginal_top2k": float(np.mean(acc_marg_2k)),
        "imbalance_mean": {s: float(np.mean(v)) for s, v in imb.items()},
        "imbalance_p95": {s: float(np.percentile(v, 95)) for s, v in imb.items()},
        "lower_bound_imbalance_mean": float(np.mean(lbs)),
        "lina_threshold": cfg.threshold,
        "lina_replan_frac": float(chosen.mean()),
        "threshold_sweep": sweep,
    }


def run_report(cfg: ReportConfig) -> dict[str, Any]:
    t0 = time.perf_counter()
    out: dict[str, Any] = {"config": asdict(cfg)}
    if "traces" in cfg.studies:
        out["traces"] = [trace_study(n, PRESETS[n], cfg) for n in cfg.presets]
    if "planner" in cfg.studies:
        out["planner"] = planner_study(cfg)
    if "eplb" in cfg.studies:
        out["eplb"] = eplb_study(cfg)
    if "node" in cfg.studies:
        out["node"] = node_study(cfg)
    if "timing" in cfg.studies:
        out["timing"] = timing_study(cfg)
    out["wall_clock_s"] = time.perf_counter() - t0
    return out


def _f(x: float, d: int = 3) -> str:
    return f"{x:.{d}f}"


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def _eplb_markdown(ep: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    lines = ["### plan_placement vs DeepSeek's EPLB", "",
             f"{ep['instances']} instances (`eplb_instances(seed={cfg['seed']})`: "
             f"8-{cfg['eplb_max_experts']} experts, 2-{cfg['eplb_max_devices']} devices, ceil(E/N) + 0-2 slots per device; 80% Zipf 0.5-2.0, 10% hot "
             "experts, 10% uniform; token counts, 64 per expert on average). Relative "
             "difference of the maximum device load against `eplb_placement` (global "
             "policy); positive is worse than EPLB. EPLB put two replicas of one expert on "
             f"one device in {100 * ep['duplicates_frac']:.0f}% of them (the planner may too: a "
             "device may hold several of an expert's equal shares, and EPLB's layout is one of "
             "its starts).", "",
             "| planner | instances | worst | mean | best | worse by > 0.5% | worse | better |",
             "|---|---|---|---|---|---|---|---|"]
    for r in ep["table"]:
        if r["instances"] == 0:
            continue
        lines.append(f"| {r['planner']} ({r['subset']}) | {r['instances']} | {_pct(r['worst'])} | "
                     f"{_pct(r['mean'])} | {_pct(r['best'])} | {r['worse_than_0.5pct']} | "
                     f"{r['worse']} | {r['better']} |")
    lines += ["", f"Mean time per instance: plan_placement {ep['plan_ms_mean']:.1f} ms, "
              f"eplb_placement {ep['eplb_ms_mean']:.1f} ms.", "",
              "Time at 256 experts x 64 devices (median of "
              f"{cfg['eplb_timing_repeats']} runs, one process):", "",
              "| S | Zipf | plan_placement | greedy | EPLB | plan vs EPLB max load |",
              "|---|---|---|---|---|---|"]
    for t in ep["timing"]:
        lines.append(f"| {t['S']} | {t['zipf']} | {t['plan_s']:.2f} s | {1000 * t['greedy_s']:.0f} ms "
                     f"| {1000 * t['eplb_s']:.0f} ms | {_pct(t['plan_vs_eplb'])} |")
    lines.append("")
    return lines


def to_markdown(rep: dict[str, Any], command: str) -> str:
    cfg = rep["config"]
    lines = [f"Produced by `{command}` ({rep['wall_clock_s']:.0f} s).", ""]
    for tr in rep.get("traces", []):
        st, tc = tr["stats"], tr["trace_config"]
        lines += [
            f"### Trace preset `{tr['preset']}`",
            "",
            f"E={tc['num_experts']}, L={tc['num_layers']}, k={tc['k']}, {tc['popularity']} "
            f"s={tc['zipf_s']}, stickiness p={tc['stickiness']}, cluster concentration "
            f"{tc['cluster_concentration']}, seed {tr['seed']}: {int(st['tokens'])} tokens, "
            f"{tr['profile_tokens']} profiled, {tr['test_batches']} test batches of "
            f">= {tr['tokens_per_batch']} tokens, layers {tr['layers_scored']} scored.",
            "",
            f"Measured skew: busiest expert {_f(st['max_over_mean'], 2)}x the mean per layer "
            f"({_f(st['batch_max_over_mean'], 2)}x per batch), "
            f"{_f(st['max_over_min'], 1)}x the least loaded; top-1 same-expert stickiness "
            f"{_f(st['stickiness'])}.",
            "",
            "Estimation accuracy (overlap of estimated and actual top experts of a batch):",
            "",
            "| path length l | " + " | ".join(str(m) for m in tr["accuracy_topk"]) +
            " | marginal (no path) |",
            "|---|" + "---|" * (len(tr["accuracy_topk"]) + 1),
            f"| top-k (k={tc['k']}) | " + " | ".join(_f(v) for v in tr["accuracy_topk"].values())
            + f" | {_f(tr['accuracy_marginal_topk'])} |",
            "| top-2k | " + " | ".join(_f(v) for v in tr["accuracy_top2k"].values())
            + f" | {_f(tr['accuracy_marginal_top2k'])} |",
            "",
            f"Imbalance (max/mean device load) on N={cfg['num_devices']} devices x "
            f"S={cfg['slots_per_device']} slots, over (batch, layer); lina uses l="
            f"{cfg['lina_path']} and threshold {tr['lina_threshold']} "
            f"(re-plans {100 * tr['lina_replan_frac']:.1f}% of layers); lower bound "
            f"{_f(tr['lower_bound_imbalance_mean'])} on average:",
            "",
            "| strategy | mean | p95 |",
            "|---|---|---|",
        ]
        for s in ("static", "eplb", "lina-phase1", "lina", "oracle-greedy", "oracle"):
            lines.append(f"| {s} | {_f(tr['imbalance_mean'][s])} | {_f(tr['imbalance_p95'][s])} |")
        lines += ["", "Phase-2 threshold sweep (re-plan when top-2k overlap < threshold; the "
                  f"overlap moves in steps of 1/{2 * tc['k']}):", "",
                  "| threshold | re-planned layers | imbalance mean | imbalance p95 |",
                  "|---|---|---|---|"]
        for row in tr["threshold_sweep"]:
            lines.append(f"| {row['threshold']} | {100 * row['replan_frac']:.1f}% | "
                         f"{_f(row['imbalance_mean'])} | {_f(row['imbalance_p95'])} |")
        lines.append("")
    if "planner" in rep:
        lines += ["### Planner vs greedy vs lower bound (random loads)", "",
                  f"{cfg['planner_instances']} instances per row; zipfS: multinomial token counts "
                  "(64 per expert on average) from Zipf popularity with exponent S; lognormalS: "
                  "log-normal loads with sigma S.", "",
                  "| E | N | S | load | plan/LB mean | plan/LB max | greedy/LB mean | greedy/LB max "
                  "| strictly better | greedy/plan mean | greedy/plan max | ms/plan |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rep["planner"]:
            lines.append(
                f"| {r['E']} | {r['N']} | {r['S']} | {r['load']} | {_f(r['plan_over_lb_mean'], 4)} | "
                f"{_f(r['plan_over_lb_max'], 4)} | {_f(r['greedy_over_lb_mean'], 4)} | "
                f"{_f(r['greedy_over_lb_max'], 4)} | {100 * r['strictly_better_frac']:.0f}% | "
                f"{_f(r['greedy_over_plan_mean'], 4)} | {_f(r['greedy_over_plan_max'], 4)} | "
                f"{_f(r['plan_ms_mean'], 1)} |")
        lines.append("")
    if "eplb" in rep:
        lines += _eplb_markdown(rep["eplb"], cfg)
    if "node" in rep:
        lines += _node_markdown(rep["node"], cfg)
    if "timing" in rep:
        lines += _timing_markdown(rep["timing"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commsched.bench.moe.placement_report",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the report files")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--devices", type=int, default=ReportConfig.num_devices)
    ap.add_argument("--slots", type=int, default=ReportConfig.slots_per_device)
    ap.add_argument("--threshold", type=float, default=ReportConfig.threshold,
                    help="phase-2 re-plan threshold on the top-2k overlap")
    ap.add_argument("--only", default=",".join(ReportConfig.studies),
                    help="comma-separated studies to run: traces, planner, eplb, node, timing")
    ap.add_argument("--eplb-instances", type=int, default=ReportConfig.eplb_instances,
                    help="instances of the plan_placement vs EPLB study")
    ap.add_argument("--timing", action="store_true",
                    help="add the planner timing study (CPU time of plan_placement, the greedy and EPLB at "
                         "16 x 4 and 256 x 64); alone with --only timing")
    ap.add_argument("--quick", action="store_true",
                    help="a small run (fewer tokens, batches and planner instances)")
    a = ap.parse_args(argv)
    studies = tuple(x.strip() for x in a.only.split(",") if x.strip())
    if a.timing and "timing" not in studies:
        studies += ("timing",)
    unknown = sorted(set(studies) - set(ReportConfig.studies) - {"timing"})
    if unknown or not studies:
        ap.error(f"--only takes a comma-separated list of {', '.join(ReportConfig.studies)}; "
                 f"got {a.only!r}")
    if a.eplb_instances < 1:
        ap.error(f"--eplb-instances must be at least 1, got {a.eplb_instances}")
    cfg = ReportConfig(seed=a.seed, num_devices=a.devices, slots_per_device=a.slots,
                       threshold=a.threshold, studies=studies, eplb_instances=a.eplb_instances)
    if a.quick:
        cfg = replace(cfg, num_tokens=8192, max_batches=8, planner_instances=10,
                      eplb_instances=min(cfg.eplb_instances, 50), eplb_timing_slots=(5,),
                      eplb_timing_repeats=1, node_instances=10)
    rep = run_report(cfg)
    a.out.mkdir(parents=True, exist_ok=True)
    command = "python -m commsched.bench.moe.placement_report " + " ".join(
        x for x in (argv if argv is not None else sys.argv[1:]))
    md = to_markdown(rep, command)
    write_json(a.out / "placement_report.json", rep, indent=1)
    (a.out / "placement_report.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
