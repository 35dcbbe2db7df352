"""The MoE part of ``commsched demo``: static expert placement against Lina's two-phase
placement at inference, on synthetic routing traces (skewed, sticky expert popularity),
4 ranks, unshaped loopback, a few batches. Prints the table and where the heat map is.

``main(argv)`` is the entry point the top-level demo calls.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from ...dist import DEVICE_CHOICES


def latency_note(batches: int) -> str:
    """The footnote under the table: where its latencies come from (pure)."""
    from .infer import DEFAULTS

    return (f"* latencies: {batches} batches of synthetic routing traces; each rank's experts compute on an "
            f"emulated accelerator, busy {DEFAULTS['us_per_row']:g} us per row it computes (the host sleeps "
            "meanwhile), while the rows cross the real all-to-all on unshaped loopback: compare the "
            "placements with each other, not with a GPU's milliseconds (docs/moe_inference.md).")


def demo_argv(out: Path, nproc: int, batches: int, device: str = "auto") -> list[str]:
    """The reduced bench command line."""
    return ["--nproc", str(nproc), "--variants", "static,lina", "--batches", str(batches),
            "--warmup", "2", "--bandwidth", "none", "--device", device, "--out", str(out)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m commsched.bench.moe.demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/demo/moe"))
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    a = p.parse_args(list(argv or []))
    from ..workloads import run_bench

    summary = run_bench("moe-infer", demo_argv(a.out, a.nproc, a.batches, a.device))
    print(f"\n== commsched demo: MoE inference, static vs Lina placement, {a.nproc} ranks ==")
    med = summary["median"]
    print("| placement | p50 ms | p95 ms | mean imbalance (max/mean device load) |")
    print("|---|---|---|---|")
    for v, m in med.items():
        def f(x):
            return "-" if x is None else f"{x:.4g}"
        print(f"| {v} | {f(m.get('latency_ms.p50'))} | {f(m.get('latency_ms.p95'))} | {f(m.get('imbalance'))} |")
    print(latency_note(a.batches))
    print(f"\nsummary: {a.out / 'summary.md'}")
    for name in ("heatmap.png", "breakdown.png"):
        if (a.out / name).exists():
            print(f"plot: {a.out / name}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
