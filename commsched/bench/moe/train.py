"""``commsched bench moe-train``: DeepSpeed MoE, fifo and Lina's schedule side by side.

Three variants of the same model, data and seed, each a ``torchrun`` run of
:mod:`commsched.moe.train`:

* ``deepspeed`` -- ``deepspeed.moe.layer.MoE`` under DeepSpeed's engine (ZeRO-2, gradient
  reduction overlapping the backward pass, padded equal-split all-to-all);
* ``fifo`` -- commsched's MoE layer, gradient allreduce in DDP-style buckets launched as
  soon as they are ready, on a process group of its own (so it shares the link with the
  all-to-all, as on a cluster), plain all-to-all;
* ``lina`` -- the same layer with Lina's schedule: gradients cut into micro-ops launched
  only in the gaps of the all-to-all, and the all-to-all cut into chunks pipelined with
  expert compute;
* ``lina-overlap`` -- ``lina``, but the step does not wait for the reduction: its tail runs
  into the next forward pass in layer order, each module's optimizer step happens as soon
  as its reduction ends and the next forward pass waits only for the module it enters
  (:mod:`commsched.priority.runtime.overlap`). Its bound is max(compute, link bytes / rate) per
  step (:func:`overlap_bound`), not their sum.
* ``lina-q8``, ``lina-overlap-q8`` (with ``--a2a-bits 8``; ``-q16`` with 16) -- ``lina`` and
  ``lina-overlap`` with the quantized expert all-to-all (8: rows to the experts as 8-bit
  rows of the shared codec, rows back in bfloat16; :func:`commsched.moe.model.dispatch.moe_wires`):
  commsched's schedule and compression together, against fifo and DeepSpeed in the same
  run (:func:`_q8_rows`: their ratios, the best commsched configuration's, the loss gap).
* ``lina-hier`` (only on emulated hosts, ``--hosts K``) -- ``lina`` with the hierarchical
  reduction (``--hier-reduce``: inside each host, across hosts under lina's gate, inside
  again; :mod:`commsched.priority.hier`).

With ``--model hf-mixtral-tiny`` the model is a transformers Mixtral made expert-parallel by
:mod:`commsched.moe.hf` instead, each commsched variant a run of the worker of
:mod:`commsched.bench.moe.hf_parity` (:func:`~commsched.bench.moe.hf_parity.bench_variants`;
DeepSpeed's variant left out), and the summary its step times, their ratios to fifo's and the
loss curves' gaps to fifo's (:func:`~commsched.bench.moe.hf_parity.bench_summary`).

The summary adds lina's ratios against fifo, its all-to-all time against the all-to-all
measured with no allreduce running (``a2a_alone_time_s``), the share of a fifo step spent
in all-to-all, the link's time per step at the emulated rate (:func:`link_times`) and the
lower bound of a step it implies, how closely the loss curves agree, a plot of the loss
curves and a timeline (PNG) of one step's all-to-all and allreduce operations on every rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ...configurable import add_arguments, cli_fields, from_arguments
from ...moe.model.layer import DispatchConfig
from ...moe.model.lm import ModelConfig
from ...moe.train.training import DeepSpeedConfig, TrainConfig
from ...priority.fallback import PROBE_WARMUP
from ...priority.policy import DEFAULT_CREDIT_MICROOPS, FifoConfig, LinaConfig, LinaOverlapConfig
from ...results import median
from ..plots import pyplot, save_figure
from ..runner import Variant, Workload, median_of
from . import hf_parity

# The benchmark model and link (the documented default regime; see docs/methods/moe_train.md):
# every other block MoE, 4 experts (one per rank), 800 Mbit/s shared by the 4 ranks -- the
# all-to-all is about a third of a fifo step, as in Lina's setting.
DEFAULT_BANDWIDTH = "800mbit"
# ... shared per collective (the gradient reduction in its own equal htb class), as NCCL's
# channels share a GPU cluster's link; --link-model flow: per TCP flow (bench/emulation.py)
DEFAULT_LINK_MODEL = "collective"
# the Lina paper's median slowdown of an all-to-all by a concurrent allreduce (NCCL)
PAPER_CONTENTION = 1.83
_SCHED, _FIFO = LinaConfig(), FifoConfig()  # the schedules' own defaults
MODEL = ModelConfig(seq_len=128, d_model=256, n_heads=4, n_layers=4, d_ff=1024, expert_hidden=1024, num_experts=4)
DEFAULTS = {"steps": 10, "warmup": 3, "device": "auto", "chunks": 4, "microop_bytes": _SCHED.microop_bytes,
            "credit_bytes": None, "bucket_bytes": _FIFO.bucket_bytes}


def _add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    g = p.add_argument_group("model and training (all variants)")
    g.add_argument("--model", default="commsched", choices=("commsched", *hf_parity.HF_MODELS),
                   help="commsched: commsched's MoE language model (the model flags below, every variant, "
                        "DeepSpeed's included); hf-mixtral-tiny: a transformers Mixtral (hidden 128, 8 experts, "
                        "top-2, 4 layers) made expert-parallel by commsched.moe.hf, under commsched's variants "
                        "(python -m commsched.bench.moe.hf_parity's worker; the model flags below do not apply, "
                        "--batch-size, --steps, --warmup, --corpus, --device, --chunks and the schedules' "
                        "options do; needs the hf extra)")
    add_arguments(g, TrainConfig, defaults=d, skip=tuple(f.name for f in cli_fields(TrainConfig) if f.name not in (
        "steps", "warmup", "batch_size", "corpus", "device", "dtype", "allreduce_threads", "compute",
        "device_model", "dilation")))
    add_arguments(g, DeepSpeedConfig, skip=("bucket_bytes",))
    add_arguments(g, ModelConfig, skip=("capacity_factor", "aux_weight"), defaults=dataclasses.asdict(MODEL))
    g = p.add_argument_group("schedules")
    g.add_argument("--chunks", type=int, default=d["chunks"], help="lina: chunks of the pipelined all-to-all")
    g.add_argument("--microop-bytes", type=int, default=d["microop_bytes"])
    g.add_argument("--credit-bytes", type=int, default=d["credit_bytes"])
    g.add_argument("--hold-in-block", action=argparse.BooleanOptionalAction, default=True,
                   help="lina: also hold allreduce during backward expert compute")
    g.add_argument("--bucket-bytes", type=int, default=d["bucket_bytes"], help="fifo buckets, DeepSpeed reduce bucket")
    g.add_argument("--fallback-exchange", action=argparse.BooleanOptionalAction, default=True,
                   help="lina and lina-overlap variants: the probe's fallback also runs the all-to-all and "
                        "the reduction as fifo's (one chunk, not pipelined; fifo's buckets), the trainer's "
                        "default; --no-fallback-exchange: only fifo's launching (commsched.moe.train "
                        "--fallback-exchange)")
    g.add_argument("--grad-bits", type=int, choices=(16, 8), default=None,
                   help="also run fifo-gB, lina-gB and lina-overlap-gB (and fifo-qA-gB, lina-qA-gB, "
                        "lina-overlap-qA-gB with --a2a-bits A): the gradient reduction's messages at B bits "
                        "(commsched.moe.train --grad-bits)")
    g.add_argument("--grad-batch-bytes", type=int, default=None,
                   help="the -gB variants: sums summed together up to this many bytes (default: the "
                        "trainer's, 4 MiB; 0: one sum per launch; commsched.moe.train --grad-batch-bytes)")
    g.add_argument("--grad-unbatched", action="store_true",
                   help="with --grad-bits B also run fifo-b0-gB and lina-b0-gB (and fifo-b0-qA-gB, "
                        "lina-b0-qA-gB with --a2a-bits A): those variants with every launch summed alone "
                        "(--grad-batch-bytes 0), the batching's A/B")
    g.add_argument("--a2a-bits", type=int, choices=(16, 8), default=None,
                   help="also run lina-qB and lina-overlap-qB: lina / lina-overlap with the expert all-to-all "
                        "at B bits (commsched.moe.train --a2a-bits)")


def _base(a: argparse.Namespace) -> TrainConfig:
    """The run every variant shares: the bench's flags as the trainer's config."""
    return TrainConfig(
        model=from_arguments(ModelConfig, a), deepspeed=from_arguments(DeepSpeedConfig, a, bucket_bytes=a.bucket_bytes),
        steps=a.steps, warmup=min(a.warmup, a.steps - 1), batch_size=a.batch_size,
        allreduce_threads=a.allreduce_threads, device=a.device, dtype=a.dtype, corpus=a.corpus or None,
        compute=getattr(a, "compute", "real"), device_model=getattr(a, "device_model", "a100"),
        dilation=getattr(a, "dilation", 1.0))


def emulated(a: argparse.Namespace) -> bool:
    """Whether the bench runs its variants on the emulated device (``--compute emulated``,
    every ``--cluster`` run)."""
    return getattr(a, "compute", "real") == "emulated"


# DeepSpeed's engine and MoE layer compute on real tensors: no emulated DeepSpeed variant
DEEPSPEED_NOT_EMULATED = ("deepspeed left out: --compute emulated runs --impl commsched only (DeepSpeed's engine "
                          "and MoE layer compute on real tensors and cannot be put on the emulated device)")


# the schedules' sizes on a cluster preset, for the modelled job's gradients (220 MiB at
# GPT-2 small's shape) rather than the CPU-sized defaults: fifo fuses gradients into
# buckets of PyTorch DDP's default (bucket_cap_mb = 25); lina cuts 4 MiB micro-ops, at the
# emulated NIC about half one exchange's link time, so that an exchange waits at most that
# long for a micro-op already on the wire, with 2 of them allowed in flight
CLUSTER_BUCKET_BYTES = 25 << 20
CLUSTER_MICROOP_BYTES = 4 << 20
CLUSTER_CREDIT_BYTES = 2 * CLUSTER_MICROOP_BYTES


def cluster_defaults(preset) -> dict:
    """The bench's option defaults on a cluster preset (:mod:`commsched.cluster.presets`):
    its device model and k, its MoE model with one expert per emulated GPU, on the CPU,
    and the schedules' sizes for the modelled job (``CLUSTER_*_BYTES``)."""
    m = preset.moe
    return {"compute": "emulated", "device_model": preset.device_model, "dilation": preset.dilation,
            "bucket_bytes": CLUSTER_BUCKET_BYTES, "microop_bytes": CLUSTER_MICROOP_BYTES,
            "credit_bytes": CLUSTER_CREDIT_BYTES,
            "device": "cpu", "d_model": m.d_model, "n_heads": m.n_heads, "n_layers": m.n_layers,
            "seq_len": m.seq_len, "d_ff": m.d_ff, "expert_hidden": m.expert_hidden, "num_experts": preset.ranks,
            "k": m.k, "moe_every": m.moe_every, "batch_size": m.batch_size, "dtype": m.dtype}


