"""Node partitioning (METIS through pymetis, or random) and partition folders.

Legend: N global nodes, P parts, F features, n owned nodes of one part.

A partition folder holds ``meta.json`` (graph identity, part count, method, sizes) and
one ``part-NNNNN.pt`` per part with everything its rank needs and nothing more: the
partition book (global ids, local edges, global degrees, send/receive lists) and the
owned nodes' features, labels and masks. So a rank loads only its own part.
``load_part`` refuses a folder made for another graph or another world size.

``main(argv)`` is ``commsched partition``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..._lazy import require
from ...results import load_torch_file, read_error, save_torch, write_json
from .book import PartitionBook, build_books
from .data import Graph, GraphSource, clean_edges, graph_fingerprint

METHODS = ("metis", "random", "metis-hosts")
# group_parts searches every assignment of parts to hosts up to this many, else greedy + swaps
EXACT_GROUPINGS = 20_000
FORMAT_VERSION = 1


# the share of the highest degrees the tail exponent is fitted on (Hill's estimator)
TAIL_SHARE = 0.01


def degree_stats(deg_N: np.ndarray, tail_share: float = TAIL_SHARE) -> dict:
    """How skewed the degrees ``deg_N`` (int [N]) are: ``mean``, ``max``, ``max_over_mean``
    and ``tail_exponent``, Hill's estimate of the power-law exponent alpha of the degree
    tail (P[deg > d] ~ d^-alpha) from the ``tail_share`` highest degrees (at least 10):
    k / sum_i log(d_i / d_(k+1)) over the k largest d_i. None when there are too few
    distinct degrees to fit it."""
    d = np.sort(np.asarray(deg_N, dtype=np.float64))[::-1]
    if d.size == 0:
        raise ValueError("degree_stats: no nodes")
    mean = float(d.mean())
    k = min(max(10, int(tail_share * d.size)), d.size - 1)
    alpha = None
    if k >= 1 and d[k] > 0:
        s = float(np.log(d[:k] / d[k]).sum())
        alpha = k / s if s > 0 else None
    return {"mean": mean, "max": int(d[0]), "max_over_mean": float(d[0]) / mean if mean > 0 else None,
            "tail_exponent": alpha, "tail_nodes": int(k)}


# --------------------------------------------------------------------------- partitioning
def partition_nodes(g: Graph, num_parts: int, method: str = "metis", seed: int = 0, *,
                    hosts_P: Sequence[str] | None = None) -> np.ndarray:
    """Owner of every node, int64 [N], deterministic in ``seed``.

    ``metis`` minimises the edge cut of the undirected graph with balanced part sizes;
    ``random`` deals a random permutation of the nodes round-robin (balanced, no locality);
    ``metis-hosts`` cuts as ``metis``, then gives the parts to ranks so that the heaviest
    cuts stay inside hosts (:func:`group_parts` on :func:`halo_rows`; ``hosts_P``, the
    host of every rank, is required).
    """
    if method not in METHODS:
        raise ValueError(f"partition method must be one of {METHODS}, got {method!r}")
    if method == "metis-hosts":
        if hosts_P is None or len(hosts_P) != num_parts:
            raise ValueError(f"partition method metis-hosts needs the host of each of the "
                             f"{num_parts} ranks (hosts_P), got {hosts_P!r}")
        owner = partition_nodes(g, num_parts, "metis", seed)
        part_of_rank = group_parts(halo_rows(g, owner, num_parts), hosts_P)
        rank_of_part = np.empty(num_parts, dtype=np.int64)
        rank_of_part[part_of_rank] = np.arange(num_parts)
        return rank_of_part[owner]
    if num_parts < 1:
        raise ValueError(f"number of parts must be >= 1, got {num_parts}")
    N = g.num_nodes
    if num_parts > N:
        raise ValueError(f"cannot cut {N} nodes into {num_parts} parts")
    if num_parts == 1:
        return np.zeros(N, dtype=np.int64)
    if method == "random":
        perm = np.random.default_rng(seed).permutation(N)
        parts = np.empty(N, dtype=np.int64)
        parts[perm] = np.arange(N) % num_parts
        return parts
    pymetis = require("pymetis", "METIS partitioning (--partition-method metis)")

    ei = g.edge_index_2E.numpy()
    if g.directed:  # METIS needs a symmetric adjacency
        ei = clean_edges(ei.T, N, directed=False)
    # ei is sorted by target: rows of the CSR are targets, columns their sources
    xadj = np.zeros(N + 1, dtype=np.int64)
    np.cumsum(np.bincount(ei[1], minlength=N), out=xadj[1:])
    opts = pymetis.Options(seed=int(seed))
    if hasattr(pymetis, "CSRAdjacency"):
        _, parts = pymetis.part_graph(num_parts, pymetis.CSRAdjacency(xadj, ei[0]), options=opts)
    else:  # pymetis < 2025.2
        _, parts = pymetis.part_graph(num_parts, xadj=xadj, adjncy=ei[0], options=opts)
    return np.asarray(parts, dtype=np.int64)


def halo_rows(g: Graph, parts: np.ndarray, num_parts: int) -> np.ndarray:
    """rows_PP[a, b] (int64): how many nodes of part a have an edge to a node of part b
    (a != b), i.e. the rows a sends b in one halo exchange; the diagonal is 0."""
    ei = g.edge_index_2E.numpy()
    parts = np.asarray(parts, dtype=np.int64)
    src, dst = parts[ei[0]], parts[ei[1]]
    cut = src != dst
    pairs = np.unique(ei[0][cut] * num_parts + dst[cut])  # distinct (node, destination part)
    rows = np.zeros((num_parts, num_parts), dtype=np.int64)
    np.add.at(rows, (parts[pairs // num_parts], pairs % num_parts), 1)
    return rows


def inter_host_rows(rows_PP: np.ndarray, hosts_P: Sequence[str]) -> int:
    """The rows of ``rows_PP`` (rank a sends rank b) whose two ranks are on different hosts."""
    h = np.asarray([str(x) for x in hosts_P])
    return int(np.asarray(rows_PP)[h[:, None] != h[None, :]].sum())


def group_parts(rows_PP: np.ndarray, hosts_P: Sequence[str]) -> np.ndarray:
    """Which part each rank should hold so that as few halo rows as possible cross hosts.

    ``rows_PP[a, b]``: rows part a sends part b (:func:`halo_rows`); ``hosts_P[r]``: the host
    of rank r. Returns ``part_of_rank`` [P] (a permutation) minimising
    ``inter_host_rows(rows_PP[part_of_rank][:, part_of_rank], hosts_P)``: exact (every
    assignment of parts to hosts, pruned by host capacity) while there are at most
    :data:`EXACT_GROUPINGS` of them, else greedy (each part to the host it talks to most,
    heaviest first) improved by pairwise swaps until none helps. Ties keep the identity.
    """
    W = np.asarray(rows_PP, dtype=np.int64)
    P = len(hosts_P)
    if W.shape != (P, P):
        raise ValueError(f"rows_PP must be {P} x {P} (one row and column per rank), got {W.shape}")
    W = W + W.T  # rows either way cross the same host boundary
    names = list(dict.fromkeys(str(h) for h in hosts_P))
    slots = [[r for r in range(P) if str(hosts_P[r]) == h] for h in names]
    K = len(names)
    if K == 1:
        return np.arange(P, dtype=np.int64)
    cap = [len(s) for s in slots]

    def cost(host_of: Sequence[int]) -> int:  # rows inside hosts (maximised)
        h = np.asarray(host_of)
        return int(W[h[:, None] == h[None, :]].sum())

    best: list[int] = [next(k for k in range(K) if sum(cap[:k + 1]) > p) for p in range(P)]
    if K ** P <= EXACT_GROUPINGS:
        best_val = [cost(best)]
        cur: list[int] = []
        left = list(cap)

        def rec(p: int) -> None:
            if p == P:
                v = cost(cur)
                if v > best_val[0]:
                    best_val[0], best[:] = v, list(cur)
                return
            for k in range(K):
                if left[k]:
                    left[k] -= 1
                    cur.append(k)
                    rec(p + 1)
                    cur.pop()
                    left[k] += 1

        rec(0)
    else:
        order = np.argsort(-W.sum(1), kind="stable")
        host = [-1] * P
        left = list(cap)
        for p in order:
            gain = [W[p, [q for q in range(P) if host[q] == k]].sum() if left[k] else -1
                    for k in range(K)]
            k = int(np.argmax(gain))
            host[p], left[k] = k, left[k] - 1
        val, improved = cost(host), True
        while improved:
            improved = False
            for a in range(P):
                for b in range(a + 1, P):
                    if host[a] != host[b]:
                        host[a], host[b] = host[b], host[a]
                        v = cost(host)
                        if v > val:
                            val, improved = v, True
                        else:
                            host[a], host[b] = host[b], host[a]
        best = host
    part_of_rank = np.empty(P, dtype=np.int64)
    fill = [list(s) for s in slots]
    for p in range(P):  # parts in ascending order onto their host's ranks in ascending order
        part_of_rank[fill[best[p]].pop(0)] = p
    return part_of_rank


# --------------------------------------------------------------------------- one rank's data
@dataclass(frozen=True, eq=False)
class PartData:
    """Everything one rank needs to train on its part.

    ``x_nF``, ``y_n`` and the masks are the owned nodes in the book's local order
    (central, then marginal). ``totals`` holds the global train/val/test node counts.
    """

    book: PartitionBook
    x_nF: torch.Tensor
    y_n: torch.Tensor
    train_mask: torch.Tensor
    val_mask: torch.Tensor
    test_mask: torch.Tensor
    num_classes: int
    fingerprint: str
    name: str
    totals: dict[str, int]

    @property
    def num_features(self) -> int:
        return int(self.x_nF.shape[1])


def _graph_totals(g: Graph) -> dict[str, int]:
    return {"train": int(g.train_mask.sum()), "val": int(g.val_mask.sum()),
            "test": int(g.test_mask.sum()), "nodes": g.num_nodes, "edges": g.num_edges}


def make_parts(g: Graph, parts: np.ndarray, num_parts: int,
               fingerprint: str | None = None) -> list[PartData]:
    """Books and owned data of every part of ``g`` under ``parts``."""
    parts = np.asarray(parts, dtype=np.int64)
    if parts.shape != (g.num_nodes,):
        raise ValueError(f"parts must have one entry per node ({g.num_nodes}), got {parts.shape}")
    ei = g.edge_index_2E.numpy()
    books = build_books(ei[0], ei[1], parts, num_parts)
    fp = fingerprint or graph_fingerprint(g)
    totals = _graph_totals(g)
    out = []
    for b in books:
        own = torch.from_numpy(b.owned_ids)
        out.append(PartData(b, g.x_NF[own].contiguous(), g.y_N[own].contiguous(),
                            g.train_mask[own].contiguous(), g.val_mask[own].contiguous(),
                            g.test_mask[own].contiguous(), g.num_classes, fp, g.name, totals))
    return out


def edge_cut(g: Graph, parts: np.ndarray) -> int:
    """Directed edges whose endpoints lie in different parts."""
    ei = g.edge_index_2E.numpy()
    return int((parts[ei[0]] != parts[ei[1]]).sum())


# --------------------------------------------------------------------------- folders
def _part_file(folder: Path, rank: int) -> Path:
    return folder / f"part-{rank:05d}.pt"


def _to_record(p: PartData) -> dict:
    b = p.book
    t = torch.from_numpy
    rec = {"format": FORMAT_VERSION, "rank": b.rank, "num_parts": b.num_parts,
           "num_nodes": b.num_nodes, "num_central": b.num_central, "num_marginal": b.num_marginal,
           "global_ids": t(b.global_ids), "edge_src": t(b.edge_src), "edge_dst": t(b.edge_dst),
           "in_degree": t(b.in_degree), "send_idx": t(b.send_idx),
           "send_counts": list(b.send_counts), "recv_counts": list(b.recv_counts),
           "x": p.x_nF, "y": p.y_n, "train_mask": p.train_mask, "val_mask": p.val_mask,
           "test_mask": p.test_mask, "num_classes": p.num_classes, "fingerprint": p.fingerprint,
           "name": p.name, "totals": dict(p.totals)}
    for k, v in b.send_coef_sq.items():
        rec[f"send_coef_sq_{k}"] = t(v)
    return rec


def _from_record(rec: dict) -> PartData:
    n = lambda k: rec[k].numpy()  # noqa: E731
    coef = {k[len("send_coef_sq_"):]: rec[k].numpy() for k in rec if k.startswith("send_coef_sq_")}
    book = PartitionBook(rank=rec["rank"], num_parts=rec["num_parts"], num_nodes=rec["num_nodes"],
                         global_ids=n("global_ids"), num_central=rec["num_central"],
                         num_marginal=rec["num_marginal"], edge_src=n("edge_src"),
                         edge_dst=n("edge_dst"), in_degree=n("in_degree"), send_idx=n("send_idx"),
                         send_counts=tuple(rec["send_counts"]), recv_counts=tuple(rec["recv_counts"]),
                         send_coef_sq=coef)
    return PartData(book, rec["x"], rec["y"], rec["train_mask"], rec["val_mask"], rec["test_mask"],
                    int(rec["num_classes"]), rec["fingerprint"], rec["name"], dict(rec["totals"]))


def save_partition(folder: str | os.PathLike, g: Graph, parts: np.ndarray, num_parts: int, *,
                   method: str, seed: int, source: GraphSource | None = None) -> dict:
    """Write a partition folder for ``g``; returns the metadata written to meta.json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fp = graph_fingerprint(g)
    pdata = make_parts(g, parts, num_parts, fingerprint=fp)
    # remove part files of an older, larger partition in the same folder
    for old in folder.glob("part-*.pt"):
        old.unlink()
    for p in pdata:  # each atomically (fsync, rename); a full disk is one OutputError line
        save_torch(_to_record(p), _part_file(folder, p.book.rank), what="part file")
    meta = {"format": FORMAT_VERSION, "num_parts": num_parts, "method": method, "seed": seed,
            "fingerprint": fp, "source_id": source.identity() if source is not None else None,
            "graph": g.summary(), "edge_cut": edge_cut(g, parts),
            "degrees": degree_stats(np.bincount(g.edge_index_2E[1].numpy(), minlength=g.num_nodes)),
            "parts": [p.book.summary() for p in pdata]}
    write_json(folder / "meta.json", meta, indent=1)
    return meta


