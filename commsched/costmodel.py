"""Alpha-beta link cost model: time = gamma + theta * bytes, per peer.

``fit_link_cost`` is pure (least squares with both terms kept >= 0);
``probe_link_costs`` times ring-ordered paired exchanges on a process group and fits
one model per peer. The bit-width assigner consumes (theta, gamma); :mod:`commsched.topology`
turns per-pair fits into link classes. Importing this module does not import torch (the
functions do), so the topology and its file format load without it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class LinkCost:
    """time_s(bytes) = gamma + theta * bytes."""

    gamma: float  # seconds per message
    theta: float  # seconds per byte

    def time_s(self, nbytes: float) -> float:
        return self.gamma + self.theta * nbytes

    @property
    def bandwidth_Bps(self) -> float:
        return float("inf") if self.theta == 0 else 1.0 / self.theta


def fit_link_cost(nbytes: Sequence[float], times_s: Sequence[float]) -> LinkCost:
    """Weighted least-squares fit of time = gamma + theta * bytes, with gamma, theta >= 0.

    Needs at least two distinct sizes. Raises ValueError on mismatched, empty or
    non-finite input.
    """
    import torch

    x = torch.as_tensor(list(nbytes), dtype=torch.float64)
    y = torch.as_tensor(list(times_s), dtype=torch.float64)
    if x.numel() != y.numel():
        raise ValueError(f"{x.numel()} sizes but {y.numel()} times")
    if x.numel() < 2 or torch.unique(x).numel() < 2:
        raise ValueError("fit_link_cost needs timings at two or more distinct sizes")
    if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
        raise ValueError("fit_link_cost got non-finite sizes or times")
    if (x < 0).any() or (y < 0).any():
        raise ValueError("fit_link_cost got negative sizes or times")
    # Timing noise is multiplicative (a fraction of the time), so weigh each sample by
    # 1/time^2: relative errors count equally and the small-message latency is not
    # swamped by the large messages.
    w = 1.0 / torch.clamp(y, min=1e-12) ** 2
    sw = w.sum()
    xm, ym = (w * x).sum() / sw, (w * y).sum() / sw
    var = (w * (x - xm) ** 2).sum()
    theta = float((w * (x - xm) * (y - ym)).sum() / var)
    gamma = float(ym - theta * xm)
    if theta < 0:  # no size dependence measurable: all latency
        theta, gamma = 0.0, float(y.mean())
    elif gamma < 0:  # refit through the origin
        gamma = 0.0
        theta = float((w * x * y).sum() / (w * x * x).sum())
    return LinkCost(gamma=gamma, theta=theta)


def probe_link_costs(group=None, sizes: Sequence[int] = (1 << 12, 1 << 16, 1 << 20, 1 << 22),
                     repeats: int = 3, device=None) -> dict[int, LinkCost]:
    """Time paired exchanges with every peer in ring order and fit a LinkCost per peer.

    Collective: every rank of ``group`` must call it. Returns {peer rank: LinkCost}
    as seen from this rank (time of round i is charged to the peer it sends to).
    ``device`` (default the CPU) holds the probe buffers: the device the real messages use.
    On CUDA each round is timed up to a device synchronisation, since NCCL's ``wait()``
    returns at enqueue.
    """
    import torch
    import torch.distributed as dist

    from .clock import Clock
    from .dist import comm_guard

    clock = Clock(device if device is not None else "cpu")
    P, me = dist.get_world_size(group), dist.get_rank(group)
    samples: dict[int, tuple[list[float], list[float]]] = {p: ([], []) for p in range(P) if p != me}

    def g(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    for nb in sizes:
        buf = torch.zeros(nb, dtype=torch.uint8, device=device)
        rbuf = torch.empty(nb, dtype=torch.uint8, device=device)
        for rep in range(repeats + 1):  # first repetition warms the connection up
            for i in range(1, P):
                dst, src = (me + i) % P, (me - i) % P
                with comm_guard(f"link probe round {i}", group):
                    dist.barrier(group=group)
                    t = time.perf_counter()
                    s = dist.isend(buf, g(dst), group=group)
                    r = dist.irecv(rbuf, g(src), group=group)
                    s.wait()
                    r.wait()
                    clock.sync()
                    dt = time.perf_counter() - t
                if rep > 0:
                    samples[dst][0].append(nb)
                    samples[dst][1].append(dt)
    return {p: fit_link_cost(*samples[p]) for p in samples}
