"""``commsched bench gnn``: Vanilla against AdaQP's modes, side by side, interleaved.

Each variant is one ``torchrun -m commsched.gnn.train`` run on the same synthetic graph
(or ``--dataset``) and partition. Default regime: the emulated rate
:data:`DEFAULT_BANDWIDTH`, chosen (and recorded in docs/methods/gnn.md) so that Vanilla
spends about three quarters of its epoch communicating on this machine, as in AdaQP's
Table 1; without root/tc the runs are unshaped and the summary says so.

A variant is a label and the run's config: a mode name, then suffixes that each change the
config (:data:`SUFFIXES`, :func:`bench_run`): ``-bf16`` (``vanilla-bf16``: ``--dtype
bfloat16``, the Vanilla a modern framework runs, in the default variants), on an adaptive
mode ``-topo``, ``-topoev``, ``-avg`` (``--link-costs``; docs/methods/gnn.md), ``-hp``
(``--partition-method metis-hosts``), ``-lina``, ``-fifo`` (``--grad-schedule``), ``-gB``
(``--grad-bits``), on ``adaptive`` ``-ebX`` and ``-wsign``. ``--device`` is passed to every
variant; ``--seeds 0,1,2`` runs every variant once per seed and the summary pools them. With ``--hosts`` the summary's "Per link class" table gives
each variant's mean width and bytes inside and across hosts, its speed-up over
``adaqp-avg`` and the inter-host halo rows; ``widths_by_class.png`` the width histogram
per link class.

Time to accuracy (docs/methods/gnn.md):
``--metric time-to-acc`` (or ``--target-acc A``) evaluates after every epoch and adds the
report of :mod:`commsched.bench.gnn.tta`: per variant, epochs and wall-clock until the
validation accuracy first reaches the target (``A``, or ``--target-frac`` of Vanilla's
best), test accuracy at the best validation epoch, mean and spread over ``--seeds``, and
``time_to_acc.png`` (validation accuracy against wall-clock); ``--score auc`` (the
default ``auto`` on a two-class graph such as Tolokers) uses ROC AUC instead of accuracy
throughout. Its default variants are
:data:`TTA_MODES` on GCN; a name whose mode this checkout does not register is skipped
with a note.

The summary adds, per model: each mode's per-epoch speed-up over Vanilla (and over the
bf16 Vanilla, when it ran), Vanilla's communication share, each mode's quantization share of its epoch, assignment share of
wall-clock, bytes per epoch, test accuracy, and AdaQP's epoch time as a multiple of the
timing-only ``nocomm`` limit; plots: the breakdown bars (by the runner), the loss curves
and the histogram of assigned widths.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ...configurable import add_arguments as config_arguments
from ...dist import DEVICE_CHOICES
from ...gnn.exchange.modes import MODE_NAMES, MODES, AdaQPConfig, mode_spec, option_owners
from ...gnn.nn.models import LAYERS
from ...gnn.train.cli import CLI_DEFAULTS
from ...gnn.train.trainer import COMPUTE, TrainConfig
from ...priority.policy import FifoConfig, LinaConfig
from ...quant.reference import BITS
from ...results import median
from ..plots import pyplot, save_figure
from ..runner import Variant, Workload, median_of
from .tta import (
    DEFAULT_TARGET_FRAC,
    SCORES,
    SEED_MARK,
    TTA_MODES,
    check_tta_args,
    pick_score,
    plot_tta,
    split_seed,
    tta_rows,
    tta_table,
)

DEFAULT_BANDWIDTH = "300mbit"
BF16_SUFFIX = "-bf16"  # a full-precision mode run with --dtype bfloat16
HOSTS_SUFFIX = "-hp"  # partitioned with --partition-method metis-hosts (heavy cuts inside hosts)
# A bench mode name is a --mode, then "-"-separated suffixes, each a change of the run: of its
# TrainConfig ("train"), of its exchange, the mode's config ("exchange"), or of the partitioner
SUFFIXES: dict[str, tuple[str, dict]] = {
    "bf16": ("train", {"dtype": "bfloat16"}),
    "lina": ("train", {"schedule": LinaConfig()}), "fifo": ("train", {"schedule": FifoConfig()}),  # vanilla-lina
    "topo": ("exchange", {"link_costs": "topology"}), "avg": ("exchange", {"link_costs": "averaged"}),
    "topoev": ("exchange", {"link_costs": "topology", "equal_variance": True}),  # adaqp-topoev
    "wsign": ("exchange", {"warmup": "sign"}),  # adaptive-wsign: the first period as signs
    "hp": ("partition", {}),
}
# ... and those with a number: adaptive-eb0.5 (--error-budget 0.5), adaptive-g8 (--grad-bits 8)
NUMBERED = {"eb": ("exchange", "error_budget", float), "g": ("train", "grad_bits", int)}
# the `--hosts K` comparison: the four variants of the topology table
MODES_TOPOLOGY = ("vanilla", "adaqp-topo", "adaqp-topoev", "adaqp-avg", "uniform")
MODES_GCN = ("vanilla", "vanilla" + BF16_SUFFIX) + tuple(m for m in MODE_NAMES if m != "vanilla")
MODES_SAGE = ("vanilla", "vanilla" + BF16_SUFFIX, "adaqp")
# TTA_MODES (from gnn_tta): the time-to-accuracy comparison; a mode that is not registered is skipped
METRICS = ("epoch", "time-to-acc")


def tta_modes(names: tuple[str, ...] = TTA_MODES) -> tuple[list[str], list[str]]:
    """(the bench mode names of ``names`` this checkout can run, the others): a name is
    skipped when :func:`bench_run` refuses it (its mode is not registered)."""
    keep, skipped = [], []
    for n in names:
        try:
            bench_run(n)
            keep.append(n)
        except ValueError:
            skipped.append(n)
    return keep, skipped


def time_to_acc(a: argparse.Namespace) -> bool:
    """Whether the bench runs the time-to-accuracy report (``--metric time-to-acc`` or
    ``--target-acc``)."""
    return getattr(a, "metric", "epoch") == "time-to-acc" or getattr(a, "target_acc", None) is not None


def _suffix(name: str, tok: str) -> tuple[str, dict]:
    if tok in SUFFIXES:
        return SUFFIXES[tok]
    for key, (where, field, kind) in NUMBERED.items():
        if tok.startswith(key):
            try:
                return where, {field: kind(tok[len(key):])}
            except ValueError:
                pass
    raise ValueError(f"--modes {name}: -{tok} is not a known suffix (known: {', '.join(SUFFIXES)}, "
                     f"{', '.join(k + 'N' for k in NUMBERED)})")


def _owners(field: str) -> list[str]:  # the modes a suffix may change (--link-costs: adaptive widths)
    return [m for m in option_owners(field) if field != "link_costs" or getattr(MODES[m], "scheme", "") == "adaptive"]


def bench_run(name: str, base: TrainConfig | None = None, **options) -> tuple[TrainConfig, tuple[str, ...]]:
    """The run of a bench mode name (``adaqp-topo-lina``): ``base`` with its ``--mode``, its
    exchange (the mode's config of ``options``, the AdaQP knobs, where the mode has them) and
    each suffix's change (:data:`SUFFIXES`, :data:`NUMBERED`, in any order); and the training
    command's own flags it adds (``-hp``: ``--partition-method metis-hosts``)."""
    mode = max((m for m in MODES if name == m or name.startswith(m + "-")), key=len, default=None)
    if mode is None:
        mode_spec(name)  # the ValueError naming the modes
    train, exchange, own = {}, {}, ()
    for tok in name[len(mode) + 1:].split("-") if name != mode else ():
        where, change = _suffix(name, tok)
        if where == "partition":
            own = ("--partition-method", "metis-hosts")
        for field in change if where == "exchange" else ():
            if mode not in _owners(field):
                raise ValueError(f"--modes {name}: -{tok} sets --{field.replace('_', '-')} of --mode "
                                 f"{', '.join(_owners(field))}, not of {mode}")
        (train if where == "train" else exchange).update(change)
    fields = {f.name for f in dataclasses.fields(MODES[mode])}
    ex = MODES[mode](**{k: v for k, v in {**options, **exchange}.items() if k in fields})
    cfg = (base or TrainConfig()).replace(mode=mode, exchange=ex, **train)
    if cfg.schedule.policy != TrainConfig().schedule.policy:  # the selector of the nested schedule's flags
        own = (*own, "--grad-schedule", cfg.schedule.policy)
    return cfg, own


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gnn workload")
    g.add_argument("--dataset", default=None, help="named data set instead of the synthetic graph")
    g.add_argument("--data-root", default=None)
    g.add_argument("--syn-nodes", type=int, default=20_000)
    g.add_argument("--syn-edges", type=int, default=200_000)
    g.add_argument("--syn-seed", type=int, default=0,
                   help="seed of the synthetic graph (another graph of the same shape; --seeds "
                        "seeds the training)")
    g.add_argument("--epochs", type=int, default=20)
    g.add_argument("--eval-every", type=int, default=None,
                   help="evaluate every K epochs (default 5; 1 with --metric time-to-acc)")
    g.add_argument("--metric", choices=METRICS, default="epoch",
                   help="epoch: time per epoch (default); time-to-acc: also epochs and wall-clock "
                        "to a target validation accuracy (docs/methods/gnn.md)")
    g.add_argument("--target-acc", type=float, default=None, metavar="A",
                   help="time-to-acc target validation accuracy in (0, 1] (implies --metric "
                        "time-to-acc; default: --target-frac of vanilla's best)")
    g.add_argument("--target-frac", type=float, default=DEFAULT_TARGET_FRAC, metavar="F",
                   help=f"time-to-acc target as a fraction of vanilla's best validation accuracy, "
                        f"mean over seeds (default {DEFAULT_TARGET_FRAC})")
    g.add_argument("--score", choices=SCORES, default="auto",
                   help="time-to-acc validation score: acc (accuracy), auc (ROC AUC, two-class graphs), "
                        "auto (default: auc when every run recorded it, else acc)")
    g.add_argument("--sustain", type=int, default=1, metavar="S",
                   help="time-to-acc: the target counts when held for S evaluations in a row "
                        "(default 1: the first crossing)")
    config_arguments(g, AdaQPConfig, skip=("compile", "link_costs", "equal_variance"), defaults={"period": 5, "bits": 4})
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--seeds", default=None, metavar="S,S,...",
                   help="several seeds: every variant once per seed (named VARIANT-sSEED, run "
                        "seed by seed); the summary pools them, pairing each variant with "
                        "Vanilla of the same seed and repeat")
    g.add_argument("--partition-method", default="metis",
                   help=f"partitioner of every variant (metis, random, metis-hosts); a mode with "
                        f"{HOSTS_SUFFIX} uses metis-hosts")
    g.add_argument("--models", default=None,
                   help=f"comma-separated, from the layer registry: {', '.join(LAYERS)} (default "
                        "gcn,sage; gcn with --metric time-to-acc)")
    g.add_argument("--modes", default=None,
                   help=f"comma-separated modes for every model, a full-precision one may end in "
                        f"{BF16_SUFFIX} (--dtype bfloat16), any in -lina or -fifo (--grad-schedule), any in -g16, -g8, -g4 or -g2 (--grad-bits) (default: gcn {','.join(MODES_GCN)}; "
                        f"sage {','.join(MODES_SAGE)})")
    g.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="device of every variant (default auto: CUDA when every rank has its own GPU)")
    g.add_argument("--layers", type=int, default=TrainConfig().layers, help="layers of every model")
    g.add_argument("--compute", choices=COMPUTE, default="real",
                   help="every variant's compute: real, or emulated on --device-model at time dilation --dilation "
                        "(commsched.gnn.train --compute; --cluster sets all three)")
    g.add_argument("--device-model", default="a100", help="--compute emulated: the GPU (a100, h100, h200, or a file)")
    g.add_argument("--dilation", type=float, default=1.0, help="--compute emulated: time dilation k")