def read_meta(folder: str | os.PathLike) -> dict:
    folder = Path(folder)
    f = folder / "meta.json"
    if not f.is_file():
        raise ValueError(f"partition folder {folder}: no meta.json (make one with `commsched partition`)")
    try:
        meta = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"partition folder {folder}: {f.name} is not readable JSON ({read_error(e)}); "
                         "re-run `commsched partition`") from None
    if not isinstance(meta, dict):
        raise ValueError(f"partition folder {folder}: {f.name} holds a {type(meta).__name__}, not an "
                         "object; re-run `commsched partition`")
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"partition folder {folder}: format {meta.get('format')!r}, this build "
                         f"reads format {FORMAT_VERSION}; re-run `commsched partition`")
    missing = [k for k in ("num_parts", "fingerprint", "graph") if k not in meta]
    if missing or not isinstance(meta.get("graph"), dict) or not isinstance(meta.get("num_parts"), int):
        raise ValueError(f"partition folder {folder}: {f.name} is damaged (field "
                         f"'{missing[0] if missing else 'num_parts or graph'}' missing or of the wrong "
                         "type); re-run `commsched partition`")
    return meta


def check_meta(meta: dict, folder: str | os.PathLike, world_size: int, *,
               fingerprint: str | None = None, source_id: str | None = None) -> None:
    """Refuse a folder made for another world size or another graph (ValueError)."""
    if meta["num_parts"] != world_size:
        raise ValueError(f"partition folder {folder} was made for {meta['num_parts']} parts but "
                         f"this run has world size {world_size}; re-run `commsched partition "
                         f"--parts {world_size}` or start {meta['num_parts']} ranks")
    if fingerprint is not None and meta["fingerprint"] != fingerprint:
        raise ValueError(f"partition folder {folder} was made for another graph (fingerprint "
                         f"{meta['fingerprint']}, {meta['graph']['name']}, {meta['graph']['num_nodes']} "
                         f"nodes) than this one (fingerprint {fingerprint}); re-run `commsched partition`")
    if source_id is not None and meta.get("source_id") not in (None, source_id):
        raise ValueError(f"partition folder {folder} was made for another graph "
                         f"({meta['graph']['name']}: {meta['source_id'][:80]}) than the one asked "
                         f"for ({source_id[:80]}); re-run `commsched partition` or drop the graph options")


def load_part(folder: str | os.PathLike, rank: int, world_size: int, *,
              fingerprint: str | None = None, source_id: str | None = None) -> PartData:
    """Load rank ``rank``'s part, refusing a folder made for another graph or world size."""
    meta = read_meta(folder)
    check_meta(meta, folder, world_size, fingerprint=fingerprint, source_id=source_id)
    f = _part_file(Path(folder), rank)
    if not f.is_file():
        raise ValueError(f"partition folder {folder}: {f.name} is missing")
    rec = load_torch_file(f, f"partition folder {folder}: part file")
    if not isinstance(rec, dict):
        raise ValueError(f"partition folder {folder}: {f.name} is not a part file (it holds a "
                         f"{type(rec).__name__}); re-run `commsched partition`")
    if rec.get("fingerprint") != meta["fingerprint"] or rec.get("num_parts") != world_size:
        raise ValueError(f"partition folder {folder}: {f.name} belongs to another partition than "
                         "meta.json; re-run `commsched partition`")
    try:
        return _from_record(rec)
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"partition folder {folder}: {f.name} is damaged ({read_error(e)}); "
                         "re-run `commsched partition`") from None
