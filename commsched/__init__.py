"""commsched: communication scheduling for distributed GNN and MoE workloads.

Nothing runs at import. The core lives here; front-ends are ``commsched.gnn`` and
``commsched.moe``; ``commsched.quant`` and ``commsched.priority`` hold the planners.
"""

from .all2all import (
    A2AHandle,
    A2APlan,
    CommStats,
    SegmentLayout,
    all_to_all,
    all_to_all_async,
    exchange_segments,
    make_plan,
    pack_segments,
    segment_plan,
)
from .costmodel import LinkCost, fit_link_cost, probe_link_costs
from .dist import CommError, check_same_config, init_distributed
from .lanes import LaneEvent, Lanes
from .observe import A2AEvents, A2AObserver, A2ATimer

__version__ = "0.1.0"

__all__ = [
    "A2AEvents", "A2AHandle", "A2AObserver", "A2APlan", "A2ATimer", "CommError", "CommStats", "LaneEvent", "Lanes", "LinkCost",
    "SegmentLayout", "all_to_all", "all_to_all_async", "check_same_config",
    "exchange_segments", "fit_link_cost", "init_distributed", "make_plan", "pack_segments",
    "probe_link_costs", "segment_plan",
]