# the AdaQP paper's modes (its code's Vanilla, AdaQP, AdaQP-q, AdaQP-p): a --cluster run's default
CLUSTER_MODES = "vanilla,adaqp-q,adaqp-p,adaqp"


def cluster_defaults(preset) -> dict:
    """The bench's option defaults on a cluster preset (:mod:`commsched.cluster.presets`):
    its device model and k, the preset's graph and models, AdaQP's modes, on the CPU."""
    g = preset.gnn
    return {"compute": "emulated", "device_model": preset.device_model, "dilation": preset.dilation,
            "device": "cpu", "models": g.models, "modes": CLUSTER_MODES, "layers": g.layers, "hidden": g.hidden,
            "syn_nodes": g.syn_nodes, "syn_edges": g.syn_edges}


def parse_seeds(text: str | None) -> list[int] | None:
    """``--seeds 0,1,2`` -> [0, 1, 2]; None without it (one run per variant at ``--seed``)."""
    if text is None:
        return None
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated integers, e.g. 0,1,2; got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds needs one or more distinct integers, got {text!r}")
    return seeds


def variants(a: argparse.Namespace) -> list[Variant]:
    tta = time_to_acc(a)
    if tta:
        check_tta_args(a.target_acc, a.target_frac, a.sustain)
        if getattr(a, "compute", "real") == "emulated":
            raise ValueError("--metric time-to-acc needs accuracies, and --compute emulated (as every --cluster "
                             "preset) times the kernels without computing their values: measure time to "
                             "accuracy with real compute, and epoch times on the emulated cluster")
    seeds = parse_seeds(getattr(a, "seeds", None))
    if seeds is not None:
        out = []
        for s in seeds:
            one = argparse.Namespace(**{**vars(a), "seed": s, "seeds": None})
            out += [dataclasses.replace(v, name=f"{v.name}{SEED_MARK}{s}") for v in variants(one)]
        return out
    eval_every = a.eval_every if a.eval_every is not None else (1 if tta else 5)
    base = TrainConfig(epochs=a.epochs, eval_every=eval_every, hidden=a.hidden, seed=a.seed, dropout_rng="local",
                       device=getattr(a, "device", "auto"), layers=getattr(a, "layers", TrainConfig().layers))
    if getattr(a, "compute", "real") == "emulated":
        base = base.replace(compute="emulated", device_model=a.device_model, dilation=a.dilation)
    if a.dataset:
        graph = ("--dataset", a.dataset) + (("--data-root", a.data_root) if a.data_root else ())
    else:
        graph = ("--syn-nodes", str(a.syn_nodes), "--syn-edges", str(a.syn_edges))
        if getattr(a, "syn_seed", 0):
            graph += ("--syn-seed", str(a.syn_seed))
    pm = getattr(a, "partition_method", "metis")
    out = []
    models = a.models or ("gcn" if tta else "gcn,sage")
    if a.modes and not a.models and "," in models and not getattr(a, "_told_models", False):
        print(f"[bench gnn] note: --modes without --models runs them for every default model "
              f"({models}); pass --models gcn for one", file=sys.stderr, flush=True)
        a._told_models = True
    for model in models.split(","):
        LAYERS[model]  # an unknown model names the registry's
        if a.modes:
            modes = a.modes.split(",")
        elif tta:
            modes = tta_modes()[0]
        else:
            modes = MODES_GCN if model == "gcn" else MODES_SAGE
        for name in modes:
            cfg, part = bench_run(name, base.replace(model=model), period=a.period, group_size=a.group_size,
                                  lam=a.lam, bits=a.bits)
            part = part or (() if pm == "metis" else ("--partition-method", pm))
            out.append(Variant(f"{model}-{name}", "commsched.gnn.train", (*part, *graph), config=cfg,
                               defaults=CLI_DEFAULTS))
    return out


