"""The GNN part of ``commsched demo``: Vanilla against AdaQP on a reduced default.

4 ranks, a 10,000-node synthetic graph, GCN (3 x 256, LayerNorm), a few epochs. As root
with ``ip``/``tc`` the runs go through the bench's default emulated rate (the regime
where Vanilla spends most of its epoch communicating); otherwise they run on unshaped
loopback, where communication is nearly free and AdaQP's quantization is not repaid
(the printed note says so). Prints the comparison table and where the plots are.

``main(argv)`` is the entry point the top-level demo calls.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from ...dist import DEVICE_CHOICES

UNSHAPED_NOTE = ("NOTE: no bandwidth emulation here (needs root, ip and tc), so the ranks talk "
                 "over unshaped loopback, where moving bytes costs almost nothing: AdaQP's "
                 "quantization then costs more than it saves and Vanilla may well be faster. "
                 "AdaQP pays where communication dominates the epoch; run as root (or pass "
                 "--bandwidth RATE to `commsched bench gnn`) to see that regime.")


SYN_NODES = 10_000


def accuracy_note(epochs: int, nodes: int = SYN_NODES) -> str:
    """The footnote under the table: what its accuracies are (pure)."""
    from ...gnn.graph.data import SyntheticSpec

    classes = SyntheticSpec().num_classes
    return (f"* test accuracy: after {epochs} epochs on a synthetic {nodes:,}-node graph of {classes} "
            f"classes (chance: {1 / classes:.2f}), enough to time the epochs, not to train the model: "
            "far from converged. For accuracy, run `commsched bench gnn` with its default epochs, "
            "or see docs/results.md.")


def demo_argv(out: Path, nproc: int, epochs: int, device: str = "auto") -> list[str]:
    """The reduced bench command line (also what the README quotes)."""
    return ["--nproc", str(nproc), "--out", str(out), "--models", "gcn", "--modes", "vanilla,adaqp",
            "--syn-nodes", str(SYN_NODES), "--syn-edges", "100000", "--epochs", str(epochs),
            "--eval-every", str(epochs), "--period", "3", "--device", device]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m commsched.bench.gnn.demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/demo/gnn"))
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    a = p.parse_args(list(argv or []))
    from ..workloads import run_bench

    summary = run_bench("gnn", demo_argv(a.out, a.nproc, a.epochs, a.device))
    meta = summary["meta"]
    print(f"\n== commsched demo: Vanilla vs AdaQP, GCN on a synthetic graph, {a.nproc} ranks ==")
    print(f"emulated rate: {meta.get('bandwidth') or 'none (unshaped loopback)'}")
    if not meta.get("bandwidth"):
        print(UNSHAPED_NOTE)
    print(summary["extra_tables"]["AdaQP against Vanilla (per model)"])
    print(accuracy_note(a.epochs))
    print(f"\nsummary: {a.out / 'summary.md'}")
    for path in summary.get("plots", []):
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
