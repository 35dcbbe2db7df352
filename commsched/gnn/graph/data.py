"""Graphs: the graph-file loader, named data sets, the synthetic generator, adapters.

Legend: N nodes, F features, E directed edges (messages flow source -> target),
M undirected edge pairs, S mask splits, K classes.

Every graph becomes a :class:`Graph`: features ``x_NF`` (float32), labels ``y_N``
(int64), ``edge_index_2E`` (int64, row 0 = source, row 1 = target) and three boolean
masks. Edges are cleaned the same way whatever the source: self loops are dropped
(models add their own), duplicates are dropped, and unless the graph is ``directed``
every edge is present in both directions.

Malformed input is rejected with one ``ValueError`` line that names the offending key.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import tempfile
import warnings
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ..._lazy import require
from ...configurable import option
from ...results import read_error

GRAPH_KEYS = ("node_features", "node_labels", "edges", "train_masks", "val_masks", "test_masks")
# named data sets: torch_geometric's Planetoid (folder name) and the heterophilous-graph
# files of yandex-research/heterophilous-graphs (PyG's HeterophilousGraphDataset reads
# five of them; squirrel and chameleon come from the same place)
PLANETOID = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
PLANETOID_RAW = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")
HETEROPHILOUS = ("tolokers", "minesweeper", "squirrel", "chameleon", "roman_empire",
                 "amazon_ratings", "questions")
PYG_HETEROPHILOUS = ("roman_empire", "amazon_ratings", "minesweeper", "tolokers", "questions")
DATASETS = (*PLANETOID, *HETEROPHILOUS, "synthetic")
# The classes are the labels 0..max: a file whose largest label leaves most of them unused
# (more than CLASS_SLACK_FACTOR x the distinct labels + CLASS_SLACK, or over MAX_CLASSES)
# would give the output layer a row per unused class (2^31 - 1: 137 GB) and is refused
MAX_CLASSES = 1_000_000
CLASS_SLACK_FACTOR, CLASS_SLACK = 10, 100


# --------------------------------------------------------------------------- Graph
@dataclass(frozen=True, eq=False)
class Graph:
    """A node-classification graph held in memory (see the module legend).

    ``edge_index_2E`` has no self loops and no duplicates; an undirected graph holds both
    directions of every edge.
    """

    x_NF: torch.Tensor
    y_N: torch.Tensor
    edge_index_2E: torch.Tensor
    train_mask: torch.Tensor
    val_mask: torch.Tensor
    test_mask: torch.Tensor
    name: str = "graph"
    directed: bool = False
    num_classes: int = field(default=0)

    def __post_init__(self) -> None:
        if self.num_classes <= 0:
            k = int(self.y_N.max()) + 1 if self.y_N.numel() else 0
            object.__setattr__(self, "num_classes", k)

    @property
    def num_nodes(self) -> int:
        return int(self.x_NF.shape[0])

    @property
    def num_features(self) -> int:
        return int(self.x_NF.shape[1])

    @property
    def num_edges(self) -> int:
        """Directed edges (an undirected pair counts twice)."""
        return int(self.edge_index_2E.shape[1])

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "num_nodes": self.num_nodes, "num_edges": self.num_edges,
                "num_features": self.num_features, "num_classes": self.num_classes,
                "directed": self.directed, "train": int(self.train_mask.sum()),
                "val": int(self.val_mask.sum()), "test": int(self.test_mask.sum())}


def graph_fingerprint(g: Graph) -> str:
    """Content hash of a graph (structure, features, labels, masks); 24 hex digits."""
    h = hashlib.blake2b(digest_size=12)
    h.update(json.dumps([g.num_nodes, g.num_features, g.num_edges, g.num_classes,
                         g.directed]).encode())
    for t in (g.edge_index_2E, g.y_N, g.train_mask, g.val_mask, g.test_mask, g.x_NF):
        h.update(np.ascontiguousarray(t.numpy()).tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- validation
class _Bad(ValueError):
    pass


def _fail(where: str, key: str, what: str) -> _Bad:
    return _Bad(f"{where}: key '{key}': {what}")


def _check_arrays(where: str, x: np.ndarray, y: np.ndarray, edges_E2: np.ndarray,
                  masks: Mapping[str, np.ndarray], split: int,
                  keys: Mapping[str, str]) -> tuple[np.ndarray, ...]:
    """Validate raw arrays; return (x float32, y int64, edges int64 [E,2], train, val, test).

    ``keys`` maps the roles (x, y, edges, train, val, test) to the names used in errors.
    """
    kx, ky, ke = keys["x"], keys["y"], keys["edges"]
    if x.dtype == object or not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise _fail(where, kx, f"expected real numbers, got dtype {x.dtype}")
    if x.ndim != 2:
        raise _fail(where, kx, f"expected shape [N, F], got {list(x.shape)}")
    N = x.shape[0]
    if N == 0:
        raise _fail(where, kx, "the graph has no nodes (N = 0)")
    if x.shape[1] == 0:
        raise _fail(where, kx, "nodes have no features (F = 0)")
    xf = x.astype(np.float32, copy=False)
    if not np.isfinite(xf).all():
        bad = int(np.argwhere(~np.isfinite(xf))[0, 0])
        raise _fail(where, kx, f"non-finite value (nan or inf) in the features, first at node {bad}")
    if not np.issubdtype(y.dtype, np.integer):
        raise _fail(where, ky, f"expected integer class labels, got dtype {y.dtype}")
    if y.shape != (N,):
        raise _fail(where, ky, f"expected shape [N] = [{N}] (one label per row of {kx}), got {list(y.shape)}")
    if (y < 0).any():
        raise _fail(where, ky, f"labels must be >= 0, found {int(y.min())} at node {int(np.argmin(y))}")
    distinct = len(np.unique(y))
    k = int(y.max()) + 1
    if k > MAX_CLASSES or k > CLASS_SLACK_FACTOR * distinct + CLASS_SLACK:
        raise _fail(where, ky, f"label {k - 1} at node {int(np.argmax(y))} makes {k} classes (labels 0..{k - 1}) for "
                               f"{distinct} distinct labels; the output layer has a row per class, so at most "
                               f"{CLASS_SLACK_FACTOR} x the distinct labels + {CLASS_SLACK} (and {MAX_CLASSES}) are "
                               "taken: number the classes 0..K-1")
    if not np.issubdtype(edges_E2.dtype, np.integer):
        raise _fail(where, ke, f"expected integer node ids, got dtype {edges_E2.dtype}")
    if edges_E2.ndim != 2 or edges_E2.shape[1] != 2:
        raise _fail(where, ke, f"expected shape [E, 2] (source, target), got {list(edges_E2.shape)}")
    if edges_E2.size and (edges_E2.min() < 0 or edges_E2.max() >= N):
        lo, hi = int(edges_E2.min()), int(edges_E2.max())
        raise _fail(where, ke, f"node ids must lie in [0, {N}) but range over [{lo}, {hi}]")
    out = []
    if split != 0 and all(np.ndim(masks[r]) == 1 for r in ("train", "val", "test")):
        raise _fail(where, keys["train"], f"holds one split but split {split} was asked for (use split 0)")
    for role in ("train", "val", "test"):
        k = keys[role]
        m = masks[role]
        if m.dtype != np.bool_:
            if np.issubdtype(m.dtype, np.integer) and m.size and set(np.unique(m).tolist()) <= {0, 1}:
                m = m.astype(bool)
            elif np.issubdtype(m.dtype, np.integer) and not m.size:
                m = m.astype(bool)
            else:
                raise _fail(where, k, f"expected a boolean mask, got dtype {m.dtype}")
        if m.ndim == 1:
            if m.shape[0] != N:
                raise _fail(where, k, f"expected shape [N] = [{N}] or [S, {N}], got {list(m.shape)}")
            # a one-split mask is shared by every split of the other masks
        elif m.ndim == 2:
            if m.shape[1] != N:
                raise _fail(where, k, f"expected shape [S, N] with N = {N}, got {list(m.shape)}")
            if not 0 <= split < m.shape[0]:
                raise _fail(where, k, f"split {split} asked for but the file holds {m.shape[0]} splits "
                                      f"(0..{m.shape[0] - 1})")
            m = m[split]
        else:
            raise _fail(where, k, f"expected shape [N] or [S, N], got {list(m.shape)}")
        out.append(np.ascontiguousarray(m))
    return (xf, y.astype(np.int64, copy=False), edges_E2.astype(np.int64, copy=False), *out)


def sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique`` by sorting (numpy's hash-based unique is far slower on large int64)."""
    a = np.sort(a, kind="stable" if a.size < 1024 else "quicksort")
    if a.size == 0:
        return a
    keep = np.empty(a.size, dtype=bool)
    keep[0] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


