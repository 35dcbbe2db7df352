"""Expert placement for MoE inference: replicate popular experts, pack unpopular ones.

Legend: E experts, N devices, S slots per device (how many experts' weights a device
may hold at once), R replicas in all, T tokens (or token assignments), P source ranks.

A *placement* says which devices hold each expert. An expert held by r devices has its
tokens split evenly over them, so each of its replicas carries ``load_e / r``; a device's
load is the sum over the replicas it holds. The all-to-all of a layer waits for the
busiest device, so every planner here minimises the *maximum* device load.

Planners (all pure, no process group):

* :func:`greedy_placement` -- the EPLB-style baseline: every spare slot goes, one at a
  time, to the expert with the highest load per replica; the replicas are then packed in
  descending per-replica load, each onto the lightest device with room that does not
  already hold that expert.
* :func:`plan_placement` -- the planner the runtime uses. It tries several total replica
  counts (the greedy apportionment of each), packs each by LPT, improves the best
  packings by local search (move, swap, add, drop and re-target replicas on the busiest
  device), and returns the best of those and of the greedy baseline, so it is never worse
  than the greedy by construction.
* :func:`static_placement` -- E/N contiguous experts per device and no replicas, as
  DeepSpeed serves experts.
* :func:`lower_bound` -- no placement can have a lower maximum device load.

The strategies of the inference runtime are these functions on different inputs:
``static`` is :func:`static_placement`; ``eplb`` is :func:`plan_placement` on a
historical mean load; ``lina`` is :func:`plan_placement` on the estimated load (see
``popularity.py``); ``oracle`` is :func:`plan_placement` on the actual load.

:func:`split_tokens` maps each token of a replicated expert to one of its replicas,
round robin, so every replica gets an equal share (within one token).
"""

from __future__ import annotations

import heapq
import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = [
    "Placement",
    "plan_placement",
    "greedy_placement",
    "static_placement",
    "lower_bound",
    "replica_counts_greedy",
    "pack_lpt",
    "device_loads",
    "split_tokens",
    "split_tokens_reference",
    "split_offsets",
    "imbalance",
]


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
    """

    replicas: tuple[tuple[int, ...], ...]
    device_load: tuple[float, ...]
    slots_per_device: int

    def __post_init__(self) -> None:
        N, S = len(self.device_load), self.slots_per_device
        if N < 1:
            raise ValueError("a placement needs at least one device")
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
        dl = device_loads(self.replicas, load, self.num_devices)
        return Placement(self.replicas, tuple(float(x) for x in dl), self.slots_per_device)


def imbalance(device_load_N: Sequence[float] | np.ndarray) -> float:
    """max / mean of a device-load vector; 1.0 when the total is zero."""
    dl = np.asarray(device_load_N, dtype=np.float64)
    total = float(dl.sum())
    if total <= 0.0:
        return 1.0
    return float(dl.max() / (total / dl.size))


def device_loads(replicas: Sequence[Sequence[int]], load_E: Sequence[float] | np.ndarray,
                 num_devices: int) -> np.ndarray:
    """[N] float64 device loads: each expert's load split evenly over its replicas."""
    load = np.asarray(load_E, dtype=np.float64)
    out = np.zeros(num_devices, dtype=np.float64)
    for e, devs in enumerate(replicas):
        share = load[e] / len(devs)
        for d in devs:
            out[d] += share
    return out


def _make(replicas: Sequence[Sequence[int]], load: np.ndarray, N: int, S: int) -> Placement:
    reps = tuple(tuple(sorted(int(d) for d in devs)) for devs in replicas)
    dl = device_loads(reps, load, N)
    return Placement(reps, tuple(float(x) for x in dl), S)


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
    per = [load[e] / counts[e] for e in range(E)]
    # first replicas of all experts come before extra replicas of equal per-replica load,
    # so an expert's first replica never loses its slot to another's extra replica
    items = sorted(((e, i) for e in range(E) for i in range(counts[e])),
                   key=lambda t: (-per[t[0]], t[1] > 0, t[0], t[1]))
    dev_load = [0.0] * N
    held: list[set[int]] = [set() for _ in range(N)]
    replicas: list[list[int]] = [[] for _ in range(E)]
    for e, _i in items:
        best = -1
        for d in range(N):
            if len(held[d]) < S and e not in held[d] and (best < 0 or dev_load[d] < dev_load[best]):
                best = d
        if best < 0:
            continue  # dropped replica
        held[best].add(e)
        replicas[e].append(best)
        dev_load[best] += per[e]
    assert all(replicas), "an expert lost its first replica (slots < experts?)"
    return _make(replicas, load, N, S)


