"""GNN front-end: graphs, partitioning, distributed full-graph training (Vanilla, AdaQP).

Names are resolved lazily from their submodules; importing ``commsched.gnn`` runs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> submodule
_EXPORTS: dict[str, str] = {
    "load_graph": "data",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
