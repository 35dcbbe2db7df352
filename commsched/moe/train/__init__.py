"""MoE training: the command line (``python -m commsched.moe.train``), commsched's trainer, the
DeepSpeed runtime and Lina's schedule under it, the shared training config, checkpoints.
"""

from __future__ import annotations

from ..._lazy import lazy_getattr

_EXPORTS: dict[str, str] = {"main": "cli"}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