def greedy_placement(load_E: Sequence[float] | np.ndarray, num_devices: int,
                     slots_per_device: int) -> Placement:
    """The EPLB-style baseline: fill all N*S slots by :func:`replica_counts_greedy`
    (at most N replicas per expert), then :func:`pack_lpt`."""
    load = _check_load(load_E)
    N, S = _check_sizes(load.size, num_devices, slots_per_device)
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


# --------------------------------------------------------------------------- local search
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

    def step(self) -> bool:
        """Apply the best improving move that involves the busiest device; False if none."""
        dl, N = self.dl, self.N
        d = max(range(N), key=lambda i: (dl[i], -i))
        cur = (max(dl), sum(x * x for x in dl))
        best, best_move = cur, None

        def consider(new: list[float], move: tuple) -> None:
            nonlocal best, best_move
            m = max(new)
            ss = sum(x * x for x in new)
            if m < best[0] - self.eps or (m <= best[0] + self.eps and ss < best[1] - self.eps2):
                best, best_move = (m, ss), move

        for e in sorted(self.held[d]):
            pe = self.per(e)
            r_e = len(self.devs[e])
            pe_add = self.per(e, +1)
            if r_e >= 2:  # drop the replica of e on d; its share goes to e's other replicas
                pe_drop = self.per(e, -1)
                new = dl[:]
                for dd in self.devs[e]:
                    new[dd] += pe_drop - pe
                new[d] -= pe_drop
                consider(new, ("drop", e, d))
            for d2 in range(N):
                if d2 == d or e in self.held[d2]:
                    continue
                if len(self.held[d2]) < self.S:
                    new = dl[:]
                    new[d] -= pe
                    new[d2] += pe
                    consider(new, ("move", e, d, d2))
                    new = dl[:]
                    for dd in self.devs[e]:
                        new[dd] += pe_add - pe
                    new[d2] += pe_add
                    consider(new, ("add", e, d2))
                for f in sorted(self.held[d2]):
                    pf = self.per(f)
                    if pf < pe and f not in self.held[d]:
                        new = dl[:]
                        new[d] += pf - pe
                        new[d2] += pe - pf
                        consider(new, ("swap", e, d, f, d2))
                    if len(self.devs[f]) >= 2:  # re-target f's replica on d2 to e
                        pf_drop = self.per(f, -1)
                        new = dl[:]
                        for dd in self.devs[e]:
                            new[dd] += pe_add - pe
                        for dd in self.devs[f]:
                            new[dd] += pf_drop - pf
                        new[d2] += pe_add - pf_drop
                        consider(new, ("retarget", e, f, d2))
        if best_move is None:
            return False
        self.apply(best_move)
        return True

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
        if not s.step():
            break
    return s.result(load)


