"""The planner table: the placement planners the strategies of the inference runtime may
name (``PolicyConfig.planner`` / ``online_planner``, ``--planner`` / ``--online-planner``),
and DeepSeek's EPLB as a :class:`~.types.Placement` (global and hierarchical policy).

Legend: E experts, N devices, S slots per device, H hosts.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .eplb import eplb_placement
from .greedy import greedy_placement
from .planner import plan_placement
from .types import Placement


def eplb_layout(load_E: Sequence[float] | np.ndarray, num_devices: int,
                slots_per_device: int) -> Placement:
    """DeepSeek's EPLB (:func:`~commsched.moe.placement.eplb_placement`) as a
    :class:`Placement`: a replica that shares a device with another of its expert is
    merged into it, and the expert's load splits evenly over its distinct devices."""
    return eplb_placement(load_E, num_devices, slots_per_device).placement(load_E)


def eplb_hier_layout(load_E: Sequence[float] | np.ndarray, num_devices: int, slots_per_device: int,
                     device_host: Sequence[int]) -> Placement:
    """DeepSeek's EPLB, hierarchical policy, on the hosts ``device_host`` (each host a block of
    consecutive devices of equal size, as torchrun numbers them): every expert its own
    group (the finest grouping EPLB allows), the groups packed onto the hosts by their
    loads, then replicated and packed within each host; as a :class:`Placement` as
    :func:`eplb_layout`. Each expert ends up on one host only."""
    hosts = [int(h) for h in device_host]
    H = max(hosts) + 1
    size = num_devices // H
    if len(hosts) != num_devices or hosts != [d // size for d in range(num_devices)] or size * H != num_devices:
        raise ValueError(f"EPLB's hierarchical policy needs hosts of equal size holding consecutive devices "
                         f"(0,0,1,1,...); got device_host {hosts}")
    E = len(load_E)
    return eplb_placement(load_E, num_devices, slots_per_device, num_nodes=H,
                          num_groups=E if E % H == 0 else None).placement(load_E)



# name -> planner (load_E, num_devices, slots_per_device, **node-aware keywords) -> Placement
PLANNERS: dict[str, Callable[..., Placement]] = {
    "full": plan_placement,
    "greedy": greedy_placement,
    "eplb": eplb_layout,
}

__all__ = ["PLANNERS", "eplb_layout", "eplb_hier_layout"]
