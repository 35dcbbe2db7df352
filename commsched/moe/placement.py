"""Expert placement for MoE inference: replicate popular experts, pack unpopular ones.

Legend: E experts, N devices, S slots per device (how many experts' weights a device
may hold at once), R replicas in all, T tokens (or token assignments), P source ranks,
H hosts.

A *placement* says which devices hold each expert. An expert held by r devices has its
tokens split evenly over them, so each of its replicas carries ``load_e / r``; a device's
load is the sum over the replicas it holds. The all-to-all of a layer waits for the
busiest device, so every planner here minimises the *maximum* device load.

Planners (all pure, no process group):

* :func:`eplb_placement` -- DeepSeek's EPLB, rewritten from its published algorithm: all
  N*S slots are filled, each spare one to the expert with the highest load per replica
  (no cap); the replicas are packed in descending load, each onto the lightest device
  with room (:func:`balanced_packing`, exactly S per device), and two replicas of one
  expert may land on one device; the hierarchical variant packs expert groups onto
  nodes first. It returns an :class:`EplbPlan` (physical slots), the baseline the
  planner is measured against.
* :func:`greedy_placement` -- the greedy: every spare slot goes, one at a time, to the
  expert with the highest load per replica (at most N replicas each); the replicas are
  then packed in descending per-replica load, each onto the lightest device with room
  that does not already hold that expert. Fast: the online planner.
* :func:`plan_placement` -- the planner the runtime uses. It tries several total replica
  counts (the greedy apportionment of each), packs each by LPT, improves the best
  packings, the greedy's and EPLB's layouts by local search (move, swap, add, drop and
  re-target replicas on the busiest device), then searches over replica counts
  (re-packing after each change), and returns the best layout found, so it is never
  worse than the greedy by construction (against EPLB: measured, see
  docs/benchmarks.md).
* :func:`static_placement` -- E/N contiguous experts per device and no replicas, as
  DeepSpeed serves experts.
* :func:`lower_bound` -- no placement can have a lower maximum device load.

The strategies of the inference runtime are these functions on different inputs:
``static`` is :func:`static_placement`; ``eplb`` is a planner (default
:func:`plan_placement`; ``eplb_placement`` on request) on a historical mean load;
``lina`` is :func:`plan_placement` on the estimated load (see ``popularity.py``);
``oracle`` is :func:`plan_placement` on the actual load.

Node-aware placement. Devices sit on hosts, and a row sent to a device on another host
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

:func:`split_tokens` maps each token of a replicated expert to one of its replicas,
round robin, so every replica gets an equal share (within one token); with a host-local
placement, round robin over the replicas of :meth:`Placement.candidates`.
"""

from __future__ import annotations

import heapq
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = [
    "Placement",
    "plan_placement",
    "greedy_placement",
    "eplb_placement",
    "EplbPlan",
    "balanced_packing",
    "static_placement",
    "lower_bound",
    "replica_counts_greedy",
    "pack_lpt",
    "device_loads",
    "split_tokens",
    "split_tokens_reference",
    "split_offsets",
    "imbalance",
    "even_origin",
    "host_local_loads",
    "cross_rows",
    "node_cost",
]


# plan_placement's search effort (docs/benchmarks.md, "Planner against DeepSeek's EPLB"):
# packings improved by local search besides the greedy's and EPLB's layouts, for up to
# REFINE_SMALL_SLOTS slots (N*S) and above; at 256 x 64 the extra starts changed the
# maximum load by under 0.01% for about twice the time
REFINE_SMALL = 6
REFINE_LARGE = 1
REFINE_SMALL_SLOTS = 256
# up to this many slots every replica-count change of the count search is decoded by LPT
# and local search (milliseconds there); above it by LPT alone
THOROUGH_SLOTS = 16
# node-aware placement: how many counts k of experts kept on every host are tried (each
# plans every host with the greedy; the best k is then planned with the full planner)
NODE_CANDIDATES = 16
NODE_REFINE = 3  # the best counts k by the packing-free estimate, planned in full


# --------------------------------------------------------------------------- validation
def _check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def _check_load(load_E: Sequence[float] | np.ndarray, name: str = "load_E") -> np.ndarray:
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
    return arr


def _check_sizes(num_experts: int, num_devices: object, slots_per_device: object) -> tuple[int, int]:
    N = _check_positive_int(num_devices, "num_devices")
    S = _check_positive_int(slots_per_device, "slots_per_device")
    if N * S < num_experts:
        raise ValueError(
            f"{N} devices x {S} slots = {N * S} slots cannot hold {num_experts} experts "
            f"(each needs at least one replica): raise slots_per_device to at least "
            f"{math.ceil(num_experts / N)} or use more devices")
    return N, S


