"""Alpha-beta link cost model: time = gamma + theta * bytes, per peer.

``fit_link_cost`` is pure (least squares with both terms kept >= 0);
``probe_link_costs`` times ring-ordered paired exchanges on a process group and fits
one model per peer. The bit-width assigner consumes (theta, gamma). ``probe_pair_costs``
times one-way sends of given pairs, round by round, so that :mod:`commsched.cluster.topology` can
time each pair alone and turn the fits into link classes. Importing this module does not import torch (the
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
    returns at enqueue. Each round's send and receive go in one ``batch_isend_irecv``
    (never a lone ``isend``/``irecv``, which deadlocks NCCL at 3+ ranks).
    """
    import torch
    import torch.distributed as dist

    from ..clock import Clock
    from ..dist import comm_guard

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
                    # one batch per round: on NCCL a lone isend / irecv gets a lazy two-rank
                    # communicator, and with 3+ ranks the first ones wait in a cycle
                    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, g(dst), group),
                                                     dist.P2POp(dist.irecv, rbuf, g(src), group)]):
                        w.wait()
                    clock.sync()
                    dt = time.perf_counter() - t
                if rep > 0:
                    samples[dst][0].append(nb)
                    samples[dst][1].append(dt)
    return {p: fit_link_cost(*samples[p]) for p in samples}


def check_probe_rounds(rounds: Sequence[Sequence[tuple[int, int]]], world_size: int
                       ) -> list[list[tuple[int, int]]]:
    """``rounds`` as lists of (src, dst) pairs, checked: ranks in 0..world_size-1, src !=
    dst, each rank in at most one pair of a round, each pair in one round only. Pure."""
    out: list[list[tuple[int, int]]] = []
    seen: set[tuple[int, int]] = set()
    for i, rnd in enumerate(rounds):
        used: set[int] = set()
        cur = []
        for pair in rnd:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in pair)):
                raise ValueError(f"round {i}: a pair is (src, dst) ranks, got {pair!r}")
            a, b = pair
            if not (0 <= a < world_size and 0 <= b < world_size) or a == b:
                raise ValueError(f"round {i}: pair {(a, b)} must be two different ranks in "
                                 f"0..{world_size - 1}")
            if a in used or b in used:
                raise ValueError(f"round {i}: rank {a if a in used else b} is in two pairs; "
                                 "each rank sends or receives at most once a round")
            if (a, b) in seen:
                raise ValueError(f"round {i}: pair {(a, b)} is probed twice")
            used |= {a, b}
            seen.add((a, b))
            cur.append((a, b))
        out.append(cur)
    return out


def probe_pair_costs(rounds: Sequence[Sequence[tuple[int, int]]], group=None,
                     sizes: Sequence[int] = (1 << 12, 1 << 16, 1 << 20, 1 << 22),
                     repeats: int = 3, device=None) -> dict[tuple[int, int], LinkCost]:
    """Time one-way sends of the given (src, dst) pairs, round by round, and fit a LinkCost
    per pair; every rank gets every pair's fit.

    Collective: every rank of ``group`` calls it with the same ``rounds`` (ranks of
    ``group``; see :func:`check_probe_rounds`). The pairs of a round send at once, after a
    barrier; the receiver times from the barrier to the last byte, so give rounds whose
    pairs share no link (``commsched.cluster.topology.probe_rounds`` does) to time each pair
    alone. ``device`` as :func:`probe_link_costs`.
    """
    import torch
    import torch.distributed as dist

    from ..clock import Clock
    from ..dist import all_gather_object, comm_guard

    P, me = dist.get_world_size(group), dist.get_rank(group)
    plan = check_probe_rounds(rounds, P)
    if repeats < 1 or not sizes:
        raise ValueError(f"probe_pair_costs needs repeats >= 1 and sizes, got {repeats}, {list(sizes)}")
    clock = Clock(device if device is not None else "cpu")

    def g(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    samples: dict[tuple[int, int], tuple[list[float], list[float]]] = {}
    bufs = {nb: torch.zeros(nb, dtype=torch.uint8, device=device) for nb in sizes}
    for i, rnd in enumerate(plan):
        role = next(((a, b) for a, b in rnd if me in (a, b)), None)
        for nb in sizes:
            for rep in range(repeats + 1):  # the first repetition warms the connection up
                with comm_guard(f"pair probe round {i} ({nb} bytes)", group):
                    dist.barrier(group=group)
                    t = time.perf_counter()
                    if role is not None:
                        a, b = role
                        # one op, still batched: the pairs of a round are disjoint, but a
                        # lone P2P is the pattern NCCL's docs warn about (and the NCCL fake
                        # refuses), so every P2P in commsched goes through a batch
                        op = (dist.P2POp(dist.isend, bufs[nb], g(b), group=group) if me == a
                              else dist.P2POp(dist.irecv, bufs[nb], g(a), group=group))
                        for w in dist.batch_isend_irecv([op]):
                            w.wait()
                        clock.sync()
                    dt = time.perf_counter() - t
                if rep > 0 and role is not None and me == role[1]:
                    xs, ys = samples.setdefault(role, ([], []))
                    xs.append(nb)
                    ys.append(dt)
    mine = {pair: fit_link_cost(*s) for pair, s in samples.items()}
    rows = all_gather_object({p: (c.gamma, c.theta) for p, c in mine.items()},
                             "gathering the pair probe's fits", group)
    return {p: LinkCost(*gt) for row in rows for p, gt in row.items()}