def configs(a: argparse.Namespace) -> dict[str, TrainConfig]:
    """The variants' labels and configs, in run order."""
    base = _base(a)
    ours = base.replace(deepspeed=DeepSpeedConfig())  # commsched's runs: the schedule's options, each its own
    address = {"reduce_address": getattr(a, "reduce_address", None)}
    micro = {"microop_bytes": a.microop_bytes, "credit_bytes": a.credit_bytes, "hold_in_block": a.hold_in_block,
             **address}
    lina = ours.replace(schedule=LinaConfig(**micro), dispatch=DispatchConfig(chunks=a.chunks, pipeline=True),
                        fallback_exchange=getattr(a, "fallback_exchange", True))
    out = {} if emulated(a) else {"deepspeed": base.replace(impl="deepspeed")}
    out |= {"fifo": ours.replace(schedule=FifoConfig(bucket_bytes=a.bucket_bytes, **address)), "lina": lina,
           "lina-overlap": lina.replace(schedule=LinaOverlapConfig(**micro))}
    bits = getattr(a, "a2a_bits", None)

    def q(c: TrainConfig) -> TrainConfig:  # schedule + compression: the quantized expert all-to-all
        return c.replace(dispatch=c.dispatch.replace(a2a_bits=bits))

    if bits:
        out |= {f"{n}-q{bits}": q(out[n]) for n in ("lina", "lina-overlap")}
    gbits = getattr(a, "grad_bits", None)
    if gbits:  # the gradient reduction compressed (quant/allreduce.py), alone and with -qA
        g = {"grad_bits": gbits}
        if getattr(a, "grad_batch_bytes", None) is not None:
            g["grad_batch_bytes"] = a.grad_batch_bytes
        out |= {f"{n}-g{gbits}": out[n].replace(**g) for n in ("fifo", "lina", "lina-overlap")}
        if bits:  # both compressions: fifo-qA-gB, lina-qA-gB, lina-overlap-qA-gB
            out |= {f"{n}-q{bits}-g{gbits}": q(out[n]).replace(**g) for n in ("fifo", "lina", "lina-overlap")}
        if getattr(a, "grad_unbatched", False):  # the A/B of CompressedLauncher's batches
            b0 = {**g, "grad_batch_bytes": 0}
            out |= {f"{n}-b0-g{gbits}": out[n].replace(**b0) for n in ("fifo", "lina")}
            if bits:
                out |= {f"{n}-b0-q{bits}-g{gbits}": q(out[n]).replace(**b0) for n in ("fifo", "lina")}
    if (getattr(a, "hosts", 1) or 1) > 1:  # on emulated hosts: lina with the hierarchical reduction
        out["lina-hier"] = lina.replace(schedule=lina.schedule.replace(hier_reduce=True))
        if gbits:  # and its phase across hosts compressed: schedule + compression together
            out[f"lina-hier-g{gbits}"] = out["lina-hier"].replace(**g)
            if bits:
                out[f"lina-hier-q{bits}-g{gbits}"] = q(out["lina-hier"]).replace(**g)
    return out