# --------------------------------------------------------------------------- placement
@dataclass(frozen=True)
class Placement:
    """Which devices hold each expert, and the device loads that result.

    replicas[e]     -- ascending tuple of the distinct devices holding expert e (>= 1)
    device_load[d]  -- sum over experts e on d of load_e / len(replicas[e])
    slots_per_device -- the bound the placement respects (experts per device)
    device_host[d]  -- None (the flat split), or the host (0..H-1) of each device: the
                       host-local split (module docstring, "Node-aware placement"); the
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
            object.__setattr__(self, "device_host", _check_hosts(self.device_host, N))
        held = [0] * N
        for e, devs in enumerate(self.replicas):
            if len(devs) == 0:
                raise ValueError(f"expert {e} has no replica: every expert needs a device")
            if len(set(devs)) != len(devs):
                raise ValueError(f"expert {e} is placed twice on one device: {devs}")
            for d in devs:
                if not 0 <= d < N:
                    raise ValueError(f"expert {e} is placed on device {d}, outside 0..{N - 1}")
                held[d] += 1
        over = [d for d in range(N) if held[d] > S]
        if over:
            raise ValueError(f"device {over[0]} holds {held[over[0]]} experts, more than "
                             f"slots_per_device={S}")

    @property
    def num_experts(self) -> int:
        return len(self.replicas)

    @property
    def num_devices(self) -> int:
        return len(self.device_load)

    @property
    def replica_counts(self) -> tuple[int, ...]:
        """[E] number of replicas of each expert."""
        return tuple(len(r) for r in self.replicas)

    @property
    def device_experts(self) -> tuple[tuple[int, ...], ...]:
        """[N] ascending experts held by each device."""
        out: list[list[int]] = [[] for _ in range(self.num_devices)]
        for e, devs in enumerate(self.replicas):
            for d in devs:
                out[d].append(e)
        return tuple(tuple(x) for x in out)

    @property
    def max_load(self) -> float:
        return max(self.device_load)

    @property
    def imbalance(self) -> float:
        """max / mean device load (1.0 when all loads are zero)."""
        return imbalance(self.device_load)

    def with_load(self, load_E: Sequence[float] | np.ndarray) -> Placement:
        """The same layout with device loads recomputed for another load (e.g. the actual
        load of a batch, to evaluate a plan made from an estimate)."""
        load = _check_load(load_E)
        if load.size != self.num_experts:
            raise ValueError(f"load_E has {load.size} entries, the placement {self.num_experts} "
                             "experts")
        dl = device_loads(self.replicas, load, self.num_devices, self.device_host)
        return Placement(self.replicas, tuple(float(x) for x in dl), self.slots_per_device,
                         self.device_host)

    @property
    def num_hosts(self) -> int:
        """Hosts of the host-local split (1 for the flat split)."""
        return 1 if self.device_host is None else max(self.device_host) + 1

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
    out = np.zeros(num_devices, dtype=np.float64)
    for e, devs in enumerate(replicas):
        share = load[e] / len(devs)
        for d in devs:
            out[d] += share
    return out


def _make(replicas: Sequence[Sequence[int]], load: np.ndarray, N: int, S: int,
          device_host: tuple[int, ...] | None = None) -> Placement:
    reps = tuple(tuple(sorted(int(d) for d in devs)) for devs in replicas)
    dl = device_loads(reps, load, N, device_host)
    return Placement(reps, tuple(float(x) for x in dl), S, device_host)


def _key(p: Placement) -> tuple[float, float]:
    """Lexicographic quality: maximum device load, then sum of squared device loads."""
    return (p.max_load, float(sum(x * x for x in p.device_load)))


# --------------------------------------------------------------------------- bounds
def replica_counts_greedy(load_E: Sequence[float] | np.ndarray, total_replicas: int,
                          num_devices: int) -> np.ndarray:
    """[E] replica counts: start at one each; give each further replica, one at a time,
    to the expert with the highest load per replica (ties: lowest expert id), never more
    than ``num_devices`` replicas of one expert. Stops early when every expert is at the
    cap. This apportionment minimises max_e load_e / r_e for its total (the classic
    greedy for min-max apportionment)."""
    load = _check_load(load_E)
    E = load.size
    N = _check_positive_int(num_devices, "num_devices")
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
    load = _check_load(load_E)
    N, S = _check_sizes(load.size, num_devices, slots_per_device)
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
    load = _check_load(load_E)
    E = load.size
    N, S = _check_sizes(E, num_devices, slots_per_device)
    counts = [int(c) for c in counts_E]
    if len(counts) != E:
        raise ValueError(f"counts_E has {len(counts)} entries, load_E {E}")
    if any(c < 1 or c > N for c in counts):
        raise ValueError(f"replica counts must lie in 1..{N} (num_devices), got {counts}")
    if sum(counts) > N * S:
        raise ValueError(f"{sum(counts)} replicas do not fit in {N * S} slots")
    return _make(_lpt([float(x) for x in load], counts, N, S), load, N, S)


def _lpt(load: list[float], counts: list[int], N: int, S: int) -> list[list[int]]:
    """:func:`pack_lpt` on checked inputs: [E] the devices of each expert's replicas.

    The lightest device (ties: lowest id) comes off a heap of (load, device); full
    devices leave it for good, devices already holding the expert are set aside and
    pushed back after the replica is placed."""
    E = len(load)
    per = [load[e] / counts[e] for e in range(E)]
    # first replicas of all experts come before extra replicas of equal per-replica load,
    # so an expert's first replica never loses its slot to another's extra replica
    items = sorted(((e, i) for e in range(E) for i in range(counts[e])),
                   key=lambda t: (-per[t[0]], t[1] > 0, t[0], t[1]))
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


def greedy_placement(load_E: Sequence[float] | np.ndarray, num_devices: int,
                     slots_per_device: int, *, device_host: Sequence[int] | None = None,
                     cross_weight: float = 0.0, origin_HE: np.ndarray | None = None) -> Placement:
    """The greedy: fill all N*S slots by :func:`replica_counts_greedy`
    (at most N replicas per expert), then :func:`pack_lpt`. ``device_host``,
    ``cross_weight``, ``origin_HE``: node-aware, as :func:`plan_placement`, with the greedy
    inside each host."""
    load = _check_load(load_E)
    N, S = _check_sizes(load.size, num_devices, slots_per_device)
    node = _node_inputs(load, N, device_host, cross_weight, origin_HE)
    if node is not None:
        return _node_aware(load, N, S, node[0], float(cross_weight), node[1], _greedy_reps, NODE_CANDIDATES)
    counts = replica_counts_greedy(load, min(N * S, N * load.size), N)
    return pack_lpt(load, counts, N, S)


def static_placement(num_experts: int, num_devices: int,
                     load_E: Sequence[float] | np.ndarray | None = None,
                     slots_per_device: int | None = None) -> Placement:
    """DeepSpeed's layout: expert e on one device, contiguous blocks of E/N experts (when
    N does not divide E the first E mod N devices get one more). ``load_E`` (default
    zeros) gives the device loads; ``slots_per_device`` defaults to ceil(E/N)."""
    E = _check_positive_int(num_experts, "num_experts")
    N = _check_positive_int(num_devices, "num_devices")
    need = math.ceil(E / N)
    S = need if slots_per_device is None else _check_positive_int(slots_per_device,
                                                                  "slots_per_device")
    if S < need:
        raise ValueError(f"the static layout puts {need} experts on a device; "
                         f"slots_per_device={S} is too small")
    load = np.zeros(E) if load_E is None else _check_load(load_E)
    if load.size != E:
        raise ValueError(f"load_E has {load.size} entries, num_experts is {E}")
    base, extra = divmod(E, N)
    replicas: list[list[int]] = []
    for d in range(N):
        replicas.extend([[d]] * (base + (1 if d < extra else 0)))
    return _make(replicas, load, N, S)


# --------------------------------------------------------------------------- EPLB
def balanced_packing(weight_X: Sequence[float] | np.ndarray, num_packs: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """EPLB's packing: X items into ``num_packs`` packs of exactly X / num_packs items each.

    Items go in descending weight (ties: lower index), each into the lightest pack
    (ties: lower pack) that still has room. Returns ([X] pack of each item, [X] its
    position within the pack, in the order it arrived)."""
    w = np.asarray(weight_X, dtype=np.float64)
    X = w.size
    P = _check_positive_int(num_packs, "num_packs")
    if X % P:
        raise ValueError(f"{X} items do not split into {P} packs of equal count")
    per = X // P
    pack = np.empty(X, dtype=np.int64)
    rank = np.empty(X, dtype=np.int64)
    pack_w = [0.0] * P
    pack_n = [0] * P
    for i in np.argsort(-w, kind="stable").tolist():
        best = min((p for p in range(P) if pack_n[p] < per), key=pack_w.__getitem__)
        pack[i], rank[i] = best, pack_n[best]
        pack_w[best] += float(w[i])
        pack_n[best] += 1
    return pack, rank


@dataclass(frozen=True)
class EplbPlan:
    """DeepSeek EPLB's layout of one layer: N devices x S physical expert slots, every slot
    filled, an expert's tokens split evenly over its *physical* replicas -- two replicas
    of one expert may share a device, which then carries two shares.

    slots[d]        -- [S] the expert of each physical slot of device d
    replica_counts  -- [E] physical replicas of each expert (>= 1; may exceed N)
    device_load[d]  -- sum over the slots of d of load_e / replica_counts[e]
    """

    slots: tuple[tuple[int, ...], ...]
    replica_counts: tuple[int, ...]
    device_load: tuple[float, ...]

    @property
    def max_load(self) -> float:
        return max(self.device_load)

    @property
    def imbalance(self) -> float:
        return imbalance(self.device_load)

    @property
    def duplicates(self) -> int:
        """Physical replicas beyond the first of an expert on the same device: what a
        :class:`Placement` (distinct devices per expert) cannot express."""
        return sum(len(row) - len(set(row)) for row in self.slots)

    def placement(self, load_E: Sequence[float] | np.ndarray) -> Placement:
        """The layout as a :class:`Placement`: each expert on the distinct devices of its
        slots, loads split evenly over those (so device loads differ from EPLB's own when
        :attr:`duplicates` > 0, and the duplicate slots are left unused)."""
        load = _check_load(load_E)
        reps: list[set[int]] = [set() for _ in self.replica_counts]
        for d, row in enumerate(self.slots):
            for e in row:
                reps[e].add(d)
        return _make([sorted(r) for r in reps], load, len(self.slots), len(self.slots[0]))


def _eplb_within(load: np.ndarray, experts: np.ndarray, num_devices: int, S: int,
                 first_device: int, slots: list[list[int]], counts: np.ndarray) -> None:
    """EPLB's replicate-then-pack for ``experts`` on devices first_device.. (+num_devices):
    the num_devices*S physical slots go by the greedy apportionment without a cap (each
    further replica to the highest load per replica, ties: lower position), then the
    replicas (first replicas in expert order, then extras in the order given) are packed
    by :func:`balanced_packing`, S per device."""
    w = load[experts]
    R = num_devices * S
    # the physical replicas in EPLB's order: one of each expert, then each extra as the
    # apportionment hands it out (the same counts as replica_counts_greedy, uncapped)
    phys = list(range(experts.size))
    heap = [(-float(w[i]), i) for i in range(experts.size)]
    heapq.heapify(heap)
    c = np.ones(experts.size, dtype=np.int64)
    while len(phys) < R:
        _, i = heapq.heappop(heap)
        phys.append(i)
        c[i] += 1
        heapq.heappush(heap, (-float(w[i]) / c[i], i))
    per_phys = np.array([w[i] / c[i] for i in phys])
    pack, rank = balanced_packing(per_phys, num_devices)
    order = np.lexsort((rank, pack))
    for j in order.tolist():
        slots[first_device + int(pack[j])].append(int(experts[phys[j]]))
    counts[experts] = c


def eplb_placement(load_E: Sequence[float] | np.ndarray, num_devices: int,
                   slots_per_device: int, *, num_nodes: int = 1,
                   num_groups: int | None = None) -> EplbPlan:
    """DeepSeek's Expert Parallelism Load Balancer (EPLB), rewritten from its published
    algorithm (github.com/deepseek-ai/EPLB, ``rebalance_experts``) for one layer.

    Global policy (``num_groups`` None, or not a multiple of ``num_nodes``, as EPLB
    falls back): all N*S physical slots are filled: starting from one replica per
    expert, each further slot goes to the expert with the highest load per replica
    (ties: lower id; no cap, an expert may get more replicas than there are devices);
    the replicas, in descending load per replica, each go to the lightest device that
    has a free slot (:func:`balanced_packing`: exactly S per device). Nothing keeps two
    replicas of one expert off the same device (:attr:`EplbPlan.duplicates`).

    Hierarchical policy (``num_groups`` G experts groups of E/G consecutive experts,
    ``num_nodes`` M nodes of N/M consecutive devices, G a multiple of M): the groups
    are packed onto nodes by :func:`balanced_packing` of their total loads (G/M groups
    per node), then each node runs the global policy on its own experts and devices.

    Raises ValueError when N*S < E, or for the hierarchical policy when G does not
    divide E or M does not divide N."""
    load = _check_load(load_E)
    E = load.size
    N, S = _check_sizes(E, num_devices, slots_per_device)
    M = _check_positive_int(num_nodes, "num_nodes")
    G = None if num_groups is None else _check_positive_int(num_groups, "num_groups")
    slots: list[list[int]] = [[] for _ in range(N)]
    counts = np.zeros(E, dtype=np.int64)
    if G is None or G % M:
        _eplb_within(load, np.arange(E), N, S, 0, slots, counts)
    else:
        if E % G:
            raise ValueError(f"num_groups={G} must divide the {E} experts (groups of "
                             "consecutive experts, equal size)")
        if N % M:
            raise ValueError(f"num_nodes={M} must divide the {N} devices (nodes of "
                             "consecutive devices, equal size)")
        size = E // G
        group_pack, group_rank = balanced_packing(load.reshape(G, size).sum(axis=1), M)
        per_node = N // M
        for n in range(M):
            groups = np.flatnonzero(group_pack == n)
            groups = groups[np.argsort(group_rank[groups], kind="stable")]
            experts = (groups[:, None] * size + np.arange(size)).reshape(-1)
            _eplb_within(load, experts, per_node, S, n * per_node, slots, counts)
    dl = [sum(load[e] / counts[e] for e in row) for row in slots]
    return EplbPlan(tuple(tuple(r) for r in slots), tuple(int(c) for c in counts),
                    tuple(float(x) for x in dl))


# --------------------------------------------------------------------------- local search
class _Expert:
    """What :meth:`_Search.step` needs of expert x in one step: its devices (``devs``,
    and ``order``: descending load), its share ``per`` now, the change ``grow`` of each
    replica's share when x gains a replica and ``shrink`` when it loses one, and the
    resulting changes of the sum of squared device loads, over all of x's devices."""

    __slots__ = ("devs", "order", "per", "per_add", "grow", "shrink", "grow_ss", "shrink_ss")

    def __init__(self, s: _Search, x: int) -> None:
        dl = s.dl
        self.devs = s.devs[x]
        self.order = sorted(self.devs, key=lambda i: -dl[i])
        r = len(self.devs)
        self.per = s.load[x] / r
        self.per_add = s.load[x] / (r + 1)
        self.grow = self.per_add - self.per
        self.shrink = s.load[x] / (r - 1) - self.per if r >= 2 else 0.0
        g, h = self.grow, self.shrink
        self.grow_ss = sum(g * (2.0 * dl[i] + g) for i in self.devs)
        self.shrink_ss = sum(h * (2.0 * dl[i] + h) for i in self.devs)