# --------------------------------------------------------------------------- planner
def plan_placement(load_E: Sequence[float] | np.ndarray, num_devices: int,
                   slots_per_device: int, *, max_candidates: int = 16,
                   refine: int = 2, max_steps: int | None = None) -> Placement:
    """Place E experts on N devices with at most S experts each, minimising the maximum
    device load (an expert's load split evenly over its replicas).

    Popular experts get more replicas; unpopular ones are packed together. Method: for up
    to ``max_candidates`` total replica counts between E and N*S, take the greedy
    apportionment (:func:`replica_counts_greedy`) and pack it by LPT
    (:func:`pack_lpt`); the ``refine`` best packings and the EPLB-style greedy
    (:func:`greedy_placement`) are improved by local search on the busiest device
    (``max_steps`` moves each, default 20*N*S); the best layout found wins (maximum device
    load, then sum of squares). The greedy itself is a candidate, so the result is never
    worse than :func:`greedy_placement`.

    load_E: [E] non-negative finite loads (tokens routed to each expert, or an estimate).
    Raises ValueError when N*S < E or a load is negative or not finite.
    """
    load = _check_load(load_E)
    E = load.size
    N, S = _check_sizes(E, num_devices, slots_per_device)
    if max_candidates < 1 or refine < 0 or (max_steps is not None and max_steps < 0):
        raise ValueError(f"need max_candidates >= 1, refine >= 0 and max_steps >= 0; got "
                         f"{max_candidates}, {refine}, {max_steps}")
    steps = 20 * N * S if max_steps is None else max_steps
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
    starts = [greedy] + packed[:max(0, refine)]
    cands = [greedy] + packed + [_improve(p, load, steps) for p in starts]
    return min(cands, key=_key)


# --------------------------------------------------------------------------- token split
def split_offsets(counts_PE: Sequence[Sequence[int]] | np.ndarray) -> np.ndarray:
    """[P, E] exclusive prefix over source ranks of per-rank expert token counts.

    Passing ``offset_E=split_offsets(counts)[p]`` to :func:`split_tokens` on rank p makes
    the round robin continue where rank p-1 stopped, so each replica of an expert gets
    an equal share (within one token) of the tokens of *all* ranks together."""
    c = np.asarray(counts_PE, dtype=np.int64)
    if c.ndim != 2 or (c < 0).any():
        raise ValueError("counts_PE must be a [P, E] array of non-negative token counts")
    return np.cumsum(c, axis=0) - c


def _check_split_inputs(expert_T, placement: Placement, offset_E) -> tuple[np.ndarray, np.ndarray]:
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
    return ex, off


def split_tokens(expert_T: np.ndarray | Sequence[int], placement: Placement,
                 offset_E: np.ndarray | Sequence[int] | None = None) -> np.ndarray:
    """Device of each token: the i-th token (in flattened order) routed to expert e goes
    to ``placement.replicas[e][(offset_E[e] + i) % len(replicas[e])]``.

    expert_T: int array of any shape (e.g. [T] or [T, k]) of expert ids.
    offset_E: [E] starting position of each expert's round robin (default zeros; see
    :func:`split_offsets` to balance across source ranks).
    Returns an int64 array of the same shape. :func:`split_tokens_reference` is the
    one-token-at-a-time twin."""
    ex, off = _check_split_inputs(expert_T, placement, offset_E)
    flat = ex.reshape(-1)
    E = placement.num_experts
    rmax = max(placement.replica_counts)
    table = np.zeros((E, rmax), dtype=np.int64)
    for e, devs in enumerate(placement.replicas):
        table[e, :len(devs)] = devs
    r = np.asarray(placement.replica_counts, dtype=np.int64)
    order = np.argsort(flat, kind="stable")
    sorted_ex = flat[order]
    starts = np.searchsorted(sorted_ex, np.arange(E))
    pos = np.empty_like(flat)
    pos[order] = np.arange(flat.size) - starts[sorted_ex]
    slot = (off[flat] + pos) % r[flat]
    return table[flat, slot].reshape(ex.shape)


def split_tokens_reference(expert_T: np.ndarray | Sequence[int], placement: Placement,
                           offset_E: np.ndarray | Sequence[int] | None = None) -> np.ndarray:
    """Slow twin of :func:`split_tokens`: a plain loop with one counter per expert."""
    ex, off = _check_split_inputs(expert_T, placement, offset_E)
    seen = [int(x) for x in off]
    out = []
    for e in ex.reshape(-1).tolist():
        devs = placement.replicas[e]
        out.append(devs[seen[e] % len(devs)])
        seen[e] += 1
    return np.asarray(out, dtype=np.int64).reshape(ex.shape)