def clean_edges(edges_E2: np.ndarray, num_nodes: int, directed: bool) -> np.ndarray:
    """Drop self loops and duplicates; add reverse edges unless ``directed``.

    Returns int64 [2, E] sorted by (target, source).
    """
    e = np.asarray(edges_E2, dtype=np.int64).reshape(-1, 2)
    src, dst = e[:, 0], e[:, 1]
    keep = src != dst
    src, dst = src[keep], dst[keep]
    if not directed:
        src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
    key = sorted_unique(dst * num_nodes + src)  # sorted by (target, source), duplicates gone
    return np.stack([key % num_nodes, key // num_nodes])


def _make_graph(x, y, edges_E2, train, val, test, *, name: str, directed: bool,
                num_classes: int = 0) -> Graph:
    N = x.shape[0]
    ei = clean_edges(edges_E2, N, directed)
    return Graph(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y)),
                 torch.from_numpy(ei), torch.from_numpy(train), torch.from_numpy(val),
                 torch.from_numpy(test), name=name, directed=directed, num_classes=num_classes)


# --------------------------------------------------------------------------- graph files
def _is_npy(p: Path) -> bool:
    """Whether ``p`` starts with the .npy magic (a single array, reported as such)."""
    try:
        with open(p, "rb") as f:
            return f.read(6) == b"\x93NUMPY"
    except OSError:
        return False


