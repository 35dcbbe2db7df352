"""The host-local split of a layer's tokens (see :mod:`.node_aware`): where the tokens
of each host go, and the device loads and host-link rows that follow.

Legend: E experts, N devices, H hosts.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np


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


__all__ = ["even_origin", "replica_matrix", "host_local_loads"]
