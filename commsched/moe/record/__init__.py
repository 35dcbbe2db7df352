"""Routing traces: the recorder (``python -m commsched.moe.record``) and the trace format.
"""

from __future__ import annotations

from ..._lazy import lazy_getattr

_EXPORTS: dict[str, str] = {"main": "cli"}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