def load_graph(path: str | os.PathLike, *, split: int = 0, directed: bool = False,
               name: str | None = None) -> Graph:
    """Read a graph file (DESIGN.md "Graph files"): an npz with ``node_features`` [N, F],
    ``node_labels`` [N], ``edges`` [E, 2] and ``train_masks``/``val_masks``/``test_masks``
    [N] or [S, N]. ``split`` picks the mask split. Malformed files raise one ValueError
    line naming the key."""
    p = Path(path)
    where = f"graph file {p}"
    if not p.is_file():
        raise ValueError(f"{where}: no such file")
    if not zipfile.is_zipfile(p) and not _is_npy(p):
        # np.load would guess a pickle and advise allow_pickle=True: never the answer here
        raise ValueError(f"{where}: not a readable .npz file (not a zip archive: a text file, "
                         "a truncated download or another format?); graph files are npz "
                         f"archives with keys {', '.join(GRAPH_KEYS)}")
    try:
        z = np.load(p, allow_pickle=False)
    except Exception as e:  # a damaged archive
        raise ValueError(f"{where}: not a readable .npz file ({type(e).__name__}: {e})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise ValueError(f"{where}: holds a single array, expected an .npz archive with keys "
                         f"{', '.join(GRAPH_KEYS)}")
    with z:
        missing = [k for k in GRAPH_KEYS if k not in z.files]
        if missing:
            raise ValueError(f"{where}: key '{missing[0]}': missing (the file has "
                             f"{', '.join(sorted(z.files)) or 'no keys'}; needs {', '.join(GRAPH_KEYS)})")
        arrays = {}
        for k in GRAPH_KEYS:
            try:
                arrays[k] = z[k]
            except ValueError as e:  # object arrays need pickle, which is refused
                raise _fail(where, k, f"unreadable array ({e})") from None
            except Exception as e:  # noqa: BLE001 - a bad CRC, a truncated member, zlib's errors
                raise _fail(where, k, f"unreadable array, the file is corrupt or truncated "
                                      f"({read_error(e)})") from None
    x, y, e, tr, va, te = _check_arrays(
        where, arrays["node_features"], arrays["node_labels"], arrays["edges"],
        {"train": arrays["train_masks"], "val": arrays["val_masks"], "test": arrays["test_masks"]},
        split, {"x": "node_features", "y": "node_labels", "edges": "edges",
                "train": "train_masks", "val": "val_masks", "test": "test_masks"})
    if not tr.any():
        raise _fail(where, "train_masks", f"no training nodes in split {split} (every entry is False); "
                                          "a graph to train on needs at least one")
    return _make_graph(x, y, e, tr, va, te, name=name or p.stem, directed=directed)


