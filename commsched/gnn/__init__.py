"""GNN front-end: graphs, partitioning, distributed full-graph training (Vanilla, AdaQP).

Names are resolved lazily from their submodules; importing ``commsched.gnn`` runs nothing.
"""

from __future__ import annotations

from .._lazy import lazy_getattr

# name -> submodule
_EXPORTS: dict[str, str] = {
    # graphs
    "Graph": "graph.data", "GraphSource": "graph.data", "SyntheticSpec": "graph.data", "load_graph": "graph.data",
    "load_dataset": "graph.data", "synthetic_graph": "graph.data", "from_pyg": "graph.data", "from_edges": "graph.data",
    "save_graph": "graph.data", "graph_fingerprint": "graph.data",
    # partitioning
    "PartitionBook": "graph.book", "build_book": "graph.book", "build_books": "graph.book",
    "partition_nodes": "graph.partition", "make_parts": "graph.partition", "PartData": "graph.partition",
    "save_partition": "graph.partition", "load_part": "graph.partition",
    # exchange, layers, training
    "HaloExchange": "exchange.halo", "VanillaExchange": "exchange.halo", "ZeroExchange": "exchange.halo",
    "MODES": "exchange.modes", "make_exchange": "exchange.modes", "ExchangeConfig": "exchange.modes", "mode_config": "exchange.modes",
    "LAYERS": "nn.models", "FastLayer": "nn.models", "PyGLayer": "nn.models", "AdaQPExchange": "exchange.adaqp",
    "AdaQPConfig": "exchange.modes", "ExchangeContext": "context", "PassContext": "context",
    "GNNMetrics": "train.metrics",
    "DistMessagePassing": "nn.layers", "GCNConv": "nn.layers",
    "SAGEConv": "nn.layers", "DistGNN": "nn.layers", "LocalGraph": "nn.layers",
    "Breakdown": "timing", "BREAKDOWN_KEYS": "timing",
    "TrainConfig": "train.trainer", "Trainer": "train.trainer", "run_training": "train.trainer",
    "allreduce_grads": "train.trainer",
    # PyG layers and own loops
    "DistGraph": "nn.pyg", "DistributedLayer": "nn.pyg", "distributed": "nn.pyg", "LayerKind": "nn.pyg",
    "LAYER_KINDS": "nn.pyg", "layer_kind": "nn.pyg",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
