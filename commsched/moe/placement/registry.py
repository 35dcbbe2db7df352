"""The planner registry: the placement planners (:class:`Planner` classes) the strategies of
the inference runtime may name (a strategy's ``planner`` / ``online_planner``, ``--planner`` / ``--online-planner``),
and DeepSeek's EPLB as a :class:`~.types.Placement` (global and hierarchical policy).

Legend: E experts, N devices, S slots per device, H hosts.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import numpy as np

from ...configurable import Registry
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


class Planner:
    """A placement planner: ``planner(load_E, num_devices, slots_per_device, **kw) ->
    Placement``; ``node_aware``: it also takes the node-aware keywords (``device_host``,
    ``cross_weight``, ``origin_HE``, :mod:`.node_aware`). A new planner is one subclass
    registered in :data:`PLANNERS` (its name becomes a ``--planner`` /
    ``--online-planner`` choice) and one test."""

    name: ClassVar[str]
    node_aware: ClassVar[bool] = True

    def __call__(self, load_E: Sequence[float] | np.ndarray, num_devices: int, slots_per_device: int,
                 **kw: Any) -> Placement:
        return self.plan(load_E, num_devices, slots_per_device, **kw)

    def plan(self, load_E, num_devices: int, slots_per_device: int, **kw: Any) -> Placement:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<planner {self.name}>"


# name -> planner; the command lines' --planner / --online-planner choices are its names
PLANNERS: Registry[Planner] = Registry("planner")


class FullPlanner(Planner):
    """:func:`~.planner.plan_placement`: replica counts, LPT, local search (the runtime's)."""

    name = "full"

    def plan(self, load_E, num_devices, slots_per_device, **kw):
        return plan_placement(load_E, num_devices, slots_per_device, **kw)


class GreedyPlanner(Planner):
    """:func:`~.greedy.greedy_placement`: fast, the online planner."""

    name = "greedy"

    def plan(self, load_E, num_devices, slots_per_device, **kw):
        return greedy_placement(load_E, num_devices, slots_per_device, **kw)


class EplbPlanner(Planner):
    """DeepSeek's EPLB as a :class:`Placement` (:func:`eplb_layout`); not node-aware (the
    ``eplb-hier`` strategy is EPLB on hosts)."""

    name = "eplb"
    node_aware = False

    def plan(self, load_E, num_devices, slots_per_device, **kw):
        return eplb_layout(load_E, num_devices, slots_per_device, **kw)


for _cls in (FullPlanner, GreedyPlanner, EplbPlanner):
    PLANNERS.register(_cls.name, _cls())
del _cls

__all__ = ["EplbPlanner", "FullPlanner", "GreedyPlanner", "PLANNERS", "Planner", "eplb_layout", "eplb_hier_layout"]