def _variants(a: argparse.Namespace) -> list[Variant]:
    if a.model != "commsched":  # a transformers model: the same variants, hf_parity's worker
        return hf_parity.bench_variants(a, configs(a))
    return [Variant(n, "commsched.moe.train", config=c,
                    args=("--schedule", c.schedule.policy) if c.impl == "commsched" else ())
            for n, c in configs(a).items()]


def link_times(payload: float, grad_bytes: float, P: int, hosts: int, rate_bps: float) -> dict[str, float]:
    """Seconds the busiest emulated link needs per step (pure): ``a2a`` for the all-to-all's
    bytes (all four exchanges; under even routing a rank sends (P-1)/P of its rows to other
    ranks), ``a2a_backward`` for the backward half, ``allreduce_flat`` for a ring allreduce of
    the non-expert gradients, ``allreduce_hier`` for the hierarchical one. One host: every
    byte between ranks passes the one shared limit (a ring's P edges each carry 2S(P-1)/P).
    H hosts of L ranks, one limited NIC each way per host: a NIC carries the bytes of its L
    ranks to the P - L ranks elsewhere; a ring over consecutive ranks crosses each NIC once
    each way (2S(P-1)/P), the hierarchical reduction 2S(H-1)/H (priority/hier.py)."""
    L = P // hosts
    if hosts <= 1:
        a2a_bytes = payload * (P - 1)
        flat = hier = 2 * grad_bytes * (P - 1)
    else:
        a2a_bytes = L * payload * (P - L) / P
        flat = 2 * grad_bytes * (P - 1) / P
        hier = 2 * grad_bytes * (hosts - 1) / hosts
    sec = 8.0 / rate_bps
    return {"a2a": a2a_bytes * sec, "a2a_backward": a2a_bytes * sec / 2,
            "allreduce_flat": flat * sec, "allreduce_hier": hier * sec}