def save_graph(g: Graph, path: str | os.PathLike) -> None:
    """Write ``g`` as a graph file (one split, edges as stored: both directions if undirected)."""
    np.savez(path, node_features=g.x_NF.numpy(), node_labels=g.y_N.numpy(),
             edges=g.edge_index_2E.t().numpy(), train_masks=g.train_mask.numpy(),
             val_masks=g.val_mask.numpy(), test_masks=g.test_mask.numpy())


# --------------------------------------------------------------------------- adapters
def from_edges(edges: torch.Tensor | np.ndarray, x_NF, y_N, train_mask, val_mask, test_mask, *,
               split: int = 0, directed: bool = False, name: str = "graph") -> Graph:
    """Build a graph from plain tensors. ``edges`` is [E, 2] (source, target) or [2, E]."""
    e = np.asarray(edges.cpu() if isinstance(edges, torch.Tensor) else edges)
    if e.ndim == 2 and e.shape[0] == 2 and e.shape[1] != 2:
        e = e.T
    def a(t):
        return np.asarray(t.detach().cpu() if isinstance(t, torch.Tensor) else t)
    x, y, e, tr, va, te = _check_arrays(
        f"graph {name!r}", a(x_NF), a(y_N), e, {"train": a(train_mask), "val": a(val_mask),
                                             "test": a(test_mask)}, split,
        {"x": "x", "y": "y", "edges": "edges", "train": "train_mask", "val": "val_mask",
         "test": "test_mask"})
    return _make_graph(x, y, e, tr, va, te, name=name, directed=directed)


def from_pyg(data, *, split: int = 0, directed: bool = False, name: str = "pyg") -> Graph:
    """Adapt a torch_geometric ``Data`` (``x``, ``y``, ``edge_index``, ``*_mask``).

    Masks of shape [N, S] (PyG's layout for several splits) are read at column ``split``.
    Without ``directed=True`` the edges are made undirected (as the graph files are), and a
    graph that was not already symmetric gets one ``UserWarning`` saying how many edges
    that added.
    """
    for k in ("x", "y", "edge_index", "train_mask", "val_mask", "test_mask"):
        if getattr(data, k, None) is None:
            raise ValueError(f"graph {name!r}: key '{k}': missing from the PyG Data object")
    N = data.x.shape[0]

    def mask(m):
        m = m.detach().cpu()
        if m.dim() == 2 and m.shape[0] == N and m.shape[1] != N:
            m = m.t()
        return m
    ei = data.edge_index.detach().cpu()
    if ei.dim() != 2 or ei.shape[0] != 2:
        raise ValueError(f"graph {name!r}: key 'edge_index': expected shape [2, E], got {list(ei.shape)}")
    g = from_edges(ei.t(), data.x, data.y.view(-1) if data.y.dim() == 2 and data.y.shape[1] == 1 else data.y,
                   mask(data.train_mask), mask(data.val_mask), mask(data.test_mask),
                   split=split, directed=directed, name=name)
    if not directed:
        e = ei[:, ei[0] != ei[1]].long()
        given = int(torch.unique(e[0] * N + e[1]).numel()) if e.numel() else 0
        made = int(g.edge_index_2E.shape[1])
        if made > given:
            warnings.warn(f"graph {name!r}: edge_index is directed ({given} distinct edges); made "
                          f"undirected ({made} edges, both directions of each), as commsched's "
                          "graphs are by default; pass from_pyg(..., directed=True) to keep the "
                          "direction (the layers aggregate along edge_index as given)",
                          UserWarning, stacklevel=2)
    return g


