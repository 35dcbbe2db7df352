"""Replica counts and their packing: the greedy min-max apportionment of replicas, the
lower bound it gives, and longest-processing-time packing of replicas onto devices.

Legend: E experts, N devices, S slots per device.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from .checks import check_load, check_positive_int, check_sizes
from .types import Placement, make_placement


# --------------------------------------------------------------------------- bounds
def replica_counts_greedy(load_E: Sequence[float] | np.ndarray, total_replicas: int,
                          num_devices: int) -> np.ndarray:
    """[E] replica counts: start at one each; give each further replica, one at a time,
    to the expert with the highest load per replica (ties: lowest expert id), never more
    than ``num_devices`` replicas of one expert. Stops early when every expert is at the
    cap. This apportionment minimises max_e load_e / r_e for its total (the classic
    greedy for min-max apportionment)."""
    load = check_load(load_E)
    E = load.size
    N = check_positive_int(num_devices, "num_devices")
    if total_replicas < E:
        raise ValueError(f"total_replicas={total_replicas} is fewer than the {E} experts")
    counts = np.ones(E, dtype=np.int64)
    heap = [(-float(load[e]), e) for e in range(E) if N > 1]
    heapq.heapify(heap)
    spare = total_replicas - E
    while spare > 0 and heap:
        _, e = heapq.heappop(heap)
        counts[e] += 1
        spare -= 1
        if counts[e] < N:
            heapq.heappush(heap, (-float(load[e]) / counts[e], e))
    return counts


def lower_bound(load_E: Sequence[float] | np.ndarray, num_devices: int,
                slots_per_device: int) -> float:
    """A bound no placement can beat: max(mean device load, smallest achievable largest
    per-replica load). The second term is max_e load_e / r_e under the greedy
    apportionment of all N*S slots (at most N replicas per expert), which is optimal for
    that min-max; any placement has some expert with at least that per-replica load on
    one device."""
    load = check_load(load_E)
    N, S = check_sizes(load.size, num_devices, slots_per_device)
    counts = replica_counts_greedy(load, min(N * S, N * load.size), N)
    return float(max(load.sum() / N, (load / counts).max()))


# --------------------------------------------------------------------------- packing
def pack_lpt(load_E: Sequence[float] | np.ndarray, counts_E: Sequence[int], num_devices: int,
             slots_per_device: int) -> Placement:
    """Pack replicas in descending per-replica load (ties: lower expert id), each onto the
    lightest device (ties: lowest id) with a free slot that does not already hold that
    expert. A replica with no such device is dropped (its expert keeps the replicas
    already placed; the first replica of an expert always finds room because there are
    at least as many slots as experts). Device loads are recomputed from the result."""
    load = check_load(load_E)
    E = load.size
    N, S = check_sizes(E, num_devices, slots_per_device)
    counts = [int(c) for c in counts_E]
    if len(counts) != E:
        raise ValueError(f"counts_E has {len(counts)} entries, load_E {E}")
    if any(c < 1 or c > N for c in counts):
        raise ValueError(f"replica counts must lie in 1..{N} (num_devices), got {counts}")
    if sum(counts) > N * S:
        raise ValueError(f"{sum(counts)} replicas do not fit in {N * S} slots")
    return make_placement(lpt_replicas([float(x) for x in load], counts, N, S), load, N, S)


def lpt_order(per: list[float], counts: list[int]) -> list[tuple[int, int]]:
    """The replicas (e, i), i < counts[e], in LPT order: descending per-replica load
    ``per[e]``, then first replicas before extra ones, then expert id, then i (one
    ``np.lexsort``; the same order as sorting the tuples by that key)."""
    c = np.asarray(counts, dtype=np.int64)
    ev = np.repeat(np.arange(c.size), c)
    iv = np.arange(ev.size) - np.repeat(np.cumsum(c) - c, c)
    neg = -np.asarray(per, dtype=np.float64)[ev]
    o = np.lexsort((iv, ev, iv > 0, neg))
    return list(zip(ev[o].tolist(), iv[o].tolist()))


def greedy_sequence(lo: list[float], N: int, spare: int) -> np.ndarray:
    """[spare] the expert that gets each further replica under :func:`replica_counts_greedy`
    (the highest load per replica, ties: lowest id, at most N each), in order: the counts
    of any total E + j are one each plus the first j entries (one heap run serves every
    total). Shorter when every expert reaches N."""
    E = len(lo)
    counts = [1] * E
    heap = [(-lo[e], e) for e in range(E)] if N > 1 else []
    heapq.heapify(heap)
    out: list[int] = []
    while len(out) < spare and heap:
        _, e = heapq.heappop(heap)
        counts[e] += 1
        out.append(e)
        if counts[e] < N:
            heapq.heappush(heap, (-lo[e] / counts[e], e))
    return np.asarray(out, dtype=np.int64)


def lpt_replicas(load: list[float], counts: list[int], N: int, S: int) -> list[list[int]]:
    """:func:`pack_lpt` on checked inputs: [E] the devices of each expert's replicas.

    The lightest device (ties: lowest id) comes off a heap of (load, device); full
    devices leave it for good, devices already holding the expert are set aside and
    pushed back after the replica is placed."""
    E = len(load)
    per = [load[e] / counts[e] for e in range(E)]
    # first replicas of all experts come before extra replicas of equal per-replica load,
    # so an expert's first replica never loses its slot to another's extra replica
    items = lpt_order(per, counts)
    dev_load = [0.0] * N
    held: list[set[int]] = [set() for _ in range(N)]
    replicas: list[list[int]] = [[] for _ in range(E)]
    heap = [(0.0, d) for d in range(N)]
    for e, _i in items:
        aside = []
        best = -1
        while heap:
            entry = heapq.heappop(heap)
            if e in held[entry[1]]:
                aside.append(entry)
                continue
            best = entry[1]
            break
        for entry in aside:
            heapq.heappush(heap, entry)
        if best < 0:
            continue  # dropped replica
        held[best].add(e)
        replicas[e].append(best)
        dev_load[best] += per[e]
        if len(held[best]) < S:
            heapq.heappush(heap, (dev_load[best], best))
    assert all(replicas), "an expert lost its first replica (slots < experts?)"
    return replicas



def lpt_shares(load: list[float], counts: list[int], N: int, S: int) -> list[list[int]]:
    """LPT for shares: expert e's load in ``counts[e]`` equal shares, in descending share
    (ties: first shares first, then lower expert id), each onto the lightest device (ties:
    lowest id) that holds e already or has a free slot, so two shares of one expert may
    land on one device (one slot). When a first share finds no device (the slots went to
    other experts' shares), the packing is redone with every expert's first share first.
    Returns [E] the devices of each expert's shares (repeats allowed)."""
    E = len(load)
    per = [load[e] / counts[e] for e in range(E)]
    items = lpt_order(per, counts)
    for attempt in (items, sorted(items, key=lambda t: t[1] > 0)):
        dev_load = [0.0] * N
        free = [S] * N
        holds = [set() for _ in range(N)]
        replicas: list[list[int]] = [[] for _ in range(E)]
        for e, _i in attempt:
            best = -1
            for d in range(N):  # small N only: the count search of tiny instances decodes with this
                if (free[d] > 0 or e in holds[d]) and (best < 0 or dev_load[d] < dev_load[best]):
                    best = d
            if best < 0:
                break
            if e not in holds[best]:
                holds[best].add(e)
                free[best] -= 1
            replicas[e].append(best)
            dev_load[best] += per[e]
        else:
            return [sorted(r) for r in replicas]
    raise AssertionError("first shares did not fit (slots < experts?)")


def greedy_counts(lo: list[float], N: int, S: int) -> list[int]:
    """:func:`replica_counts_greedy` of all N*S slots on checked inputs (plain lists)."""
    E = len(lo)
    counts = [1] * E
    heap = [(-lo[e], e) for e in range(E)] if N > 1 else []
    heapq.heapify(heap)
    spare = min(N * S, N * E) - E
    while spare > 0 and heap:
        _, e = heapq.heappop(heap)
        counts[e] += 1
        spare -= 1
        if counts[e] < N:
            heapq.heappush(heap, (-lo[e] / counts[e], e))
    return counts


def greedy_replicas(load: np.ndarray, N: int, S: int) -> list[list[int]]:
    """:func:`greedy_placement`'s replicas on checked inputs, without building a Placement
    (the node-aware search calls it once per host and candidate)."""
    lo = [float(x) for x in load]
    return lpt_replicas(lo, greedy_counts(lo, N, S), N, S)



__all__ = ["replica_counts_greedy", "lower_bound", "pack_lpt", "lpt_order", "lpt_replicas", "lpt_shares",
           "greedy_counts", "greedy_sequence", "greedy_replicas"]
