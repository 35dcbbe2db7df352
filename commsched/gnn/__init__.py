"""GNN front-end: graphs, partitioning, distributed full-graph training (Vanilla, AdaQP).

Names are resolved lazily from their submodules; importing ``commsched.gnn`` runs nothing.
"""

from __future__ import annotations

from .._lazy import lazy_getattr

# name -> submodule
_EXPORTS: dict[str, str] = {
    # graphs
    "Graph": "data", "GraphSource": "data", "SyntheticSpec": "data", "load_graph": "data",
    "load_dataset": "data", "synthetic_graph": "data", "from_pyg": "data", "from_edges": "data",
    "save_graph": "data", "graph_fingerprint": "data",
    # partitioning
    "PartitionBook": "book", "build_book": "book", "build_books": "book",
    "partition_nodes": "partition", "make_parts": "partition", "PartData": "partition",
    "save_partition": "partition", "load_part": "partition",
    # exchange, layers, training
    "HaloExchange": "halo", "VanillaExchange": "halo", "ZeroExchange": "halo",
    "MODES": "modes", "make_exchange": "modes", "ExchangeConfig": "modes", "mode_config": "modes",
    "LAYERS": "models", "FastLayer": "models", "PyGLayer": "models", "AdaQPExchange": "adaqp",
    "AdaQPConfig": "modes", "ExchangeContext": "context", "PassContext": "context",
    "GNNMetrics": "metrics",
    "DistMessagePassing": "layers", "GCNConv": "layers",
    "SAGEConv": "layers", "DistGNN": "layers", "LocalGraph": "layers",
    "Breakdown": "timing", "BREAKDOWN_KEYS": "timing",
    "TrainConfig": "trainer", "Trainer": "trainer", "run_training": "trainer",
    "allreduce_grads": "trainer",
    # PyG layers and own loops
    "DistGraph": "pyg", "DistributedLayer": "pyg", "distributed": "pyg", "LayerKind": "pyg",
    "LAYER_KINDS": "pyg", "layer_kind": "pyg",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
