"""Command-line options shared by ``commsched partition`` and ``-m commsched.gnn.train``.

Parsing lives in the CLI modules; this file only adds arguments to a parser and turns
the parsed namespace into a :class:`~commsched.gnn.graph.data.GraphSource`.
"""

from __future__ import annotations

import argparse

from .data import DATASETS, GraphSource, SyntheticSpec

_SYN = SyntheticSpec()


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
    s = p.add_argument_group("synthetic graph")
    s.add_argument("--syn-nodes", type=int, default=_SYN.num_nodes)
    s.add_argument("--syn-edges", type=int, default=_SYN.num_edges, help="undirected edge pairs")
    s.add_argument("--syn-features", type=int, default=_SYN.num_features)
    s.add_argument("--syn-classes", type=int, default=_SYN.num_classes)
    s.add_argument("--syn-communities", type=int, default=_SYN.communities_per_class,
                   help="communities per class")
    s.add_argument("--syn-homophily", type=float, default=_SYN.homophily)
    s.add_argument("--syn-degree-exponent", type=float, default=_SYN.degree_exponent)
    s.add_argument("--syn-signal", type=float, default=_SYN.signal)
    s.add_argument("--syn-seed", type=int, default=_SYN.seed)


_SYN_ARGS = {"syn_nodes": _SYN.num_nodes, "syn_edges": _SYN.num_edges,
             "syn_features": _SYN.num_features, "syn_classes": _SYN.num_classes,
             "syn_communities": _SYN.communities_per_class, "syn_homophily": _SYN.homophily,
             "syn_degree_exponent": _SYN.degree_exponent, "syn_signal": _SYN.signal,
             "syn_seed": _SYN.seed}


def graph_args_given(a: argparse.Namespace) -> bool:
    """Whether the command line named a graph (a data set, a file or synthetic options)."""
    return (a.graph is not None or a.dataset is not None
            or any(getattr(a, k) != v for k, v in _SYN_ARGS.items()))


def source_from_args(a: argparse.Namespace) -> GraphSource:
    if a.graph:
        return GraphSource(kind="file", name=a.graph, path=a.graph, split=a.split, directed=a.directed)
    if a.dataset and a.dataset.lower() != "synthetic":
        return GraphSource(kind="dataset", name=a.dataset.lower(), data_root=a.data_root,
                           split=a.split, directed=a.directed)
    spec = SyntheticSpec(num_nodes=a.syn_nodes, num_edges=a.syn_edges, num_features=a.syn_features,
                         num_classes=a.syn_classes, communities_per_class=a.syn_communities,
                         homophily=a.syn_homophily, degree_exponent=a.syn_degree_exponent,
                         signal=a.syn_signal, seed=a.syn_seed)
    return GraphSource(kind="synthetic", synthetic=spec)