class _Search:
    """Mutable layout for local search on the maximum device load (plain Python floats:
    N and S are small, and list copies beat NumPy calls at this size)."""

    def __init__(self, p: Placement, load: np.ndarray) -> None:
        self.load = [float(x) for x in load]
        self.N, self.S = p.num_devices, p.slots_per_device
        self.devs: list[set[int]] = [set(r) for r in p.replicas]  # expert -> devices
        self.held: list[set[int]] = [set(x) for x in p.device_experts]  # device -> experts
        self.dl = [float(x) for x in p.device_load]
        scale = max(1.0, float(load.sum()))
        self.eps = 1e-12 * scale
        self.eps2 = 1e-12 * scale * scale

    def per(self, e: int, extra: int = 0) -> float:
        return self.load[e] / (len(self.devs[e]) + extra)

    def step(self) -> tuple | None:
        """Apply the best improving move that involves the busiest device and return it;
        None if there is none.

        Moves and their order are those of :meth:`step_reference`; a candidate is scored
        in O(1) amortised instead of O(devices it touches). Per expert x (once per step):
        its devices in descending load, its share now / with one replica more / one less,
        and the change of the sum of squares when all its replicas grow or shrink by that
        share (``_Expert``). A move's maximum is then the largest of: the first entry of
        those descending lists not otherwise changed, the one or two single devices it
        changes, and the busiest device it leaves alone (the first of the global order
        outside the changed sets); its sum of squares the current one plus the
        precomputed changes (with the cross term of devices both experts share)."""
        dl, N, S = self.dl, self.N, self.S
        d = max(range(N), key=lambda i: (dl[i], -i))
        order = sorted(range(N), key=lambda i: -dl[i])
        cur_ss = sum(x * x for x in dl)
        best, best_move = (dl[d], cur_ss), None
        eps, eps2 = self.eps, self.eps2
        cache: dict[int, _Expert] = {}

        def info(x: int) -> _Expert:
            got = cache.get(x)
            if got is None:
                got = cache[x] = _Expert(self, x)
            return got

        def untouched(a: set[int], b: set[int] | None = None, c: int = -1) -> float:
            for dd in order:
                if dd not in a and (b is None or dd not in b) and dd != c:
                    return dl[dd]
            return -math.inf

        def consider(m: float, ss: float, move: tuple) -> None:
            nonlocal best, best_move
            if m < best[0] - eps or (m <= best[0] + eps and ss < best[1] - eps2):
                best, best_move = (m, ss), move

        def sq(x: int, delta: float) -> float:  # change of x's square when it moves by delta
            return delta * (2.0 * dl[x] + delta)

        for e in sorted(self.held[d]):
            ie = info(e)
            de, pe, pe_add, g = ie.devs, ie.per, ie.per_add, ie.grow
            top_e = dl[ie.order[0]] + g  # e's busiest replica after e gains a replica
            if len(de) >= 2:  # drop the replica of e on d; its share goes to e's other replicas
                sh = ie.shrink
                m = max(dl[d] - pe, untouched(de))
                for dd in ie.order:
                    if dd != d:
                        m = max(m, dl[dd] + sh)
                        break
                consider(m, cur_ss + ie.shrink_ss - sq(d, sh) + sq(d, -pe), ("drop", e, d))
            for d2 in range(N):
                if d2 == d or e in self.held[d2]:
                    continue
                if len(self.held[d2]) < S:
                    m = max(dl[d] - pe, dl[d2] + pe, untouched({d, d2}))
                    consider(m, cur_ss + sq(d, -pe) + sq(d2, pe), ("move", e, d, d2))
                    m = max(top_e, dl[d2] + pe_add, untouched(de, None, d2))
                    consider(m, cur_ss + ie.grow_ss + sq(d2, pe_add), ("add", e, d2))
                for f in sorted(self.held[d2]):
                    jf = info(f)
                    pf = jf.per
                    if pf < pe and f not in self.held[d]:
                        m = max(dl[d] + pf - pe, dl[d2] + pe - pf, untouched({d, d2}))
                        consider(m, cur_ss + sq(d, pf - pe) + sq(d2, pe - pf), ("swap", e, d, f, d2))
                    if len(jf.devs) >= 2:  # re-target f's replica on d2 to e
                        df, sh = jf.devs, jf.shrink
                        m = dl[d2] + pe_add - pf
                        for dd in jf.order:  # f's other replicas gain sh (and lose g on e's)
                            if dd == d2:
                                continue
                            if dd in de:
                                m = max(m, dl[dd] + sh + g)
                            else:
                                m = max(m, dl[dd] + sh)
                                break
                        for dd in ie.order:  # e's replicas that f does not share
                            if dd not in df:
                                m = max(m, dl[dd] + g)
                                break
                        m = max(m, untouched(de, df))
                        both = len(de & df)
                        ss = (cur_ss + ie.grow_ss + jf.shrink_ss - sq(d2, sh)
                              + sq(d2, pe_add - pf) + 2.0 * g * sh * both)
                        consider(m, ss, ("retarget", e, f, d2))
        if best_move is not None:
            self.apply(best_move)
        return best_move

    def step_reference(self) -> tuple | None:
        """Slow twin of :meth:`step`: every candidate's changed loads in a dict.

        A move changes the loads of a few devices (``delta``: device -> change); its
        maximum is the largest changed load or the largest unchanged one (the first device
        of the descending order not in ``delta``), its sum of squares the current one
        plus the changes."""
        dl, N = self.dl, self.N
        d = max(range(N), key=lambda i: (dl[i], -i))
        order = sorted(range(N), key=lambda i: -dl[i])
        cur_ss = sum(x * x for x in dl)
        best, best_move = (dl[d], cur_ss), None

        def consider(delta: dict[int, float], move: tuple) -> None:
            nonlocal best, best_move
            m = -math.inf
            ss = cur_ss
            for dd, dv in delta.items():
                v = dl[dd] + dv
                m = v if v > m else m
                ss += v * v - dl[dd] * dl[dd]
            for dd in order:
                if dd not in delta:
                    m = dl[dd] if dl[dd] > m else m
                    break
            if m < best[0] - self.eps or (m <= best[0] + self.eps and ss < best[1] - self.eps2):
                best, best_move = (m, ss), move

        for e in sorted(self.held[d]):
            pe = self.per(e)
            r_e = len(self.devs[e])
            pe_add = self.per(e, +1)
            grow_e = {dd: pe_add - pe for dd in self.devs[e]}  # e gains a replica elsewhere
            if r_e >= 2:  # drop the replica of e on d; its share goes to e's other replicas
                pe_drop = self.per(e, -1)
                delta = {dd: pe_drop - pe for dd in self.devs[e]}
                delta[d] = -pe
                consider(delta, ("drop", e, d))
            for d2 in range(N):
                if d2 == d or e in self.held[d2]:
                    continue
                if len(self.held[d2]) < self.S:
                    consider({d: -pe, d2: pe}, ("move", e, d, d2))
                    delta = dict(grow_e)
                    delta[d2] = pe_add
                    consider(delta, ("add", e, d2))
                for f in sorted(self.held[d2]):
                    pf = self.per(f)
                    if pf < pe and f not in self.held[d]:
                        consider({d: pf - pe, d2: pe - pf}, ("swap", e, d, f, d2))
                    if len(self.devs[f]) >= 2:  # re-target f's replica on d2 to e
                        pf_drop = self.per(f, -1)
                        delta = dict(grow_e)
                        for dd in self.devs[f]:
                            delta[dd] = delta.get(dd, 0.0) + pf_drop - pf
                        delta[d2] = delta.get(d2, 0.0) + pe_add - pf_drop
                        consider(delta, ("retarget", e, f, d2))
        if best_move is not None:
            self.apply(best_move)
        return best_move

    def _place(self, e: int, d: int) -> None:
        self.devs[e].add(d)
        self.held[d].add(e)

    def _remove(self, e: int, d: int) -> None:
        self.devs[e].discard(d)
        self.held[d].discard(e)

    def apply(self, move: tuple) -> None:
        kind = move[0]
        if kind == "drop":
            _, e, d = move
            self._remove(e, d)
        elif kind == "move":
            _, e, d, d2 = move
            self._remove(e, d)
            self._place(e, d2)
        elif kind == "add":
            _, e, d2 = move
            self._place(e, d2)
        elif kind == "swap":
            _, e, d, f, d2 = move
            self._remove(e, d)
            self._remove(f, d2)
            self._place(e, d2)
            self._place(f, d)
        elif kind == "retarget":
            _, e, f, d2 = move
            self._remove(f, d2)
            self._place(e, d2)
        else:  # pragma: no cover - internal
            raise AssertionError(kind)
        self.dl = [0.0] * self.N  # recompute exactly (no drift from incremental updates)
        for x, devs in enumerate(self.devs):
            share = self.load[x] / len(devs)
            for dd in devs:
                self.dl[dd] += share

    def result(self, load: np.ndarray) -> Placement:
        return _make([sorted(s) for s in self.devs], load, self.N, self.S)


