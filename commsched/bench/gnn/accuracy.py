"""Accuracy grid: does AdaQP train as well as Vanilla? ``python -m commsched.bench.gnn.accuracy``

Runs ``torchrun -m commsched.gnn.train`` once per (data set, mode, seed) with one fixed
recipe (by default the one docs/methods/gnn.md quotes for Cora: GCN 3 x 256, LayerNorm,
dropout 0.5, lr 0.01, 100 epochs, evaluation every 2 epochs, AdaQP period 20 and group
size 20, local dropout masks, 4 ranks, unshaped loopback: accuracy does not depend on the
link rate), one run at a time, each under ``nice`` (these runs are not timed).

Writes, under ``--out``:

* ``<dataset>/<mode>/seed<S>/metrics.json`` (and ``log.txt``): one run each; a cell whose
  metrics.json already holds the same recipe is not run again, so an interrupted grid
  resumes where it stopped (``--force`` reruns);
* ``accuracy.json``: every run's test accuracy (at the best validation epoch) and loss
  curve, plus the per-(data set, mode) summary;
* ``accuracy.md``: the table (mean test accuracy over seeds, per seed, difference to
  Vanilla in percentage points, final loss);
* ``loss.png``: training loss per epoch, mean over seeds, one panel per data set.

The synthetic graph is the bench's default (``commsched bench gnn``: 20,000 nodes,
200,000 undirected edges) unless ``--syn-nodes`` / ``--syn-edges`` say otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ...gnn.exchange.modes import MODES as TRAIN_MODES
from ...gnn.exchange.modes import mode_config
from ...gnn.train.cli import CLI_DEFAULTS
from ...gnn.train.trainer import TrainConfig
from ...results import write_json
from ..plots import pyplot, save_figure
from ..runner import Variant

DATASETS = ("cora", "citeseer", "tolokers", "synthetic")
MODES = ("vanilla", "adaqp", "random")


@dataclass(frozen=True)
class Recipe:
    """The training options every cell of the grid shares (see the module docstring)."""

    model: str = "gcn"
    epochs: int = 100
    eval_every: int = 2
    period: int = 20
    group_size: int = 20
    lam: float = 0.5
    hidden: int = 256
    dropout_rng: str = "local"
    syn_nodes: int = 20_000
    syn_edges: int = 200_000
    data_root: str = "../shared/data"

    def variant(self, dataset: str, mode: str, seed: int) -> Variant:
        """The ``commsched.gnn.train`` run of one cell: its config and its graph's flags."""
        if mode not in TRAIN_MODES or TRAIN_MODES[mode].timing_only:
            raise ValueError(f"mode {mode!r} is not a training mode of the grid (nocomm is timing only)")
        cfg = TrainConfig(model=self.model, mode=mode, seed=seed, epochs=self.epochs, eval_every=self.eval_every,
                          hidden=self.hidden, dropout_rng=self.dropout_rng, device="auto", exchange=mode_config(
                              mode, period=self.period, group_size=self.group_size, lam=self.lam))
        graph = (("--syn-nodes", str(self.syn_nodes), "--syn-edges", str(self.syn_edges)) if dataset == "synthetic"
                 else ("--dataset", dataset, "--data-root", self.data_root))
        return Variant(f"{dataset}-{mode}-s{seed}", "commsched.gnn.train", graph, config=cfg, defaults=CLI_DEFAULTS)


def cell_dir(out: Path, dataset: str, mode: str, seed: int) -> Path:
    return out / dataset / mode / f"seed{seed}"


def matches(metrics: dict, recipe: Recipe, mode: str, seed: int) -> bool:
    """Whether a stored metrics.json is the run this recipe asks for (so it can be reused):
    written by the grid with this very recipe (every field, the synthetic graph's size
    included), for this mode and seed, and not cut short."""
    c = metrics.get("config") or {}
    return (metrics.get("recipe") == dataclasses.asdict(recipe) and c.get("mode") == mode
            and c.get("seed") == seed and len(metrics.get("loss") or []) == recipe.epochs)


