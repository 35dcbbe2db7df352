"""The partition book: what one rank owns, what it needs, what it sends. Pure numpy.

Legend: N global nodes, P parts (ranks), E directed edges (source -> target),
L local nodes of one rank (owned + remote), T rows this rank sends per exchange.

For rank r, with ``parts[v]`` the owner of node v:

* **owned** (local) nodes: ``parts[v] == r``; their in-edges are all stored here.
* **remote** (halo) nodes: owned elsewhere, source of an in-edge of an owned node.
* **marginal** nodes: owned nodes with at least one remote in-neighbour; **central**
  nodes: owned nodes whose in-neighbours are all owned (their aggregation needs no
  communication, so it can run while the marginal exchange is in flight).

Local ids order the nodes central | marginal | remote; within central and marginal by
global id, remote by (owner, global id), which is the order the owners send them in.
So the rows received from peer q land, in arrival order, in q's slice of the remote
section. ``send_idx`` lists the owned nodes each peer needs (by global id), grouped by
peer in rank order: exactly what ``commsched.all_to_all`` expects.

Edge weights come from *global* degrees, so a rank's partial aggregation equals the
full-graph one: GCN (symmetric, self loops added) uses (in_deg(u)+1)^-1/2 (in_deg(v)+1)^-1/2
on edge u -> v, as torch_geometric's ``gcn_norm`` does; the mean aggregator 1/in_deg(v).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NORMS = ("gcn", "mean", "sum")


@dataclass(frozen=True, eq=False)
class PartitionBook:
    """One rank's view of a partitioned graph (see the module docstring).

    Arrays are int64 unless noted. ``edge_src``/``edge_dst`` are local ids, sorted by
    (dst, src); every dst is owned (< num_owned). ``in_degree`` is the global in-degree of
    every local node. ``send_coef_sq[norm]`` (float64, aligned with ``send_idx``) holds, for
    each sent row, the sum over the receiving peer's nodes it feeds of the squared edge
    weight under ``norm`` (AdaQP's per-message variance weight, before the D (max-min)^2/6
    factor).
    """

    rank: int
    num_parts: int
    num_nodes: int
    global_ids: np.ndarray          # [L]
    num_central: int
    num_marginal: int
    edge_src: np.ndarray            # [E_local]
    edge_dst: np.ndarray            # [E_local]
    in_degree: np.ndarray           # [L]
    send_idx: np.ndarray            # [T]
    send_counts: tuple[int, ...]    # [P]
    recv_counts: tuple[int, ...]    # [P]
    send_coef_sq: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "send_counts", tuple(int(c) for c in self.send_counts))
        object.__setattr__(self, "recv_counts", tuple(int(c) for c in self.recv_counts))
        assert len(self.send_counts) == len(self.recv_counts) == self.num_parts
        assert self.send_counts[self.rank] == 0 and self.recv_counts[self.rank] == 0
        assert sum(self.send_counts) == self.send_idx.size
        assert sum(self.recv_counts) == self.num_remote
        assert self.in_degree.size == self.num_local

    # sizes ------------------------------------------------------------------
    @property
    def num_local(self) -> int:
        return int(self.global_ids.size)

    @property
    def num_owned(self) -> int:
        return self.num_central + self.num_marginal

    @property
    def num_remote(self) -> int:
        return self.num_local - self.num_owned

    @property
    def owned_ids(self) -> np.ndarray:
        """Global ids of the owned nodes in local order (central, then marginal)."""
        return self.global_ids[: self.num_owned]

    @property
    def remote_ids(self) -> np.ndarray:
        return self.global_ids[self.num_owned:]

    @property
    def num_central_edges(self) -> int:
        """Edges into central nodes come first in the (dst-sorted) edge list."""
        return int(np.searchsorted(self.edge_dst, self.num_central, side="left"))

    def send_slice(self, peer: int) -> slice:
        o = int(sum(self.send_counts[:peer]))
        return slice(o, o + self.send_counts[peer])

    def recv_slice(self, peer: int) -> slice:
        """Local ids of the rows received from ``peer``."""
        o = self.num_owned + int(sum(self.recv_counts[:peer]))
        return slice(o, o + self.recv_counts[peer])

    def remote_owner(self) -> np.ndarray:
        """[num_remote] owning rank of each remote node."""
        return np.repeat(np.arange(self.num_parts), self.recv_counts)

    def summary(self) -> dict:
        return {"rank": self.rank, "owned": self.num_owned, "central": self.num_central,
                "marginal": self.num_marginal, "remote": self.num_remote,
                "local_edges": int(self.edge_dst.size), "send_rows": int(self.send_idx.size),
                "send_counts": list(self.send_counts), "recv_counts": list(self.recv_counts)}


# --------------------------------------------------------------------------- building
def _check_parts(src: np.ndarray, dst: np.ndarray, parts: np.ndarray, num_parts: int) -> None:
    if parts.ndim != 1:
        raise ValueError(f"parts must be one owner per node ([N]), got shape {list(parts.shape)}")
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if parts.size and (parts.min() < 0 or parts.max() >= num_parts):
        raise ValueError(f"part ids must lie in [0, {num_parts}), got [{parts.min()}, {parts.max()}]")
    if src.shape != dst.shape:
        raise ValueError("edge sources and targets differ in length")
    if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= parts.size):
        raise ValueError(f"edge endpoints must lie in [0, {parts.size})")


def _edge_weight_sq(norm: str, deg_src: np.ndarray, deg_dst: np.ndarray) -> np.ndarray:
    if norm == "gcn":
        return 1.0 / ((deg_src + 1.0) * (deg_dst + 1.0))
    if norm == "mean":
        return 1.0 / np.maximum(deg_dst, 1.0) ** 2
    return np.ones(deg_src.shape, dtype=np.float64)


def _unique(a: np.ndarray) -> np.ndarray:
    """Sorted unique values (by sorting; numpy's hash-based unique is slow on large int64)."""
    a = np.sort(a)
    if a.size:
        a = a[np.concatenate([[True], a[1:] != a[:-1]])]
    return a


class _Shared:
    """Arrays every rank's book needs, computed once for the whole graph."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, parts: np.ndarray, num_parts: int):
        self.src, self.dst, self.parts, self.P = src, dst, parts, num_parts
        self.N = parts.size
        self.in_deg = np.bincount(dst, minlength=self.N).astype(np.int64)
        self.psrc = parts[src]
        self.pdst = parts[dst]


def build_book(src: np.ndarray, dst: np.ndarray, parts: np.ndarray, rank: int,
               num_parts: int, _shared: _Shared | None = None) -> PartitionBook:
    """The book of ``rank`` for the directed edges ``src[i] -> dst[i]`` (int arrays [E],
    no self loops or duplicates) partitioned by ``parts`` ([N] owner ids)."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    parts = np.asarray(parts, dtype=np.int64)
    if _shared is None:
        _check_parts(src, dst, parts, num_parts)
        _shared = _Shared(src, dst, parts, num_parts)
    if not 0 <= rank < num_parts:
        raise ValueError(f"rank {rank} outside [0, {num_parts})")
    S = _shared
    N, P, r = S.N, S.P, rank
    owned = np.flatnonzero(parts == r)
    into = S.pdst == r
    e_src, e_dst = src[into], dst[into]
    cross = S.psrc[into] != r
    is_marg = np.zeros(N, dtype=bool)
    is_marg[e_dst[cross]] = True
    marginal = owned[is_marg[owned]]
    central = owned[~is_marg[owned]]
    remote = _unique(e_src[cross])
    remote = remote[np.lexsort((remote, parts[remote]))]
    gids = np.concatenate([central, marginal, remote])
    g2l = np.full(N, -1, dtype=np.int64)
    g2l[gids] = np.arange(gids.size)
    ls, ld = g2l[e_src], g2l[e_dst]
    order = np.lexsort((ls, ld))
    ls, ld = ls[order], ld[order]
    # rows to send: owned nodes with an out-edge into peer q, by global id
    out_e = (S.psrc == r) & (S.pdst != r)
    o_src, o_dst, o_q = src[out_e], dst[out_e], S.pdst[out_e]
    send_parts, coef_parts = [], {n: [] for n in NORMS}
    send_counts = [0] * P
    for q in range(P):
        if q == r:
            continue
        sel = o_q == q
        s_q, d_q = o_src[sel], o_dst[sel]
        nodes = _unique(s_q)
        send_parts.append(g2l[nodes])
        send_counts[q] = nodes.size
        pos = np.searchsorted(nodes, s_q)
        for n in coef_parts:
            w2 = _edge_weight_sq(n, S.in_deg[s_q].astype(np.float64), S.in_deg[d_q].astype(np.float64))
            coef_parts[n].append(np.bincount(pos, weights=w2, minlength=nodes.size))
    recv_counts = np.bincount(parts[remote], minlength=P).astype(np.int64)
    empty_i = np.zeros(0, dtype=np.int64)
    send_idx = np.concatenate(send_parts) if send_parts else empty_i
    coef = {n: (np.concatenate(v) if v else np.zeros(0)) for n, v in coef_parts.items()}
    return PartitionBook(rank=r, num_parts=P, num_nodes=N, global_ids=gids,
                         num_central=int(central.size), num_marginal=int(marginal.size),
                         edge_src=ls, edge_dst=ld, in_degree=S.in_deg[gids], send_idx=send_idx,
                         send_counts=tuple(send_counts), recv_counts=tuple(recv_counts.tolist()),
                         send_coef_sq=coef)


def build_books(src: np.ndarray, dst: np.ndarray, parts: np.ndarray, num_parts: int) -> list[PartitionBook]:
    """Books of every rank (shares the whole-graph work)."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    parts = np.asarray(parts, dtype=np.int64)
    _check_parts(src, dst, parts, num_parts)
    S = _Shared(src, dst, parts, num_parts)
    return [build_book(src, dst, parts, r, num_parts, _shared=S) for r in range(num_parts)]


# --------------------------------------------------------------------------- adjacency
@dataclass(frozen=True, eq=False)
class Block:
    """A weighted bipartite block in COO form: ``w[i]`` on ``src[i] -> dst[i]``; dst ids are
    row offsets inside the block (0..num_dst-1), src ids column ids (0..num_src-1).
    Sorted by (dst, src)."""

    src: np.ndarray
    dst: np.ndarray
    w: np.ndarray  # float64
    num_dst: int
    num_src: int


def edge_weights(book: PartitionBook, norm: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Local edges (src, dst, weight) under ``norm``; "gcn" adds one self loop per owned
    node. Sorted by (dst, src)."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    s, d = book.edge_src, book.edge_dst
    deg = book.in_degree.astype(np.float64)
    if norm == "gcn":
        own = np.arange(book.num_owned, dtype=np.int64)
        s = np.concatenate([s, own])
        d = np.concatenate([d, own])
        order = np.lexsort((s, d))
        s, d = s[order], d[order]
        w = 1.0 / np.sqrt((deg[s] + 1.0) * (deg[d] + 1.0))
    elif norm == "mean":
        w = 1.0 / np.maximum(deg[d], 1.0)
    else:
        w = np.ones(s.size)
    return s, d, w


def split_blocks(book: PartitionBook, norm: str) -> tuple[Block, Block]:
    """(central, marginal) blocks. central: rows = central nodes, columns = owned nodes
    (their sources are all owned). marginal: rows = marginal nodes, columns = all local
    nodes (owned, then remote)."""
    s, d, w = edge_weights(book, norm)
    k = int(np.searchsorted(d, book.num_central, side="left"))
    central = Block(s[:k], d[:k], w[:k], book.num_central, book.num_owned)
    marginal = Block(s[k:], d[k:] - book.num_central, w[k:], book.num_marginal, book.num_local)
    assert central.src.size == 0 or central.src.max() < book.num_owned
    return central, marginal


__all__ = ["Block", "NORMS", "PartitionBook", "build_book", "build_books", "edge_weights",
           "split_blocks"]
