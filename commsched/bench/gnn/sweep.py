"""Rate sweep: where AdaQP pays. ``python -m commsched.bench.gnn.sweep [--rates 1gbit,300mbit,100mbit] [-- BENCH OPTIONS]``

Runs ``commsched bench gnn`` (vanilla, adaqp and the timing-only nocomm, GCN) once per
emulated rate (``none``: unshaped loopback) and plots AdaQP's per-epoch speed-up over
Vanilla against Vanilla's communication share of its epoch. Options after ``--`` go to
every bench run (e.g. ``-- --epochs 10 --period 3``). Writes ``OUT/sweep.json``,
``OUT/sweep.md`` and ``OUT/sweep.png`` (rewritten after every rate, so an interrupted
sweep keeps what it measured); each rate's bench folder is ``OUT/<rate>/``.
``--collect`` rebuilds the three files from those folders without running anything.
Needs root, ip and tc for the shaped rates (the bench refuses them otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from ...results import write_json
from ..plots import pyplot, save_figure

DEFAULT_RATES = "none,1gbit,600mbit,300mbit,100mbit"


def point_from_summary(rate: str, summary: dict) -> dict:
    """One sweep point from a ``commsched bench gnn`` summary (its ``gnn`` rows)."""
    rows = summary.get("gnn") or {}
    if "gcn-vanilla" not in rows or "gcn-adaqp" not in rows:
        raise ValueError(f"rate {rate}: the bench summary has no gcn-vanilla/gcn-adaqp rows "
                         f"(has {sorted(rows)}); run it with --models gcn --modes vanilla,adaqp[,nocomm]")
    v, q = rows["gcn-vanilla"], rows["gcn-adaqp"]
    noc = rows.get("gcn-nocomm") or {}
    return {"rate": rate, "vanilla_comm_share": v.get("comm_share"), "speedup": q.get("speedup_vs_vanilla"),
            "adaqp_x_nocomm": q.get("x_nocomm"), "vanilla_epoch_s": v.get("epoch_time_s"),
            "adaqp_epoch_s": q.get("epoch_time_s"), "nocomm_epoch_s": noc.get("epoch_time_s"),
            "adaqp_comm_share": q.get("comm_share"), "adaqp_quant_share": q.get("quant_share"),
            "vanilla_MB_per_epoch": v.get("bytes_per_epoch_MB"),
            "adaqp_MB_per_epoch": q.get("bytes_per_epoch_MB")}


def sweep_table(points: Sequence[dict]) -> str:
    """Markdown table of the sweep points (``-`` where a figure is missing)."""
    cols = (("rate", "rate", "{}"), ("vanilla comm share", "vanilla_comm_share", "{:.2f}"),
            ("vanilla s/epoch", "vanilla_epoch_s", "{:.3g}"), ("adaqp s/epoch", "adaqp_epoch_s", "{:.3g}"),
            ("speed-up", "speedup", "{:.2f}x"), ("adaqp comm share", "adaqp_comm_share", "{:.2f}"),
            ("adaqp quant share", "adaqp_quant_share", "{:.2f}"),
            ("nocomm s/epoch", "nocomm_epoch_s", "{:.3g}"), ("adaqp x nocomm", "adaqp_x_nocomm", "{:.2f}"))
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|---" * len(cols) + "|"]
    for pt in points:
        cells = ["-" if pt.get(k) is None else fmt.format(pt[k]) for _, k, fmt in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_sweep(points: Sequence[dict], path: Path) -> Path:
    """Speed-up against Vanilla's communication share, one labelled point per rate."""
    plt = pyplot()

    pts = sorted((p for p in points if p.get("vanilla_comm_share") is not None and p.get("speedup") is not None),
                 key=lambda p: p["vanilla_comm_share"])
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot([p["vanilla_comm_share"] for p in pts], [p["speedup"] for p in pts], "o-")
    for p in pts:
        ax.annotate(p["rate"], (p["vanilla_comm_share"], p["speedup"]), fontsize="small",
                    xytext=(4, -10), textcoords="offset points")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlim(0, 1)
    ax.set_xlabel("Vanilla's communication share of its epoch")
    ax.set_ylabel("AdaQP speed-up per epoch over Vanilla (x)")
    ax.grid(alpha=0.3)
    save_figure(fig, path)
    return path


def write_outputs(points: Sequence[dict], out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "sweep.json", list(points), indent=1)
    table = sweep_table(points)
    (out / "sweep.md").write_text(table)
    if points:
        plot_sweep(points, out / "sweep.png")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m commsched.bench.gnn.sweep", description=__doc__.splitlines()[0])
    p.add_argument("--rates", default=DEFAULT_RATES, help=f"comma-separated (default {DEFAULT_RATES})")
    p.add_argument("--out", type=Path, default=Path("runs/gnn-sweep"))
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--collect", action="store_true",
                   help="only rebuild sweep.json/.md/.png from OUT/<rate>/summary.json")
    p.add_argument("bench_args", nargs="*", help="extra `commsched bench gnn` options (after --)")
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    rates = [r.strip() for r in a.rates.split(",") if r.strip()]
    points = []
    for rate in rates:
        out = a.out / rate
        if a.collect:
            if not (out / "summary.json").exists():
                print(f"sweep: no {out / 'summary.json'}; rate {rate} skipped", file=sys.stderr)
                continue
            s = json.loads((out / "summary.json").read_text())
        else:
            from ..workloads import run_bench

            s = run_bench("gnn", ["--bandwidth", rate, "--nproc", str(a.nproc), "--repeat", str(a.repeat),
                                  "--models", "gcn", "--modes", "vanilla,adaqp,nocomm", "--out", str(out),
                                  *a.bench_args])
        points.append(point_from_summary(rate, s))
        write_outputs(points, a.out)
    table = write_outputs(points, a.out)
    print(table)
    print(f"plot: {a.out / 'sweep.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