def after_probe_start(probes: int = _SCHED.fallback_probes) -> int:
    """Index (from 0) of the first step after the fallback probe of lina and lina-overlap
    that carries no probe step's tail: the probe runs steps PROBE_WARMUP .. PROBE_WARMUP +
    2 probes - 1, the step after it may still wait for the last probe step's overlapped
    reduction. Pure."""
    return PROBE_WARMUP + 2 * probes + 1


def step_after_probe(m: dict, start: int) -> float | None:
    """Median time of a run's steps from ``start`` on (``step_times_s``), None when it has
    none there: a schedule's steady state once its probe has decided, the one-time probe
    left out (every variant over the same steps)."""
    st = m.get("step_times_s") or []
    return median(st[start:]) if len(st) > start else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _pair(a: float | None, b: float | None) -> str | None:
    """``"a / b"`` of two ratios (x), or None when the first is unknown."""
    return None if a is None else f"{a:.3g}x / {_fmt(b, 'x')}"


def _fmt(x, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:.3g}{unit}"


def plot_timeline(timelines: dict[str, dict], path: Path) -> Path:
    """One panel per variant; per rank two lanes: all-to-all (top) and allreduce (bottom),
    and under ``lina-overlap`` a third: the next step's forward pass (light green, from its
    start to its end) with each module group's wait for its update and its optimizer step
    (dark green), which start inside the allreduce tail."""
    plt = pyplot()

    names = [n for n, t in timelines.items() if t.get("ranks")]
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.0 + 1.1 * max(len(timelines[n]["ranks"]) for n in names)
                                                     * len(names)), squeeze=False)
    colors = {"a2a": "tab:red", "allreduce": "tab:blue", "forward": "palegreen", "update": "darkgreen"}
    for ax, n in zip(axes[:, 0], names):
        ranks = timelines[n]["ranks"]
        labels = ["a2a", "allreduce"]
        if any(rec["kind"] == "forward" for recs in ranks for rec in recs):
            labels.append("next fwd")
        nl = len(labels)
        for r, recs in enumerate(ranks):
            for rec in sorted(recs, key=lambda x: x["kind"] == "update"):  # updates drawn over the forward
                if rec["end_s"] < 0 or rec["start_s"] < 0 or rec["kind"] not in colors:
                    continue
                lane = nl * r + {"a2a": 0, "allreduce": 1}.get(rec["kind"], 2)
                s0 = rec["ready_s"] if rec["kind"] == "update" else rec["start_s"]
                ax.broken_barh([(s0, max(rec["end_s"] - s0, 2e-3))], (lane + 0.1, 0.8),
                               facecolors=colors[rec["kind"]], edgecolor="black", linewidth=0.3)
        ax.set_yticks([nl * r + 0.5 + i for r in range(len(ranks)) for i in range(nl)])
        ax.set_yticklabels([f"rank {r} {lab}" for r in range(len(ranks)) for lab in labels], fontsize="x-small")
        ax.invert_yaxis()
        ax.set_title(f"{n}: step {timelines[n].get('step')} (seconds from the step start)", fontsize="small")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds")
    save_figure(fig, path)
    return path