def _improve(p: Placement, load: np.ndarray, max_steps: int) -> Placement:
    s = _Search(p, load)
    for _ in range(max_steps):
        if s.step() is None:
            break
    return s.result(load)


def _count_search(p: Placement, load: np.ndarray, max_evals: int, thorough: bool) -> Placement:
    """Search over replica counts with :func:`pack_lpt` as the decoder, from ``p``'s
    counts: try, in order, one more replica of an expert on the busiest device (any
    expert when ``thorough``), taken from a free slot or from any expert with two or
    more replicas, then one fewer replica of any expert; pack each by LPT (then improve
    it by local search when ``thorough``) and move to the first that lowers (maximum
    load, then sum of squares). Stops at a local optimum or after ``max_evals`` packings.

    Local search on a layout moves one replica at a time and each move must help; a
    count change re-packs everything, which finds layouts such as a mid-sized expert cut
    into many small shares that fill the devices of the big ones (tight slots)."""
    N, S, E = p.num_devices, p.slots_per_device, p.num_experts
    lo = [float(x) for x in load]
    counts = list(p.replica_counts)
    best, best_key = p, _key(p)
    tol = 1e-12 * max(1.0, float(load.sum()))
    evals = 0

    def neighbours():
        busiest = max(range(N), key=lambda i: (best.device_load[i], -i))
        free = sum(counts) < N * S
        for x in (range(E) if thorough else best.device_experts[busiest]):
            if counts[x] >= N:
                continue
            if free:
                yield ((x, 1),)
            for y in range(E):
                if y != x and counts[y] > 1:
                    yield ((x, 1), (y, -1))
        for y in range(E):
            if counts[y] > 1:
                yield ((y, -1),)

    while evals < max_evals:
        for change in neighbours():
            if evals >= max_evals:
                break
            evals += 1
            trial = list(counts)
            for x, dx in change:
                trial[x] += dx
            reps = _lpt(lo, trial, N, S)
            if thorough:
                q: Placement | None = _improve(_make(reps, load, N, S), load, 20 * N * S)
                k = _key(q)
            else:  # scored without building the Placement (the same sums as _make's), built if taken
                q = None
                dl = device_loads(reps, load, N).tolist()
                k = (max(dl), float(sum(x * x for x in dl)))
            if k[0] < best_key[0] - tol or (k[0] <= best_key[0] + tol and k[1] < best_key[1] - tol * tol):
                best = q if q is not None else _make(reps, load, N, S)
                best_key, counts = k, list(best.replica_counts)
                break
        else:
            break  # no neighbour is better: a local optimum
    return best