# --------------------------------------------------------------------------- synthetic
@dataclass(frozen=True)
class SyntheticSpec:
    """A seeded synthetic graph with community structure, skewed degrees and class-dependent
    features: a degree-corrected stochastic block model.

    ``num_edges`` counts undirected pairs (the graph holds 2 * num_edges directed edges).
    ``homophily`` is the share of edges drawn inside the source's community; communities
    map onto classes (community c has class c % num_classes). ``degree_exponent`` is the
    tail exponent of the Pareto node weights (smaller = more skewed). ``signal`` scales the
    class means against unit feature noise.
    """

    # the fields are the command line's --syn-* flags (commsched.gnn.graph.flags)
    num_nodes: int = option(100_000, "nodes", flag="--syn-nodes")
    num_edges: int = option(1_000_000, "undirected edge pairs", flag="--syn-edges")
    num_features: int = option(64, "feature width", flag="--syn-features")
    num_classes: int = option(10, "classes", flag="--syn-classes")
    communities_per_class: int = option(4, "communities per class", flag="--syn-communities")
    homophily: float = option(0.8, "share of edges inside the source's community")
    degree_exponent: float = option(1.6, "Pareto tail exponent of the node weights (smaller: more skewed)")
    signal: float = option(0.05, "class means against unit feature noise")
    train_frac: float = option(0.3, cli=False)
    val_frac: float = option(0.2, cli=False)
    seed: int = option(0, "generator seed")

    def __post_init__(self) -> None:
        if self.num_nodes < 2:
            raise ValueError(f"synthetic graph: num_nodes must be >= 2, got {self.num_nodes}")
        max_pairs = self.num_nodes * (self.num_nodes - 1) // 2
        if not 0 <= self.num_edges <= max_pairs // 2:
            raise ValueError(f"synthetic graph: num_edges must lie in [0, {max_pairs // 2}] for "
                             f"{self.num_nodes} nodes (at most half of all pairs), got {self.num_edges}")
        if self.num_features < 1 or self.num_classes < 2 or self.communities_per_class < 1:
            raise ValueError("synthetic graph: needs num_features >= 1, num_classes >= 2, "
                             "communities_per_class >= 1")
        if not 0.0 <= self.homophily <= 1.0:
            raise ValueError(f"synthetic graph: homophily must lie in [0, 1], got {self.homophily}")
        if self.degree_exponent <= 1.0:
            raise ValueError(f"synthetic graph: degree_exponent must be > 1, got {self.degree_exponent}")
        if not (0 < self.train_frac and 0 < self.val_frac and self.train_frac + self.val_frac < 1):
            raise ValueError("synthetic graph: train_frac and val_frac must be > 0 with sum < 1")


