"""``commsched partition``: partition a graph once and write a partition folder.

The command line of :mod:`commsched.gnn.graph.partition` (which is library code and parses
nothing): the graph options of :mod:`.cliargs`, ``--parts``, ``--method``, ``--seed``,
``--out``. Errors are one line and exit status 2 (:func:`commsched.dist.cli_main`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from ...dist import cli_main
from ...results import prepare_out, read_error
from .data import load_source
from .flags import add_graph_args, source_from_args
from .partition import METHODS, partition_nodes, save_partition

PROG = "commsched partition"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Partition a graph and write a partition "
                                "folder (meta.json + one file per part).")
    add_graph_args(p)
    p.add_argument("--parts", type=int, required=True, help="number of parts (= training world size)")
    p.add_argument("--method", choices=METHODS, default="metis")
    p.add_argument("--seed", type=int, default=0, help="partitioner seed")
    p.add_argument("--out", required=True, metavar="DIR", help="partition folder to write")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return cli_main(PROG, lambda: _run(a))


def _run(a: argparse.Namespace) -> int:
    src = source_from_args(a)
    prepare_out(a.out)  # the folder is made (or refused) before any work
    t0 = time.perf_counter()
    g = load_source(src)
    t1 = time.perf_counter()
    parts = partition_nodes(g, a.parts, a.method, a.seed)
    t2 = time.perf_counter()
    try:
        meta = save_partition(a.out, g, parts, a.parts, method=a.method, seed=a.seed, source=src)
    except OSError as e:  # the disk filled up, the folder went away
        raise ValueError(f"writing {a.out} failed ({read_error(e)})") from None
    t3 = time.perf_counter()
    gs = meta["graph"]
    print(f"{gs['name']}: {gs['num_nodes']} nodes, {gs['num_edges']} directed edges "
          f"(loaded in {t1 - t0:.1f} s); {a.method} into {a.parts} parts in {t2 - t1:.1f} s; "
          f"edge cut {meta['edge_cut']} ({meta['edge_cut'] / max(gs['num_edges'], 1):.1%}); "
          f"written to {a.out} in {t3 - t2:.1f} s")
    for s in meta["parts"]:
        print(f"  part {s['rank']}: {s['owned']} owned ({s['central']} central, {s['marginal']} "
              f"marginal), {s['remote']} remote, sends {s['send_rows']} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