def _plots(runs: dict[str, list[dict]], out: Path) -> list[str]:
    plt = pyplot()

    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for v, rs in runs.items():
        if v.endswith("nocomm"):
            continue  # wrong maths by design
        ax.plot(range(1, len(rs[0]["loss"]) + 1), rs[0]["loss"], label=v,
                linestyle="-" if "vanilla" in v or "adaqp" == v.split("-", 1)[1] else "--")
    ax.set_xlabel("epoch")
    ax.set_ylabel("train loss (repeat 0)")
    ax.legend(fontsize="small")
    p = out / "loss.png"
    save_figure(fig, p)
    paths.append(str(p))
    hists = {}
    for v, rs in runs.items():
        ad = rs[0].get("adaqp") or {}
        if ad.get("assignments"):
            hists[v] = ad["assignments"][-1]["rows_per_width"]
    if hists:
        fig, ax = plt.subplots(figsize=(6, 4))
        w = 0.8 / len(hists)
        for i, (v, h) in enumerate(hists.items()):
            tot = max(sum(h.values()), 1)
            ax.bar([j + i * w for j in range(len(BITS))], [h[str(b)] / tot for b in BITS], width=w, label=v)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(BITS))], [f"{b} bits" for b in BITS])
        ax.set_ylabel("share of exchanged rows (last assignment)")
        ax.legend(fontsize="small")
        p = out / "widths.png"
        save_figure(fig, p)
        paths.append(str(p))
    p = plot_class_widths(runs, out / "widths_by_class.png")
    if p is not None:
        paths.append(str(p))
    return paths


