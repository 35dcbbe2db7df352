"""PyG layers through the halo exchange: :class:`DistGraph` and :func:`distributed`.

Legend: n owned nodes (n_c central, then n_m marginal), R remote (halo) nodes,
L = n + R local nodes, E local edges, F input width, H output width.

A torch_geometric ``MessagePassing`` layer (``GCNConv``, ``SAGEConv``, ``GINConv``,
``GATConv``, ...) computes the new row of a node from its own row and its in-edges. One
rank's part holds every in-edge of its owned nodes, so such a layer runs distributed
unchanged once it is handed the owned rows with the remote rows appended and the local
``edge_index``. That is all :class:`DistributedLayer` does around the user's layer:

    handle = exchange.start(x_nF, layer, ctx)          # boundary rows out (in the background)
    whole:  x_LF = [x_nF; handle.wait()]               # owned rows, then remote rows
            out  = conv(x_LF, edge_index)[:n]
    split:  out_c = conv(x_nF, central edges)[:n_c]    # while the rows are on the wire
            x_LF  = [x_marginal; x_central; handle.wait()]
            out_m = conv(x_LF, marginal edges)[:n_m]
            out   = [out_c; out_m]

The *split* form overlaps the central nodes' aggregation with the exchange; it is taken
when the exchange overlaps (``adaqp``, ``adaqp-p``, ``uniform``, ``random``) and the
layer kind allows it; the blocking modes (``vanilla``, ``adaqp-q``) take the *whole*
form. In both, the targets of a call are the first rows of its input, in the same order,
so a layer that adds self loops (GCN, GAT) adds them to the right rows, and the output
rows of non-targets are dropped. Layers that take a (source, target) pair (SAGE, GIN,
GAT, GraphConv) get one and compute only the target rows. Both forms are exact: N ranks
give the single-process layer's output and gradients up to float rounding (a test
compares 3 ranks with the full-graph PyG layer).

A layer *kind* (:class:`LayerKind`, resolved from the layer by :func:`layer_kind`) says
how a layer is called: the edge normalisation that weighs its messages in AdaQP's
variance model (``norm``), whether it gets precomputed edge weights (GCN: the
global-degree weights of :func:`commsched.gnn.graph.book.edge_weights`, its own
``normalize`` switched off during the call, since a rank sees the in-degrees of its remote
nodes as zero), whether it takes a (source, target) pair, and whether it may be split.
A layer the table does not know is a ValueError naming it and the supported kinds;
``distributed(conv, graph, kind=LayerKind(...))`` declares one.

:class:`DistGraph` is one rank's part, ready for such layers: the partition book, the
exchange of the chosen mode (:func:`commsched.gnn.make_exchange`), the owned features,
labels and masks on the device, and the small protocol of a training loop of one's own:
``train_pass(epoch)`` / ``eval_pass()`` (the pass's context, the exchange's per-epoch
work), ``sync_grads`` (the gradient allreduce, with the loss), ``all_sum``. docs/integrate.md
shows both in runnable examples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..._lazy import require
from ...agree import check_same_config
from ...clock import Clock
from ...comm.all2all import CommStats
from ...dist import comm_guard
from ...quant.allreduce import check_grad_bits, quantized_all_reduce
from ..context import ExchangeContext, PassContext
from ..exchange.halo import HaloExchange
from ..exchange.modes import ExchangeConfig, resolve_config
from ..graph.book import NORMS, edge_weights
from ..graph.partition import PartData, make_parts, partition_nodes
from ..timing import Breakdown
from .layers import LocalGraph


def _world(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def allreduce_grads(params, loss: torch.Tensor | None = None, *, group=None,
                    timer: Breakdown | None = None, bits: int = 32, seed: int = 0) -> float | None:
    """Sum every parameter's gradient over the ranks of ``group`` (one flat allreduce, timed
    as "reduce" in ``timer``), together with ``loss`` (a scalar) when given; returns the
    summed loss as a float (None without one). Parameters without a gradient get a zero one
    first, so every rank reduces the same flat tensor. Collective; on one rank (or no
    process group) the gradients stay as they are.

    ``bits`` (``TrainConfig.grad_bits``): 32 sums exactly (one ``all_reduce`` with the loss
    in it); 16 or 8/4/2 send the gradients in fewer bytes through
    :func:`commsched.quant.allreduce.quantized_all_reduce` (bfloat16, or the codec's
    unbiased stochastic row records keyed by ``seed``; vary it per step), every replica
    getting the same sums, and the loss exactly in a one-value allreduce of its own."""
    bits = check_grad_bits(bits, "grad bits")
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    rank, world = _world(group)
    if world == 1 or not params:
        return None if loss is None else float(loss.detach())
    with (timer.time("reduce") if timer is not None else contextlib.nullcontext()):
        parts = [p.grad.reshape(-1) for p in params]
        exact = bits == 32
        if loss is not None and exact:
            parts.append(loss.detach().reshape(1).to(device=params[0].device, dtype=params[0].dtype))
        flat = torch.cat(parts)
        with comm_guard("allreduce of parameter gradients", group):
            if exact:
                dist.all_reduce(flat, group=group)
            else:
                quantized_all_reduce(flat, bits, group=group, seed=seed)
                if loss is not None:
                    total = loss.detach().reshape(1).to(device=params[0].device,
                                                        dtype=torch.float64).clone()
                    dist.all_reduce(total, group=group)
        off = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p))
            off += n
    if loss is None:
        return None
    return float(flat[-1]) if exact else float(total)


# --------------------------------------------------------------------------- layer kinds
@dataclass(frozen=True)
class LayerKind:
    """How a message-passing layer is called on a rank's part.

    norm: the edge normalisation of its aggregation, one of "gcn", "mean", "sum" (AdaQP
    weighs each forward message's variance by it; attention layers take "mean", uniform
    attention). weighted: the layer gets ``edge_weight`` = the global weights of ``norm``
    (self loops included for "gcn") as its third argument. bipartite: it takes
    ``(x_source, x_target)``. split: its output row of a node depends only on that node's
    row and its in-edges, so the central nodes may run before the remote rows arrive.
    disable: boolean attributes of the layer switched off during the call (GCNConv's
    ``normalize``: the weights come precomputed).
    """

    norm: str
    weighted: bool = False
    bipartite: bool = False
    split: bool = True
    disable: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.norm not in NORMS:
            raise ValueError(f"LayerKind: norm must be one of {', '.join(NORMS)}, got {self.norm!r}")


def _aggr_norm(conv, name: str, allowed: dict[str, str]) -> str:
    aggr = conv.aggr if isinstance(conv.aggr, str) else type(conv.aggr).__name__
    if aggr not in allowed:
        raise ValueError(f"{name}(aggr={aggr!r}) is not supported by the halo exchange: supported "
                         f"aggregations are {', '.join(sorted(allowed))}")
    return allowed[aggr]


def _gcn(conv) -> LayerKind:
    if not conv.normalize:  # no normalisation, no self loops: a plain weighted sum
        return LayerKind("sum")
    if not conv.add_self_loops or getattr(conv, "improved", False):
        raise ValueError("GCNConv(add_self_loops=False or improved=True) is not supported by the "
                         "halo exchange: its symmetric normalisation is gcn_norm with one self loop")
    return LayerKind("gcn", weighted=True, disable=("normalize",))


def _sage(conv) -> LayerKind:
    return LayerKind(_aggr_norm(conv, "SAGEConv", {"mean": "mean", "add": "sum", "sum": "sum"}),
                     bipartite=True)


def _gin(conv) -> LayerKind:
    return LayerKind(_aggr_norm(conv, "GINConv", {"add": "sum", "sum": "sum"}), bipartite=True)


def _graph_conv(conv) -> LayerKind:
    return LayerKind(_aggr_norm(conv, "GraphConv", {"mean": "mean", "add": "sum", "sum": "sum"}),
                     bipartite=True)


def _attention(name: str) -> Callable:
    def kind(conv) -> LayerKind:
        if getattr(conv, "edge_dim", None) is not None:
            raise ValueError(f"{name}(edge_dim=...) needs edge features, which the halo exchange "
                             "does not partition; use edge_dim=None")
        return LayerKind("mean", bipartite=True)
    return kind


# torch_geometric class name -> the kind of one of its layers (exact classes only: a
# subclass may call its parent differently, so it declares its kind)
LAYER_KINDS: dict[str, Callable[[nn.Module], LayerKind]] = {
    "GCNConv": _gcn, "SAGEConv": _sage, "GINConv": _gin, "GraphConv": _graph_conv,
    "GATConv": _attention("GATConv"), "GATv2Conv": _attention("GATv2Conv"),
}


def layer_kind(conv: nn.Module) -> LayerKind:
    """The :class:`LayerKind` of a torch_geometric layer; a ValueError naming the layer and
    the supported kinds for one the table does not know, a TypeError for a module that is
    not a ``MessagePassing`` layer."""
    MessagePassing = require("torch_geometric.nn", "distributed()").MessagePassing

    name = type(conv).__name__
    if not isinstance(conv, MessagePassing):
        raise TypeError(f"distributed() takes a torch_geometric MessagePassing layer, got {name}; "
                        "commsched's own layers (DistMessagePassing) run through the halo "
                        "exchange already")
    found = LAYER_KINDS.get(name)
    if found is None or type(conv).__module__.split(".")[0] != "torch_geometric":
        raise ValueError(f"layer {name} is not a kind the halo exchange knows; supported: "
                         f"{', '.join(sorted(LAYER_KINDS))} (torch_geometric's). For another "
                         "layer, declare how it aggregates: distributed(conv, graph, "
                         "kind=LayerKind(norm='gcn'|'mean'|'sum', bipartite=..., split=...))")
    return found(conv)


def _in_width(conv: nn.Module) -> int | None:
    """The input row width of a layer when it is known before a call."""
    w = getattr(conv, "in_channels", None)
    if isinstance(w, int) and w > 0:
        return w
    if isinstance(w, tuple) and w and isinstance(w[0], int) and w[0] > 0:
        return w[0]
    return next((m.in_features for m in conv.modules() if isinstance(m, nn.Linear)), None)


# --------------------------------------------------------------------------- local edges
@dataclass(frozen=True, eq=False)
class _Edges:
    """One call's edges: ``index_2E`` (sources index the call's input rows, targets its
    first ``num_dst`` rows), ``weight_E`` or None."""

    index_2E: torch.Tensor
    weight_E: torch.Tensor | None
    num_dst: int


@dataclass(frozen=True, eq=False)
class _EdgeSet:
    whole: _Edges     # input [owned; remote], targets the owned nodes
    central: _Edges   # input [owned], targets the central nodes
    marginal: _Edges  # input [marginal; central; remote], targets the marginal nodes


def _edge_set(book, norm: str, weighted: bool, dtype: torch.dtype, device: torch.device) -> _EdgeSet:
    if weighted:
        s, d, w = edge_weights(book, norm)
    else:
        s, d, w = book.edge_src, book.edge_dst, None
    n_c, n = book.num_central, book.num_owned
    k = int(np.searchsorted(d, n_c, side="left"))

    def edges(src, dst, wt, num_dst) -> _Edges:
        idx = torch.from_numpy(np.stack([src, dst]).astype(np.int64)).to(device)
        wt_t = torch.from_numpy(wt).to(device=device, dtype=dtype) if wt is not None else None
        return _Edges(idx, wt_t, num_dst)

    # the marginal call's input puts the marginal rows first: local id i -> position
    m_src = s[k:]
    pos = np.where(m_src >= n, m_src, np.where(m_src >= n_c, m_src - n_c, m_src + (n - n_c)))
    return _EdgeSet(whole=edges(s, d, w, n),
                    central=edges(s[:k], d[:k], None if w is None else w[:k], n_c),
                    marginal=edges(pos, d[k:] - n_c, None if w is None else w[k:], n - n_c))


# --------------------------------------------------------------------------- the graph
class PassHistory(dict):
    """What :meth:`DistGraph.train_pass` recorded, one entry per training pass, *this rank's*.

    By position: ``history[i]`` (``history[-1]``: the last pass) is one pass's record,
    ``{"epoch": e, "breakdown_s": {"comm": s, "quant": s, ...}, "bytes_sent": n}``;
    :attr:`passes` is all of them, oldest first, and ``len(history.passes)`` their number.
    By field: ``history["epoch"]``, ``history["breakdown_s"]``, ``history["bytes_sent"]`` are
    the lists of each. ``bytes_sent`` counts the halo-exchange bytes this rank sent in the pass
    (every peer, message metadata included; not the gradient allreduce); the whole job's is
    the sum over the ranks, ``graph.all_sum(torch.tensor(graph.history[-1]["bytes_sent"]))``.
    ``breakdown_s`` is this rank's seconds per part of the pass (``comm``, ``quant``,
    ``central``, ``marginal``, ``reduce``, ``assign``)."""

    FIELDS = ("epoch", "breakdown_s", "bytes_sent")

    def __init__(self) -> None:
        super().__init__({f: [] for f in self.FIELDS})

    def record(self, epoch: int, breakdown_s: dict, bytes_sent: int) -> None:
        """Append one training pass's record."""
        for f, v in zip(self.FIELDS, (epoch, breakdown_s, bytes_sent)):
            dict.__getitem__(self, f).append(v)

    def __getitem__(self, key):
        if isinstance(key, int) and not isinstance(key, bool):
            n = len(dict.__getitem__(self, "epoch"))
            if not -n <= key < n:
                raise IndexError(f"graph.history holds {n} training pass{'es' if n != 1 else ''}; "
                                 f"no pass at position {key}")
            return {f: dict.__getitem__(self, f)[key] for f in self.FIELDS}
        if key not in self:
            raise KeyError(f"graph.history has no field {key!r}: index it by position (history[-1]: "
                           f"the last pass) or by a field, one of {', '.join(self.FIELDS)}")
        return dict.__getitem__(self, key)

    @property
    def passes(self) -> list[dict]:
        """Every pass's record, oldest first."""
        return [self[i] for i in range(len(dict.__getitem__(self, "epoch")))]