def plot_losses(runs: dict[str, list[dict]], path: Path) -> Path:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for v, rs in runs.items():
        ax.plot(range(len(rs[0]["loss"])), rs[0]["loss"], label=v, marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (mean over ranks)")
    ax.set_title("loss curves (repeat 0)")
    ax.legend()
    save_figure(fig, path)
    return path


def overlap_bound(compute_s: float | None, grad_bytes: int | None, a2a_link_s: float | None, world: int,
                  rate_bps: float | None) -> tuple[float | None, float | None]:
    """(link seconds, bound) of one ``lina-overlap`` step on one emulated link that all
    ``world`` ranks share: the link must carry the ring allreduce of the non-expert
    gradients (every rank sends 2 (P - 1) / P of them: 2 (P - 1) * ``grad_bytes`` in all)
    and the all-to-alls (``a2a_link_s``, the estimate above); the step cannot be shorter
    than that nor than its compute, and with the reduction overlapping the next forward
    pass it need not be longer than the larger of the two: bound = max(compute, link)."""
    if not (grad_bytes and rate_bps and a2a_link_s is not None):
        return None, None
    link = 2 * (world - 1) * grad_bytes * 8 / rate_bps + a2a_link_s
    return link, (max(compute_s, link) if compute_s is not None else None)


def compressed(c: TrainConfig) -> bool:
    """Whether a variant's config compresses (its all-to-all, ``-qB``, or its reduction, ``-gB``)."""
    return c.dispatch.a2a_bits != 32 or c.grad_bits != 32


def ours(names) -> list[str]:
    """commsched's configurations among the variant names (every one but DeepSpeed's)."""
    return [v for v in names if v != "deepspeed"]


def _q8_rows(runs, med, rep_ratio, quantized: list[str]) -> list[tuple]:
    """Summary rows of the ``quantized`` variants (:func:`compressed`): their step-time ratios against fifo and
    DeepSpeed, commsched's best configuration (the fastest median step of its variants)
    against both, the all-to-all against lina's, and the loss gap to fifo (largest per step,
    relative)."""
    rows = []
    for v in quantized:
        rows += [
            (f"step time: fifo / {v} (goal >= 1.5)", rep_ratio("fifo", v, "step_time_s"), "x"),
            (f"step time: deepspeed / {v} (goal >= 2)", rep_ratio("deepspeed", v, "step_time_s"), "x"),
            (f"all-to-all: lina / {v}", rep_ratio("lina", v, "a2a_time_s"), "x"),
        ]
        c, f = runs[v][0].get("loss"), runs.get("fifo", [{}])[0].get("loss")
        if c and f and None not in c and None not in f:
            rows.append((f"loss: {v} largest per-step gap to fifo, relative (goal <= 0.01)",
                         max(abs(a - b) / b for a, b in zip(c, f)), ""))
    mine = {v: med[v]["step_time_s"] for v in ours(med) if med[v]["step_time_s"]}
    if mine and quantized:
        best = min(mine, key=mine.get)
        rows += [
            (f"best commsched configuration: {best}", mine[best], " s"),
            (f"step time: fifo / best ({best}; goal >= 1.5)", rep_ratio("fifo", best, "step_time_s"), "x"),
            (f"step time: deepspeed / best ({best}; goal >= 2)", rep_ratio("deepspeed", best, "step_time_s"), "x"),
        ]
    return rows


def _overlap_rows(runs, med, rep_ratio, m_any, P, rate, a2a_link_s, hosts) -> list[tuple]:
    """Summary rows of ``lina-overlap``: its ratios and its bound (compute: its step less the
    time its compute thread waited for the all-to-all and for parameter updates)."""
    ov = med.get("lina-overlap")
    if ov is None:
        return []
    compute = None
    if ov["step_time_s"] is not None:
        compute = ov["step_time_s"] - (ov["a2a_time_s"] or 0.0) - (ov["allreduce_wait_s"] or 0.0)
    grad = m_any.get("sizes", {}).get("non_expert_grad_bytes")
    link, bound = overlap_bound(compute, grad, a2a_link_s if hosts == 1 else None, P, rate)
    return [
        ("step time: fifo / lina-overlap (goal >= 1.0; >= 1.4 per collective)", rep_ratio("fifo", "lina-overlap", "step_time_s"), "x"),
        ("step time: lina / lina-overlap", rep_ratio("lina", "lina-overlap", "step_time_s"), "x"),
        ("step time: deepspeed / lina-overlap", rep_ratio("deepspeed", "lina-overlap", "step_time_s"), "x"),
        ("lina-overlap compute per step (step - all-to-all wait - update wait), s", compute, ""),
        ("lina-overlap link per step (allreduce + all-to-all bytes / rate), s", link, ""),
        ("lina-overlap bound max(compute, link), s", bound, ""),
        ("lina-overlap step / its bound (goal <= 1.15)", _ratio(ov["step_time_s"], bound), "x"),
        ("allreduce bytes reduced within the backward pass: lina-overlap", ov["allreduce_in_backward_share"], ""),
    ]


def _summarize(runs: dict[str, list[dict]], args, out: Path) -> dict:
    if args.model != "commsched":
        return hf_parity.bench_summary(runs, args, out)
    start = after_probe_start()
    for rs in runs.values():
        for m in rs:
            m["step_after_probe_s"] = step_after_probe(m, start)
    med = {v: {k: median_of(rs, k) for k in ("step_time_s", "a2a_time_s", "allreduce_time_s",
                                             "a2a_alone_time_s", "allreduce_wait_s", "val_loss",
                                             "allreduce_in_backward_share", "step_after_probe_s",
                                             "a2a_contention.median", "a2a_contention.max")}
           for v, rs in runs.items()}
    lines = ["| quantity | value |", "|---|---|"]
    lina, fifo, ds, hier = med.get("lina"), med.get("fifo"), med.get("deepspeed"), med.get("lina-hier")
    # per-repeat ratios (interleaved runs), then their median
    def rep_ratio(a: str, b: str, key: str) -> float | None:
        if a not in runs or b not in runs:
            return None
        rs = [_ratio(x.get(key), y.get(key)) for x, y in zip(runs[a], runs[b])]
        rs = [r for r in rs if r is not None]
        return median(rs)

    rows = [
        ("step time: deepspeed / lina (goal >= 1.4)", rep_ratio("deepspeed", "lina", "step_time_s"), "x"),
        ("step time: fifo / lina (goal >= 1.0; >= 1.3 per collective)", rep_ratio("fifo", "lina", "step_time_s"), "x"),
        ("step time: deepspeed / fifo", rep_ratio("deepspeed", "fifo", "step_time_s"), "x"),
        (f"step time after the probe (steps {start + 1} on, every variant): fifo / lina (goal >= 1.0)",
         rep_ratio("fifo", "lina", "step_after_probe_s"), "x"),
        (f"step time after the probe (steps {start + 1} on, every variant): fifo / lina-overlap (goal >= 1.0)",
         rep_ratio("fifo", "lina-overlap", "step_after_probe_s"), "x"),
        ("all-to-all: fifo / lina", rep_ratio("fifo", "lina", "a2a_time_s"), "x"),
        ("all-to-all: deepspeed / lina", rep_ratio("deepspeed", "lina", "a2a_time_s"), "x"),
        ("lina all-to-all / its all-to-all alone", _ratio(lina and lina["a2a_time_s"], lina and lina["a2a_alone_time_s"]), "x"),
        (f"contention: fifo all-to-all / its all-to-all alone (link model {getattr(args, 'link_model', None)}; "
         f"the Lina paper's median {PAPER_CONTENTION}x)",
         _ratio(fifo and fifo["a2a_time_s"], fifo and fifo["a2a_alone_time_s"]), "x"),
        ("contention against the paper's median (goal 0.8-1.2)",
         _ratio(_ratio(fifo and fifo["a2a_time_s"], fifo and fifo["a2a_alone_time_s"]), PAPER_CONTENTION), "x"),
        ("contention per exchange: fifo's exchanges that ran beside an allreduce, each against itself alone, "
         "median / largest (the paper's statistic: median 1.83x, worst 4.14x)",
         _pair(fifo and fifo["a2a_contention.median"], fifo and fifo["a2a_contention.max"]), "x"),
        ("allreduce bytes reduced within the backward pass: lina", lina and lina["allreduce_in_backward_share"], ""),
        ("allreduce bytes reduced within the backward pass: fifo", fifo and fifo["allreduce_in_backward_share"], ""),
        ("all-to-all share of a fifo step", _ratio(fifo and fifo["a2a_time_s"], fifo and fifo["step_time_s"]), ""),
        ("all-to-all share of a deepspeed step", _ratio(ds and ds["a2a_time_s"], ds and ds["step_time_s"]), ""),
    ]
    if hier:
        rows += [
            ("step time: deepspeed / lina-hier (goal >= 1.4)", rep_ratio("deepspeed", "lina-hier", "step_time_s"), "x"),
            ("step time: fifo / lina-hier (goal >= 1.3)", rep_ratio("fifo", "lina-hier", "step_time_s"), "x"),
            ("step time: lina / lina-hier", rep_ratio("lina", "lina-hier", "step_time_s"), "x"),
            ("lina-hier all-to-all / its all-to-all alone", _ratio(hier["a2a_time_s"], hier["a2a_alone_time_s"]), "x"),
            ("allreduce bytes reduced within the backward pass: lina-hier", hier["allreduce_in_backward_share"], ""),
        ]
    # the link's share of a step at the emulated rate (estimates from the bytes, see link_times)
    m_any = next(iter(runs.values()))[0]
    payload = m_any.get("sizes", {}).get("a2a_payload_bytes_per_step")
    grad_bytes = m_any.get("sizes", {}).get("non_expert_grad_bytes")
    P = m_any.get("world_size") or args.nproc
    rate = getattr(args, "rate_bps", None)
    hosts = getattr(args, "hosts", 1) or 1
    lt = link_times(payload, grad_bytes, P, hosts, rate) if payload and grad_bytes and rate else None
    rows.append(("all-to-all bytes at the emulated rate / fifo step (estimate)",
                 _ratio(lt and lt["a2a"], fifo and fifo["step_time_s"]), ""))
    link_s = lt and lt["a2a"]
    rows += _overlap_rows(runs, med, rep_ratio, m_any, P, rate, link_s, hosts)
    cfgs = configs(args)
    rows += _q8_rows(runs, med, rep_ratio, [v for v in runs if v in cfgs and compressed(cfgs[v])])
    # a lower bound of a step for any schedule that waits for every gradient before the
    # optimizer step: the fastest measured forward pass and optimizer of commsched's
    # variants, plus the link time of the allreduce and of the backward all-to-alls
    ours = [runs[v] for v in ("fifo", "lina", "lina-hier") if v in runs]
    fwd = min((x for x in (median_of(rs, "breakdown_s.forward") for rs in ours) if x is not None), default=None)
    opt = min((x for x in (median_of(rs, "breakdown_s.optimizer_and_other") for rs in ours) if x is not None),
              default=None)
    bounds = {}
    if lt and fwd is not None and opt is not None:
        for kind in ("flat", "hier"):
            bounds[kind] = fwd + lt[f"allreduce_{kind}"] + lt["a2a_backward"] + opt
        rows += [
            ("allreduce link time per step: flat ring / hierarchical (s)",
             f"{lt['allreduce_flat']:.3g} / {lt['allreduce_hier']:.3g}", ""),
            ("step lower bound, flat allreduce: forward + allreduce link + backward all-to-all link + optimizer (s)",
             bounds["flat"], ""),
            ("step lower bound, hierarchical allreduce (s)", bounds["hier"], ""),
            ("fifo step / flat lower bound (the most a flat schedule can gain over fifo)",
             _ratio(fifo and fifo["step_time_s"], bounds["flat"]), "x"),
            ("fifo step / hierarchical lower bound", _ratio(fifo and fifo["step_time_s"], bounds["hier"]), "x"),
            ("deepspeed step / flat lower bound", _ratio(ds and ds["step_time_s"], bounds["flat"]), "x"),
        ]
    for name, val, unit in rows:
        lines.append(f"| {name} | {val if isinstance(val, str) else _fmt(val, unit)} |")
    # loss curves: largest per-step gap between variants (repeat 0), and final losses
    # (an emulated run has no loss values: its curve is left out)
    curves = {v: rs[0]["loss"] for v, rs in runs.items()
              if rs and rs[0].get("loss") and all(x is not None for x in rs[0]["loss"])}
    loss_lines = ["| variant | first loss | last loss | max gap to fifo | held-out loss |", "|---|---|---|---|---|"]
    for v, c in curves.items():
        gap = max(abs(a - b) for a, b in zip(c, curves["fifo"])) if "fifo" in curves else None
        loss_lines.append(f"| {v} | {c[0]:.4f} | {c[-1]:.4f} | {_fmt(gap)} | {_fmt(med[v]['val_loss'])} |")
    timelines = {}
    for v in ("fifo", "lina", "lina-overlap", "lina-hier"):
        p = out / v / "rep0" / "timeline.json"
        if p.exists():
            timelines[v] = json.loads(p.read_text())
    plots = []
    if timelines:
        plots.append(str(plot_timeline(timelines, out / "timeline.png")))
    if curves:
        plots.append(str(plot_losses(runs, out / "loss.png")))
    m0 = next(iter(runs.values()))[0]
    sizes = m0.get("sizes", {})
    m = from_arguments(ModelConfig, args)
    cfg_line = (f"model: d_model {m.d_model}, {m.n_layers} blocks (MoE every {m.moe_every}), "
                f"{m.num_experts} experts of hidden {m.expert_hidden}, top-{m.k}, dense FFN {m.d_ff}; "
                f"{args.batch_size} x {m.seq_len} tokens per rank per step; "
                f"non-expert gradients {sizes.get('non_expert_grad_bytes', 0) / 2**20:.2f} MiB; "
                f"all-to-all payload {sizes.get('a2a_payload_bytes_per_step', 0) / 2**20:.2f} MiB per rank per step; "
                f"lina: {args.chunks} chunks, micro-ops of {args.microop_bytes} B, credit "
                f"{args.credit_bytes if args.credit_bytes is not None else f'{DEFAULT_CREDIT_MICROOPS} micro-ops'}; fifo buckets {args.bucket_bytes} B; "
                f"allreduce group: {args.allreduce_threads} gloo threads")
    tables = {"Lina against fifo and DeepSpeed (medians of per-repeat ratios)": "\n".join(lines),
              **({"Loss curves": "\n".join(loss_lines)} if curves else {}), "Configuration": cfg_line}
    extra = {}
    if emulated(args):
        tables["Emulated cluster"], extra["cluster"] = _cluster_section(runs, args, med)
    return {"extra_tables": tables, **extra,
            "plots": plots,
            "lina_ratios": {name: val for name, val, _ in rows}, "link_times_s": lt, "step_bounds_s": bounds}


# the Lina paper's share of a training step spent in all-to-all (average) and the goal's band
PAPER_A2A_SHARE, FAITHFUL_BAND = 0.341, 0.2


def _cluster_section(runs: dict[str, list[dict]], args, med: dict) -> tuple[str, dict]:
    """The emulated device's table (:func:`commsched.bench.emulation.cluster_table`: k,
    measured and predicted step, host CPU share per rank, memory, start-up) and the
    faithfulness figures against the Lina paper's: the all-to-all's share of a fifo step
    and the in-step contention (fifo's all-to-all against the same all-to-all alone)."""
    import os

    from ..emulation import cluster_table

    recs = {}
    for v, rs in runs.items():
        em = [r.get("emulation") or {} for r in rs]
        recs[v] = {"time_s": med[v]["step_time_s"],
                   "host_cpu_share": [x for e in em for x in e.get("host_cpu_share") or []],
                   "peak_rss_mib": [x for e in em for x in e.get("peak_rss_mib") or []],
                   "startup_s": median_of(rs, "emulation.startup_s"), "run_cpu_share": median_of(rs, "bench_cpu_share")}
    table, out = cluster_table(recs, cluster=getattr(args, "cluster", None), dilation=args.dilation,
                               ranks=args.nproc * (getattr(args, "hosts", 1) or 1), cores=os.cpu_count() or 1)
    fifo = med.get("fifo") or {}
    share = _ratio(fifo.get("a2a_time_s"), fifo.get("step_time_s"))
    cont = _ratio(fifo.get("a2a_time_s"), fifo.get("a2a_alone_time_s"))
    per_x = fifo.get("a2a_contention.median")

    def within(x, goal):
        return None if x is None else abs(x / goal - 1) <= FAITHFUL_BAND

    faith = {"a2a_share_fifo": share, "a2a_share_goal": PAPER_A2A_SHARE, "a2a_share_within_band": within(share, PAPER_A2A_SHARE),
             "contention_fifo": cont, "contention_goal": PAPER_CONTENTION, "contention_within_band": within(cont, PAPER_CONTENTION),
             "contention_per_exchange_fifo": per_x, "contention_per_exchange_within_band": within(per_x, PAPER_CONTENTION)}
    out["faithfulness"] = faith

    def yn(b):
        return "-" if b is None else ("yes" if b else "**no**")
    table += "\n\n" + "\n".join([
        "| faithfulness (the Lina paper's testbed) | measured | paper | within 20% |", "|---|---|---|---|",
        f"| all-to-all share of a fifo step | {_fmt(share)} | {PAPER_A2A_SHARE} | {yn(faith['a2a_share_within_band'])} |",
        f"| contention: fifo all-to-all / the same all-to-all alone | {_fmt(cont, 'x')} | {PAPER_CONTENTION}x | "
        f"{yn(faith['contention_within_band'])} |",
        f"| contention per exchange: median slowdown of fifo's exchanges that ran beside an allreduce | "
        f"{_fmt(per_x, 'x')} | {PAPER_CONTENTION}x | {yn(faith['contention_per_exchange_within_band'])} |"])
    if "deepspeed" not in runs:
        table += f"\n\n{DEEPSPEED_NOT_EMULATED}."
    return table, out


WORKLOAD = Workload(
    name="moe-train",
    description="MoE LM training: DeepSpeed MoE vs fifo allreduce vs Lina's all-to-all-first schedule",
    key_metrics=("step_time_s", "a2a_time_s", "allreduce_time_s", "a2a_alone_time_s", "allreduce_wait_s"),
    add_arguments=_add_arguments,
    variants=_variants,
    summarize=_summarize,
    default_bandwidth=DEFAULT_BANDWIDTH,
    default_link_model=DEFAULT_LINK_MODEL,
    cluster_defaults=cluster_defaults,
)