# --------------------------------------------------------------------------- planner
def plan_placement(load_E: Sequence[float] | np.ndarray, num_devices: int,
                   slots_per_device: int, *, max_candidates: int = 16,
                   refine: int | None = None, max_steps: int | None = None,
                   count_evals: int = 1000, device_host: Sequence[int] | None = None,
                   cross_weight: float = 0.0, origin_HE: np.ndarray | None = None) -> Placement:
    """Place E experts on N devices with at most S experts each, minimising the maximum
    device load (an expert's load split evenly over its replicas).

    Node-aware (``device_host``: the host 0..H-1 of each device, H >= 2, and
    ``cross_weight`` > 0): minimises :func:`node_cost` instead, the busiest device's load
    plus ``cross_weight`` times the rows through the busiest host link, with the
    host-local split (module docstring, "Node-aware placement"); ``origin_HE`` [H, E]
    gives each host's tokens per expert (default :func:`even_origin`). The result carries
    ``device_host`` (a host-local placement), unless the flat plan with the flat split has
    the lower cost: then it is that plan. Without hosts, with one host or with
    ``cross_weight`` 0 the result is exactly the flat planner's.

    Popular experts get more replicas; unpopular ones are packed together. Method: for up
    to ``max_candidates`` total replica counts between E and N*S, take the greedy
    apportionment (:func:`replica_counts_greedy`) and pack it by LPT
    (:func:`pack_lpt`); the ``refine`` best packings (default :data:`REFINE_SMALL` up to
    :data:`REFINE_SMALL_SLOTS` slots, :data:`REFINE_LARGE` above), the greedy
    (:func:`greedy_placement`) and EPLB's layout (:func:`eplb_placement`, a replica that
    shares a device with another of its expert merged into it) are improved by local
    search on the busiest device (``max_steps`` moves each, default 20*N*S). From the
    best of all these a search over replica counts (up to ``count_evals`` re-packings;
    0 turns it off) changes one expert's count at a time and re-packs, then local
    search polishes its result. The best layout found wins (maximum device load, then
    sum of squares). The greedy itself is a candidate, so the result is never worse
    than :func:`greedy_placement`; against EPLB's own maximum load (two replicas of one
    expert on one device included) it is measured in docs/benchmarks.md.

    load_E: [E] non-negative finite loads (tokens routed to each expert, or an estimate).
    Raises ValueError when N*S < E or a load is negative or not finite.
    """
    load = _check_load(load_E)
    E = load.size
    N, S = _check_sizes(E, num_devices, slots_per_device)
    if (max_candidates < 1 or (refine is not None and refine < 0) or (max_steps is not None and max_steps < 0)
            or count_evals < 0):
        raise ValueError(f"need max_candidates >= 1, refine >= 0, max_steps >= 0 and "
                         f"count_evals >= 0; got {max_candidates}, {refine}, {max_steps}, "
                         f"{count_evals}")
    node = _node_inputs(load, N, device_host, cross_weight, origin_HE)
    if node is not None:
        def flat(ld, n, s):
            return [list(r) for r in plan_placement(ld, n, s, max_candidates=max_candidates, refine=refine,
                                                    max_steps=max_steps, count_evals=count_evals).replicas]

        return _node_aware(load, N, S, node[0], float(cross_weight), node[1], flat, NODE_CANDIDATES)
    steps = 20 * N * S if max_steps is None else max_steps
    if refine is None:
        refine = REFINE_SMALL if N * S <= REFINE_SMALL_SLOTS else REFINE_LARGE
    greedy = greedy_placement(load, N, S)
    if N == 1 or load.sum() == 0.0:
        return greedy
    top = min(N * S, N * E)
    if top - E + 1 <= max_candidates:
        totals = list(range(E, top + 1))
    else:
        totals = sorted({int(round(x)) for x in np.linspace(E, top, max_candidates)})
    packed = [pack_lpt(load, replica_counts_greedy(load, R, N), N, S) for R in totals]
    packed.sort(key=_key)
    eplb = eplb_placement(load, N, S).placement(load)
    starts: list[Placement] = []
    for p in [greedy, eplb] + packed[:max(0, refine)]:
        if all(p.replicas != q.replicas for q in starts):  # the greedy is often packed[0]
            starts.append(p)
    cands = starts + packed + [_improve(p, load, steps) for p in starts]
    best = min(cands, key=_key)
    if count_evals > 0:
        thorough = N * S <= THOROUGH_SLOTS
        found = _count_search(best, load, count_evals, thorough)
        best = min(best, found if thorough else _improve(found, load, steps), key=_key)
    return best


