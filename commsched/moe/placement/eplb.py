"""DeepSeek's Expert Parallelism Load Balancer (EPLB), rewritten from its published
algorithm: the baseline the planner is measured against.

Legend: E experts, N devices, S slots per device, X items, M nodes, G expert groups.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .checks import check_load, check_positive_int, check_sizes
from .types import DeviceLoads, Placement, make_placement


def balanced_packing(weight_X: Sequence[float] | np.ndarray, num_packs: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """EPLB's packing: X items into ``num_packs`` packs of exactly X / num_packs items each.

    Items go in descending weight (ties: lower index), each into the lightest pack
    (ties: lower pack) that still has room. Returns ([X] pack of each item, [X] its
    position within the pack, in the order it arrived)."""
    w = np.asarray(weight_X, dtype=np.float64)
    X = w.size
    P = check_positive_int(num_packs, "num_packs")
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
class EplbPlan(DeviceLoads):
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
    def num_experts(self) -> int:
        return len(self.replica_counts)

    @property
    def slots_per_device(self) -> int:
        return len(self.slots[0]) if self.slots else 0

    def with_load(self, load_E: Sequence[float] | np.ndarray) -> "EplbPlan":
        """The same layout with device loads recomputed for another load (EPLB's own split:
        an expert's load evenly over its physical replicas), as :meth:`Placement.with_load`:
        evaluate a plan made from an estimate on a batch's actual load, then read
        ``imbalance`` / ``max_load``."""
        load = check_load(load_E)
        if load.size != self.num_experts:
            raise ValueError(f"load_E has {load.size} entries, the plan {self.num_experts} experts")
        dl = [sum(float(load[e]) / self.replica_counts[e] for e in row) for row in self.slots]
        return EplbPlan(self.slots, self.replica_counts, tuple(dl))

    @property
    def duplicates(self) -> int:
        """Physical replicas beyond the first of an expert on the same device: what a
        :class:`Placement` (distinct devices per expert) cannot express."""
        return sum(len(row) - len(set(row)) for row in self.slots)

    def shares(self, load_E: Sequence[float] | np.ndarray) -> Placement:
        """The layout as a :class:`Placement` with EPLB's own split: a device holding m of
        an expert's physical replicas appears m times in its ``replicas`` (one copy of the
        weights, m shares), so device loads equal EPLB's (and a device's distinct experts
        fit its S slots)."""
        load = check_load(load_E)
        reps: list[list[int]] = [[] for _ in self.replica_counts]
        for d, row in enumerate(self.slots):
            for e in row:
                reps[e].append(d)
        return make_placement(reps, load, len(self.slots), len(self.slots[0]))

    def placement(self, load_E: Sequence[float] | np.ndarray) -> Placement:
        """The layout as a :class:`Placement`: each expert on the distinct devices of its
        slots, loads split evenly over those (so device loads differ from EPLB's own when
        :attr:`duplicates` > 0, and the duplicate slots are left unused)."""
        load = check_load(load_E)
        reps: list[set[int]] = [set() for _ in self.replica_counts]
        for d, row in enumerate(self.slots):
            for e in row:
                reps[e].add(d)
        return make_placement([sorted(r) for r in reps], load, len(self.slots), len(self.slots[0]))


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
    load = check_load(load_E)
    E = load.size
    N, S = check_sizes(E, num_devices, slots_per_device)
    M = check_positive_int(num_nodes, "num_nodes")
    G = None if num_groups is None else check_positive_int(num_groups, "num_groups")
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



__all__ = ["balanced_packing", "EplbPlan", "eplb_placement"]
