"""Time to accuracy: the ``--metric time-to-acc`` report of ``commsched bench gnn``.

Legend: E epochs of a run, V evaluations (one per epoch with ``--eval-every 1``).

For every run (one variant, one seed), :func:`time_to_target` finds the first evaluation
whose validation accuracy reaches the target and reports the epochs trained until then
and the wall-clock of those epochs: the sum of the run's own measured epoch times
(``epoch_time_s_per_epoch``, the maximum over ranks of each training epoch; evaluation
passes are outside the clock, set-up too). Every variant runs in the regime of the bench
invocation (``--bandwidth``), so each time is measured, not composed from another run.
The target is ``--target-acc A`` when given, else ``--target-frac F`` (default 0.98) of
Vanilla's best validation accuracy: the mean over the seeds of each Vanilla run's best,
per model, in the same bench invocation. :func:`tta_rows` aggregates the seeds (mean,
standard deviation, per seed), :func:`tta_table` writes the markdown table (with
:func:`sampling_lines`: per model, whether the fastest full-graph mode or ``minibatch``
reaches the target first, and by how much) and
:func:`plot_tta` validation accuracy against wall-clock, one line per variant (mean over
seeds at each epoch), the target as a dashed line.

The validation score is accuracy or, with ``score="auc"``, ROC AUC (recorded by the
trainer on two-class graphs, ``val_auc_per_eval``; on Tolokers 78% of the nodes are in one
class, so accuracy reaches 98% of its best after one epoch and says nothing);
:func:`pick_score` chooses AUC when every run recorded it and ``"auto"`` was asked.
"Accuracy" below stands for the chosen score.

Seeds run in separate invocations (``--seeds 0`` one day, ``--seeds 1,2`` the next, each in
its regime) are pooled into one report by :func:`pool_report`, from the command line
``python -m commsched.bench.gnn.tta DIR [DIR ...] --out OUT``: it reads every
``DIR/VARIANT-sSEED/repK/metrics.json``, refuses a seed found twice, and recomputes the
target from all the pooled Vanilla runs.

The modes the report compares by default are data here (``TTA_MODES``, used by
:mod:`commsched.bench.gnn.compare`; a name whose mode is not registered is skipped with a note):
the full-graph modes and ``minibatch`` (neighbour sampling with data-parallel replicas,
:mod:`commsched.gnn.train.minibatch`), the peer a user would pick instead.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ...results import median, write_json
from ..plots import pyplot, save_figure

DEFAULT_TARGET_FRAC = 0.98
# bench gnn --metric time-to-acc: the full-graph modes, then mini-batch training with neighbour
# sampling (what a user would reach for instead); rows and runs are reported in this order
TTA_MODES = ("vanilla", "vanilla-bf16", "adaqp", "onebit", "pipegcn", "bns", "adaptive", "minibatch")
SCORES = ("auto", "acc", "auc")
SCORE_LABEL = {"acc": "accuracy", "auc": "ROC AUC"}
SEED_MARK = "-s"  # VARIANT-sSEED: one seed's run of VARIANT (bench gnn --seeds)


def mode_rank(name: str) -> int:
    """Where a bench mode name sorts in a report: the position in :data:`TTA_MODES` of the
    name itself, else of the mode it extends (``adaptive-g8`` after ``adaptive``, with
    ``-bf16``, ``-g8``, ``-lina`` ... suffixes), else after all of them."""
    if name in TTA_MODES:
        return TTA_MODES.index(name)
    base = max((m for m in TTA_MODES if name.startswith(m + "-")), key=len, default=None)
    return len(TTA_MODES) if base is None else TTA_MODES.index(base)


def split_seed(name: str) -> tuple[str, int] | None:
    """``("VARIANT", SEED)`` from a ``VARIANT-sSEED`` run name, None for a name without it."""
    base, mark, seed = name.rpartition(SEED_MARK)
    return (base, int(seed)) if mark and base and seed.isascii() and seed.isdigit() else None


def check_tta_args(target_acc: float | None, frac: float, sustain: int) -> None:
    """ValueError naming the option when ``--target-acc``, ``--target-frac`` or ``--sustain``
    is out of range (shared by ``bench gnn`` and the pooled report)."""
    if target_acc is not None and not 0 < target_acc <= 1:
        raise ValueError(f"--target-acc is a validation accuracy in (0, 1], got {target_acc}")
    if not 0 < frac <= 1:
        raise ValueError(f"--target-frac is a fraction of vanilla's best in (0, 1], got {frac}")
    if sustain < 1:
        raise ValueError(f"--sustain is a number of evaluations >= 1, got {sustain}")


def pick_score(runs: dict[str, list[dict]], score: str = "auto") -> str:
    """``"acc"`` or ``"auc"``: ``score`` itself, or for ``"auto"`` AUC when every run
    recorded one (a two-class graph), else accuracy. Asking for AUC of a run without it is
    an error."""
    if score not in SCORES:
        raise ValueError(f"score {score!r}: expected one of {', '.join(SCORES)}")
    has_auc = bool(runs) and all(m.get("val_auc_per_eval") for rs in runs.values() for m in rs)
    if score == "auc" and not has_auc:
        raise ValueError("ROC AUC was asked for but not every run recorded it (the trainer computes "
                         "it on two-class graphs only); use the accuracy")
    return score if score != "auto" else ("auc" if has_auc else "acc")


@dataclass(frozen=True)
class TimeToTarget:
    """When one run first reached the target: epochs trained and their summed wall-clock
    (seconds); both None when it never did."""

    epochs: int | None
    seconds: float | None

    @property
    def reached(self) -> bool:
        return self.epochs is not None


def time_to_target(val_acc_V: Sequence[float], eval_epochs_V: Sequence[int],
                   epoch_time_s_E: Sequence[float], target: float, sustain: int = 1) -> TimeToTarget:
    """The first evaluation v with ``val_acc_V[v] >= target``: it followed epoch
    ``eval_epochs_V[v]`` (0-based), so ``eval_epochs_V[v] + 1`` epochs were trained, in
    ``sum(epoch_time_s_E[:eval_epochs_V[v] + 1])`` seconds. With ``--eval-every K`` > 1 the
    epoch found is the first *evaluated* one at the target (up to K - 1 epochs late).
    ``sustain`` S > 1 asks for S evaluations in a row at or above the target (v is the first
    of them; a run that ends inside such a streak has not reached it), so that a transient
    spike of a noisy curve does not count."""
    if len(val_acc_V) != len(eval_epochs_V):
        raise ValueError(f"{len(val_acc_V)} validation accuracies for {len(eval_epochs_V)} evaluation epochs")
    if sustain < 1:
        raise ValueError(f"sustain is a number of evaluations >= 1, got {sustain}")
    ok = [acc is not None and acc >= target for acc in val_acc_V]
    for v, ep in enumerate(eval_epochs_V):
        if v + sustain <= len(ok) and all(ok[v:v + sustain]):
            n = int(ep) + 1
            if n > len(epoch_time_s_E):
                raise ValueError(f"evaluation after epoch {ep} but only {len(epoch_time_s_E)} epoch times")
            return TimeToTarget(n, float(sum(epoch_time_s_E[:n])))
    return TimeToTarget(None, None)


def run_curve(m: dict, score: str = "acc") -> tuple[list[float], list[float]]:
    """(wall-clock at each evaluation: the summed epoch times up to it; validation score)."""
    times = m["epoch_time_s_per_epoch"]
    cum, t = [], 0.0
    for x in times:
        t += x
        cum.append(t)
    vals = [float("nan") if x is None else x for x in m[f"val_{score}_per_eval"]]
    return [cum[e] for e in m["eval_epochs"]], vals


def _best_val(m: dict, score: str = "acc") -> float:
    vals = [x for x in m.get(f"val_{score}_per_eval") or () if x is not None]
    return max(vals) if vals else float("nan")


def _stats(xs: Sequence[float]) -> tuple[float | None, float | None]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def targets(runs: dict[str, list[dict]], target_acc: float | None = None,
            frac: float = DEFAULT_TARGET_FRAC, score: str = "acc") -> dict[str, float | None]:
    """Per model: ``target_acc``, or ``frac`` x the mean over its Vanilla runs of each run's
    best validation accuracy (None without a ``MODEL-vanilla`` variant)."""
    models = dict.fromkeys(v.split("-", 1)[0] for v in runs)
    out: dict[str, float | None] = {}
    for model in models:
        if target_acc is not None:
            out[model] = target_acc
            continue
        base = runs.get(f"{model}-vanilla")
        out[model] = frac * statistics.fmean(_best_val(m, score) for m in base) if base else None
    return out


def tta_rows(runs: dict[str, list[dict]], target_acc: float | None = None,
             frac: float = DEFAULT_TARGET_FRAC, score: str = "acc", sustain: int = 1) -> dict[str, dict]:
    """Per variant (``MODEL-MODE``, runs pooled over seeds): the target, per run and
    aggregated, epochs and seconds to the target, best validation and test accuracy at
    the best validation epoch, the median epoch time, and the per-seed ratio of Vanilla's
    time to target to this variant's (median over the seeds where both reached it), all in
    ``score`` (``"acc"`` or ``"auc"``; the keys keep the ``acc`` names), the target held for
    ``sustain`` evaluations in a row (:func:`time_to_target`)."""
    tg = targets(runs, target_acc, frac, score)
    rows: dict[str, dict] = {}
    for v, rs in runs.items():
        model = v.split("-", 1)[0]
        target = tg.get(model)
        hits = [time_to_target(m[f"val_{score}_per_eval"], m["eval_epochs"], m["epoch_time_s_per_epoch"], target,
                               sustain)
                if target is not None else TimeToTarget(None, None) for m in rs]
        ep_m, ep_sd = _stats([h.epochs for h in hits if h.reached])
        t_m, t_sd = _stats([h.seconds for h in hits if h.reached])
        te_m, te_sd = _stats([m.get(f"test_{score}") for m in rs])
        bv_m, bv_sd = _stats([_best_val(m, score) for m in rs])
        r = {"target": target, "runs": len(rs), "reached": sum(h.reached for h in hits),
             "epochs_to_target": [h.epochs for h in hits], "seconds_to_target": [h.seconds for h in hits],
             "epochs_mean": ep_m, "epochs_sd": ep_sd, "seconds_mean": t_m, "seconds_sd": t_sd,
             "best_val_mean": bv_m, "best_val_sd": bv_sd,
             "test_acc_per_run": [m.get(f"test_{score}") for m in rs], "test_acc_mean": te_m, "test_acc_sd": te_sd,
             "score": score, "sustain": sustain,
             "epoch_time_s": median(m["epoch_time_s"] for m in rs), "epochs_run": [m["epochs"] for m in rs],
             "seeds": [(m.get("config") or {}).get("seed") for m in rs]}
        rows[v] = r
    for v, r in rows.items():
        base = rows.get(f"{v.split('-', 1)[0]}-vanilla")
        if base is None:
            continue
        if None not in base["seeds"] + r["seeds"] and len(set(base["seeds"])) == len(base["seeds"]):
            # by seed: a pooled report may hold a variant for fewer seeds than Vanilla
            by_seed = dict(zip(base["seeds"], base["seconds_to_target"]))
            pairs = [(by_seed.get(sd), x) for sd, x in zip(r["seeds"], r["seconds_to_target"])]
        else:  # repeats of one seed: run i against run i (interleaved)
            pairs = list(zip(base["seconds_to_target"], r["seconds_to_target"]))
        rat = [b / x for b, x in pairs if b is not None and x is not None and x > 0]
        r["speedup_vs_vanilla"] = median(rat)
    return rows


def _pm(m: float | None, sd: float | None, fmt: str) -> str:
    return "-" if m is None else f"{fmt.format(m)} ± {fmt.format(sd or 0.0)}"


SAMPLING_MODE = "minibatch"  # mini-batch training with neighbour sampling; every other mode is full-graph


def _is_sampling(variant: str) -> bool:
    mode = variant.split("-", 1)[1] if "-" in variant else ""
    return mode == SAMPLING_MODE or mode.startswith(SAMPLING_MODE + "-")


def _side(v: str, r: dict) -> str:
    te = r["test_acc_mean"]
    score = "-" if te is None else (f"{te:.4f}" if r.get("score") == "auc" else f"{100 * te:.2f}%")
    return f"`{v}` {r['speedup_vs_vanilla']:.2f}x Vanilla, {r['reached']}/{r['runs']} seeds, test {score}"


def sampling_lines(rows: dict[str, dict]) -> list[str]:
    """Per model with a ``minibatch`` variant and a full-graph one that reached the target:
    which reaches it first and by how much, as the ratio of their time speed-ups against
    Vanilla (the fastest full-graph variant by that speed-up against the fastest sampling
    one), with each one's seeds reached and test score beside."""
    out = []
    for model in dict.fromkeys(v.split("-", 1)[0] for v in rows):
        mine = {v: r for v, r in rows.items() if v.split("-", 1)[0] == model and r.get("speedup_vs_vanilla")}
        fg = [v for v in mine if not _is_sampling(v)]
        mb = [v for v in mine if _is_sampling(v)]
        if not fg or not mb:
            continue
        f = max(fg, key=lambda v: mine[v]["speedup_vs_vanilla"])
        m = max(mb, key=lambda v: mine[v]["speedup_vs_vanilla"])
        ratio = mine[f]["speedup_vs_vanilla"] / mine[m]["speedup_vs_vanilla"]
        first, second, x = (f, m, ratio) if ratio >= 1 else (m, f, 1 / ratio)
        kind = "full-graph" if first == f else "sampling"
        out.append(f"- {model}: {kind} reaches the target first: `{first}` {x:.2f}x sooner than `{second}` "
                   f"({_side(f, mine[f])}; {_side(m, mine[m])})")
    if out:
        out.insert(0, "Full-graph against sampling (the fastest of each by time speed-up vs Vanilla; "
                      "the ratio of the two speed-ups):")
    return out


