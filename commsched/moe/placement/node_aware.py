"""Node-aware placement. Devices sit on hosts, and a row sent to a device on another host
crosses the hosts' NICs, which are far slower than the links inside a host. With
``device_host`` (the host 0..H-1 of each device) and ``cross_weight`` > 0,
:func:`plan_placement` and :func:`greedy_placement` minimise :func:`node_cost`: the
busiest device's load plus ``cross_weight`` times the rows through the busiest host link
(the larger of the rows leaving and entering a host, over hosts). Their placements carry
``device_host`` and split *host-locally*: the tokens a host sends an expert go evenly to
the expert's replicas on that host when it has any (they cross nothing), else evenly to
all its replicas (they all cross). Where the tokens come from is ``origin_HE`` [H, E];
without it (the default) every device serves an equal share of every expert's tokens
(:func:`even_origin`), so the gain comes from keeping replicas of the heavy experts on
every host. The planner tries k = the number of most loaded experts kept on every host
(:data:`NODE_CANDIDATES` values of k), places each other expert on one host (descending
load, to the host whose devices would serve the fewest tokens, each host taking at most
its devices' share of them), plans each host's devices on the tokens they serve with the
greedy, re-plans the :data:`NODE_REFINE` best k with the full planner, and returns the
best of those and the flat plan split host-locally -- or the flat plan itself, with the
flat split and no ``device_host``, when its cost is lower: the node-aware cost is never
above the flat plan's. Without hosts, with one host or with weight 0 the result is
exactly the flat planner's.

Legend: E experts, N devices, S slots per device, H hosts.
"""

from __future__ import annotations

import itertools
import math
import numbers
from typing import Callable, Sequence

import numpy as np

from .checks import check_hosts, check_load
from .packing import greedy_counts, greedy_replicas, lpt_replicas
from .types import Placement, device_loads, even_origin, host_local_loads, make_placement

# node-aware placement: how many counts k of experts kept on every host are tried (each
# plans every host with the greedy; the best k is then planned with the full planner)
NODE_CANDIDATES = 16
NODE_REFINE = 3  # the best counts k by the packing-free estimate, planned in full


