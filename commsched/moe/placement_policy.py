"""Placement strategies of the inference runtime, as pure per-run state machines.

Legend: E experts, N devices, S slots per device (experts of one layer a device may hold
at once), L MoE layers, k experts per token.

A :class:`PlacementPolicy` answers, for each MoE layer of each batch, *which devices hold
which experts*. It has no process group: every rank builds the same policy from the
same inputs and calls it with the same global numbers (gathered by the runtime), so
every rank computes the same placement and no placement is ever broadcast. The
strategies (``STRATEGIES``):

* ``static`` -- DeepSpeed's layout, E/N contiguous experts per device, never changes.
* ``eplb``   -- :func:`~commsched.moe.placement.plan_placement` on the historical mean
  load of the layer (from the profiling trace), fixed for the whole run.
* ``lina``   -- phase 1: ``plan_placement`` on the layer's load *estimated* from tokens'
  cross-layer paths, before gating (the runtime computes it while the previous layer is
  still running); phase 2: after gating, if the estimated and actual top-2k experts
  overlap by less than ``threshold``, re-plan from the actual load.
* ``oracle`` -- planned from the actual load after gating, every layer (the bound a
  runtime can reach; its planning sits on the critical path).

Plans made once before inference (eplb) use ``planner`` (default the full
``plan_placement``); plans made during inference (lina's phases, oracle) use
``online_planner`` (default the EPLB-style greedy: about 15x faster than the full
planner for a maximum load under 1% higher; docs/moe_inference.md has the figures).

Resident experts. Every device keeps at most S experts of each layer resident (loaded
from host memory); a new placement loads the experts a device lacks and evicts the
ones it no longer holds. Devices are interchangeable, so before a new plan is used its
device labels are permuted (:func:`relabel`) to keep as many experts where they already
are as possible; that lowers the number of loads without changing any device's load.
The policy tracks every device's resident set, so all ranks agree on it too.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .placement import Placement, device_loads, greedy_placement, plan_placement, static_placement
from .popularity import DEFAULT_REPLAN_THRESHOLD, phase2_decision

STRATEGIES = ("static", "eplb", "lina", "oracle")
PLANNERS: dict[str, Callable[..., Placement]] = {
    "full": plan_placement,
    "greedy": greedy_placement,
}

__all__ = [
    "STRATEGIES",
    "PLANNERS",
    "PolicyConfig",
    "LayerDecision",
    "PlacementPolicy",
    "relabel",
    "placement_digest",
    "default_slots",
]


def default_slots(num_experts: int, num_devices: int) -> int:
    """ceil(E/N) + 2: the static layout plus two spare slots per device for replicas."""
    return math.ceil(num_experts / num_devices) + 2


@dataclass(frozen=True)
class PolicyConfig:
    """What a :class:`PlacementPolicy` needs besides the profile.

    strategy: one of :data:`STRATEGIES`; slots: S (experts of one layer per device);
    threshold: phase-2 re-plan threshold on the top-2k overlap (lina);
    planner / online_planner: names in :data:`PLANNERS` (before / during inference).
    """

    strategy: str
    num_experts: int
    num_devices: int
    num_layers: int
    k: int
    slots: int
    threshold: float = DEFAULT_REPLAN_THRESHOLD
    planner: str = "full"
    online_planner: str = "greedy"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"placement strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for name in ("num_experts", "num_devices", "num_layers", "k", "slots"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.slots * self.num_devices < self.num_experts:
            raise ValueError(f"{self.num_devices} devices x {self.slots} slots cannot hold "
                             f"{self.num_experts} experts: raise --slots to at least "
                             f"{math.ceil(self.num_experts / self.num_devices)}")
        if self.strategy == "static" and self.slots < math.ceil(self.num_experts / self.num_devices):
            raise ValueError("static needs ceil(E/N) slots per device")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a fraction in [0, 1], got {self.threshold}")
        for name in ("planner", "online_planner"):
            if getattr(self, name) not in PLANNERS:
                raise ValueError(f"{name} must be one of {tuple(PLANNERS)}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class LayerDecision:
    """The placement used for one layer of one batch and how it was reached.

    replanned: planned after gating (oracle always; lina when phase 2 fired);
    overlap: lina's top-2k overlap of estimate and actual (None for other strategies);
    loads_N: experts each device had to load for this placement (after relabelling).
    """

    placement: Placement
    replanned: bool
    overlap: float | None
    loads_N: tuple[tuple[int, ...], ...]


def placement_digest(p: Placement) -> int:
    """A 31-bit checksum of the layout (which devices hold which expert): equal on every
    rank that computed the same placement. Exact in a float64."""
    blob = ";".join(",".join(map(str, r)) for r in p.replicas).encode()
    return zlib.crc32(blob) & 0x7FFFFFFF


def relabel(p: Placement, resident_N: Sequence[set[int] | frozenset[int]],
            load_E: Sequence[float] | np.ndarray | None = None) -> Placement:
    """The same plan with its devices renamed to keep experts where they are resident.

    Planned device b becomes real device perm[b], chosen greedily: pairs (b, d) in
    decreasing |experts of b & resident_N[d]| (ties: lower b, then lower d) are matched
    while both are free. Device loads are recomputed from ``load_E`` (default: the plan's
    own loads, permuted)."""
    N = p.num_devices
    if len(resident_N) != N:
        raise ValueError(f"{len(resident_N)} resident sets for {N} devices")
    bins = p.device_experts
    pairs = sorted(((-len(set(bins[b]) & set(resident_N[d])), b, d) for b in range(N) for d in range(N)))
    perm = [-1] * N
    used = [False] * N
    for _, b, d in pairs:
        if perm[b] < 0 and not used[d]:
            perm[b] = d
            used[d] = True
    replicas = tuple(tuple(sorted(perm[b] for b in devs)) for devs in p.replicas)
    if load_E is None:
        dl = [0.0] * N
        for b in range(N):
            dl[perm[b]] = p.device_load[b]
    else:
        dl = device_loads(replicas, load_E, N).tolist()
    return Placement(replicas, tuple(float(x) for x in dl), p.slots_per_device)


class PlacementPolicy:
    """One run's placement decisions (see the module docstring).

    historical_LE: [L, E] mean load per layer from profiling (eplb plans from it; lina uses
    it for layer 0, which has no path to estimate from). Call, per layer of each batch:
    :meth:`phase1` before gating (None for oracle), then :meth:`decide` after gating.
    Layers are independent: phase 1 of layer j+1 may run while layer j is decided.
    """

    def __init__(self, cfg: PolicyConfig, historical_LE: np.ndarray | None = None) -> None:
        self.cfg = cfg
        E, N, L, S = cfg.num_experts, cfg.num_devices, cfg.num_layers, cfg.slots
        if cfg.strategy in ("eplb", "lina"):
            if historical_LE is None:
                raise ValueError(f"strategy {cfg.strategy!r} needs the historical load of a profile")
            hist = np.asarray(historical_LE, dtype=np.float64)
            if hist.shape != (L, E):
                raise ValueError(f"historical load must be [L, E] = [{L}, {E}], got {hist.shape}")
            self.historical_LE = hist
        else:
            self.historical_LE = None
        self._plan = PLANNERS[cfg.planner]
        self._online = PLANNERS[cfg.online_planner]
        self.fixed: list[Placement] | None = None
        if cfg.strategy == "static":
            st = static_placement(E, N, slots_per_device=S)
            self.fixed = [st] * L
        elif cfg.strategy == "eplb":
            self.fixed = [self._plan(self.historical_LE[j], N, S) for j in range(L)]
        self.resident: list[list[frozenset[int]]] = [[frozenset()] * N for _ in range(L)]

    # ---------------------------------------------------------------- loads
    def _commit(self, layer: int, p: Placement) -> tuple[tuple[int, ...], ...]:
        """Make ``p`` the resident layout of ``layer``; return the experts each device loads."""
        held = p.device_experts
        loads = tuple(tuple(sorted(set(held[d]) - self.resident[layer][d])) for d in range(len(held)))
        self.resident[layer] = [frozenset(h) for h in held]
        return loads

    def _fit(self, layer: int, p: Placement, load_E) -> Placement:
        return relabel(p, self.resident[layer], load_E)

    # ---------------------------------------------------------------- phases
    def estimate(self, layer: int) -> np.ndarray | None:
        """The load lina's phase 1 assumes for ``layer`` when no path estimate exists
        (layer 0): the historical mean (only its shape matters to the planner)."""
        return None if self.historical_LE is None else self.historical_LE[layer]

    def phase1(self, layer: int, estimated_E: Sequence[float] | np.ndarray | None = None
               ) -> tuple[Placement | None, tuple[tuple[int, ...], ...]]:
        """Before gating: the placement planned for ``layer`` and the experts each device
        must load for it (prefetched while the previous layer runs). Static and eplb
        return their fixed layout; lina plans from ``estimated_E`` (default: the
        historical load); oracle returns (None, no loads)."""
        s = self.cfg.strategy
        N = self.cfg.num_devices
        if s == "oracle":
            return None, tuple(() for _ in range(N))
        if s in ("static", "eplb"):
            p = self.fixed[layer]  # type: ignore[index]
            return p, self._commit(layer, p)
        est = self.estimate(layer) if estimated_E is None else np.asarray(estimated_E, dtype=np.float64)
        p = self._fit(layer, self._online(est, N, self.cfg.slots), est)
        return p, self._commit(layer, p)

    def decide(self, layer: int, phase1: Placement | None, actual_E: Sequence[float] | np.ndarray,
               estimated_E: Sequence[float] | np.ndarray | None = None) -> LayerDecision:
        """After gating: the placement used for ``layer`` given its actual load (device
        loads of the result are the actual ones), and the loads on the critical path."""
        s, N, S = self.cfg.strategy, self.cfg.num_devices, self.cfg.slots
        actual = np.asarray(actual_E, dtype=np.float64)
        none = tuple(() for _ in range(N))
        if s in ("static", "eplb"):
            assert phase1 is not None
            return LayerDecision(phase1.with_load(actual), False, None, none)
        if s == "oracle":
            p = self._fit(layer, self._online(actual, N, S), actual)
            return LayerDecision(p, True, None, self._commit(layer, p))
        assert phase1 is not None, "lina needs its phase-1 placement"
        est = self.estimate(layer) if estimated_E is None else np.asarray(estimated_E, dtype=np.float64)
        d = phase2_decision(est, actual, self.cfg.k, self.cfg.threshold)
        if not d.replan:
            return LayerDecision(phase1.with_load(actual), False, d.overlap, none)
        p = self._fit(layer, self._online(actual, N, S), actual)
        return LayerDecision(p, True, d.overlap, self._commit(layer, p))
