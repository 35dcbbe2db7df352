"""commsched: communication scheduling for distributed GNN and MoE workloads.

The core lives here; front-ends are ``commsched.gnn`` and ``commsched.moe``;
``commsched.quant`` and ``commsched.priority`` hold the planners; experiments are in
``commsched.bench``. Names are resolved lazily from their submodules: importing
``commsched`` runs nothing and imports no torch, so the pure planners import without it.
"""

from __future__ import annotations

from ._lazy import lazy_getattr

__version__ = "0.2.0"

_EXPORTS: dict[str, str] = {
    "A2AHandle": "comm.all2all",
    "A2APlan": "comm.all2all",
    "CommStats": "comm.all2all",
    "SegmentLayout": "comm.all2all",
    "all_to_all": "comm.all2all",
    "all_to_all_async": "comm.all2all",
    "exchange_segments": "comm.all2all",
    "make_plan": "comm.all2all",
    "pack_segments": "comm.all2all",
    "segment_plan": "comm.all2all",
    "LinkCost": "cluster.costmodel",
    "fit_link_cost": "cluster.costmodel",
    "probe_link_costs": "cluster.costmodel",
    "CommError": "dist",
    "check_same_config": "agree",
    "init_distributed": "dist",
    "LaneEvent": "comm.lanes",
    "Lanes": "comm.lanes",
    "ExchangePrediction": "cluster.topology",
    "Topology": "cluster.topology",
    "predict_exchange": "cluster.topology",
    "A2AEvents": "comm.observe",
    "A2AObserver": "comm.observe",
    "A2ATimer": "comm.observe",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