def plot_class_widths(runs: dict[str, list[dict]], path: Path) -> Path | None:
    """One panel per link class: per adaptive variant, the share of the rows sent at each
    width (last assignment, summed over the runs); None when no run has link classes."""
    hists: dict[str, dict[str, dict[str, int]]] = {}
    for v, rs in runs.items():
        for r in rs:
            last = ((r.get("adaqp") or {}).get("assignments") or [{}])[-1]
            for cls, rec in (last.get("link_classes") or {}).items():
                h = hists.setdefault(cls, {}).setdefault(v, {str(b): 0 for b in BITS})
                for b, n in rec["rows_per_width"].items():
                    h[b] += n
    if not hists:
        return None
    plt = pyplot()
    classes = sorted(hists)
    fig, axes = plt.subplots(1, len(classes), figsize=(5 * len(classes), 4), squeeze=False)
    for ax, cls in zip(axes[0], classes):
        vs = hists[cls]
        w = 0.8 / len(vs)
        for i, (v, h) in enumerate(vs.items()):
            tot = max(sum(h.values()), 1)
            ax.bar([j + i * w for j in range(len(BITS))], [h[str(b)] / tot for b in BITS], width=w, label=v)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(BITS))], [f"{b} bits" for b in BITS])
        ax.set_title(f"{cls}-host rows" if cls in ("intra", "inter") else cls)
        ax.set_ylabel("share of rows (last assignment, all runs)")
        ax.legend(fontsize="small")
    return save_figure(fig, path)