def summarize(results: list[dict]) -> list[dict]:
    """Per (data set, mode): mean test accuracy (percent) over seeds and the difference to
    Vanilla's mean in percentage points. ``results`` rows hold dataset, mode, seed,
    test_acc (a fraction) and loss (per epoch)."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        by.setdefault((r["dataset"], r["mode"]), []).append(r)
    rows = []
    for (ds, mode), rs in by.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        accs = [100.0 * r["test_acc"] for r in rs]
        rows.append({"dataset": ds, "mode": mode, "seeds": [r["seed"] for r in rs], "test_acc_pct": accs,
                     "mean_pct": statistics.fmean(accs),
                     "final_loss": statistics.fmean(r["loss"][-1] for r in rs)})
    means = {(r["dataset"], r["mode"]): r["mean_pct"] for r in rows}
    for r in rows:
        base = means.get((r["dataset"], "vanilla"))
        r["vs_vanilla_pp"] = None if base is None or r["mode"] == "vanilla" else r["mean_pct"] - base
    return rows


def verdicts(rows: list[dict], tol_pp: float = 0.5) -> list[dict]:
    """Per data set: is AdaQP's mean within ``tol_pp`` of Vanilla's, and is it above Random's?"""
    means = {(r["dataset"], r["mode"]): r["mean_pct"] for r in rows}
    out = []
    for ds in dict.fromkeys(r["dataset"] for r in rows):
        v, q, rnd = (means.get((ds, m)) for m in ("vanilla", "adaqp", "random"))
        out.append({"dataset": ds,
                    "adaqp_minus_vanilla_pp": None if v is None or q is None else q - v,
                    "within_tol": None if v is None or q is None else abs(q - v) <= tol_pp,
                    "adaqp_minus_random_pp": None if rnd is None or q is None else q - rnd,
                    "adaqp_beats_random": None if rnd is None or q is None else q > rnd})
    return out


def table_markdown(rows: list[dict], tol_pp: float = 0.5) -> str:
    lines = ["| data set | mode | seeds | test acc, mean | per seed | vs vanilla | final loss, mean |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["vs_vanilla_pp"]
        lines.append(f"| {r['dataset']} | {r['mode']} | {len(r['seeds'])} | {r['mean_pct']:.2f}% | "
                     + ", ".join(f"{a:.1f}" for a in r["test_acc_pct"])
                     + f" | {'-' if d is None else f'{d:+.2f} pp'} | {r['final_loss']:.4f} |")
    lines += ["", f"| data set | adaqp - vanilla | within {tol_pp} pp? | adaqp - random | adaqp beats random? |",
              "|---|---|---|---|---|"]

    def yn(x: bool | None) -> str:
        return "-" if x is None else ("yes" if x else "no")

    def pp(x: float | None) -> str:
        return "-" if x is None else f"{x:+.2f} pp"

    for v in verdicts(rows, tol_pp):
        lines.append(f"| {v['dataset']} | {pp(v['adaqp_minus_vanilla_pp'])} | {yn(v['within_tol'])} | "
                     f"{pp(v['adaqp_minus_random_pp'])} | {yn(v['adaqp_beats_random'])} |")
    return "\n".join(lines) + "\n"


def plot_losses(results: list[dict], path: Path) -> Path:
    """Training loss per epoch (mean over seeds), one panel per data set, every mode."""
    plt = pyplot()

    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.6), squeeze=False)
    styles = {"vanilla": dict(color="black", linewidth=2.2), "adaqp": dict(color="tab:red", linewidth=1.2),
              "random": dict(color="tab:blue", linewidth=1.0, linestyle="--")}
    for ax, ds in zip(axes[0], datasets):
        modes = list(dict.fromkeys(r["mode"] for r in results if r["dataset"] == ds))
        for mode in modes:
            curves = [r["loss"] for r in results if r["dataset"] == ds and r["mode"] == mode]
            n = min(len(c) for c in curves)
            mean = [statistics.fmean(c[e] for c in curves) for e in range(n)]
            ax.plot(range(1, n + 1), mean, label=f"{mode} ({len(curves)} seeds)", **styles.get(mode, {}))
        ax.set_title(ds)
        ax.set_xlabel("epoch")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training loss (mean over seeds)")
    axes[0][0].legend(fontsize="small")
    save_figure(fig, path)
    return path


