"""The layer registry (``--model``): commsched's own fast-path layers and PyG layers, one stack.

Legend: n owned nodes, F input width, H hidden width, K classes.

Every entry of :data:`LAYERS` is a :class:`LayerConfig` whose ``build(graph, F, H, K, ...)``
makes the model of a run over a :class:`~commsched.gnn.nn.pyg.DistGraph`: L layers, each
dropout (node-keyed, :meth:`LocalGraph.dropout`) -> conv -> (LayerNorm -> ReLU unless
last), parameters drawn from ``seed`` (the same on every rank; the global RNG untouched).
Every model is called as ``model(x_nF, graph.local, ctx)`` and returns the logits [n, K].

* ``gcn``, ``sage``: commsched's :class:`~commsched.gnn.nn.layers.GCNConv` and
  :class:`~commsched.gnn.nn.layers.SAGEConv` (:class:`FastLayer`: fused sparse products on the
  part's central / marginal blocks; the fast path).
* ``gin``, ``gat``: torch_geometric's ``GINConv`` (a 2-layer MLP, sum aggregation) and
  ``GATConv`` (one head) run through :func:`~commsched.gnn.nn.pyg.distributed`
  (:class:`PyGLayer`).

Adding a layer kind is one entry::

    LAYERS.register("graphconv", PyGLayer(make=lambda i, o: GraphConv(i, o, aggr="mean")))
    # or commsched's own (a DistMessagePassing subclass):
    LAYERS.register("mylayer", FastLayer(conv=MyConv))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..._lazy import require
from ...configurable import Config, Registry, option
from ..context import PassContext
from .layers import DistGNN, DistMessagePassing, GCNConv, LocalGraph, SAGEConv
from .pyg import DistGraph, distributed


@dataclass(frozen=True, kw_only=True)
class LayerConfig(Config):
    """A layer kind: ``build(graph, in_dim, hidden, num_classes, ...)`` makes the model."""

    def build(self, graph: DistGraph, in_dim: int, hidden: int, num_classes: int, *,
              layers: int = 3, dropout: float = 0.5, layer_norm: bool = True, seed: int = 0,
              dtype: torch.dtype = torch.float32) -> nn.Module:
        raise NotImplementedError

    def layer_names(self) -> tuple[str, ...]:
        """Class names of the layers (for the modes' ``check_layers``)."""
        return ()


@dataclass(frozen=True, kw_only=True)
class FastLayer(LayerConfig):
    """commsched's own layer ``conv`` (a :class:`DistMessagePassing` subclass) in a
    :class:`DistGNN`: the fast path."""

    conv: type = option(GCNConv, cli=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.conv, type) and issubclass(self.conv, DistMessagePassing)):
            raise TypeError(f"FastLayer(conv=...) takes a DistMessagePassing subclass, got {self.conv!r}")

    def build(self, graph, in_dim, hidden, num_classes, *, layers=3, dropout=0.5, layer_norm=True,
              seed=0, dtype=torch.float32) -> nn.Module:
        graph.use_norm(self.conv.norm)
        return self.model(in_dim, hidden, num_classes, layers=layers, dropout=dropout,
                          layer_norm=layer_norm, seed=seed, dtype=dtype)

    def model(self, in_dim: int, hidden: int, num_classes: int, *, layers: int = 3, dropout: float = 0.5,
              layer_norm: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32) -> DistGNN:
        """The :class:`DistGNN` alone, outside a run (called on a
        :class:`~commsched.gnn.nn.layers.LocalGraph`), parameters drawn from ``seed``
        (identical on every rank; the global RNG state is left untouched)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            m = DistGNN(self.conv, in_dim, hidden, num_classes, layers=layers, dropout=dropout,
                        layer_norm=layer_norm)
        return m.to(dtype)

    def layer_names(self) -> tuple[str, ...]:
        return (self.conv.__name__,)


class PyGStack(nn.Module):
    """L PyG layers through ``graph``'s exchange, stacked as :class:`DistGNN` stacks its own:
    dropout -> conv -> (LayerNorm -> ReLU unless last)."""

    def __init__(self, graph: DistGraph, make: Callable[[int, int], nn.Module], in_dim: int,
                 hidden: int, out_dim: int, layers: int = 3, dropout: float = 0.5,
                 layer_norm: bool = True):
        super().__init__()
        if layers < 1:
            raise ValueError(f"a model needs at least one layer, got {layers}")
        dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
        self.convs = nn.ModuleList(distributed(make(dims[i], dims[i + 1]), graph) for i in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) if layer_norm else nn.Identity()
                                   for _ in range(layers - 1))
        self.dropout = dropout

    def forward(self, x_nF: torch.Tensor, g: LocalGraph, ctx: PassContext | None = None, *,
                fused: bool | None = None) -> torch.Tensor:
        """Logits [n, K] of the owned nodes (``g``: the graph's :class:`LocalGraph`, for
        the node-keyed dropout)."""
        ctx = ctx if ctx is not None else PassContext(training=self.training)
        h = x_nF
        last = len(self.convs) - 1
        for i, conv in enumerate(self.convs):
            h = g.dropout(h, self.dropout, i, ctx)
            h = conv(h, ctx)
            if i < last:
                h = F.relu(self.norms[i](h))
        return h


@dataclass(frozen=True, kw_only=True)
class PyGLayer(LayerConfig):
    """A torch_geometric layer made by ``make(in_dim, out_dim)`` (a kind that
    :data:`commsched.gnn.nn.pyg.LAYER_KINDS` knows), run through :func:`distributed`."""

    make: Callable[[int, int], nn.Module] = option(None, cli=False)
    name: str = option("", cli=False)

    def build(self, graph, in_dim, hidden, num_classes, *, layers=3, dropout=0.5, layer_norm=True,
              seed=0, dtype=torch.float32) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            m = PyGStack(graph, self.make, in_dim, hidden, num_classes, layers=layers,
                         dropout=dropout, layer_norm=layer_norm)
        return m.to(dtype)

    def layer_names(self) -> tuple[str, ...]:
        return (self.name,) if self.name else ()


def _gin(i: int, o: int) -> nn.Module:
    GINConv = require("torch_geometric.nn", "--model gin").GINConv

    return GINConv(nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Linear(o, o)))


def _gat(i: int, o: int) -> nn.Module:
    GATConv = require("torch_geometric.nn", "--model gat").GATConv

    return GATConv(i, o, heads=1)


def _registry() -> Registry[LayerConfig]:
    reg: Registry[LayerConfig] = Registry("model")
    reg.register("gcn", FastLayer(conv=GCNConv))
    reg.register("sage", FastLayer(conv=SAGEConv))
    reg.register("gin", PyGLayer(make=_gin, name="GINConv"))
    reg.register("gat", PyGLayer(make=_gat, name="GATConv"))
    return reg


# --model name -> its layer kind
LAYERS: Registry[LayerConfig] = _registry()


def layers_copy() -> Registry[LayerConfig]:
    """A fresh registry of the built-in layer kinds (to register more locally)."""
    return _registry()


__all__ = ["LAYERS", "FastLayer", "LayerConfig", "PyGLayer", "PyGStack", "layers_copy"]
