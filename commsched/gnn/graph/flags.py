"""Command-line options shared by ``commsched partition`` and ``-m commsched.gnn.train``.

Parsing lives in the CLI modules; this file only adds arguments to a parser and turns
the parsed namespace into a :class:`~commsched.gnn.graph.data.GraphSource`. The synthetic
graph's flags (``--syn-*``) are generated from :class:`~commsched.gnn.graph.data.SyntheticSpec`'s
fields (:func:`commsched.configurable.add_arguments`).
"""

from __future__ import annotations

import argparse

from ...configurable import add_arguments, from_arguments
from .data import DATASETS, GraphSource, SyntheticSpec

_SYN = "syn-"  # the synthetic graph's flags: --syn-FIELD (or the field's own flag)


def add_graph_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("graph (default: the embedded synthetic graph)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--dataset", default=None,
                     help=f"named data set: {', '.join(DATASETS)} (default synthetic)")
    src.add_argument("--graph", metavar="FILE.npz", help="a graph file (DESIGN.md 'Graph files')")
    g.add_argument("--data-root", metavar="DIR",
                   help="folder of the named data sets: read there, downloaded there when missing "
                        "(default $COMMSCHED_DATA, else ~/.cache/commsched/data; "
                        "`commsched datasets` lists them)")
    g.add_argument("--split", type=int, default=0, help="mask split of multi-split files (default 0)")
    g.add_argument("--directed", action="store_true", help="keep edges directed (default: undirected)")
    add_arguments(p.add_argument_group("synthetic graph"), SyntheticSpec, prefix=_SYN)


def _synthetic(a: argparse.Namespace) -> SyntheticSpec:
    return from_arguments(SyntheticSpec, a, prefix=_SYN)


def graph_args_given(a: argparse.Namespace) -> bool:
    """Whether the command line named a graph (a data set, a file or synthetic options)."""
    return a.graph is not None or a.dataset is not None or _synthetic(a) != SyntheticSpec()


def source_from_args(a: argparse.Namespace) -> GraphSource:
    if a.graph:
        return GraphSource(kind="file", name=a.graph, path=a.graph, split=a.split, directed=a.directed)
    if a.dataset and a.dataset.lower() != "synthetic":
        return GraphSource(kind="dataset", name=a.dataset.lower(), data_root=a.data_root,
                           split=a.split, directed=a.directed)
    return GraphSource(kind="synthetic", synthetic=_synthetic(a))