def tta_table(rows: dict[str, dict], skipped: Sequence[str] = ()) -> str:
    """The markdown table of :func:`tta_rows` (and a note on the skipped modes)."""
    score = next((r.get("score", "acc") for r in rows.values()), "acc")
    sustain = next((r.get("sustain", 1) for r in rows.values()), 1)
    lines = [f"| variant | target val {score} | reached | epochs to target | s to target | time speed-up vs vanilla "
             f"| s/epoch | best val {score} | test {score} at best val (per seed) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v, r in rows.items():
        sp = r.get("speedup_vs_vanilla")
        if score == "auc":  # an AUC as a fraction, an accuracy in percent
            per = ", ".join("-" if a is None else f"{a:.3f}" for a in r["test_acc_per_run"])
            te = _pm(r["test_acc_mean"], r["test_acc_sd"], "{:.4f}")
        else:
            per = ", ".join("-" if a is None else f"{100 * a:.1f}" for a in r["test_acc_per_run"])
            te = "-" if r["test_acc_mean"] is None else f"{100 * r['test_acc_mean']:.2f} ± {100 * r['test_acc_sd']:.2f}%"
        tgt = "-" if r["target"] is None else f"{r['target']:.4f}"
        lines.append(f"| {v} | {tgt} "
                     f"| {r['reached']}/{r['runs']} | {_pm(r['epochs_mean'], r['epochs_sd'], '{:.1f}')} "
                     f"| {_pm(r['seconds_mean'], r['seconds_sd'], '{:.1f}')} | {'-' if sp is None else f'{sp:.2f}x'} "
                     f"| {r['epoch_time_s']:.3g} | {_pm(r['best_val_mean'], r['best_val_sd'], '{:.4f}')} "
                     f"| {te} ({per}) |")
    lines += ["", "Per variant over its seeds: mean ± standard deviation. epochs / s to target: over the "
              "seeds that reached it (reached: how many); s to target: the summed wall-clock of the "
              "training epochs up to the first evaluation at or above the target"
              + (f" that starts {sustain} evaluations in a row at or above it" if sustain > 1 else "")
              + ", evaluation excluded; "
              "time speed-up: median over seeds of vanilla's s to target / the variant's, same seed; "
              f"test {score} at the epoch of best validation {SCORE_LABEL.get(score, score)}."]
    if skipped:
        lines.append(f"Skipped (mode not registered in this checkout): {', '.join(skipped)}.")
    sampling = sampling_lines(rows)
    if sampling:
        lines += ["", *sampling]
    return "\n".join(lines) + "\n"


def plot_tta(runs: dict[str, list[dict]], rows: dict[str, dict], path: Path, title: str = "",
             score: str = "acc") -> Path:
    """Validation accuracy (or ``score``) against wall-clock, one line per variant (mean over seeds of the
    accuracy and of the wall-clock at each evaluation), one panel per model, the target
    dashed."""
    plt = pyplot()
    models = list(dict.fromkeys(v.split("-", 1)[0] for v in runs))
    fig, axes = plt.subplots(1, len(models), figsize=(6.2 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        target = None
        for v, rs in runs.items():
            if v.split("-", 1)[0] != model:
                continue
            curves = [run_curve(m, score) for m in rs]
            n = min(len(c[0]) for c in curves)
            t = [statistics.fmean(c[0][i] for c in curves) for i in range(n)]
            a = [statistics.fmean(c[1][i] for c in curves) for i in range(n)]
            mode = v.split("-", 1)[1]
            ax.plot(t, a, label=f"{mode} ({len(rs)} seeds)",
                    linewidth=2.0 if mode in ("vanilla", "adaqp") else 1.2,
                    linestyle="--" if "bf16" in mode else "-")
            target = rows.get(v, {}).get("target", target)
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1.0, label=f"target {target:.3f}")
            lo = min(target - 0.15, ax.get_ylim()[0])
            ax.set_ylim(max(lo, 0.0), None)
        ax.set_xlabel("wall-clock of the training epochs (s, evaluation excluded; mean over seeds)")
        ax.set_ylabel(f"validation {SCORE_LABEL.get(score, score)} (mean over seeds)")
        ax.set_title(f"{model}{': ' + title if title else ''}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="lower right")
    return save_figure(fig, path)


def load_bench_runs(dirs: Sequence[str | Path]) -> dict[str, list[dict]]:
    """``{MODEL-MODE: [metrics of each seed, in seed order]}`` from the bench folders
    ``dirs`` (``DIR/MODEL-MODE-sSEED/repK/metrics.json``). A seed (and repeat) found in two
    folders, a folder without runs or an unreadable metrics file is a ValueError."""
    found: dict[tuple[str, int, str], tuple[Path, dict]] = {}
    for d in map(Path, dirs):
        files = sorted(d.glob("*/rep*/metrics.json"))
        if not files:
            raise ValueError(f"{d}: no VARIANT/repK/metrics.json (is it a 'commsched bench gnn' --out folder?)")
        for f in files:
            vs = split_seed(f.parent.parent.name)
            if vs is None:
                raise ValueError(f"{f}: variant {f.parent.parent.name!r} has no {SEED_MARK}SEED suffix (run with --seeds)")
            key = (*vs, f.parent.name)
            if key in found:
                raise ValueError(f"{key[0]} seed {key[1]} ({key[2]}) is in both {found[key][0]} and {d}")
            try:
                found[key] = (d, json.loads(f.read_text()))
            except (OSError, ValueError) as e:
                raise ValueError(f"{f}: unreadable metrics ({e})") from None
    def order(key: tuple[str, int, str]) -> tuple:
        return (key[0].split("-", 1)[0], mode_rank(key[0].split("-", 1)[-1]), *key)

    runs: dict[str, list[dict]] = {}
    for key in sorted(found, key=order):
        runs.setdefault(key[0], []).append(found[key][1])
    return runs


def pool_report(dirs: Sequence[str | Path], out: str | Path, target_acc: float | None = None,
                frac: float = DEFAULT_TARGET_FRAC, score: str = "auto", sustain: int = 1) -> dict:
    """The time-to-accuracy report over the runs of several bench folders (one seed each at
    most once): ``OUT/time_to_acc.md`` (the table), ``time_to_acc.json`` (the rows) and
    ``time_to_acc.png``. Pairs for the speed-up are made seed by seed, so a variant needs
    the same seeds as Vanilla for its ratio."""
    runs = load_bench_runs(dirs)
    seeds = {v: [(m.get("config") or {}).get("seed") for m in rs] for v, rs in runs.items()}
    score = pick_score(runs, score)
    rows = tta_rows(runs, target_acc, frac, score, sustain)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = tta_table(rows)
    head = (f"# Time to accuracy, pooled\n\n- folders: {', '.join(str(d) for d in dirs)}\n"
            f"- seeds per variant: {', '.join(f'{v} {s}' for v, s in seeds.items())}\n"
            f"- score: {SCORE_LABEL[score]}; target held for {sustain} evaluation(s)\n\n")
    (out / "time_to_acc.md").write_text(head + table)
    write_json(out / "time_to_acc.json", {"dirs": [str(d) for d in dirs], "score": score, "sustain": sustain,
                                          "seeds": seeds, "rows": rows})
    plot_tta(runs, rows, out / "time_to_acc.png", title="pooled", score=score)
    return {"rows": rows, "table": table, "seeds": seeds, "score": score}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m commsched.bench.gnn.tta",
                                description="Pool the time-to-accuracy runs of several 'commsched bench gnn "
                                            "--metric time-to-acc --seeds ...' folders into one report.")
    p.add_argument("dirs", nargs="+", help="bench --out folders")
    p.add_argument("--out", required=True, help="folder for time_to_acc.{md,json,png}")
    p.add_argument("--target-acc", type=float, default=None, metavar="A")
    p.add_argument("--target-frac", type=float, default=DEFAULT_TARGET_FRAC, metavar="F")
    p.add_argument("--score", choices=SCORES, default="auto")
    p.add_argument("--sustain", type=int, default=1, metavar="S",
                   help="the target counts when held for S evaluations in a row (default 1: first crossing)")
    a = p.parse_args(argv)
    try:
        check_tta_args(a.target_acc, a.target_frac, a.sustain)
        res = pool_report(a.dirs, a.out, a.target_acc, a.target_frac, a.score, a.sustain)
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    print(res["table"], end="")
    print(f"wrote {a.out}/time_to_acc.md, .json, .png")
    return 0


__all__ = ["DEFAULT_TARGET_FRAC", "SAMPLING_MODE", "SCORES", "SEED_MARK", "mode_rank", "split_seed", "TTA_MODES", "TimeToTarget", "check_tta_args", "pick_score", "plot_tta", "run_curve", "sampling_lines", "targets", "time_to_target",
           "tta_rows", "tta_table", "load_bench_runs", "pool_report"]

if __name__ == "__main__":
    sys.exit(main())
