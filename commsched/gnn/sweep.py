"""Rate sweep: where AdaQP pays. ``python -m commsched.gnn.sweep [--rates 1gbit,300mbit,100mbit]``

Runs ``commsched bench gnn`` (vanilla and adaqp, GCN) once per emulated rate (plus
``none``: unshaped loopback) and plots AdaQP's per-epoch speed-up over Vanilla against
Vanilla's communication share of its epoch. Writes ``OUT/sweep.json``, ``OUT/sweep.md``
and ``OUT/sweep.png``; each rate's bench folder is ``OUT/<rate>/``. Needs root, ip and tc
for the shaped rates (the bench refuses them otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m commsched.gnn.sweep", description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="none,1gbit,600mbit,300mbit,100mbit")
    p.add_argument("--out", type=Path, default=Path("runs/gnn-sweep"))
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("bench_args", nargs="*", help="extra `commsched bench gnn` options (after --)")
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    from ..bench import run_bench

    points = []
    for rate in a.rates.split(","):
        out = a.out / rate
        s = run_bench("gnn", ["--bandwidth", rate, "--nproc", str(a.nproc), "--repeat", str(a.repeat),
                              "--models", "gcn", "--modes", "vanilla,adaqp,nocomm", "--out", str(out),
                              *a.bench_args])
        v, q = s["gnn"]["gcn-vanilla"], s["gnn"]["gcn-adaqp"]
        points.append({"rate": rate, "vanilla_comm_share": v["comm_share"],
                       "speedup": q.get("speedup_vs_vanilla"), "adaqp_x_nocomm": q.get("x_nocomm"),
                       "vanilla_epoch_s": v["epoch_time_s"], "adaqp_epoch_s": q["epoch_time_s"],
                       "adaqp_quant_share": q["quant_share"]})
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "sweep.json").write_text(json.dumps(points, indent=1))
    lines = ["| rate | vanilla comm share | vanilla s/epoch | adaqp s/epoch | speed-up | adaqp x nocomm | adaqp quant share |",
             "|---|---|---|---|---|---|---|"]
    for pt in points:
        lines.append(f"| {pt['rate']} | {pt['vanilla_comm_share']:.2f} | {pt['vanilla_epoch_s']:.3g} | "
                     f"{pt['adaqp_epoch_s']:.3g} | {pt['speedup']:.2f}x | {pt['adaqp_x_nocomm']:.2f} | "
                     f"{pt['adaqp_quant_share']:.2f} |")
    (a.out / "sweep.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    xs = [pt["vanilla_comm_share"] for pt in points]
    ys = [pt["speedup"] for pt in points]
    ax.plot(xs, ys, "o-")
    for pt in points:
        ax.annotate(pt["rate"], (pt["vanilla_comm_share"], pt["speedup"]), fontsize="small")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("Vanilla's communication share of its epoch")
    ax.set_ylabel("AdaQP speed-up per epoch (x)")
    fig.tight_layout()
    fig.savefig(a.out / "sweep.png", dpi=100)
    plt.close(fig)
    print("\n".join(lines))
    print(f"plot: {a.out / 'sweep.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
