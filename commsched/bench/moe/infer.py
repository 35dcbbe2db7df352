"""``commsched bench moe-infer``: static, eplb, lina and oracle expert placement side by side.

Four variants of the same inference run (:mod:`commsched.moe.infer`, same trace or
model, same batches, same seed), differing only in ``--placement``:

* ``static`` -- E/N experts per device, as DeepSpeed serves them (the baseline);
* ``eplb``   -- replicas and packing from the historical mean load, fixed;
* ``lina``   -- phase 1 from the cross-layer path estimate, phase-2 re-plan after gating
  when the top-2k overlap falls below the threshold;
* ``oracle`` -- planned from the actual gating of every layer.

On emulated hosts (``--hosts K``) two more: ``eplb-hier`` (EPLB's hierarchical policy on
the hosts) and ``lina-node`` (lina with the node-aware planner, its cross-host weight
from the emulated link rate, ``--inter-rate``, unless ``--cross-weight`` is given); the
summary then adds a table of p95 latency, imbalance and the bytes the row exchanges sent
between and within hosts (counted per peer by the exchanges, ``inter_host_bytes_per_batch``).

The default configuration (stated in docs/methods/moe_infer.md) replays the synthetic trace
(16 experts, 12 layers, top-2; busiest expert about 4.2x the mean) on an *emulated
accelerator* per rank: rows travel through the real all-to-all, and a device is busy
``--us-per-row`` microseconds per row it computes, so that expert compute dominates a
device's time as on GPUs serving MoE, and four ranks sharing two cores do not distort
it (a sleeping device leaves the CPU to the others). ``--compute real`` runs real FFNs
instead; ``--driver model --checkpoint FILE`` runs the trained language model.

The summary adds, per variant, the latency ratio to static and to oracle measured in
each interleaved repeat, the goal checks (lina's p95 at least 1.6x below
static and within 15% of oracle, mean imbalance at most 1.25), and ``heatmap.png``:
the mean expert load per layer, and per variant the mean number of replicas of each
expert per layer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from ...configurable import cli_fields
from ...dist import DEVICE_CHOICES
from ...moe.infer.cli import CLI_DEFAULTS, config_from_args
from ...moe.infer.cli import build_parser as infer_parser
from ...moe.infer.config import InferConfig
from ...moe.infer.policy import STRATEGIES, StrategyConfig
from ...results import median
from ..plots import pyplot, save_figure
from ..runner import Variant, Workload, median_of

# one variant per placement strategy; the two that know hosts run when there are hosts
HOST_VARIANTS = ("eplb-hier", "lina-node")
VARIANTS = tuple(v for v in STRATEGIES if v not in HOST_VARIANTS)
HOSTS_ORDER = ("static", "eplb", "eplb-hier", "lina", "lina-node", "oracle")
DEFAULTS = {
    "driver": "trace", "compute": "emulated", "batches": 22, "warmup": 2, "tokens_per_batch": 2048,
    "us_per_row": 100.0, "load_ms": None, "d_model": 64, "experts": 16, "layers": 12, "k": 2,
}
KEY_METRICS = ("latency_ms.p50", "latency_ms.p95", "latency_ms.p99", "model_latency_ms.p95", "imbalance",
               "estimation_accuracy", "replan_rate", "expert_loads_per_batch", "inter_host_bytes_per_batch")
GOAL_SPEEDUP, GOAL_ORACLE, GOAL_IMBALANCE = 1.6, 1.15, 1.25
LOAD_MS_PLAIN = 1.0  # an expert load without a GPU model (--load-ms not given)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    g = p.add_argument_group("inference run (all variants)")
    g.add_argument("--driver", choices=("trace", "model"), default=d["driver"])
    g.add_argument("--compute", choices=("emulated", "real"), default=None,
                   help="emulated device (default for traces) or real FFNs (always for the model)")
    g.add_argument("--batches", type=int, default=d["batches"])
    g.add_argument("--warmup", type=int, default=d["warmup"])
    g.add_argument("--slots", type=int, default=None, help="experts of one layer per device (default ceil(E/N)+2)")
    g.add_argument("--resident", type=int, default=None,
                   help="experts of one layer a device keeps in memory (default --slots; --cluster: from the "
                        "GPU's memory)")
    g.add_argument("--threshold", type=float, default=None, help="lina phase-2 threshold (default: the runtime's)")
    g.add_argument("--path-length", type=int, default=None, help="lina path length l (default 3)")
    g.add_argument("--online-planner", choices=("greedy", "full"), default=None)
    g.add_argument("--cross-weight", type=float, default=None,
                   help="lina-node's weight of a row crossing hosts (default: from the topology, the row "
                        "cost and, with --hosts and --bandwidth, the emulated link rate)")
    g.add_argument("--exchange", choices=("pipelined", "sequential"), default=None,
                   help="runtime exchange (default: the runtime's, pipelined); sequential is the first runtime")
    g.add_argument("--lina-thresholds", default="",
                   help="comma-separated extra phase-2 thresholds: adds a variant lina@T for each "
                        "(e.g. 0 = phase 1 only)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="where every variant's experts compute (--compute emulated: always the CPU)")
    g = p.add_argument_group("emulated device")
    g.add_argument("--us-per-row", type=float, default=d["us_per_row"])
    g.add_argument("--load-ms", type=float, default=d["load_ms"],
                   help=f"one expert's load, ms (default: with --device-model the expert's bytes over the GPU's "
                        f"host link, else {LOAD_MS_PLAIN})")
    g.add_argument("--device-model", default=None,
                   help="GPU model of the emulated device (a100, h100, h200 or a file; --cluster sets it): each "
                        "expert's rows cost its FFN's GEMMs (--d-model x --expert-hidden) on it")
    g.add_argument("--dilation", type=float, default=None, help="time dilation k, with --device-model")
    g = p.add_argument_group("trace driver")
    g.add_argument("--trace", default=None, help="routing trace npz (default: synthetic)")
    g.add_argument("--tokens-per-batch", type=int, default=d["tokens_per_batch"])
    g.add_argument("--d-model", type=int, default=d["d_model"], help="floats per token on the wire")
    g.add_argument("--expert-hidden", type=int, default=None, help="FFN width with --compute real")
    g.add_argument("--experts", type=int, default=d["experts"])
    g.add_argument("--layers", type=int, default=d["layers"])
    g.add_argument("--k", type=int, default=d["k"])
    g.add_argument("--zipf", type=float, default=None)
    g = p.add_argument_group("model driver")
    g.add_argument("--checkpoint", default=None)
    g.add_argument("--corpus", default=None)
    g.add_argument("--batch-size", type=int, default=None, help="sequences per rank per batch")
    g.add_argument("--profile-trace", default=None)


def _common(a: argparse.Namespace) -> list[str]:
    out: list = ["--driver", a.driver, "--batches", a.batches, "--warmup", a.warmup, "--seed", a.seed,
                 "--device", a.device, "--us-per-row", a.us_per_row]
    load_ms = a.load_ms  # without a GPU model to derive it from: the bench's set figure
    if load_ms is None and getattr(a, "device_model", None) is None:
        load_ms = LOAD_MS_PLAIN
    opt = {"--compute": a.compute, "--slots": a.slots, "--exchange": a.exchange, "--load-ms": load_ms,
           "--resident": getattr(a, "resident", None),
           "--device-model": getattr(a, "device_model", None), "--dilation": getattr(a, "dilation", None)}
    if a.driver == "trace":
        out += ["--tokens-per-batch", a.tokens_per_batch, "--d-model", a.d_model, "--experts", a.experts,
                "--layers", a.layers, "--k", a.k]
        opt.update({"--trace": a.trace, "--zipf": a.zipf, "--expert-hidden": a.expert_hidden})
    else:
        opt.update({"--checkpoint": a.checkpoint, "--corpus": a.corpus, "--batch-size": a.batch_size,
                    "--profile-trace": a.profile_trace})
    for k, v in opt.items():
        if v is not None:
            out += [k, v]
    return [str(x) for x in out]


def base_config(a: argparse.Namespace) -> InferConfig:
    """The run every variant shares: the bench's options as the inference command line reads
    them (its own parser and :func:`~commsched.moe.infer.cli.config_from_args`)."""
    return config_from_args(infer_parser().parse_args([*_common(a), "--out", "-"]))


def _strategy(name: str, options: dict) -> StrategyConfig:
    """``--placement name``'s config from the bench's strategy options (field -> value, None:
    not given) that it has (the command line refuses another strategy's)."""
    cls = STRATEGIES[name]
    own = {f.name for f in cli_fields(cls)}
    return cls(**{k: v for k, v in options.items() if k in own and v is not None})


def _variants(a: argparse.Namespace) -> list[Variant]:
    if a.driver == "model" and not a.checkpoint:
        raise ValueError("--driver model needs --checkpoint (python -m commsched.moe.record --train-steps N "
                         "--save-checkpoint FILE --out TRACE)")
    if a.device == "cuda" and a.driver == "trace" and a.compute in (None, "emulated"):
        raise ValueError("--device cuda runs real expert FFNs: add --compute real (the emulated device is the "
                         "CPU model of an accelerator)")
    base = base_config(a)
    hosts = getattr(a, "hosts", 1) or 1
    names = HOSTS_ORDER if hosts > 1 else VARIANTS
    rate = getattr(a, "rate_bps", None)
    opts = {"threshold": a.threshold, "path_length": a.path_length, "online_planner": a.online_planner,
            "inter_rate": f"{rate}bit" if hosts > 1 and rate and a.cross_weight is None else None,
            "cross_weight": a.cross_weight}

    def placed(label: str, name: str, **options) -> Variant:
        cfg = base.replace(placement=name, strategy=_strategy(name, {**opts, **options}))
        return Variant(label, "commsched.moe.infer", config=cfg, defaults=CLI_DEFAULTS)

    out = [placed(v, v) for v in names]
    for t in (x.strip() for x in a.lina_thresholds.split(",") if x.strip()):
        try:
            thr = float(t)
        except ValueError:
            raise ValueError(f"--lina-thresholds: {t!r} is not a number") from None
        if not 0.0 <= thr <= 1.0:
            raise ValueError(f"--lina-thresholds: {thr} is outside [0, 1]")
        out.append(placed(f"lina@{t}", "lina", threshold=thr))
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _summarize(runs: dict[str, list[dict]], args: argparse.Namespace, out: Path) -> dict:
    # device-time ratios use critical_rows (the busiest device's rows summed over layers):
    # the same ratio as the model latency, without the per-row cost a real-FFN run times
    med = {v: {k: median_of(rs, k) for k in ("latency_ms.p95", "latency_ms.p50", "critical_rows.p95",
                                              "imbalance")} for v, rs in runs.items()}
    extra: dict = {}
    # per interleaved repeat: the ratio of each variant's p95 to static's and to oracle's
    per_rep: dict[str, dict[str, list[float]]] = {}
    n = min(len(rs) for rs in runs.values()) if runs else 0
    for v, rs in runs.items():
        per_rep[v] = {"static_over_variant_p95": [], "variant_over_oracle_p95": []}
        for i in range(n):
            p = rs[i]["latency_ms"]["p95"]
            if "static" in runs:
                per_rep[v]["static_over_variant_p95"].append(runs["static"][i]["latency_ms"]["p95"] / p)
            if "oracle" in runs:
                per_rep[v]["variant_over_oracle_p95"].append(p / runs["oracle"][i]["latency_ms"]["p95"])
    extra["per_repeat_ratios"] = per_rep
    # the repeats of a variant serve the same batches with the same decisions, so the
    # median over repeats of each batch's latency removes one-off stalls of the shared
    # machine; p95 over batches of those medians:
    denoised: dict[str, dict[str, float]] = {}
    for v, rs in runs.items():
        series = [r.get("latency_ms_per_batch") for r in rs]
        if series and all(series) and len({len(x) for x in series}) == 1:
            med_b = np.median(np.asarray(series, dtype=np.float64), axis=0)
            denoised[v] = {q: float(np.percentile(med_b, int(q[1:]))) for q in ("p50", "p95", "p99")}
    extra["latency_ms_batch_median_over_repeats"] = denoised
    rows = ["| variant | static p95 / variant p95 (each repeat) | variant p95 / oracle p95 (each repeat) | "
            "device time p95 (model latency), static / variant | imbalance |", "|---|---|---|---|---|"]
    for v in runs:
        r = per_rep[v]
        ml = _ratio(med.get("static", {}).get("critical_rows.p95"), med[v]["critical_rows.p95"])
        rows.append(f"| {v} | {', '.join(f'{x:.3f}' for x in r['static_over_variant_p95']) or '-'} | "
                    f"{', '.join(f'{x:.3f}' for x in r['variant_over_oracle_p95']) or '-'} | "
                    f"{ml:.3f} | {med[v]['imbalance']:.3f} |" if ml else f"| {v} | - | - | - | - |")
    tables = {"ratios per interleaved repeat": "\n".join(rows)}
    if denoised:
        d_rows = ["| variant | p50 | p95 | p99 | static p95 / variant p95 |", "|---|---|---|---|---|"]
        for v, d in denoised.items():
            r = _ratio(denoised.get("static", {}).get("p95"), d["p95"])
            d_rows.append(f"| {v} | {d['p50']:.0f} | {d['p95']:.0f} | {d['p99']:.0f} | "
                          + (f"{r:.3f}" if r else "-") + " |")
        tables["latency (ms) over batches of each batch's median over the repeats"] = "\n".join(d_rows)
    if {"static", "lina", "oracle"} <= set(runs):
        sp = _ratio(med["static"]["latency_ms.p95"], med["lina"]["latency_ms.p95"])
        orc = _ratio(med["lina"]["latency_ms.p95"], med["oracle"]["latency_ms.p95"])
        msp = _ratio(med["static"]["critical_rows.p95"], med["lina"]["critical_rows.p95"])
        morc = _ratio(med["lina"]["critical_rows.p95"], med["oracle"]["critical_rows.p95"])
        imb = med["lina"]["imbalance"]
        dn = extra["latency_ms_batch_median_over_repeats"]
        dsp = _ratio(dn.get("static", {}).get("p95"), dn.get("lina", {}).get("p95"))
        dorc = _ratio(dn.get("lina", {}).get("p95"), dn.get("oracle", {}).get("p95"))
        goals = {
            "lina_p95_speedup_vs_static": {"measured": sp, "goal": f">= {GOAL_SPEEDUP}",
                                           "met": bool(sp and sp >= GOAL_SPEEDUP)},
            "lina_p95_over_oracle": {"measured": orc, "goal": f"<= {GOAL_ORACLE}",
                                     "met": bool(orc and orc <= GOAL_ORACLE)},
            "lina_p95_speedup_vs_static (batch medians over repeats)": {
                "measured": dsp, "goal": f">= {GOAL_SPEEDUP}", "met": bool(dsp and dsp >= GOAL_SPEEDUP)},
            "lina_p95_over_oracle (batch medians over repeats)": {
                "measured": dorc, "goal": f"<= {GOAL_ORACLE}", "met": bool(dorc and dorc <= GOAL_ORACLE)},
            "lina_mean_imbalance": {"measured": imb, "goal": f"<= {GOAL_IMBALANCE}",
                                    "met": bool(imb and imb <= GOAL_IMBALANCE)},
            "model_latency_p95_speedup_vs_static": {"measured": msp, "goal": f">= {GOAL_SPEEDUP}",
                                                    "met": bool(msp and msp >= GOAL_SPEEDUP)},
            "model_latency_p95_over_oracle": {"measured": morc, "goal": f"<= {GOAL_ORACLE}",
                                              "met": bool(morc and morc <= GOAL_ORACLE)},
        }
        extra["goals"] = goals
        g_rows = ["| goal | measured (medians over repeats) | target | met |", "|---|---|---|---|"]
        for k, g in goals.items():
            m = g["measured"]
            g_rows.append(f"| {k} | {m:.3f} | {g['goal']} | {'yes' if g['met'] else 'no'} |" if m is not None
                          else f"| {k} | - | {g['goal']} | no |")
        tables["goals"] = "\n".join(g_rows)
    if any(rs and (rs[0].get("hosts") or 1) > 1 for rs in runs.values()):
        tables[HOSTS_TABLE], extra["inter_host_bytes_per_batch"] = hosts_table(runs)
    if getattr(args, "device_model", None) is not None:
        tables["Emulated cluster"], extra["cluster"] = _cluster_section(runs, args)
    extra["extra_tables"] = tables
    try:
        extra["plots"] = [str(plot_heatmap(runs, out / "heatmap.png"))]
    except Exception as e:  # noqa: BLE001 - a plot must not lose the measured summary
        extra["plot_error"] = f"{type(e).__name__}: {e}"
    breakdown = {v: {k: median([r["breakdown_s"][k] for r in rs]) for k in rs[0]["breakdown_s"]}
                 for v, rs in runs.items() if rs and "breakdown_s" in rs[0]}
    extra["breakdown_ms"] = {v: {k: 1e3 * x for k, x in b.items()} for v, b in breakdown.items()}
    return extra


def cluster_defaults(preset) -> dict:
    """The bench's option defaults on a cluster preset (:mod:`commsched.cluster.presets`):
    the trace replayed on the preset's device model at its k, with the preset's expert layers
    (the width and FFN of its MoE model; 16 experts, as the Lina paper's 16-expert models);
    expert loads cost the expert's bytes over the GPU's host link, and each device keeps as
    many experts of a layer resident as its memory holds
    (:func:`~commsched.cluster.presets.resident_experts`)."""
    from ...cluster.device import dtype_name, load_device_model
    from ...cluster.presets import resident_experts
    from ...moe.infer.banks import expert_bytes

    gpu = load_device_model(preset.device_model)
    b = 4 if dtype_name(preset.moe.dtype) in ("fp32", "tf32") else 2
    resident = None if gpu.memory_bytes is None else resident_experts(
        gpu.memory_bytes, preset.infer_experts, preset.infer_layers,
        expert_bytes(preset.moe.d_model, preset.moe.expert_hidden, b))
    return {"compute": "emulated", "device_model": preset.device_model, "dilation": preset.dilation,
            "device": "cpu", "experts": preset.infer_experts, "layers": preset.infer_layers,
            "tokens_per_batch": preset.infer_tokens_per_batch, "d_model": preset.moe.d_model,
            "expert_hidden": preset.moe.expert_hidden, "resident": resident}


def _cluster_section(runs: dict[str, list[dict]], args: argparse.Namespace) -> tuple[str, dict]:
    """The emulated cluster's table: per variant its p95 latency per batch measured and on the
    real cluster (/ k), each rank's host CPU share of the serving loop, memory and set-up
    (``host`` in its metrics), and the whole run's CPU share (``bench_cpu_share``)."""
    import os

    from ..emulation import cluster_table

    recs = {v: {"time_s": (median_of(rs, "latency_ms.p95") or 0) / 1e3 or None,
                "host_cpu_share": [x for r in rs for x in (r.get("host") or {}).get("host_cpu_share") or []],
                "peak_rss_mib": [x for r in rs for x in (r.get("host") or {}).get("peak_rss_mib") or []],
                "startup_s": median_of(rs, "host.startup_s"),
                "run_cpu_share": median_of(rs, "bench_cpu_share")} for v, rs in runs.items()}
    table, out = cluster_table(recs, cluster=getattr(args, "cluster", None), dilation=args.dilation or 1.0,
                               ranks=args.nproc * (getattr(args, "hosts", 1) or 1), cores=os.cpu_count() or 1,
                               unit="p95 batch")
    return table, out


HOSTS_TABLE = "hosts: latency, imbalance and bytes measured by the row exchanges"


def hosts_table(runs: dict[str, list[dict]]) -> tuple[str, dict[str, float | None]]:
    """The markdown table of a run on hosts (p95 latency, imbalance, inter- and intra-host
    bytes a batch, inter-host bytes against static; medians over the repeats) and the
    inter-host bytes per variant."""
    ib = {v: median_of(rs, "inter_host_bytes_per_batch") for v, rs in runs.items()}
    rows = ["| variant | p95 (ms) | imbalance | inter-host MB / batch | intra-host MB / batch | "
            "inter-host vs static |", "|---|---|---|---|---|---|"]
    for v, rs in runs.items():
        p95, imb = median_of(rs, "latency_ms.p95"), median_of(rs, "imbalance")
        intra = median_of(rs, "intra_host_bytes_per_batch")
        rel = _ratio(ib[v], ib.get("static"))
        rows.append(f"| {v} | {p95 or 0:.0f} | {imb or 0:.3f} | {(ib[v] or 0) / 1e6:.2f} | "
                    f"{(intra or 0) / 1e6:.2f} | " + (f"{rel:.3f}" if rel is not None else "-") + " |")
    return "\n".join(rows), ib


def plot_heatmap(runs: dict[str, list[dict]], path: Path) -> Path:
    """Top row: mean expert load share per (layer, expert), then per variant the mean
    number of replicas of each expert per layer (the placement chosen). Bottom row: per
    variant the mean share of each device in the rows computed per layer (a balanced
    device is at 1/N). From each variant's first repeat."""
    plt = pyplot()

    names = [v for v in runs if runs[v]]
    first = runs[names[0]][0]
    share = np.asarray(first["expert_load_share"])
    cols = 1 + len(names)
    fig, axes = plt.subplots(2, cols, figsize=(3.2 * cols, 7.0), squeeze=False)
    ax = axes[0][0]
    im = ax.imshow(share, aspect="auto", cmap="viridis")
    ax.set_title("expert load share")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    fig.colorbar(im, ax=ax, fraction=0.046)
    axes[1][0].axis("off")
    axes[1][0].text(0.0, 0.5, "bottom row: share of the rows\nof each layer computed by\neach device "
                    "(balanced = 1/N)", fontsize=9, va="center")
    vmax = max(float(np.max(runs[v][0]["replicas"])) for v in names)
    dmax = max(float(np.max(runs[v][0]["device_rows_share"])) for v in names)
    for i, v in enumerate(names, start=1):
        ax = axes[0][i]
        im = ax.imshow(np.asarray(runs[v][0]["replicas"]), aspect="auto", cmap="magma", vmin=0, vmax=vmax)
        ax.set_title(f"{v}: replicas")
        ax.set_xlabel("expert")
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, fraction=0.046)
        ax = axes[1][i]
        im = ax.imshow(np.asarray(runs[v][0]["device_rows_share"]), aspect="auto", cmap="viridis", vmin=0,
                       vmax=dmax)
        ax.set_title(f"{v}: device load share")
        ax.set_xlabel("device")
        ax.set_ylabel("MoE layer")
        fig.colorbar(im, ax=ax, fraction=0.046)
    save_figure(fig, path, dpi=90)
    return path


WORKLOAD = Workload(
    name="moe-infer",
    description="MoE inference: static, eplb, lina and oracle expert placement side by side",
    key_metrics=KEY_METRICS,
    add_arguments=_add_arguments,
    variants=_variants,
    summarize=_summarize,
    higher_is_better=("estimation_accuracy",),
    cluster_defaults=cluster_defaults,
)