def synthetic_graph(spec: SyntheticSpec = SyntheticSpec()) -> Graph:
    """Generate the graph of ``spec`` (deterministic in ``spec.seed``; vectorised numpy)."""
    s = spec
    N, K = s.num_nodes, s.num_classes
    C = K * s.communities_per_class
    rng = np.random.default_rng(s.seed)
    # communities of uneven size, node ids shuffled (ids carry no information)
    sizes = rng.uniform(0.5, 1.5, C)
    comm_N = rng.choice(C, size=N, p=sizes / sizes.sum()).astype(np.int64)
    y_N = comm_N % K
    # Pareto node weights: expected degree is proportional to the weight
    w_N = (1.0 - rng.random(N)) ** (-1.0 / s.degree_exponent)
    np.minimum(w_N, math.sqrt(N) * 4.0, out=w_N)
    order = np.argsort(comm_N, kind="stable")
    cdf = np.cumsum(w_N[order])
    total = cdf[-1]
    starts = np.searchsorted(comm_N[order], np.arange(C), side="left")
    ends = np.searchsorted(comm_N[order], np.arange(C), side="right")
    lo_C = np.where(starts > 0, cdf[np.maximum(starts - 1, 0)], 0.0)
    mass_C = np.where(ends > starts, cdf[np.maximum(ends - 1, 0)] - lo_C, 0.0)
    pairs = np.empty((0,), dtype=np.int64)
    want = s.num_edges
    drawn = 0
    while pairs.size < want and drawn < 8:
        m = int((want - pairs.size) * 1.15) + 16
        src = order[np.minimum(np.searchsorted(cdf, rng.random(m) * total), N - 1)]
        c = comm_N[src]
        u = rng.random(m)
        pos = np.where(rng.random(m) < s.homophily, lo_C[c] + u * mass_C[c], u * total)
        dst = order[np.minimum(np.searchsorted(cdf, pos), N - 1)]
        keep = src != dst
        a, b = np.minimum(src[keep], dst[keep]), np.maximum(src[keep], dst[keep])
        pairs = sorted_unique(np.concatenate([pairs, a * N + b]))
        drawn += 1
    if pairs.size > want:
        drop = rng.permutation(pairs.size)[: pairs.size - want]
        keep_P = np.ones(pairs.size, dtype=bool)
        keep_P[drop] = False
        pairs = pairs[keep_P]
    edges_E2 = np.stack([pairs // N, pairs % N], axis=1)
    # class-dependent features: class mean * signal + unit Gaussian noise
    mu_KF = rng.standard_normal((K, s.num_features)).astype(np.float32)
    x_NF = rng.standard_normal((N, s.num_features), dtype=np.float32)
    x_NF += s.signal * mu_KF[y_N]
    perm = rng.permutation(N)
    n_tr, n_va = int(s.train_frac * N), int(s.val_frac * N)
    masks = [np.zeros(N, dtype=bool) for _ in range(3)]
    masks[0][perm[:n_tr]] = True
    masks[1][perm[n_tr:n_tr + n_va]] = True
    masks[2][perm[n_tr + n_va:]] = True
    return _make_graph(x_NF, y_N, edges_E2, *masks, name="synthetic", directed=False,
                       num_classes=K)


# --------------------------------------------------------------------------- named data sets
class DatasetUnavailable(ValueError):
    """A named data set is not under the data root and could not be downloaded."""


def default_data_root() -> Path:
    """``$COMMSCHED_DATA``, else ``$XDG_CACHE_HOME/commsched/data`` or ``~/.cache/commsched/data``."""
    from ...config import read_env

    return read_env().data_root


def _planetoid_dir(root: Path, name: str) -> Path | None:
    files = [f"ind.{name.lower()}.{s}" for s in PLANETOID_RAW]
    for cand in (root / "planetoid" / name, root / name, root / name.lower()):
        if all((cand / "raw" / f).is_file() for f in files):
            return cand
    return None


def _hetero_file(root: Path, name: str) -> Path | None:
    for cand in (root / "heterophilous" / name / "raw" / f"{name}.npz", root / name / "raw" / f"{name}.npz",
                 root / "heterophilous" / f"{name}.npz", root / f"{name}.npz"):
        if cand.is_file():
            return cand
    return None


def _check_name(name: str) -> str:
    key = name.lower().replace("-", "_")
    if key not in DATASETS or key == "synthetic":
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(d for d in DATASETS if d != 'synthetic')} "
                         "(or pass --graph FILE.npz)")
    return key