# --------------------------------------------------------------------------- node-aware
def _check_hosts(device_host: Sequence[int], N: int) -> tuple[int, ...]:
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


def even_origin(load_E: Sequence[float] | np.ndarray, device_host: Sequence[int]) -> np.ndarray:
    """[H, E] the tokens each host sends each expert when every device serves an equal share of
    the tokens: host h originates n_h / N of every expert's load (n_h: its devices). The model
    of a load that does not say where its tokens come from."""
    load = np.asarray(load_E, dtype=np.float64)
    hosts = np.asarray(device_host, dtype=np.int64)
    n_H = np.bincount(hosts)
    return (n_H / hosts.size)[:, None] * load[None, :]


def host_local_loads(replicas: Sequence[Sequence[int]], origin_HE: np.ndarray, device_host: Sequence[int]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host-local split of ``origin_HE[h, e]`` tokens (host h's tokens routed to expert e):
    host h's tokens of e go evenly to e's replicas on h when there are any (they cross no
    host), else evenly to all of e's replicas (they all cross). Returns ([N] device loads,
    [H] rows leaving each host, [H] rows entering each host).
    :func:`_host_local_loads_reference` is the loop-per-token-group twin."""
    o = np.asarray(origin_HE, dtype=np.float64).T  # [E, H]
    host = np.asarray(device_host, dtype=np.int64)
    E, H, N = o.shape[0], o.shape[1], host.size
    R = np.zeros((E, N))
    for e, devs in enumerate(replicas):
        R[e, list(devs)] = 1.0
    r_EH = R @ (host[:, None] == np.arange(H)[None, :])  # replicas of e on host h
    local = r_EH > 0
    stay = np.where(local, o / np.maximum(r_EH, 1.0), 0.0)  # [E, H] share of each local replica
    away = np.where(local, 0.0, o)  # tokens that find no replica at home
    spread = away.sum(axis=1) / R.sum(axis=1)  # [E] their share of each replica
    dl = (R * stay[:, host]).sum(axis=0) + spread @ R
    return dl, away.sum(axis=0), spread @ r_EH


def _host_local_loads_reference(replicas: Sequence[Sequence[int]], origin_HE: np.ndarray,
                                device_host: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slow twin of :func:`host_local_loads`: one host's tokens of one expert at a time."""
    o = np.asarray(origin_HE, dtype=np.float64)
    host = list(device_host)
    N, H = len(host), o.shape[0]
    dl = np.zeros(N)
    out_H, in_H = np.zeros(H), np.zeros(H)
    for e, devs in enumerate(replicas):
        for h in range(H):
            t = float(o[h, e])
            if t == 0.0:
                continue
            local = [d for d in devs if host[d] == h]
            cand = local or list(devs)
            share = t / len(cand)
            for d in cand:
                dl[d] += share
            if not local:
                out_H[h] += t
                for d in cand:
                    in_H[host[d]] += share
    return dl, out_H, in_H


def cross_rows(p: Placement, load_E: Sequence[float] | np.ndarray, device_host: Sequence[int] | None = None,
               origin_HE: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """([H] rows leaving, [H] rows entering each host) of one layer under placement ``p``.

    ``device_host``: the hosts of the devices (default ``p.device_host``); ``origin_HE``: the
    tokens of each host per expert (default :func:`even_origin`). A host-local placement
    (``p.device_host`` set) splits as :func:`host_local_loads`; a flat one splits every
    expert's tokens evenly over all its replicas, wherever they come from, so host h's
    tokens of e cross in the share of e's replicas that are on other hosts."""
    hosts = p.device_host if device_host is None else _check_hosts(device_host, p.num_devices)
    if hosts is None:
        raise ValueError("cross_rows needs the host of each device: pass device_host or a placement that has it")
    load = _check_load(load_E)
    o = even_origin(load, hosts) if origin_HE is None else np.asarray(origin_HE, dtype=np.float64)
    H = max(hosts) + 1
    if o.shape != (H, p.num_experts):
        raise ValueError(f"origin_HE must be [H, E] = [{H}, {p.num_experts}], got {o.shape}")
    if p.device_host is not None:
        return host_local_loads(p.replicas, o, hosts)[1:]
    out_H, in_H = np.zeros(H), np.zeros(H)
    for e, devs in enumerate(p.replicas):
        for h in range(H):
            for d in devs:
                if hosts[d] != h:
                    x = o[h, e] / len(devs)
                    out_H[h] += x
                    in_H[hosts[d]] += x
    return out_H, in_H


def node_cost(p: Placement, load_E: Sequence[float] | np.ndarray, cross_weight: float,
              device_host: Sequence[int] | None = None, origin_HE: np.ndarray | None = None) -> float:
    """The node-aware objective of one layer: the busiest device's load plus ``cross_weight``
    times the rows through the busiest host link (the larger of the rows leaving and the rows
    entering a host, over hosts: one NIC carries all of its host's traffic to other hosts).
    Loads and rows follow ``p``'s split (:func:`cross_rows`)."""
    load = _check_load(load_E)
    hosts = p.device_host if device_host is None else _check_hosts(device_host, p.num_devices)
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


def _counts(lo: list[float], N: int, S: int) -> list[int]:
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


def _greedy_reps(load: np.ndarray, N: int, S: int) -> list[list[int]]:
    """:func:`greedy_placement`'s replicas on checked inputs, without building a Placement
    (the node-aware search calls it once per host and candidate)."""
    lo = [float(x) for x in load]
    return _lpt(lo, _counts(lo, N, S), N, S)


def _node_aware(load: np.ndarray, N: int, S: int, hosts: tuple[int, ...], w: float,
                origin: np.ndarray, inner: Callable[..., list[list[int]]], max_candidates: int) -> Placement:
    """The node-aware planner (module docstring, "Node-aware placement"): for k experts kept
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
    assigned: dict[int, tuple[list[list[int]], list[list[float]]]] = {}

    def assign(k: int) -> tuple[list[list[int]], list[list[float]]]:
        """Which experts each host holds, and the tokens its devices serve of each."""
        if k in assigned:
            return assigned[k]
        everywhere, rest = set(order[:k]), order[k:]
        served = [float(x) for x in origin[:, order[:k]].sum(axis=1)]  # tokens each host's devices serve
        room = [c - k for c in cap_H]
        # each host takes at most its devices' share of the other experts while another host
        # has room, so that every host keeps spare slots for replicas of its heavy experts
        fair = [min(room[h], -(-len(rest) * n_H[h] // N)) for h in range(H)]
        on: list[list[int]] = [sorted(everywhere) for _ in range(H)]
        for e in rest:  # descending load, to the host whose devices would serve the least
            quota = fair if any(x > 0 for x in fair) else room
            best_h, best_v = -1, math.inf
            for h in range(H):
                if quota[h] > 0:
                    v = (served[h] + lo[e]) / n_H[h]
                    if v < best_v:
                        best_h, best_v = h, v
            on[best_h].append(e)
            room[best_h] -= 1
            fair[best_h] -= 1
            served[best_h] += lo[e]
        on = [sorted(x) for x in on]
        local = [[float(origin[h, e]) if e in everywhere else lo[e] for e in on[h]] for h in range(H)]
        assigned[k] = (on, local)
        return on, local

    def estimate(k: int) -> tuple[float, float]:
        """(node cost, max load) of k without packing: each host's devices at the larger of
        their mean and the largest share of the greedy apportionment of their slots (a bound
        LPT comes close to), the rows crossing from the assignment alone."""
        on, local = assign(k)
        top = 0.0
        out_H, in_H = np.zeros(H), np.zeros(H)
        held = np.zeros((H, E), dtype=bool)
        for h in range(H):
            held[h, on[h]] = True
        for h in range(H):
            if on[h]:
                c = _counts(local[h], n_H[h], S)
                top = max(top, sum(local[h]) / n_H[h], max(x / r for x, r in zip(local[h], c)))
        only = held.sum(axis=0) == 1  # experts on one host: every other host's tokens cross to it
        for h in range(H):
            out_H[h] = float(origin[h, ~held[h]].sum())
            in_H[h] = float((load - origin[h])[only & held[h]].sum())
        x = float(max(out_H.max(), in_H.max()))
        return top + w * x, top

    def layout(k: int, planner: Callable[..., list[list[int]]]) -> list[list[int]]:
        on, local = assign(k)
        reps: list[list[int]] = [[] for _ in range(E)]
        for h in range(H):
            sub = planner(np.asarray(local[h]), n_H[h], S)
            for i, e in enumerate(on[h]):
                reps[e].extend(dev_H[h][d] for d in sub[i])
        return reps

    best_ks = sorted(ks, key=lambda k: (*estimate(k), k))[:NODE_REFINE]
    cands = [(_node_key(r, origin, hosts, w), r) for k in best_ks for r in [layout(k, inner)]]
    flat_reps = inner(load, N, S)
    cands.append((_node_key(flat_reps, origin, hosts, w), flat_reps))
    best_key, best = min(cands, key=lambda t: t[0])
    flat = _make(flat_reps, load, N, S)
    if node_cost(flat, load, w, hosts, origin) < best_key[0]:
        return flat  # the flat split wins: never worse than the flat plan in the objective
    return _make(best, load, N, S, hosts)


def _node_inputs(load: np.ndarray, N: int, device_host, cross_weight: float, origin_HE
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
    hosts = _check_hosts(device_host, N)
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


# --------------------------------------------------------------------------- token split
def split_offsets(counts_PE: Sequence[Sequence[int]] | np.ndarray,
                  placement: Placement | None = None) -> np.ndarray:
    """[P, E] exclusive prefix over source ranks of per-rank expert token counts.

    Passing ``offset_E=split_offsets(counts)[p]`` to :func:`split_tokens` on rank p makes
    the round robin continue where rank p-1 stopped, so each replica of an expert gets
    an equal share (within one token) of the tokens of *all* ranks together. With a
    host-local ``placement`` (``device_host`` set; ranks are its devices) the prefix runs
    over the ranks that split over the same replicas (:meth:`Placement.candidates`): the
    ranks of one host where it holds the expert, else every rank of a host that does not."""
    c = np.asarray(counts_PE, dtype=np.int64)
    if c.ndim != 2 or (c < 0).any():
        raise ValueError("counts_PE must be a [P, E] array of non-negative token counts")
    if placement is None or placement.device_host is None:
        return np.cumsum(c, axis=0) - c
    P, E = c.shape
    if (P, E) != (placement.num_devices, placement.num_experts):
        raise ValueError(f"counts_PE must be [N, E] = [{placement.num_devices}, {placement.num_experts}] "
                         f"for a host-local placement, got {c.shape}")
    host = placement.device_host
    off = np.zeros_like(c)
    for e, devs in enumerate(placement.replicas):
        held = {host[d] for d in devs}
        seen: dict[int, int] = {}
        for p in range(P):
            key = host[p] if host[p] in held else -1  # -1: hosts without a replica share all of them
            off[p, e] = seen.get(key, 0)
            seen[key] = off[p, e] + c[p, e]
    return off


def _check_split_inputs(expert_T, placement: Placement, offset_E, source) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a Placement, got {type(placement).__name__}")
    ex = np.asarray(expert_T)
    if ex.size and not np.issubdtype(ex.dtype, np.integer):
        raise TypeError(f"expert ids must be integers, got dtype {ex.dtype}")
    ex = ex.astype(np.int64, copy=False)
    E = placement.num_experts
    if ex.size and (ex.min() < 0 or ex.max() >= E):
        raise ValueError(f"expert ids must lie in 0..{E - 1}, got {int(ex.min())}..{int(ex.max())}")
    off = np.zeros(E, dtype=np.int64) if offset_E is None else np.asarray(offset_E, np.int64)
    if off.shape != (E,):
        raise ValueError(f"offset_E must have one entry per expert ({E}), got shape {off.shape}")
    if placement.device_host is not None and not (isinstance(source, numbers.Integral)
                                                  and 0 <= source < placement.num_devices):
        raise ValueError(f"a host-local placement splits by the tokens' host: pass source, the rank "
                         f"(0..{placement.num_devices - 1}) whose tokens these are; got {source!r}")
    return ex, off


def _cands(placement: Placement, source: int | None) -> list[tuple[int, ...]]:
    if placement.device_host is None:
        return list(placement.replicas)
    return [placement.candidates(e, int(source)) for e in range(placement.num_experts)]


def split_tokens(expert_T: np.ndarray | Sequence[int], placement: Placement,
                 offset_E: np.ndarray | Sequence[int] | None = None, source: int | None = None) -> np.ndarray:
    """Device of each token: the i-th token (in flattened order) routed to expert e goes
    to ``placement.replicas[e][(offset_E[e] + i) % len(replicas[e])]`` -- with a
    host-local placement, to the i-th (from ``offset_E[e]``) of
    ``placement.candidates(e, source)``.

    expert_T: int array of any shape (e.g. [T] or [T, k]) of expert ids.
    offset_E: [E] starting position of each expert's round robin (default zeros; see
    :func:`split_offsets` to balance across source ranks).
    source: the rank whose tokens these are (required for a host-local placement).
    Returns an int64 array of the same shape. :func:`split_tokens_reference` is the
    one-token-at-a-time twin."""
    ex, off = _check_split_inputs(expert_T, placement, offset_E, source)
    flat = ex.reshape(-1)
    E = placement.num_experts
    cands = _cands(placement, source)
    rmax = max(len(c) for c in cands)
    table = np.zeros((E, rmax), dtype=np.int64)
    for e, devs in enumerate(cands):
        table[e, :len(devs)] = devs
    r = np.asarray([len(c) for c in cands], dtype=np.int64)
    order = np.argsort(flat, kind="stable")
    sorted_ex = flat[order]
    starts = np.searchsorted(sorted_ex, np.arange(E))
    pos = np.empty_like(flat)
    pos[order] = np.arange(flat.size) - starts[sorted_ex]
    slot = (off[flat] + pos) % r[flat]
    return table[flat, slot].reshape(ex.shape)


def split_tokens_reference(expert_T: np.ndarray | Sequence[int], placement: Placement,
                           offset_E: np.ndarray | Sequence[int] | None = None,
                           source: int | None = None) -> np.ndarray:
    """Slow twin of :func:`split_tokens`: a plain loop with one counter per expert."""
    ex, off = _check_split_inputs(expert_T, placement, offset_E, source)
    seen = [int(x) for x in off]
    out = []
    for e in ex.reshape(-1).tolist():
        devs = placement.candidates(e, source) if placement.device_host is not None else placement.replicas[e]
        out.append(devs[seen[e] % len(devs)])
        seen[e] += 1
    return np.asarray(out, dtype=np.int64).reshape(ex.shape)