def cross_rows(p: Placement, load_E: Sequence[float] | np.ndarray, device_host: Sequence[int] | None = None,
               origin_HE: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """([H] rows leaving, [H] rows entering each host) of one layer under placement ``p``.

    ``device_host``: the hosts of the devices (default ``p.device_host``); ``origin_HE``: the
    tokens of each host per expert (default :func:`even_origin`). A host-local placement
    (``p.device_host`` set) splits as :func:`host_local_loads`; a flat one splits every
    expert's tokens evenly over all its replicas, wherever they come from, so host h's
    tokens of e cross in the share of e's replicas that are on other hosts."""
    hosts = p.device_host if device_host is None else check_hosts(device_host, p.num_devices)
    if hosts is None:
        raise ValueError("cross_rows needs the host of each device: pass device_host or a placement that has it")
    load = check_load(load_E)
    o = even_origin(load, hosts) if origin_HE is None else np.asarray(origin_HE, dtype=np.float64)
    H = max(hosts) + 1
    if o.shape != (H, p.num_experts):
        raise ValueError(f"origin_HE must be [H, E] = [{H}, {p.num_experts}], got {o.shape}")
    if p.device_host is not None:
        return host_local_loads(p.replicas, o, hosts)[1:]
    # every (expert e, host h, replica d of e off h) in the order of the loop twin in the
    # tests, accumulated in that order by np.add.at: the same sums, bit for bit
    host = np.asarray(hosts, dtype=np.int64)
    lens = np.fromiter((len(r) for r in p.replicas), dtype=np.int64, count=p.num_experts)
    e_j = np.repeat(np.arange(p.num_experts), lens)
    d_j = np.fromiter(itertools.chain.from_iterable(p.replicas), dtype=np.int64, count=e_j.size)
    j, h = (a.ravel() for a in np.meshgrid(np.arange(e_j.size), np.arange(H), indexing="ij"))
    keep = host[d_j[j]] != h
    j, h = j[keep], h[keep]
    o_ = np.lexsort((j, h, e_j[j]))
    j, h = j[o_], h[o_]
    x = o[h, e_j[j]] / lens[e_j[j]]
    out_H, in_H = np.zeros(H), np.zeros(H)
    np.add.at(out_H, h, x)
    np.add.at(in_H, host[d_j[j]], x)
    return out_H, in_H


def node_cost(p: Placement, load_E: Sequence[float] | np.ndarray, cross_weight: float,
              device_host: Sequence[int] | None = None, origin_HE: np.ndarray | None = None) -> float:
    """The node-aware objective of one layer: the busiest device's load plus ``cross_weight``
    times the rows through the busiest host link (the larger of the rows leaving and the rows
    entering a host, over hosts: one NIC carries all of its host's traffic to other hosts).
    Loads and rows follow ``p``'s split (:func:`cross_rows`)."""
    load = check_load(load_E)
    hosts = p.device_host if device_host is None else check_hosts(device_host, p.num_devices)
    o = None if hosts is None else (even_origin(load, hosts) if origin_HE is None else np.asarray(origin_HE))
    if p.device_host is not None:
        dl, out_H, in_H = host_local_loads(p.replicas, o, p.device_host)
    else:
        dl = device_loads(p.replicas, load, p.num_devices)
        out_H, in_H = cross_rows(p, load, hosts, o) if hosts is not None else (np.zeros(1), np.zeros(1))
    return float(dl.max() + cross_weight * max(out_H.max(), in_H.max()))


def _node_key(reps: Sequence[Sequence[int]], origin: np.ndarray, hosts: tuple[int, ...],
              w: float) -> tuple[float, float, float]:
    """(node cost, maximum device load, rows through the busiest host link) of a host-local
    layout: the order the node-aware planner ranks layouts by."""
    dl, out_H, in_H = host_local_loads(reps, origin, hosts)
    x = float(max(out_H.max(), in_H.max()))
    return (float(dl.max()) + w * x, float(dl.max()), x)



def node_aware_placement(load: np.ndarray, N: int, S: int, hosts: tuple[int, ...], w: float,
                origin: np.ndarray, inner: Callable[..., list[list[int]]], max_candidates: int) -> Placement:
    """The node-aware planner (:mod:`.node_aware`): for k experts kept
    on every host (the k most loaded), the others each on one host, estimate the cost
    without packing (``estimate``); plan the :data:`NODE_REFINE` best k with ``inner`` on
    each host's devices (the tokens they serve); compare with the flat plan (``inner`` on
    all devices) split host-locally, and return the flat plan itself (the flat split) when
    its :func:`node_cost` is lower still."""
    E = load.size
    H = max(hosts) + 1
    dev_H = [[d for d in range(N) if hosts[d] == h] for h in range(H)]
    cap_H = [len(ds) * S for ds in dev_H]
    order = sorted(range(E), key=lambda e: (-load[e], e))
    ks = [k for k in range(min(E, min(cap_H)) + 1) if sum(c - k for c in cap_H) >= E - k]
    if len(ks) > max_candidates:
        ks = sorted({ks[int(round(i))] for i in np.linspace(0, len(ks) - 1, max_candidates)})

    lo = [float(x) for x in load]
    n_H = [len(ds) for ds in dev_H]
    assigned: dict[int, tuple[list[list[int]], list[list[float]], np.ndarray]] = {}
    counts: dict[tuple[int, int], list[int]] = {}  # (k, h): the greedy counts estimate() found

    def assign(k: int) -> tuple[list[list[int]], list[list[float]], np.ndarray]:
        """Which experts each host holds, the tokens its devices serve of each, and [E] the
        host of each expert (-1: kept on every host)."""
        if k in assigned:
            return assigned[k]
        rest = order[k:]
        served = [float(x) for x in origin[:, order[:k]].sum(axis=1)]  # tokens each host's devices serve
        room = [c - k for c in cap_H]
        # each host takes at most its devices' share of the other experts while another host
        # has room, so that every host keeps spare slots for replicas of its heavy experts;
        # then any host with room. (hosts leave ``elig`` when their quota runs out)
        fair = [min(room[h], -(-len(rest) * n_H[h] // N)) for h in range(H)]
        quota = fair
        elig = [h for h in range(H) if fair[h] > 0]
        if not elig:
            quota, elig = room, [h for h in range(H) if room[h] > 0]
        host_of = [-1] * E
        for e in rest:  # descending load, to the host whose devices would serve the least
            x = lo[e]
            best_h, best_v = -1, math.inf
            for h in elig:
                v = (served[h] + x) / n_H[h]
                if v < best_v:
                    best_h, best_v = h, v
            host_of[e] = best_h
            room[best_h] -= 1
            fair[best_h] -= 1
            served[best_h] += x
            if quota[best_h] <= 0:
                elig.remove(best_h)
                if not elig and quota is fair:
                    quota, elig = room, [h for h in range(H) if room[h] > 0]
        on: list[list[int]] = [[] for _ in range(H)]
        local: list[list[float]] = [[] for _ in range(H)]
        for e in range(E):  # ascending expert id on every host
            g = host_of[e]
            if g < 0:
                for h in range(H):
                    on[h].append(e)
                    local[h].append(float(origin[h, e]))
            else:
                on[g].append(e)
                local[g].append(lo[e])
        assigned[k] = (on, local, np.asarray(host_of, dtype=np.int64))
        return assigned[k]

    def estimate(k: int) -> tuple[float, float]:
        """(node cost, max load) of k without packing: each host's devices at the larger of
        their mean and the largest share of the greedy apportionment of their slots (a bound
        LPT comes close to), the rows crossing from the assignment alone."""
        on, local, host_of = assign(k)
        top = 0.0
        for h in range(H):
            if on[h]:
                c = counts[k, h] = greedy_counts(local[h], n_H[h], S)
                top = max(top, sum(local[h]) / n_H[h], max(x / r for x, r in zip(local[h], c)))
        # experts on one host: every other host's tokens cross to it
        out_H = [float(origin[h, (host_of >= 0) & (host_of != h)].sum()) for h in range(H)]
        in_H = [float((load - origin[h])[host_of == h].sum()) for h in range(H)]
        x = max(max(out_H), max(in_H))
        return top + w * x, top

    def layout(k: int, planner: Callable[..., list[list[int]]]) -> list[list[int]]:
        on, local, _ = assign(k)
        reps: list[list[int]] = [[] for _ in range(E)]
        for h in range(H):
            if planner is greedy_replicas and (k, h) in counts:  # the counts estimate() found
                sub = lpt_replicas(local[h], counts[k, h], n_H[h], S)
            else:
                sub = planner(np.asarray(local[h]), n_H[h], S)
            for i, e in enumerate(on[h]):
                reps[e].extend(dev_H[h][d] for d in sub[i])
        return reps

    best_ks = sorted(ks, key=lambda k: (*estimate(k), k))[:NODE_REFINE]
    cands = [(_node_key(r, origin, hosts, w), r) for k in best_ks for r in [layout(k, inner)]]
    flat_reps = inner(load, N, S)
    cands.append((_node_key(flat_reps, origin, hosts, w), flat_reps))
    best_key, best = min(cands, key=lambda t: t[0])
    flat = make_placement(flat_reps, load, N, S)
    if node_cost(flat, load, w, hosts, origin) < best_key[0]:
        return flat  # the flat split wins: never worse than the flat plan in the objective
    return make_placement(best, load, N, S, hosts)


def node_inputs(load: np.ndarray, N: int, device_host, cross_weight: float, origin_HE
                 ) -> tuple[tuple[int, ...], np.ndarray] | None:
    """Checked (hosts, origin) of a node-aware call, or None when it is the flat planner's
    (no hosts, one host, or a zero weight)."""
    if not (isinstance(cross_weight, numbers.Real) and math.isfinite(cross_weight) and cross_weight >= 0):
        raise ValueError(f"cross_weight must be a finite number >= 0 (load units per row crossing hosts), "
                         f"got {cross_weight!r}")
    if device_host is None:
        if origin_HE is not None:
            raise ValueError("origin_HE (tokens per host) needs device_host (the host of each device)")
        return None
    hosts = check_hosts(device_host, N)
    H = max(hosts) + 1
    if origin_HE is None:
        origin = even_origin(load, hosts)
    else:
        origin = np.asarray(origin_HE, dtype=np.float64)
        if origin.shape != (H, load.size):
            raise ValueError(f"origin_HE must be [H, E] = [{H}, {load.size}], got {origin.shape}")
        if not np.isfinite(origin).all() or (origin < 0).any():
            raise ValueError("origin_HE must hold finite token counts >= 0")
        if not np.allclose(origin.sum(axis=0), load, rtol=1e-9, atol=1e-9):
            raise ValueError("origin_HE's columns must sum to load_E (each expert's tokens, by host)")
    if H == 1 or cross_weight == 0:
        return None
    return hosts, origin



__all__ = ["NODE_CANDIDATES", "NODE_REFINE", "cross_rows", "node_cost",
           "node_aware_placement", "node_inputs"]
