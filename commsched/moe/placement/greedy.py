"""The greedy planner (the online planner of the inference runtime) and DeepSpeed's
static layout.

Legend: E experts, N devices, S slots per device.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .checks import check_load, check_positive_int, check_sizes
from .node_aware import NODE_CANDIDATES, node_aware_placement, node_inputs
from .packing import greedy_replicas, pack_lpt, replica_counts_greedy
from .types import Placement, make_placement


def greedy_placement(load_E: Sequence[float] | np.ndarray, num_devices: int,
                     slots_per_device: int, *, device_host: Sequence[int] | None = None,
                     cross_weight: float = 0.0, origin_HE: np.ndarray | None = None) -> Placement:
    """The greedy: fill all N*S slots by :func:`replica_counts_greedy`
    (at most N replicas per expert), then :func:`pack_lpt`. ``device_host``,
    ``cross_weight``, ``origin_HE``: node-aware, as :func:`plan_placement`, with the greedy
    inside each host."""
    load = check_load(load_E)
    N, S = check_sizes(load.size, num_devices, slots_per_device)
    node = node_inputs(load, N, device_host, cross_weight, origin_HE)
    if node is not None:
        return node_aware_placement(load, N, S, node[0], float(cross_weight), node[1], greedy_replicas, NODE_CANDIDATES)
    counts = replica_counts_greedy(load, min(N * S, N * load.size), N)
    return pack_lpt(load, counts, N, S)


def static_placement(num_experts: int, num_devices: int,
                     load_E: Sequence[float] | np.ndarray | None = None,
                     slots_per_device: int | None = None) -> Placement:
    """DeepSpeed's layout: expert e on one device, contiguous blocks of E/N experts (when
    N does not divide E the first E mod N devices get one more). ``load_E`` (default
    zeros) gives the device loads; ``slots_per_device`` defaults to ceil(E/N)."""
    E = check_positive_int(num_experts, "num_experts")
    N = check_positive_int(num_devices, "num_devices")
    need = math.ceil(E / N)
    S = need if slots_per_device is None else check_positive_int(slots_per_device,
                                                                  "slots_per_device")
    if S < need:
        raise ValueError(f"the static layout puts {need} experts on a device; "
                         f"slots_per_device={S} is too small")
    load = np.zeros(E) if load_E is None else check_load(load_E)
    if load.size != E:
        raise ValueError(f"load_E has {load.size} entries, num_experts is {E}")
    base, extra = divmod(E, N)
    replicas: list[list[int]] = []
    for d in range(N):
        replicas.extend([[d]] * (base + (1 if d < extra else 0)))
    return make_placement(replicas, load, N, S)



__all__ = ["greedy_placement", "static_placement"]