def pool_seeds(runs: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """{VARIANT: runs of every seed, seed by seed} from ``VARIANT-sSEED`` names (--seeds);
    other names pass unchanged. Pairing run i of two pooled variants pairs the same seed
    and repeat."""
    out: dict[str, list[dict]] = {}
    for v, rs in runs.items():
        vs = split_seed(v)
        out.setdefault(vs[0] if vs else v, []).extend(rs)
    return out


def class_figures(r: dict, uniform_bits: int) -> dict:
    """One run's per-link-class figures: ``{cls}_MB`` (bytes per epoch, from
    ``bytes_per_epoch_by_class``) and ``{cls}_bits`` (mean width of the rows: the last
    assignment's for adaptive modes, ``uniform_bits`` for uniform; none for full precision)."""
    out: dict = {}
    for cls, b in (r.get("bytes_per_epoch_by_class") or {}).items():
        out[f"{cls}_MB"] = b / 1e6
    ad = r.get("adaqp") or {}
    assigned = ad.get("assignments") or []
    if assigned and assigned[-1].get("link_classes"):
        for cls, rec in assigned[-1]["link_classes"].items():
            out[f"{cls}_bits"] = rec["mean_bits"]
    elif ad.get("scheme") == "uniform":
        for cls in (r.get("bytes_per_epoch_by_class") or {}):
            out[f"{cls}_bits"] = float(uniform_bits)
    return out


def baseline_of(v: str, names: list[str]) -> str | None:
    """The variant ``v`` is compared with in the generic ratio table: Vanilla of the same
    model (and seed), else the first variant of that model; never another model's."""
    sp = split_seed(v)
    name, mark = (sp[0], f"{SEED_MARK}{sp[1]}") if sp else (v, "")
    model = name.split("-", 1)[0]
    if f"{model}-vanilla{mark}" in names:
        return f"{model}-vanilla{mark}"
    same = [n for n in names if (split_seed(n) or (n, None))[0].split("-", 1)[0] == model
            and n.endswith(mark)]
    return same[0] if same else None


# a mode is worth picking when its test accuracy is within this of Vanilla's (a fraction)
PICK_ACC_TOLERANCE = 0.01


def pick_line(rows: dict[str, dict], regime: str) -> str:
    """One line per model: which mode to pick in this regime and why (the fastest epoch
    among the training modes whose test accuracy is within PICK_ACC_TOLERANCE of Vanilla's)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows.values()):
        mine = {v: r for v, r in rows.items() if r["model"] == model}
        van = next((r for r in mine.values() if r["mode"] == "vanilla"), None)
        if van is None or not van.get("epoch_time_s"):
            continue
        ok = [(v, r) for v, r in mine.items()
              if r["mode"] != "nocomm" and r.get("epoch_time_s") and r.get("test_acc") is not None
              and van.get("test_acc") is not None and r["test_acc"] >= van["test_acc"] - PICK_ACC_TOLERANCE]
        if not ok and van.get("test_acc") is None:  # no accuracy measured (--compute emulated)
            v, r = min(((v, r) for v, r in mine.items() if r["mode"] != "nocomm" and r.get("epoch_time_s")),
                       key=lambda t: t[1]["epoch_time_s"])
            out.append(f"- {model}: fastest epoch at {regime}: **{r['mode']}** "
                       f"({van['epoch_time_s'] / r['epoch_time_s']:.2f}x Vanilla's); no accuracy was measured "
                       f"(emulated compute), so check the pick's accuracy in a run with real compute")
            continue
        if not ok:
            continue
        v, r = min(ok, key=lambda t: t[1]["epoch_time_s"])
        sp = van["epoch_time_s"] / r["epoch_time_s"]
        why = (f"the fastest epoch ({sp:.2f}x Vanilla's) among the modes within "
               f"{100 * PICK_ACC_TOLERANCE:.0f} pp of Vanilla's test accuracy ({r['test_acc']:.3f} vs "
               f"{van['test_acc']:.3f})")
        if r["mode"] == "vanilla":
            why = ("no mode is faster than Vanilla with its accuracy here"
                   + (" (unshaped: moving bytes costs little, compression does not pay)" if regime == "unshaped" else ""))
        out.append(f"- {model}: pick **{r['mode']}** at {regime}: {why}")
    return "\n".join(out) if out else "- no pick: no Vanilla run to compare with"


def summarize(runs: dict[str, list[dict]], a: argparse.Namespace, out: Path) -> dict:
    runs = pool_seeds(runs)
    rows, lines = {}, []
    for v, rs in runs.items():
        model, mode = v.split("-", 1)
        base = runs.get(f"{model}-vanilla")
        base16 = runs.get(f"{model}-vanilla{BF16_SUFFIX}")
        ep = median_of(rs, "epoch_time_s")
        r = {"model": model, "mode": mode, "epoch_time_s": ep,
             "bytes_per_epoch_MB": (median_of(rs, "bytes_sent_per_epoch") or 0) / 1e6,
             "test_acc": median_of(rs, "test_acc"),
             "comm_share": (median_of(rs, "breakdown_s.comm") or 0) / ep if ep else None,
             "quant_share": (median_of(rs, "breakdown_s.quant") or 0) / ep if ep else None,
             "assign_share_of_wall": median_of(rs, "assign_share_of_wall"),
             "solve_share_of_wall": median_of(rs, "solve_share_of_wall")}
        if base:
            # per-repeat ratios (repeat k of vanilla against repeat k of this variant: interleaved)
            rat = [b["epoch_time_s"] / x["epoch_time_s"] for b, x in zip(base, rs)]
            r["speedup_vs_vanilla"] = median(rat)
            r["speedup_per_repeat"] = rat
        if base16:
            r["speedup_vs_vanilla_bf16"] = median(b["epoch_time_s"] / x["epoch_time_s"]
                                                  for b, x in zip(base16, rs))
        noc = runs.get(f"{model}-nocomm")
        if noc and mode != "nocomm":
            r["x_nocomm"] = ep / median_of(noc, "epoch_time_s")
        r["epoch_time_s_assigned"] = median_of(rs, "epoch_time_s_assigned")
        peer = "adaptive-avg" if mode.split("-")[0] == "adaptive" else "adaqp-avg"
        avg = runs.get(f"{model}-{peer}")
        if avg and mode != peer:
            # the plans compare on the epochs they ran (the warm-up before the first
            # assignment sends the same in both): the assigned epochs where both have them
            on = ("epoch_time_s_assigned" if all(x.get("epoch_time_s_assigned") for x in (*avg, *rs))
                  else "epoch_time_s")
            r["speedup_vs_avg"] = median(b[on] / x[on] for b, x in zip(avg, rs))
            r["speedup_vs_avg_per_run"] = [b[on] / x[on] for b, x in zip(avg, rs)]
            r["speedup_vs_avg_on"] = on
        accs = [x["test_acc"] for x in rs if isinstance(x.get("test_acc"), (int, float))]
        r["test_acc_mean"] = sum(accs) / len(accs) if accs else None
        r["test_acc_per_run"] = accs
        per = [class_figures(x, a.bits) for x in rs]
        for k in sorted({k for f in per for k in f}):
            vals = [f[k] for f in per if isinstance(f.get(k), (int, float))]
            r[k] = median(vals) if vals else None
        r["inter_host_rows"] = median_of(rs, "partitioning.inter_host_rows")
        r["runs"] = len(rs)
        rows[v] = r
    keys = ("epoch_time_s", "epoch_time_s_assigned", "speedup_vs_vanilla", "speedup_vs_vanilla_bf16", "comm_share", "quant_share", "assign_share_of_wall",
            "solve_share_of_wall", "bytes_per_epoch_MB", "test_acc", "x_nocomm")
    lines = _variant_rows(rows, keys, 3)
    lines.append("speedup_vs_vanilla: median over repeats of (vanilla epoch / variant epoch) of the "
                 "same repeat (_bf16: against vanilla with --dtype bfloat16); epoch_time_s_assigned: the median epoch from the first re-assignment on (adaqp, adaptive: the epochs before it send the start-up widths); comm/quant shares: of the variant's median epoch; assign_share_of_wall: the re-assignments' time on the training thread (adaptive: gather and broadcast), solve_share_of_wall: adaptive's background solves, both of rank 0's wall clock; x_nocomm: epoch time "
                 "as a multiple of the timing-only nocomm mode (remote rows = zeros, wrong maths).")
    tables = {"AdaQP against Vanilla (per model)": "\n".join(lines)}
    tables["Which mode to pick here"] = pick_line(rows, getattr(a, "bandwidth", None) or "unshaped")
    if any(k.endswith("_MB") for r in rows.values() for k in r):
        tables["Per link class (topology)"] = _class_table(rows)
    res = {"gnn": rows, "extra_tables": tables, "plots": _plots(runs, out)}
    if getattr(a, "compute", "real") == "emulated":
        tables["Emulated cluster"], res["cluster"] = _cluster_section(runs, rows, a)
    if time_to_acc(a):
        skipped = [] if a.modes else tta_modes()[1]
        score = pick_score(runs, getattr(a, "score", "auto"))
        tta = tta_rows(runs, a.target_acc, a.target_frac, score, getattr(a, "sustain", 1))
        tables["Time to accuracy" + (" (ROC AUC)" if score == "auc" else "")] = tta_table(tta, skipped)
        regime = getattr(a, "bandwidth", None) or "unshaped"
        res["time_to_acc"] = {"rows": tta, "skipped_modes": skipped, "target_acc": a.target_acc,
                              "target_frac": a.target_frac, "regime": regime, "score": score}
        res["plots"].append(str(plot_tta(runs, tta, out / "time_to_acc.png",
                                         title=f"{a.dataset or 'synthetic'}, {regime}", score=score)))
    return res


def _cluster_section(runs: dict[str, list[dict]], rows: dict[str, dict], a: argparse.Namespace) -> tuple[str, dict]:
    """The emulated device's table (:func:`commsched.bench.emulation.cluster_table`: k,
    measured and predicted epoch, host CPU share per rank, memory, start-up: set-up, graph
    load and partitioning) and, per model, AdaQP's and the overlap's own gain (adaqp against
    adaqp-q, as the paper's ablation)."""
    import os

    from ..emulation import cluster_table

    recs = {}
    for v, rs in runs.items():
        start = [sum(r.get(k) or 0.0 for k in ("load_time_s", "partition_time_s"))
                 + ((r.get("emulated") or {}).get("setup_s") or 0.0) for r in rs]
        recs[v] = {"time_s": rows[v]["epoch_time_s"],
                   "host_cpu_share": [x for r in rs for x in (r.get("emulated") or {}).get("host_cpu_share_per_rank") or []],
                   "peak_rss_mib": [x for r in rs for x in r.get("peak_rss_mib_per_rank") or []],
                   "startup_s": median(start), "run_cpu_share": median_of(rs, "bench_cpu_share")}
    table, out = cluster_table(recs, cluster=getattr(a, "cluster", None), dilation=a.dilation,
                               ranks=a.nproc * (getattr(a, "hosts", 1) or 1), cores=os.cpu_count() or 1,
                               unit="epoch")
    gains = []
    for model in dict.fromkeys(r["model"] for r in rows.values()):
        ada, q = ((rows.get(f"{model}-{m}") or {}).get("epoch_time_s") for m in ("adaqp", "adaqp-q"))
        ada_a, q_a = ((rows.get(f"{model}-{m}") or {}).get("epoch_time_s_assigned") for m in ("adaqp", "adaqp-q"))
        van = (rows.get(f"{model}-vanilla") or {}).get("epoch_time_s")
        g = {"vanilla_over_adaqp": (rows.get(f"{model}-adaqp") or {}).get("speedup_vs_vanilla"),
             "overlap_gain_adaqp_q_over_adaqp": q / ada if q and ada else None,
             # on the widths AdaQP assigned (the epochs before its first plan send 8 bits)
             "vanilla_over_adaqp_assigned": van / ada_a if van and ada_a else None,
             "overlap_gain_assigned": q_a / ada_a if q_a and ada_a else None}
        out[f"{model}_gains"] = g
        gains.append(f"| {model} | {_num(g['vanilla_over_adaqp'])} | {_num(g['vanilla_over_adaqp_assigned'])} | "
                     f"{_num(g['overlap_gain_adaqp_q_over_adaqp'])} | {_num(g['overlap_gain_assigned'])} |")
    if gains:
        table += ("\n\n| model | Vanilla / AdaQP per epoch (the paper: 2.19-3.01x) | the same on AdaQP's assigned "
                  "widths | the overlap's own gain: adaqp-q / adaqp | the same on the assigned widths |\n"
                  "|---|---|---|---|---|\n" + "\n".join(gains)
                  + "\n\nOn the assigned widths: each mode's median epoch from its first plan on "
                    "(`epoch_time_s_assigned`; the epochs before it send 8-bit messages); give the run a few "
                    "periods (`--epochs` several times `--period`) so that the epochs that also solve a plan "
                    "do not set that median.")
    return table, out


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}x"


