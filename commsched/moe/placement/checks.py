"""Input checks shared by the placement planners: sizes, loads and hosts, each
rejected with a message that says what was wrong and how to fix it."""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import numpy as np

# The largest total load the planners take: they sum loads and the squares of device loads
# in float64 (max about 1.8e308), so a total above 1e150 would overflow those sums.
MAX_TOTAL_LOAD = 1e150


def check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def check_load(load_E: Sequence[float] | np.ndarray, name: str = "load_E") -> np.ndarray:
    """Return ``load_E`` as a float64 [E] array; reject what cannot be a load."""
    try:
        arr = np.asarray(load_E, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a sequence of numbers (one load per expert), "
                        f"got {type(load_E).__name__}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (one load per expert), "
                         f"got shape {tuple(arr.shape)}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty: give one load per expert (at least one expert)")
    bad = ~np.isfinite(arr)
    if bad.any():
        e = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}[{e}] is {arr[e]}: loads must be finite numbers")
    if (arr < 0).any():
        e = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{name}[{e}] is {arr[e]}: loads must be >= 0 (token counts or "
                         "expected token counts)")
    total = float(np.sum(arr, dtype=np.float64)) if np.all(arr <= MAX_TOTAL_LOAD) else math.inf
    if total > MAX_TOTAL_LOAD:
        e = int(np.argmax(arr))
        raise ValueError(f"{name} sums to more than {MAX_TOTAL_LOAD:g} (largest: {name}[{e}] = {arr[e]:g}): "
                         "loads are token counts; scale them down (only their ratios matter)")
    return arr


def check_sizes(num_experts: int, num_devices: object, slots_per_device: object) -> tuple[int, int]:
    N = check_positive_int(num_devices, "num_devices")
    S = check_positive_int(slots_per_device, "slots_per_device")
    if N * S < num_experts:
        raise ValueError(
            f"{N} devices x {S} slots = {N * S} slots cannot hold {num_experts} experts "
            f"(each needs at least one replica): raise slots_per_device to at least "
            f"{math.ceil(num_experts / N)} or use more devices")
    return N, S



def check_hosts(device_host: Sequence[int], N: int) -> tuple[int, ...]:
    """``device_host`` as a tuple of N host indices 0..H-1 (every host holding a device)."""
    try:
        hosts = tuple(int(h) for h in device_host)
    except (TypeError, ValueError):
        raise TypeError(f"device_host must be a sequence of host indices (one per device), got "
                        f"{device_host!r}") from None
    if len(hosts) != N:
        raise ValueError(f"device_host has {len(hosts)} entries for {N} devices (one host index per device)")
    if set(hosts) != set(range(max(hosts) + 1)):
        raise ValueError(f"device_host must number the hosts 0..H-1, each holding a device; got {list(hosts)}")
    return hosts



__all__ = ["MAX_TOTAL_LOAD", "check_positive_int", "check_load", "check_sizes", "check_hosts"]