class DistGraph:
    """One rank's part of a graph with its halo exchange, for PyG layers and own loops.

    part: this rank's :class:`PartData` (:func:`commsched.gnn.load_part`, a scatter, or
    :meth:`from_graph`); mode: a ``--mode`` (:data:`commsched.gnn.MODES`); config: the
    mode's :class:`~commsched.gnn.exchange.modes.ExchangeConfig` (default: its defaults; another
    mode's config gives the fields it shares); seed: of AdaQP's random widths
    and rounding and BNS's samples; group: the process group (None: the default group, or
    one process without any); device: where rows, edges and the exchange live (default:
    the CPU); dtype: of the features and the edge weights; wire_dtype: the dtype
    full-precision rows cross the wire in (mixed precision); dropout_rng: of
    :attr:`local`'s dropout; exchange: a ready :class:`HaloExchange` instead of ``mode``'s.

    The owned rows are in the book's local order, central then marginal: ``x`` [n, F],
    ``y`` [n], ``masks["train" | "val" | "test"]`` [n], ``global_ids`` [n] (each owned
    row's node id in the whole graph); ``totals`` holds the whole graph's counts.

    Set-up (checking the ranks agree, the exchange's ``validate`` and ``prepare``) runs
    once, collectively, on the first pass or layer call.
    """

    def __init__(self, part: PartData, *, mode: str = "vanilla", group=None,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                 seed: int = 0, pattern: str = "direct",
                 exchange: HaloExchange | None = None, config: ExchangeConfig | None = None,
                 wire_dtype: torch.dtype | None = None, dropout_rng: str = "node"):
        if not isinstance(part, PartData):
            raise TypeError(f"DistGraph takes one rank's PartData (make_parts, load_part or "
                            f"DistGraph.from_graph), got {type(part).__name__}")
        rank, world = _world(group)
        if part.book.num_parts != world or part.book.rank != rank:
            raise ValueError(f"rank {rank} of {world} was given part {part.book.rank} of "
                             f"{part.book.num_parts}")
        # an unknown mode fails here, naming the known ones; options another mode's
        self.config = resolve_config(mode, config, strict=False)
        self.part, self.book, self.mode, self.group = part, part.book, mode, group
        self.rank, self.world = rank, world
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype, self.seed, self.pattern = dtype, seed, pattern
        self.wire_dtype, self.dropout_rng = wire_dtype, dropout_rng
        self._norm: str | None = None
        self.x = part.x_nF.to(device=self.device, dtype=dtype)
        self.y = part.y_n.to(self.device)
        self.masks = {"train": part.train_mask.to(self.device), "val": part.val_mask.to(self.device),
                      "test": part.test_mask.to(self.device)}
        self.totals = dict(part.totals)
        self.num_classes = part.num_classes
        self.global_ids = torch.from_numpy(self.book.owned_ids).to(self.device)
        self._halo = exchange.to(self.device) if exchange is not None else None
        self._layers: list[DistributedLayer] = []
        self._edges: dict[tuple[str, bool], _EdgeSet] = {}
        self._ctx: PassContext | None = None
        self._ready = False
        self.clock = Clock(self.device)
        self.history = PassHistory()

    @classmethod
    def from_graph(cls, graph, *, group=None, method: str = "metis", partition_seed: int = 0,
                   **kw) -> "DistGraph":
        """Every rank holds the whole ``graph`` (a :class:`commsched.gnn.Graph` or a
        torch_geometric ``Data``, read by :func:`commsched.gnn.from_pyg`), partitions it
        the same way (``method``, ``partition_seed``) and keeps its own part; ``kw`` as
        for the constructor. For graphs too big for every rank, partition once with
        ``commsched partition`` and pass ``load_part(...)`` to the constructor."""
        from ..graph.data import Graph, from_pyg

        g = graph if isinstance(graph, Graph) else from_pyg(graph)
        rank, world = _world(group)
        parts = partition_nodes(g, world, method, partition_seed)
        return cls(make_parts(g, parts, world)[rank], group=group, **kw)

    # -- the exchange ---------------------------------------------------------------------
    @property
    def halo(self) -> HaloExchange:
        """The halo exchange (built on first use, weighing AdaQP's messages by the first
        registered layer's norm)."""
        if self._halo is None:
            norm = self._layers[0].kind.norm if self._layers else (self._norm or "gcn")
            self._halo = self.config.build(ExchangeContext(
                self.book, group=self.group, pattern=self.pattern, seed=self.seed, norm=norm,
                device=self.device, wire_dtype=self.wire_dtype))
            for lay in self._layers:
                if lay.kind.norm != norm:
                    self._halo.set_layer_norm(lay.layer, lay.kind.norm)
        return self._halo

    @functools.cached_property
    def local(self) -> LocalGraph:
        """The :class:`LocalGraph` of commsched's own layers (``DistMessagePassing``) on
        this part and exchange: ``conv(h, graph.local, layer, ctx)``."""
        return LocalGraph(self.book, self.halo, dtype=self.dtype, seed=self.seed,
                          dropout_rng=self.dropout_rng, device=self.device)

    def use_norm(self, norm: str) -> None:
        """The edge normalisation the exchange weighs messages by when no PyG layer is
        registered (commsched's own layers: their ``norm``); before the first use of
        :attr:`halo` (which builds the exchange)."""
        self._norm = norm  # (a given exchange was built with its own)

    def register(self, layer: "DistributedLayer") -> int:
        """Give ``layer`` the next layer index (its key in the exchange); returns it."""
        if self._ready:
            raise RuntimeError("distributed(): wrap every layer before the first pass (the "
                               "exchange is set up for the layers known then)")
        self._layers.append(layer)
        return len(self._layers) - 1

    def edges(self, kind: LayerKind) -> _EdgeSet:
        key = (kind.norm, kind.weighted)
        if key not in self._edges:
            self._edges[key] = _edge_set(self.book, kind.norm, kind.weighted, self.dtype, self.device)
        return self._edges[key]

    def setup(self, *, row_numel: int | None = None, dims: list[int] | None = None,
              check: bool = True) -> None:
        """Once, collectively: the ranks compare what shapes the run (graph, partition,
        mode, layers; ``check=False``: the caller compared them already), the exchange
        checks its peers (``validate``; ``row_numel``: the input width) and compiles what
        it will run (``prepare``: ``dims``, the input width of every layer, default the
        registered layers'). Called by the first pass or layer call."""
        if self._ready:
            return
        self.config.check_layers(self.mode, [type(lay.conv).__name__ for lay in self._layers])
        self._ready = True
        if check:
            check_same_config({"partition": {"fingerprint": self.part.fingerprint,
                                             "num_parts": self.book.num_parts},
                               "mode": self.mode, "seed": self.seed, "pattern": self.pattern,
                               "dtype": str(self.dtype), "options": dataclasses.asdict(self.config),
                               "layers": [type(lay.conv).__name__ for lay in self._layers]},
                              self.group, what="DistGraph configuration")
        halo = self.halo
        halo.validate(dtype=self.wire_dtype or self.dtype, row_numel=row_numel)
        if dims is None:
            dims = [d for d in (_in_width(lay.conv) for lay in self._layers) if d is not None]
        halo.prepare(dims)
        for lay in self._layers:
            self.edges(lay.kind)

    # -- passes ---------------------------------------------------------------------------
    def context(self, training: bool = True) -> PassContext:
        """The open pass's context, or (outside any) a pass of epoch 0 with ``training``."""
        return self._ctx if self._ctx is not None else PassContext(training=training)

    @contextlib.contextmanager
    def train_pass(self, epoch: int) -> Iterator[PassContext]:
        """One training epoch: everything of it (forward, loss, backward, ``sync_grads``, the
        optimizer step) runs inside. Opens the pass (every distributed layer picks it up)
        and calls the exchange's ``begin_epoch`` (AdaQP's periodic re-assignment) at entry
        and ``end_epoch`` at exit; its timer and byte counters land in ``history``."""
        self.setup()
        ctx = PassContext(epoch=epoch, training=True, timer=Breakdown(self.clock),
                          stats=CommStats(self.world))
        self._ctx = ctx
        try:
            self.halo.begin_epoch(ctx)
            yield ctx
            self.halo.end_epoch(ctx)
        finally:
            self._ctx = None
        self.history.record(epoch, ctx.timer.as_dict(), ctx.stats.total_bytes_sent)

    @contextlib.contextmanager
    def eval_pass(self, epoch: int = 0) -> Iterator[PassContext]:
        """An evaluation pass: no autograd, full-precision exchanges (also in AdaQP modes);
        put the model in ``eval()`` mode yourself (dropout)."""
        self.setup()
        ctx = PassContext(epoch=epoch, training=False, timer=Breakdown(self.clock))
        self._ctx = ctx
        try:
            with torch.no_grad():
                yield ctx
        finally:
            self._ctx = None

    # -- collectives of a loop ------------------------------------------------------------
    def sync_grads(self, params: Iterable[torch.Tensor], loss: torch.Tensor | None = None, *,
                   bits: int = 32, seed: int = 0) -> float | None:
        """Sum the gradients of ``params`` over the ranks (call it after ``backward`` and
        before the optimizer step; with the loss normalised by the global count, such as
        ``totals["train"]``, the sum is the full-graph gradient); returns the summed
        ``loss`` when given. ``bits`` < 32 sends the gradients compressed, keyed by
        ``seed`` (vary it per step): :func:`allreduce_grads`. Collective."""
        timer = self._ctx.timer if self._ctx is not None else None
        return allreduce_grads(params, loss, group=self.group, timer=timer, bits=bits, seed=seed)

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (a new tensor; for counts, losses). Collective."""
        out = t.detach().clone()
        if self.world > 1:
            with comm_guard("allreduce (DistGraph.all_sum)", self.group):
                dist.all_reduce(out, group=self.group)
        return out


# --------------------------------------------------------------------------- the layer
class DistributedLayer(nn.Module):
    """A PyG layer run on one rank's part through the halo exchange (see the module doc);
    made by :func:`distributed`. ``forward(x_nF)`` takes the owned rows [n, F] and returns
    the owned rows [n, H]. ``conv`` is the user's layer, its parameters this module's."""

    def __init__(self, conv: nn.Module, graph: DistGraph, kind: LayerKind | None = None):
        super().__init__()
        if not isinstance(graph, DistGraph):
            raise TypeError(f"distributed(conv, graph): graph must be a DistGraph, got "
                            f"{type(graph).__name__}")
        self.conv = conv
        self.kind = kind if kind is not None else layer_kind(conv)
        if not isinstance(self.kind, LayerKind):
            raise TypeError(f"kind must be a LayerKind, got {type(self.kind).__name__}")
        object.__setattr__(self, "graph", graph)  # not a submodule: graphs are not state
        self.layer = graph.register(self)
        self._warned = False

    def extra_repr(self) -> str:
        return f"layer={self.layer}, kind={self.kind}"

    def _call(self, x_SF: torch.Tensor, e: _Edges) -> torch.Tensor:
        k = self.kind
        xin = (x_SF, x_SF[:e.num_dst]) if k.bipartite else x_SF
        args = (xin, e.index_2E) + ((e.weight_E,) if k.weighted else ())
        saved = {a: getattr(self.conv, a) for a in k.disable}
        try:
            for a in k.disable:
                setattr(self.conv, a, False)
            out = self.conv(*args)
        finally:
            for a, v in saved.items():
                setattr(self.conv, a, v)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{type(self.conv).__name__} returned {type(out).__name__}; a "
                            "distributed layer needs it to return the new rows as one tensor")
        return out[:e.num_dst]

    def forward(self, x_nF: torch.Tensor, ctx: PassContext | None = None) -> torch.Tensor:
        """New owned rows [n, H] from the owned rows ``x_nF`` [n, F] (central, then marginal,
        as ``graph.x``); ``ctx``: the pass (default: the graph's open pass)."""
        g = self.graph
        g.setup()
        ctx = ctx if ctx is not None else g.context(self.training)
        book = g.book
        if x_nF.dim() != 2 or x_nF.shape[0] != book.num_owned:
            raise ValueError(f"{type(self.conv).__name__} on rank {book.rank}: expects the "
                             f"{book.num_owned} owned rows [n, F] (graph.x or a layer's output), "
                             f"got shape {list(x_nF.shape)}")
        halo = g.halo
        es = g.edges(self.kind)
        n_c, n_m = book.num_central, book.num_marginal
        handle = halo.start(x_nF, self.layer, ctx)
        split = self.kind.split and halo.overlaps
        if halo.overlaps and not self.kind.split and not self._warned:
            self._warned = True
            warnings.warn(f"{type(self.conv).__name__} (layer {self.layer}) cannot be split into "
                          "central and marginal nodes: it runs after the exchange, without "
                          "overlap (the results are the same)", RuntimeWarning, stacklevel=2)
        if not split:
            h_RF = handle.wait()
            with ctx.timer.time("marginal"):
                return self._call(torch.cat([x_nF, h_RF.to(x_nF.dtype)]), es.whole)
        outs = []
        if n_c:
            with ctx.timer.time("central"):
                outs.append(self._call(x_nF, es.central))
        h_RF = handle.wait()
        if n_m:
            with ctx.timer.time("marginal"):
                x_LF = torch.cat([x_nF[n_c:], x_nF[:n_c], h_RF.to(x_nF.dtype)])
                outs.append(self._call(x_LF, es.marginal))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if not n_m and h_RF.requires_grad:
            out = out + h_RF.sum() * 0  # keep the (empty) exchange in the backward graph
        return out


def distributed(conv: nn.Module, graph: DistGraph, *, kind: LayerKind | None = None) -> DistributedLayer:
    """Run the torch_geometric layer ``conv`` on ``graph``'s part through its halo
    exchange: ``layer = distributed(GCNConv(F, H), graph)``, then ``layer(x_nF)``. The
    layer's kind comes from :data:`LAYER_KINDS` (or ``kind``); layers get their index in
    the order they are wrapped, before the first pass."""
    return DistributedLayer(conv, graph, kind)


__all__ = ["LAYER_KINDS", "DistGraph", "DistributedLayer", "LayerKind", "PassHistory", "distributed", "layer_kind"]
