"""Figures of the benchmarks: matplotlib on the file-only Agg backend, one save sequence,
and the stacked time-breakdown bars every bench writes."""

from __future__ import annotations

from pathlib import Path

from .._lazy import require


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed); the
    ``plots`` extra."""
    matplotlib = require("matplotlib", "the figures of a bench")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 100) -> Path:
    """Lay ``fig`` out, write it to ``path`` (PNG; the folder is created), free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_breakdown(medians: dict[str, dict[str, float]], path: Path, title: str = "") -> Path:
    """One stacked bar per variant, one segment per part of its time breakdown (PNG)."""
    plt = pyplot()

    variants = list(medians)
    parts: list[str] = []
    for m in medians.values():
        parts += [k for k in m if k not in parts]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(variants) + 2.5), 4.0))
    bottom = [0.0] * len(variants)
    for k in parts:
        vals = [medians[v].get(k, 0.0) for v in variants]
        ax.bar(variants, vals, bottom=bottom, label=k)
        bottom = [b + x for b, x in zip(bottom, vals)]
    ax.set_ylabel("seconds (median over repeats)")
    ax.set_title(title or "time breakdown per variant")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    save_figure(fig, path)
    return path


__all__ = ["plot_breakdown", "pyplot", "save_figure", "scaling_main", "scaling_report"]


# ---------------------------------------------------------------------------- scaling series
def _scaling_point(summary: dict) -> tuple[int, str, str, dict[str, float]]:
    """(GPUs, cluster, time key, {variant: predicted seconds on the cluster}) of one bench
    summary on an emulated cluster."""
    meta = summary.get("meta") or {}
    emu = meta.get("emulation") or {}
    hosts = int(meta.get("hosts") or emu.get("hosts") or 1)
    gpus = hosts * int(meta.get("nproc") or 1)
    key = next((k for k in ("step_time_s", "epoch_time_s", "p95_s") if
                any(k in (m or {}) for m in (summary.get("median") or {}).values())), None)
    cl = summary.get("cluster") or {}
    k = cl.get("dilation")
    if key is None or not k:
        raise ValueError("not a summary of a bench on an emulated cluster (--cluster): it has no time or no k")
    times = {v: m[key] / k for v, m in (summary.get("median") or {}).items() if (m or {}).get(key)}
    return gpus, str(emu.get("cluster") or f"{gpus} GPUs"), key, times


def scaling_report(summaries: dict[str, dict], out: Path, baseline: str | None = None) -> tuple[str, Path]:
    """The scaling series of bench runs on emulated clusters of different sizes (``{run
    folder: summary.json}``): per variant and size the predicted time on the cluster and
    its ratio to ``baseline`` (default: the runs' own baseline) in the same run, as a
    markdown table (returned) and a plot (``out/scaling.png``: the ratio against the GPU
    count, and the time). Several runs of one size are merged (a variant from the first
    that has it, its ratio against that run's baseline); a variant missing at a size is '-'."""
    def base_of(s: dict, v: str) -> str | None:
        """The variant ``v``'s baseline in summary ``s``: ``baseline`` when given, else the
        run's own (one name, or a name per variant as ``bench gnn`` records it)."""
        if baseline:
            return baseline
        b = s.get("baseline")
        if isinstance(b, dict):
            return b.get(v) or (v if v in b.values() else None)
        return b

    names = {n for s in summaries.values() for v in (s.get("median") or {}) if (n := base_of(s, v))}
    if not names:
        raise ValueError("no baseline variant: name one with --baseline")
    base = " / ".join(sorted(names))
    sizes: dict[int, dict] = {}
    for s in summaries.values():
        gpus, cluster, key, times = _scaling_point(s)
        pt = sizes.setdefault(gpus, {"cluster": cluster, "key": key, "times": {}, "ratios": {}})
        for v, t in times.items():
            if v not in pt["times"]:
                b = base_of(s, v)
                pt["times"][v] = t
                pt["ratios"][v] = times[b] / t if b in times else None
    points = [(g, p["cluster"], p["key"], p["times"], p["ratios"]) for g, p in sorted(sizes.items())]
    variants = list(dict.fromkeys(v for p in points for v in p[3]))
    unit = "ms"
    head = " | ".join(f"{g} GPUs ({c}): {unit}, {base} / it" for g, c, *_ in points)
    lines = [f"| variant | {head} |", "|---" * (len(points) + 1) + "|"]
    ratios: dict[str, list[float | None]] = {}
    for v in variants:
        cells, rs = [], []
        for _, _, _, t, rr in points:
            r = rr.get(v)
            rs.append(r)
            cells.append("-" if v not in t else f"{1e3 * t[v]:.4g} / {'-' if r is None else f'{r:.2f}x'}")
        ratios[v] = rs
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines += ["", f"Each cell: the predicted {points[0][2].replace('_s', '')} on the real cluster (measured / k, "
                  f"median over repeats) and {base}'s time over the variant's in the same run (> 1: faster than "
                  f"{base})."]
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    gpus = [p[0] for p in points]
    for v in variants:
        ts = [1e3 * p[3][v] if v in p[3] else None for p in points]
        ax1.plot(gpus, [r if r is not None else float("nan") for r in ratios[v]], marker="o", label=v)
        ax2.plot(gpus, [t if t is not None else float("nan") for t in ts], marker="o", label=v)
    ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax1.set(xlabel="emulated GPUs", ylabel=f"{base} time / variant time", xticks=gpus, title="speed-up over " + base)
    ax2.set(xlabel="emulated GPUs", ylabel=f"predicted time on the cluster ({unit})", xticks=gpus, title="time")
    ax1.legend(fontsize=7)
    return "\n".join(lines), save_figure(fig, Path(out) / "scaling.png")


def scaling_main(argv=None) -> int:
    """``commsched scaling RUN... --out DIR [--baseline V]``: the scaling table and plot of
    bench runs on emulated clusters of different sizes."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="commsched scaling", description=scaling_main.__doc__)
    p.add_argument("runs", nargs="+", help="bench output folders (each with summary.json), one per cluster size")
    p.add_argument("--out", required=True, help="folder for scaling.md and scaling.png")
    p.add_argument("--baseline", default=None, help="variant the ratios are against (default: the runs' baseline)")
    a = p.parse_args(argv)
    summaries = {}
    for d in a.runs:
        f = Path(d) / "summary.json"
        try:
            summaries[d] = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            print(f"commsched scaling: cannot read {f}: {e}", file=sys.stderr)
            return 2
    try:
        table, png = scaling_report(summaries, Path(a.out), a.baseline)
    except ValueError as e:
        print(f"commsched scaling: {e}", file=sys.stderr)
        return 2
    Path(a.out, "scaling.md").write_text(f"{table}\n\n![scaling]({png.name})\n")
    print(table)
    print(f"\nwrote {Path(a.out) / 'scaling.md'} and {png}")
    return 0