def _variant_rows(rows: dict[str, dict], keys: tuple[str, ...], digits: int) -> list[str]:
    """A markdown table, a row per variant and a column per key (floats to ``digits``
    significant digits, missing values as '-'), followed by an empty line."""
    lines = ["| variant | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for v, r in rows.items():
        cells = []
        for k in keys:
            x = r.get(k)
            cells.append("-" if x is None else (f"{x:.{digits}g}" if isinstance(x, float) else str(x)))
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _class_table(rows: dict[str, dict]) -> str:
    keys = ("runs", "epoch_time_s", "epoch_time_s_assigned", "speedup_vs_vanilla", "speedup_vs_avg", "test_acc_mean",
            "intra_bits", "inter_bits", "intra_MB", "inter_MB", "inter_host_rows")
    lines = _variant_rows(rows, keys, 4)
    lines.append("runs: seeds x repeats pooled; speedup_vs_avg: median of (adaqp-avg epoch / variant "
                 "epoch, adaptive-avg's for an adaptive variant) of the same seed and repeat, on "
                 "epoch_time_s_assigned where every run has it; test_acc_mean: mean over the runs; "
                 "{intra,inter}_bits: mean width of the rows sent inside / across hosts (last "
                 "assignment; '-' for full precision); {intra,inter}_MB: bytes per epoch, all ranks; "
                 "inter_host_rows: halo rows per exchange whose ends are on different hosts.")
    return "\n".join(lines)


WORKLOAD = Workload(
    name="gnn",
    description=("Distributed full-graph GNN training, the modes side by side: "
                 + ", ".join(MODE_NAMES) + f" (each may end in {BF16_SUFFIX} for a bfloat16 wire where "
                 "it takes one); nocomm is timing only. Ratios compare each variant with Vanilla "
                 "of the same model. Run under an emulated network with --bandwidth RATE and "
                 "--hosts K (root, ip and tc)."),
    key_metrics=("epoch_time_s", "bytes_sent_per_epoch", "test_acc", "breakdown_s.comm",
                 "breakdown_s.quant", "assign_share_of_wall", "solve_share_of_wall"),
    add_arguments=add_arguments,
    variants=variants,
    summarize=summarize,
    higher_is_better=("test_acc",),
    default_bandwidth=DEFAULT_BANDWIDTH,
    baseline_of=baseline_of,
    cluster_defaults=cluster_defaults,
)

__all__ = ["BF16_SUFFIX", "DEFAULT_BANDWIDTH", "HOSTS_SUFFIX", "METRICS", "MODES_TOPOLOGY",
           "SEED_MARK", "TTA_MODES", "WORKLOAD", "time_to_acc", "tta_modes", "class_figures", "bench_run", "parse_seeds", "plot_class_widths",
           "pool_seeds", "NUMBERED", "SUFFIXES"]