def _git_state() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "commsched"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return head + (" (commsched/ modified)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_grid(recipe: Recipe, datasets: Sequence[str], modes: Sequence[str], seeds: Sequence[int],
             out: Path, *, nproc: int = 4, nice: int = 10, force: bool = False,
             timeout_s: float = 3600.0, say=print) -> list[dict]:
    """Run every missing cell (one at a time) and return one result row per cell."""
    from ..runner import RunContext, run_variant

    ctx = RunContext(wrap=(lambda cmd: ["nice", "-n", str(nice), *cmd]) if nice else (lambda cmd: cmd))
    results = []
    cells = [(ds, mode, seed) for ds in datasets for seed in seeds for mode in modes]
    for k, (ds, mode, seed) in enumerate(cells, 1):
        d = cell_dir(out, ds, mode, seed)
        mpath = d / "metrics.json"
        m = json.loads(mpath.read_text()) if mpath.exists() and not force else None
        if m is None or not matches(m, recipe, mode, seed):
            say(f"[accuracy] {k}/{len(cells)}: {ds} {mode} seed {seed}")
            m = run_variant(recipe.variant(ds, mode, seed), nproc, d, ctx, timeout_s)
            m["git"] = _git_state()
            m["recipe"] = dataclasses.asdict(recipe)
            write_json(mpath, m)
            say(f"[accuracy]   test {100 * m['test_acc']:.2f}%, final loss {m['loss'][-1]:.4f}, "
                f"wall {m['wall_clock_s']:.0f} s")
        results.append({"dataset": ds, "mode": mode, "seed": seed, "test_acc": m["test_acc"],
                        "val_acc": m["val_acc"], "best_epoch": m["best_epoch"], "loss": m["loss"],
                        "wall_clock_s": m.get("wall_clock_s"), "git": m.get("git")})
    return results


def main(argv: Sequence[str] | None = None) -> int:
    d = Recipe()
    p = argparse.ArgumentParser(prog="python -m commsched.bench.gnn.accuracy", description=__doc__.splitlines()[0])
    p.add_argument("--datasets", default=",".join(DATASETS), help=f"comma-separated from {', '.join(DATASETS)}")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--period", type=int, default=d.period)
    p.add_argument("--group-size", type=int, default=d.group_size)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--syn-nodes", type=int, default=d.syn_nodes)
    p.add_argument("--syn-edges", type=int, default=d.syn_edges)
    p.add_argument("--data-root", default=d.data_root)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--nice", type=int, default=10, help="niceness of the runs (0: not niced)")
    p.add_argument("--tol-pp", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=Path("runs/gnn-accuracy"))
    p.add_argument("--force", action="store_true", help="rerun cells that already have metrics")
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    datasets = [s.strip().lower() for s in a.datasets.split(",") if s.strip()]
    unknown = set(datasets) - set(DATASETS)
    if unknown:
        p.error(f"unknown data sets {sorted(unknown)}; choose from {', '.join(DATASETS)}")
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {a.seeds!r}")
    try:
        recipe = Recipe(epochs=a.epochs, eval_every=a.eval_every, period=a.period, group_size=a.group_size,
                        hidden=a.hidden, syn_nodes=a.syn_nodes, syn_edges=a.syn_edges, data_root=a.data_root)
        modes = [m.strip() for m in a.modes.split(",") if m.strip()]
        for m in modes:
            recipe.train_args("synthetic", m, 0)  # validates the mode
    except ValueError as e:
        p.error(str(e))
    results = run_grid(recipe, datasets, modes, seeds, a.out, nproc=a.nproc, nice=a.nice, force=a.force,
                       say=lambda s: print(s, flush=True))
    rows = summarize(results)
    a.out.mkdir(parents=True, exist_ok=True)
    table = table_markdown(rows, a.tol_pp)
    summary: dict[str, Any] = {"recipe": dataclasses.asdict(recipe),
                               "nproc": a.nproc, "runs": results, "summary": rows,
                               "verdicts": verdicts(rows, a.tol_pp),
                               "command": "python -m commsched.bench.gnn.accuracy " + " ".join(
                                   sys.argv[1:] if argv is None else argv)}
    write_json(a.out / "accuracy.json", summary, indent=1)
    (a.out / "accuracy.md").write_text(table)
    png = plot_losses(results, a.out / "loss.png")
    print(table)
    print(f"wrote {a.out / 'accuracy.json'}, {a.out / 'accuracy.md'}, plot {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
