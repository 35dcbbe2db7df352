"""The placement record: which devices hold each expert, the device loads that result,
and the helpers that build and rank placements.

Legend: E experts, N devices, S slots per device.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .checks import check_hosts, check_load


# ----------------------------------------------------------------- the host-local split
# where each host's tokens go when its devices hold replicas (:mod:`.node_aware`)
def even_origin(load_E: Sequence[float] | np.ndarray, device_host: Sequence[int]) -> np.ndarray:
    """[H, E] the tokens each host sends each expert when every device serves an equal share of
    the tokens: host h originates n_h / N of every expert's load (n_h: its devices). The model
    of a load that does not say where its tokens come from."""
    load = np.asarray(load_E, dtype=np.float64)
    hosts = np.asarray(device_host, dtype=np.int64)
    n_H = np.bincount(hosts)
    return (n_H / hosts.size)[:, None] * load[None, :]


def replica_matrix(replicas: Sequence[Sequence[int]], num_devices: int) -> np.ndarray:
    """[E, N] float: how many replicas (shares) of expert e device d holds (a device holding
    m shares of e counts m times)."""
    E, N = len(replicas), num_devices
    lens = np.fromiter((len(r) for r in replicas), dtype=np.int64, count=E)
    flat = np.fromiter(itertools.chain.from_iterable(replicas), dtype=np.int64, count=int(lens.sum()))
    return np.bincount(np.repeat(np.arange(E), lens) * N + flat, minlength=E * N).reshape(E, N).astype(np.float64)


def host_local_loads(replicas: Sequence[Sequence[int]], origin_HE: np.ndarray, device_host: Sequence[int]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host-local split of ``origin_HE[h, e]`` tokens (host h's tokens routed to expert e):
    host h's tokens of e go evenly to e's replicas on h when there are any (they cross no
    host), else evenly to all of e's replicas (they all cross). Returns ([N] device loads,
    [H] rows leaving each host, [H] rows entering each host).
    The tests hold its loop-per-token-group twin."""
    o = np.asarray(origin_HE, dtype=np.float64).T  # [E, H]
    host = np.asarray(device_host, dtype=np.int64)
    H = o.shape[1]
    R = replica_matrix(replicas, host.size)
    r_EH = R @ (host[:, None] == np.arange(H)[None, :])  # replicas of e on host h
    local = r_EH > 0
    stay = np.where(local, o / np.maximum(r_EH, 1.0), 0.0)  # [E, H] share of each local replica
    away = np.where(local, 0.0, o)  # tokens that find no replica at home
    spread = away.sum(axis=1) / R.sum(axis=1)  # [E] their share of each replica
    dl = (R * stay[:, host]).sum(axis=0) + spread @ R
    return dl, away.sum(axis=0), spread @ r_EH


class DeviceLoads:
    """The load properties of a layout record with ``device_load`` [N] (the load each
    device computes): :class:`Placement` and :class:`~.eplb.EplbPlan` share them."""

    device_load: tuple[float, ...]

    @property
    def num_devices(self) -> int:
        return len(self.device_load)

    @property
    def max_load(self) -> float:
        return max(self.device_load)

    @property
    def mean_load(self) -> float:
        return sum(self.device_load) / len(self.device_load)

    @property
    def imbalance(self) -> float:
        """max / mean device load (1.0 when all loads are zero)."""
        return imbalance(self.device_load)

    @property
    def key(self) -> tuple[float, float]:
        """Lexicographic quality: maximum device load, then sum of squared device loads."""
        dl = np.asarray(self.device_load)
        return (self.max_load, float(dl @ dl))


