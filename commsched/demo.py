"""``commsched demo``: the main job on the embedded default (no download, no data path).

Until the GNN and MoE front-ends land, the demo is the core exchange benchmark at a
small size: both all-to-all patterns on 4 local ranks, beside loopback throughput.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="commsched demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--nproc", type=int, default=4)
    a = p.parse_args(list(argv or []))
    from .bench import run_bench

    run_bench("all2all", ["--nproc", str(a.nproc), "--out", str(a.out / "all2all"),
                          "--sizes", f"{64 << 10},{1 << 20}", "--min-time", "0.5"])
    print((a.out / "all2all" / "summary.md").read_text())
    return 0
