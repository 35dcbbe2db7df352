"""``commsched datasets``: the named GNN data sets, the data root, which are present there."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from ...dist import cli_error
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


if __name__ == "__main__":
    sys.exit(main())
