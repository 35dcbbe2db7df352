"""The graph commands: ``commsched partition`` (partition a graph once and write a partition
folder) and ``commsched datasets`` (the named data sets, the data root, which are present).

``commsched partition`` is the command line of :mod:`commsched.gnn.graph.partition` (which is
library code and parses nothing): the graph options of :mod:`.flags`, ``--parts``,
``--method``, ``--seed``, ``--out``. Errors are one line and exit status 2
(:func:`commsched.dist.cli_main`).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Sequence

from ...dist import cli_error, cli_main
from ...results import prepare_out, read_error, write_json
from .data import load_source
from .flags import add_graph_args, source_from_args
from .partition import METHODS, partition_nodes, save_partition

PROG = "commsched partition"


def partition_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Partition a graph and write a partition "
                                "folder (meta.json + one file per part).")
    add_graph_args(p)
    p.add_argument("--parts", type=int, required=True, help="number of parts (= training world size)")
    p.add_argument("--method", choices=METHODS, default="metis")
    p.add_argument("--seed", type=int, default=0, help="partitioner seed")
    p.add_argument("--out", required=True, metavar="DIR", help="partition folder to write")
    return p


def partition_main(argv: Sequence[str] | None = None) -> int:
    a = partition_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
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
    # what the step cost, beside what it made: seconds per stage and this process's peak memory
    meta["times_s"] = {"load": t1 - t0, "partition": t2 - t1, "write": t3 - t2}
    meta["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    try:
        write_json(Path(a.out) / "meta.json", meta, indent=1)
    except OSError as e:
        raise ValueError(f"writing {a.out} failed ({read_error(e)})") from None
    gs = meta["graph"]
    print(f"{gs['name']}: {gs['num_nodes']} nodes, {gs['num_edges']} directed edges "
          f"(loaded in {t1 - t0:.1f} s); {a.method} into {a.parts} parts in {t2 - t1:.1f} s; "
          f"edge cut {meta['edge_cut']} ({meta['edge_cut'] / max(gs['num_edges'], 1):.1%}); "
          f"written to {a.out} in {t3 - t2:.1f} s")
    for s in meta["parts"]:
        print(f"  part {s['rank']}: {s['owned']} owned ({s['central']} central, {s['marginal']} "
              f"marginal), {s['remote']} remote, sends {s['send_rows']} rows")
    return 0


def datasets_main(argv: Sequence[str] | None = None) -> int:
    from .data import (
        DATASETS,
        dataset_home,
        dataset_status,
        default_data_root,
        download_dataset,
    )

    p = argparse.ArgumentParser(
        prog="commsched datasets",
        description="List the named GNN data sets (--dataset NAME) and whether each is in the "
                    "data root; a missing one is downloaded there by torch_geometric the first "
                    "time a command uses it, or now with --download NAME.")
    p.add_argument("--data-root", metavar="DIR",
                   help="the folder to look in (default $COMMSCHED_DATA, else "
                        "~/.cache/commsched/data)")
    p.add_argument("--download", metavar="NAME", choices=[d for d in DATASETS if d != "synthetic"],
                   help="download this data set into the data root (when missing)")
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    root = Path(a.data_root) if a.data_root else default_data_root()
    try:
        if a.download:
            print(f"{a.download}: {download_dataset(a.download, root)}")
            return 0
        rows = dataset_status(root)
    except ValueError as e:
        return cli_error("commsched datasets", e)
    print(f"data root: {root}" + ("" if root.is_dir() else " (does not exist yet)"))
    width = max(len(n) for n, _ in rows)
    for name, where in rows:
        state = f"present  {where}" if where is not None else \
            f"missing  (downloaded to {dataset_home(name, root)} on first use)"
        print(f"  {name:<{width}}  {state}")
    print(f"  {'synthetic':<{width}}  embedded  (generated; the default without --dataset/--graph)")
    return 0
