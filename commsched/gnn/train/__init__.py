"""Distributed full-graph GNN training: the command line (``python -m commsched.gnn.train``),
the trainer, and the run's metrics.
"""

from __future__ import annotations

from ..._lazy import lazy_getattr

_EXPORTS: dict[str, str] = {"main": "cli"}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
