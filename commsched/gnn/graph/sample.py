"""Neighbour sampling for mini-batch training (``--mode minibatch``). Pure numpy.

Legend: N nodes of the graph, E directed edges (source -> target), B seeds of a batch,
S nodes of a sampled subgraph, L hops (one per layer), P ranks.

The sampling is that of torch_geometric's ``NeighborLoader`` (``directed=True``, no
replacement): hop 0 expands the seeds, hop h the nodes first reached at hop h - 1; a node
is expanded once, keeping ``fanouts[h]`` of its in-edges drawn uniformly without
replacement (all of them when it has no more, or when the fan-out is -1). The subgraph
lists the seeds first, then the nodes each hop reached, and holds exactly the sampled
edges; the model runs on every node of it and the loss is taken on the seeds. With every
fan-out -1 and L hops, the seeds' L-layer outputs equal the full graph's.

:func:`subgraph_book` turns a sample into a one-part
:class:`~commsched.gnn.graph.book.PartitionBook`, so commsched's own layers run on it as
on a part: every node owned and central, the in-degrees (which weigh the edges under the
``gcn`` and ``mean`` norms) those of the subgraph for the expanded nodes (the mean of the
sampled neighbours, as torch_geometric's layers take it on a sampled batch) and the
whole graph's for the last hop's nodes, which are not expanded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .book import PartitionBook

# the fan-outs of torch_geometric's examples, by layer count (examples/reddit.py: [25, 10] for
# two layers; examples/ogbn_products_sage.py: [15, 10, 5] for three; both batches of 1024)
DEFAULT_FANOUTS = {1: (10,), 2: (25, 10), 3: (15, 10, 5)}
DEFAULT_BATCH_SIZE = 1024  # the batch size of those examples
ALL = -1  # a fan-out keeping every neighbour


def default_fanouts(layers: int) -> tuple[int, ...]:
    """The fan-outs of an ``layers``-layer model: :data:`DEFAULT_FANOUTS`, else
    ``(15, 10, 5, 5, ...)`` (5 for every hop past the third)."""
    if layers < 1:
        raise ValueError(f"a model needs at least one layer, got {layers}")
    return DEFAULT_FANOUTS.get(layers, DEFAULT_FANOUTS[3] + (5,) * (layers - 3))


def parse_fanouts(text: str) -> tuple[int, ...]:
    """``"25,10"`` -> ``(25, 10)``; ``""`` -> ``()`` (the defaults by layer count). Each
    fan-out is a positive count or -1 (every neighbour)."""
    if not text.strip():
        return ()
    try:
        out = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise ValueError(f"--fanouts must be comma-separated integers (e.g. 25,10; -1 keeps every "
                         f"neighbour), got {text!r}") from None
    bad = [f for f in out if f < 1 and f != ALL]
    if bad:
        raise ValueError(f"--fanouts: each fan-out is a count >= 1 or -1 (every neighbour), got {bad[0]}")
    return out


@dataclass(frozen=True, eq=False)
class InNeighbours:
    """The in-edges of every node in CSR form: node v's sources are
    ``sources[indptr[v]:indptr[v + 1]]`` (sorted)."""

    indptr: np.ndarray   # int64 [N + 1]
    sources: np.ndarray  # int64 [E]

    @classmethod
    def from_edges(cls, src_E: np.ndarray, dst_E: np.ndarray, num_nodes: int) -> "InNeighbours":
        src_E = np.asarray(src_E, dtype=np.int64)
        dst_E = np.asarray(dst_E, dtype=np.int64)
        order = np.lexsort((src_E, dst_E))
        indptr = np.zeros(num_nodes + 1, dtype=np.int64)
        np.cumsum(np.bincount(dst_E, minlength=num_nodes), out=indptr[1:])
        return cls(indptr, src_E[order])

    @property
    def num_nodes(self) -> int:
        return int(self.indptr.size - 1)

    @property
    def in_degree(self) -> np.ndarray:
        """int64 [N]."""
        return np.diff(self.indptr)

    @property
    def nbytes(self) -> int:
        return int(self.indptr.nbytes + self.sources.nbytes)


@dataclass(frozen=True, eq=False)
class Sample:
    """A sampled subgraph: ``node_ids`` [S] (global ids: the seeds, then each hop's new
    nodes), the sampled edges ``edge_src`` -> ``edge_dst`` in local ids sorted by (dst,
    src), and ``num_expanded``: the first nodes, whose in-edges were sampled."""

    node_ids: np.ndarray
    num_seeds: int
    edge_src: np.ndarray
    edge_dst: np.ndarray
    num_expanded: int

    @property
    def num_nodes(self) -> int:
        return int(self.node_ids.size)


def sample_neighbours(adj: InNeighbours, seeds_B: np.ndarray, fanouts: tuple[int, ...],
                      rng: np.random.Generator) -> Sample:
    """The subgraph of ``len(fanouts)`` hops around the distinct ``seeds_B`` (see the
    module doc); the draws come from ``rng``."""
    seeds = np.asarray(seeds_B, dtype=np.int64)
    if np.unique(seeds).size != seeds.size:
        raise ValueError("sample_neighbours: the seeds must be distinct")
    if seeds.size and (seeds.min() < 0 or seeds.max() >= adj.num_nodes):
        raise ValueError(f"sample_neighbours: seed ids must lie in [0, {adj.num_nodes})")
    nodes = [seeds]
    known = np.sort(seeds)
    frontier = np.arange(seeds.size, dtype=np.int64)  # local ids of the nodes to expand
    srcs, dsts = [], []
    expanded = 0
    for k in fanouts:
        f_gid = np.concatenate(nodes)[frontier] if frontier.size else frontier
        start, deg = adj.indptr[f_gid], adj.in_degree[f_gid]
        seg = np.repeat(np.arange(frontier.size), deg)
        pos = np.arange(int(deg.sum())) - np.repeat(np.cumsum(deg) - deg, deg)  # within a segment
        edge = np.repeat(start, deg) + pos
        if k != ALL and edge.size:
            order = np.lexsort((rng.random(edge.size), seg))  # a random order within each node
            seg, edge = seg[order], edge[order]
            keep = pos < k  # pos read as the rank in that order (segments keep their sizes)
            seg, edge = seg[keep], edge[keep]
        src_gid = adj.sources[edge]
        new = np.unique(src_gid)
        new = new[~np.isin(new, known, assume_unique=True)]
        expanded += frontier.size
        base = sum(a.size for a in nodes)
        nodes.append(new)
        known = np.union1d(known, new)
        all_ids = np.concatenate(nodes)
        sorter = np.argsort(all_ids, kind="stable")
        srcs.append(sorter[np.searchsorted(all_ids, src_gid, sorter=sorter)])
        dsts.append(frontier[seg])
        frontier = np.arange(base, base + new.size, dtype=np.int64)
    s = np.concatenate(srcs) if srcs else np.zeros(0, dtype=np.int64)
    d = np.concatenate(dsts) if dsts else np.zeros(0, dtype=np.int64)
    order = np.lexsort((s, d))
    return Sample(np.concatenate(nodes), int(seeds.size), s[order], d[order], expanded)


def subgraph_book(sample: Sample, in_degree_N: np.ndarray) -> PartitionBook:
    """A one-part book of ``sample`` (see the module doc); ``in_degree_N``: the whole
    graph's in-degrees (the last hop's nodes keep theirs)."""
    S = sample.num_nodes
    deg = np.asarray(in_degree_N, dtype=np.int64)[sample.node_ids].copy()
    deg[:sample.num_expanded] = np.bincount(sample.edge_dst, minlength=S)[:sample.num_expanded]
    empty = np.zeros(0, dtype=np.int64)
    return PartitionBook(rank=0, num_parts=1, num_nodes=int(in_degree_N.size),
                         global_ids=sample.node_ids, num_central=S, num_marginal=0,
                         edge_src=sample.edge_src, edge_dst=sample.edge_dst, in_degree=deg,
                         send_idx=empty, send_counts=(0,), recv_counts=(0,))


def num_batches(seeds_P: list[int] | tuple[int, ...], batch_size: int) -> int:
    """Mini-batches per epoch on every rank: the most any rank's ``seeds_P[r]`` training
    nodes fill (at least one), so the ranks step together."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    return max(1, max((-(-int(n) // batch_size) for n in seeds_P), default=1))


def epoch_batches(seeds_n: np.ndarray, batch_size: int, count: int,
                  rng: np.random.Generator) -> list[np.ndarray]:
    """``count`` batches of one epoch: ``seeds_n`` shuffled, cut into batches of
    ``batch_size`` (the last one shorter), repeated from the first when this rank has
    fewer than ``count`` (a rank without seeds gets empty batches)."""
    perm = np.asarray(seeds_n, dtype=np.int64)[rng.permutation(len(seeds_n))]
    own = [perm[i:i + batch_size] for i in range(0, perm.size, batch_size)] or [perm]
    return [own[i % len(own)] for i in range(count)]


__all__ = ["ALL", "DEFAULT_BATCH_SIZE", "DEFAULT_FANOUTS", "InNeighbours", "Sample", "default_fanouts",
           "epoch_batches", "num_batches", "parse_fanouts", "sample_neighbours", "subgraph_book"]
