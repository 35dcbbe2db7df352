"""``commsched demo``: the main job on the embedded default (no download, no data path).

1. GNN: Vanilla against AdaQP, GCN on a seeded synthetic graph, 4 ranks, under the
   bench's emulated communication-bound rate when run as root (unshaped otherwise, with
   a note saying what that means). See ``commsched.bench.gnn.demo``.
2. MoE: a short inference run comparing static expert placement with Lina's two-phase
   placement on synthetic routing traces. See ``commsched.bench.moe.infer``.

Results land under ``--out`` (default ``runs/demo``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from .._lazy import require
from ..dist import DEVICE_CHOICES


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="commsched demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--skip-moe", action="store_true", help="run only the GNN part")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="where the ranks compute (auto: CUDA when every rank has its own GPU)")
    a = p.parse_args(list(argv or []))
    # METIS, the CP-SAT bit-width model and the figures: found missing before any run
    for module in ("pymetis", "ortools", "matplotlib"):
        require(module, "the demo (a GNN comparison under AdaQP, and figures)")
    from .gnn.demo import main as gnn_demo

    rc = gnn_demo(["--out", str(a.out / "gnn"), "--nproc", str(a.nproc), "--device", a.device])
    if rc or a.skip_moe:
        return rc
    from .moe.demo import main as moe_demo

    return moe_demo(["--out", str(a.out / "moe"), "--nproc", str(a.nproc), "--device", a.device])