@dataclass(frozen=True)
class Placement(DeviceLoads):
    """Which devices hold each expert, and the device loads that result.

    replicas[e]     -- ascending tuple of the devices holding a share of expert e (>= 1
                       entries); a device may appear m > 1 times: it holds one copy of e's
                       weights and serves m of e's len(replicas[e]) equal shares (the
                       round robin of :func:`split_tokens` visits it m times)
    device_load[d]  -- sum over the entries d of replicas[e] of load_e / len(replicas[e])
    slots_per_device -- the bound the placement respects (distinct experts per device: one
                       copy of an expert's weights, however many of its shares)
    device_host[d]  -- None (the flat split), or the host (0..H-1) of each device: the
                       host-local split (:mod:`.node_aware`); the
                       device loads are then those of that split with the tokens spread
                       over the hosts in proportion to their devices (:func:`device_loads`)
    """

    replicas: tuple[tuple[int, ...], ...]
    device_load: tuple[float, ...]
    slots_per_device: int
    device_host: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        N, S = len(self.device_load), self.slots_per_device
        if N < 1:
            raise ValueError("a placement needs at least one device")
        if self.device_host is not None:
            object.__setattr__(self, "device_host", check_hosts(self.device_host, N))
        held = [0] * N
        for e, devs in enumerate(self.replicas):
            if len(devs) == 0:
                raise ValueError(f"expert {e} has no replica: every expert needs a device")
            if any(a > b for a, b in zip(devs, devs[1:])):
                raise ValueError(f"expert {e}'s devices must be ascending (repeats allowed): {devs}")
            for d in devs:
                if not 0 <= d < N:
                    raise ValueError(f"expert {e} is placed on device {d}, outside 0..{N - 1}")
            for d in set(devs):
                held[d] += 1
        over = [d for d in range(N) if held[d] > S]
        if over:
            raise ValueError(f"device {over[0]} holds {held[over[0]]} experts, more than "
                             f"slots_per_device={S}")

    @property
    def num_experts(self) -> int:
        return len(self.replicas)

    @property
    def copy_counts(self) -> tuple[int, ...]:
        """[E] copies of each expert: the distinct devices holding its weights."""
        return tuple(len(set(r)) for r in self.replicas)

    @property
    def share_counts(self) -> tuple[int, ...]:
        """[E] equal shares each expert's load is split into (``len(replicas[e])``): its
        copies, plus one per extra share a device takes of it (a cold expert packed into the
        gaps of several devices can have many shares on few copies)."""
        return tuple(len(r) for r in self.replicas)

    @property
    def replica_counts(self) -> tuple[int, ...]:
        """Deprecated: :attr:`share_counts` (the shares, which it always counted); for the
        copies of each expert's weights use :attr:`copy_counts`."""
        import warnings

        warnings.warn("Placement.replica_counts is deprecated: it counts load shares; use "
                      "share_counts for those, copy_counts for the copies per expert",
                      DeprecationWarning, stacklevel=2)
        return self.share_counts

    @property
    def duplicates(self) -> int:
        """Shares beyond the first of an expert on one device (0: every expert's replicas
        on distinct devices, equal shares)."""
        return sum(len(r) - len(set(r)) for r in self.replicas)

    @property
    def device_experts(self) -> tuple[tuple[int, ...], ...]:
        """[N] ascending distinct experts held by each device."""
        out: list[list[int]] = [[] for _ in range(self.num_devices)]
        for e, devs in enumerate(self.replicas):
            for d in sorted(set(devs)):
                out[d].append(e)
        return tuple(tuple(x) for x in out)

    def with_load(self, load_E: Sequence[float] | np.ndarray) -> Placement:
        """The same layout with device loads recomputed for another load (e.g. the actual
        load of a batch, to evaluate a plan made from an estimate)."""
        load = check_load(load_E)
        if load.size != self.num_experts:
            raise ValueError(f"load_E has {load.size} entries, the placement {self.num_experts} "
                             "experts")
        dl = device_loads(self.replicas, load, self.num_devices, self.device_host)
        return Placement(self.replicas, tuple(float(x) for x in dl), self.slots_per_device,
                         self.device_host)

    def candidates(self, e: int, source: int) -> tuple[int, ...]:
        """The replicas of expert e that the tokens of rank ``source`` (a device index) are
        split over: all of them (flat split), or with ``device_host`` those on the host of
        ``source`` when there are any, else all of them."""
        devs = self.replicas[e]
        if self.device_host is None:
            return devs
        h = self.device_host[source]
        local = tuple(d for d in devs if self.device_host[d] == h)
        return local or devs


def imbalance(device_load_N: Sequence[float] | np.ndarray) -> float:
    """max / mean of a device-load vector; 1.0 when the total is zero."""
    dl = np.asarray(device_load_N, dtype=np.float64)
    total = float(dl.sum())
    if total <= 0.0:
        return 1.0
    return float(dl.max() / (total / dl.size))


def device_loads(replicas: Sequence[Sequence[int]], load_E: Sequence[float] | np.ndarray,
                 num_devices: int, device_host: Sequence[int] | None = None) -> np.ndarray:
    """[N] float64 device loads: each expert's load split evenly over its replicas; with
    ``device_host``, split host-locally with the load spread over the hosts in proportion
    to their devices (:func:`even_origin`, :func:`host_local_loads`)."""
    load = np.asarray(load_E, dtype=np.float64)
    if device_host is not None:
        return host_local_loads(replicas, even_origin(load, device_host), device_host)[0]
    lens = np.fromiter((len(r) for r in replicas), dtype=np.int64, count=len(replicas))
    flat = np.fromiter(itertools.chain.from_iterable(replicas), dtype=np.int64, count=int(lens.sum()))
    share = np.repeat(load[:lens.size] / np.maximum(lens, 1), lens)
    return np.bincount(flat, weights=share, minlength=num_devices).astype(np.float64)


def make_placement(replicas: Sequence[Sequence[int]], load: np.ndarray, N: int, S: int,
          device_host: tuple[int, ...] | None = None) -> Placement:
    reps = tuple(tuple(sorted(int(d) for d in devs)) for devs in replicas)
    dl = device_loads(reps, load, N, device_host)
    return Placement(reps, tuple(float(x) for x in dl), S, device_host)


def matrix_loads(C_EN: np.ndarray, load: np.ndarray) -> np.ndarray:
    """[N] device loads of a share matrix (``C[e, d]`` shares of expert e on device d), summed
    in the order :func:`device_loads` sums the replica lists of that layout (so the values are
    bit for bit those of the :class:`Placement`, without building it)."""
    E, N = C_EN.shape
    cnt = C_EN.sum(axis=1)
    flat = np.repeat(np.tile(np.arange(N), E), C_EN.ravel())
    share = np.repeat(load / np.maximum(cnt, 1), cnt)
    return np.bincount(flat, weights=share, minlength=N).astype(np.float64)


def matrix_key(C_EN: np.ndarray, load: np.ndarray) -> tuple[float, float]:
    """:attr:`DeviceLoads.key` of the layout of a share matrix, without building it."""
    dl = matrix_loads(C_EN, load)
    return (float(dl.max()), float(dl @ dl))


__all__ = ["DeviceLoads", "Placement", "imbalance", "device_loads", "make_placement", "matrix_loads", "matrix_key", "even_origin", "replica_matrix", "host_local_loads"]