def find_dataset(name: str, data_root: str | os.PathLike | None = None) -> Path | None:
    """Where data set ``name``'s raw files are under ``data_root`` (the Planetoid folder or
    the npz file), or None when they are not there. Nothing is downloaded."""
    key = _check_name(name)
    root = Path(data_root) if data_root is not None else default_data_root()
    if key in PLANETOID:
        return _planetoid_dir(root, PLANETOID[key])
    return _hetero_file(root, key)


def dataset_home(name: str, data_root: str | os.PathLike | None = None) -> Path:
    """The folder a download of ``name`` goes to (``raw/`` inside it holds the files)."""
    key = _check_name(name)
    root = Path(data_root) if data_root is not None else default_data_root()
    if key in PLANETOID:
        return root / "planetoid" / PLANETOID[key]
    return root / "heterophilous" / key


@contextlib.contextmanager
def _quiet():
    """PyG prints "Downloading ..." and "Processing..."; warnings about its own internals."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def download_dataset(name: str, data_root: str | os.PathLike | None = None) -> Path:
    """Download data set ``name`` into ``data_root`` with torch_geometric (``Planetoid``,
    ``HeterophilousGraphDataset``, or PyG's ``download_url`` from the same source for
    squirrel and chameleon) unless it is there already; return ``find_dataset``'s path.

    Raises :class:`DatasetUnavailable` (a ValueError) naming the data set, the folder and
    what to do when the download fails (no network, a proxy, a full disk).
    """
    key = _check_name(name)
    root = Path(data_root) if data_root is not None else default_data_root()
    found = find_dataset(key, root)
    if found is not None:
        return found
    home = dataset_home(key, root)
    require("torch_geometric", f"downloading dataset {key!r}")  # before the try: not a download error
    made = [d for d in (home, home.parent, root) if not d.exists()]  # deepest first
    try:
        with _quiet():
            if key in PLANETOID:
                from torch_geometric.datasets import Planetoid

                Planetoid(str(root / "planetoid"), PLANETOID[key])
            elif key in PYG_HETEROPHILOUS:
                from torch_geometric.datasets import HeterophilousGraphDataset

                HeterophilousGraphDataset(str(root / "heterophilous"), key)
            else:
                from torch_geometric.data import download_url
                from torch_geometric.datasets import HeterophilousGraphDataset

                download_url(f"{HeterophilousGraphDataset.url}/{key}.npz", str(home / "raw"))
    except Exception as e:  # noqa: BLE001 - urllib, fsspec, aiohttp, OSError: all one answer
        for d in made:  # nothing half-downloaded is taken for the data set next time
            shutil.rmtree(d, ignore_errors=True) if d == home else _rmdir_if_empty(d)
        raise DatasetUnavailable(
            f"dataset {key!r} is not in {root} and could not be downloaded there "
            f"({read_error(e)}); connect to the internet and run again, or put its files in "
            f"{home / 'raw'}, or pass --data-root DIR of a folder that holds them "
            "(`commsched datasets` lists what it finds)") from None
    found = find_dataset(key, root)
    if found is None:
        raise DatasetUnavailable(f"dataset {key!r}: the download into {home} did not leave the "
                                 f"expected files in {home / 'raw'}")
    return found


def _rmdir_if_empty(d: Path) -> None:
    with contextlib.suppress(OSError):
        d.rmdir()


def dataset_status(data_root: str | os.PathLike | None = None) -> list[tuple[str, Path | None]]:
    """(name, where its files are or None) for every named data set under ``data_root``."""
    return [(n, find_dataset(n, data_root)) for n in DATASETS if n != "synthetic"]


def load_dataset(name: str, data_root: str | os.PathLike | None = None, *, split: int = 0,
                 directed: bool = False, normalize_features: bool = True,
                 download: bool = True) -> Graph:
    """A named data set from ``data_root`` (default :func:`default_data_root`), downloaded
    there with torch_geometric when its files are missing (``download=False``: never).

    cora / citeseer / pubmed: Planetoid raw files under ``planetoid/{Cora,...}/raw``, read
    with torch_geometric's ``Planetoid`` on a temporary writable copy (PyG writes a
    ``processed/`` folder; the data root is only read); Planetoid split; features are
    row-normalised as in Kipf & Welling unless ``normalize_features`` is False.
    tolokers / minesweeper / squirrel / chameleon / roman_empire / amazon_ratings /
    questions: graph files under ``heterophilous/NAME/raw/NAME.npz``, 10 splits.
    """
    key = _check_name(name)
    root = Path(data_root) if data_root is not None else default_data_root()
    src = download_dataset(key, root) if download else find_dataset(key, root)
    if src is None:
        raise DatasetUnavailable(f"dataset {key!r}: its files are not in {root} (looked for "
                                 f"{dataset_home(key, root) / 'raw'})")
    if key in PLANETOID:
        pname = PLANETOID[key]
        Planetoid = require("torch_geometric.datasets", f"dataset {key!r}").Planetoid
        require("scipy", f"dataset {key!r} (Planetoid's files)")

        with tempfile.TemporaryDirectory(prefix="commsched-planetoid-") as tmp:
            shutil.copytree(src / "raw", Path(tmp) / pname / "raw")
            with _quiet():
                data = Planetoid(tmp, pname)[0]
        g = from_pyg(data, split=split, directed=directed, name=key)
        if normalize_features:
            x = g.x_NF
            rs = x.sum(1, keepdim=True)
            x = torch.where(rs > 0, x / rs.clamp_min(1e-30), x)
            g = Graph(x.contiguous(), g.y_N, g.edge_index_2E, g.train_mask, g.val_mask,
                      g.test_mask, name=g.name, directed=g.directed, num_classes=g.num_classes)
        return g
    return load_graph(src, split=split, directed=directed, name=key)


# --------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class GraphSource:
    """Where a graph comes from: ``kind`` is "dataset", "file" or "synthetic"."""

    kind: str = "synthetic"
    name: str = "synthetic"
    path: str | None = None
    data_root: str | None = None
    split: int = 0
    directed: bool = False
    synthetic: SyntheticSpec | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("dataset", "file", "synthetic"):
            raise ValueError(f"graph source kind must be dataset, file or synthetic, got {self.kind!r}")
        if self.kind == "file" and not self.path:
            raise ValueError("a graph file source needs a path")
        if self.kind == "dataset":
            object.__setattr__(self, "name", _check_name(self.name))
            if not self.data_root:  # the default, resolved once so every rank agrees
                object.__setattr__(self, "data_root", str(default_data_root()))
        if self.kind == "synthetic" and self.synthetic is None:
            object.__setattr__(self, "synthetic", SyntheticSpec())

    def identity(self) -> str:
        """A cheap identity (no graph is built): what a partition folder was made from."""
        if self.kind == "synthetic":
            return "synthetic:" + json.dumps(asdict(self.synthetic), sort_keys=True)
        if self.kind == "file":
            h = hashlib.blake2b(digest_size=12)
            try:
                with open(self.path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 22), b""):
                        h.update(chunk)
            except OSError as e:
                raise ValueError(f"graph file {self.path}: cannot be read ({read_error(e)})") from None
            return f"file:{h.hexdigest()}:split={self.split}:directed={int(self.directed)}"
        return f"dataset:{self.name.lower()}:split={self.split}:directed={int(self.directed)}"


def load_source(src: GraphSource) -> Graph:
    if src.kind == "synthetic":
        return synthetic_graph(src.synthetic)
    if src.kind == "file":
        return load_graph(src.path, split=src.split, directed=src.directed)
    return load_dataset(src.name, src.data_root, split=src.split, directed=src.directed)


__all__ = ["DATASETS", "DatasetUnavailable", "Graph", "GraphSource", "SyntheticSpec", "clean_edges",
           "dataset_status", "default_data_root", "download_dataset", "find_dataset", "from_edges",
           "from_pyg", "graph_fingerprint", "load_dataset", "load_graph", "load_source",
           "save_graph", "synthetic_graph"]
