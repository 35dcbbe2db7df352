"""Placement strategies of the inference runtime, as pure per-run state machines.

Legend: E experts, N devices, S slots per device (experts of one layer a device may hold
at once), L MoE layers, k experts per token.

A placement strategy (a :class:`PlacementStrategy` subclass) answers, for each MoE layer
of each batch, *which devices hold which experts*. It has no process group: every rank
builds the same strategy from the same inputs and calls it with the same global numbers
(gathered by the runtime), so every rank computes the same placement and no placement
is ever broadcast. The strategies (``STRATEGIES``, name -> class):

* ``static`` -- DeepSpeed's layout, E/N contiguous experts per device, never changes.
* ``eplb``   -- ``planner`` (default :func:`~commsched.moe.placement.plan_placement`;
  ``"eplb"``: DeepSeek's algorithm, :func:`eplb_layout`) on the historical mean load of
  the layer (from the profiling trace), fixed for the whole run.
* ``lina``   -- phase 1: ``plan_placement`` on the layer's load *estimated* from tokens'
  cross-layer paths, before gating (the runtime computes it while the previous layer is
  still running); phase 2: after gating, if the estimated and actual top-2k experts
  overlap by less than ``threshold``, re-plan from the actual load.
* ``oracle`` -- planned from the actual load after gating, every layer (the bound a
  runtime can reach; its planning sits on the critical path).
* ``eplb-hier`` -- ``eplb`` with DeepSeek's hierarchical policy on the run's hosts
  (:func:`eplb_hier_layout`: experts packed onto hosts first, replicated within them).
* ``lina-node`` -- ``lina`` with the node-aware planner: the host of each device
  (``PolicyConfig.device_host``) and the weight of a row that crosses hosts
  (``cross_weight``, :func:`cross_host_weight`) go to the planners, whose placements
  split each expert's tokens over the replicas on the tokens' own host when there are any.

Each class states what the runtime must do for it: ``needs_profile`` (it plans from the
historical load of a profiling trace), ``loads_online`` (it may plan after gating, so
experts are loaded during inference), ``estimates_paths`` (its phase 1 is planned one
layer ahead from the popularity estimator's path estimate and prefetched; the phase-2
threshold and the path length apply). A new strategy is one subclass registered in
``STRATEGIES`` (a :class:`~commsched.configurable.Registry`) and one test::

    class HalfPlacement(OraclePlacement):  # re-planned on odd layers, static on the others
        name = "half"

        def decide(self, layer, phase1, actual_E, estimated_E=None, actual_PE=None):
            if layer % 2:
                return super().decide(layer, phase1, actual_E, estimated_E, actual_PE)
            p = static_placement(self.cfg.num_experts, self.cfg.num_devices, self.cfg.slots)
            return LayerDecision(p.with_load(actual_E), False, None, self._commit(layer, p))

    STRATEGIES.register(HalfPlacement.name, HalfPlacement)

Plans made once before inference (eplb) use ``planner`` (default the full
``plan_placement``); plans made during inference (lina's phases, oracle) use
``online_planner`` (default the greedy: much faster than the full planner for a maximum
load under 1% higher; docs/moe_inference.md has the figures).

Resident experts. Every device keeps at most S experts of each layer resident (loaded
from host memory); a new placement loads the experts a device lacks and evicts the
ones it no longer holds. Devices are interchangeable, so before a new plan is used its
device labels are permuted (:func:`relabel`) to keep as many experts where they already
are as possible; that lowers the number of loads without changing any device's load.
The strategy tracks every device's resident set, so all ranks agree on it too. A
host-local placement is relabelled within hosts only (a device's host is fixed).
"""

from __future__ import annotations

import functools
import math
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np

from ..configurable import Config, Registry
from .placement import Placement, device_loads, static_placement
from .placement.registry import PLANNERS, eplb_hier_layout, eplb_layout
from .popularity import DEFAULT_REPLAN_THRESHOLD, phase2_decision


def cross_host_weight(topology, row_bytes: float, row_time_s: float, *, exchanges: int = 2) -> float:
    """The node-aware planner's weight of a row that crosses hosts, in the load's unit (rows
    a device computes): the time a row spends on the inter-host link beyond what it would
    spend on the intra-host one, over the ``exchanges`` it takes (dispatch and combine),
    divided by a device's compute time per row --
    ``exchanges * row_bytes * (theta_inter - theta_intra) / row_time_s``, theta the
    seconds per byte of the topology's link classes (``intra`` taken as 0 when the layout
    has none). 0 for one host, or when compute per row is free (``row_time_s`` 0)."""
    links = topology.links
    if "inter" not in links or row_time_s <= 0:
        return 0.0
    intra = links["intra"].theta if "intra" in links else 0.0
    return max(0.0, exchanges * row_bytes * (links["inter"].theta - intra) / row_time_s)


__all__ = [
    "STRATEGIES",
    "PLANNERS",
    "eplb_layout",
    "eplb_hier_layout",
    "cross_host_weight",
    "PolicyConfig",
    "LayerDecision",
    "PlacementStrategy",
    "StaticPlacement",
    "EplbPlacement",
    "LinaPlacement",
    "OraclePlacement",
    "EplbHierPlacement",
    "LinaNodePlacement",
    "strategy_class",
    "relabel",
    "placement_digest",
    "default_slots",
]


def default_slots(num_experts: int, num_devices: int) -> int:
    """ceil(E/N) + 2: the static layout plus two spare slots per device for replicas."""
    return math.ceil(num_experts / num_devices) + 2


@dataclass(frozen=True, kw_only=True)
class PolicyConfig(Config):
    """What a placement strategy needs besides the profile.

    slots: S (experts of one layer per device); threshold: phase-2 re-plan threshold on
    the top-2k overlap (lina); planner / online_planner: names in :data:`PLANNERS`
    (before / during inference); device_host: the host 0..H-1 of each device (None: one
    host), used by the strategies that know hosts (``uses_hosts``); cross_weight: the
    node-aware planner's weight of a row crossing hosts (:func:`cross_host_weight`).
    """

    num_experts: int
    num_devices: int
    num_layers: int
    k: int
    slots: int
    threshold: float = DEFAULT_REPLAN_THRESHOLD
    planner: str = "full"
    online_planner: str = "greedy"
    device_host: tuple[int, ...] | None = None
    cross_weight: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_devices", "num_layers", "k", "slots"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.slots * self.num_devices < self.num_experts:
            raise ValueError(f"{self.num_devices} devices x {self.slots} slots cannot hold "
                             f"{self.num_experts} experts: raise --slots to at least "
                             f"{math.ceil(self.num_experts / self.num_devices)}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a fraction in [0, 1], got {self.threshold}")
        for name in ("planner", "online_planner"):
            if getattr(self, name) not in PLANNERS:
                raise ValueError(f"{name} must be one of {tuple(PLANNERS)}, got {getattr(self, name)!r}")
        if self.device_host is not None:
            hosts = tuple(int(h) for h in self.device_host)
            if len(hosts) != self.num_devices or set(hosts) != set(range(max(hosts) + 1)):
                raise ValueError(f"device_host must give each of the {self.num_devices} devices a host "
                                 f"0..H-1 (every host used), got {list(self.device_host)}")
            object.__setattr__(self, "device_host", hosts)
        if not (isinstance(self.cross_weight, (int, float)) and math.isfinite(self.cross_weight)
                and self.cross_weight >= 0):
            raise ValueError(f"cross_weight must be a finite number >= 0, got {self.cross_weight!r}")


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
    while both are free; for a host-local placement only pairs on the same host. Device
    loads are recomputed from ``load_E`` (default: the plan's own loads, permuted)."""
    N = p.num_devices
    if len(resident_N) != N:
        raise ValueError(f"{len(resident_N)} resident sets for {N} devices")
    bins = p.device_experts
    host = p.device_host
    pairs = sorted(((-len(set(bins[b]) & set(resident_N[d])), b, d) for b in range(N) for d in range(N)
                    if host is None or host[b] == host[d]))
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
        dl = device_loads(replicas, load_E, N, host).tolist()
    return Placement(replicas, tuple(float(x) for x in dl), p.slots_per_device, host)


# name -> PlacementStrategy class; the command lines' --placement choices are its names
STRATEGIES: Registry[type["PlacementStrategy"]] = Registry("placement strategy", flag="--placement")


class PlacementStrategy(ABC):
    """One run's placement decisions (see the module docstring); subclasses are the
    strategies. Call, per layer of each batch: :meth:`phase1` before gating (None for
    strategies that plan only after it), then :meth:`decide` after gating. Layers are
    independent: phase 1 of layer j+1 may run while layer j is decided.

    historical_LE: [L, E] mean load per layer from profiling, required when
    ``needs_profile`` (eplb plans from it; lina uses it for layer 0, which has no path
    to estimate from), ignored otherwise.
    """

    name: ClassVar[str]
    needs_profile: ClassVar[bool] = False    # plans from the historical load of a profile
    loads_online: ClassVar[bool] = False     # may plan after gating: loads during inference
    estimates_paths: ClassVar[bool] = False  # phase 1 from the path estimate, one layer ahead
    uses_hosts: ClassVar[bool] = False       # plans with cfg.device_host (and cross_weight)

    def __init__(self, cfg: PolicyConfig, historical_LE: np.ndarray | None = None) -> None:
        self.cfg = cfg
        E, N, L = cfg.num_experts, cfg.num_devices, cfg.num_layers
        self.historical_LE: np.ndarray | None = None
        if self.needs_profile:
            if historical_LE is None:
                raise ValueError(f"strategy {self.name!r} needs the historical load of a profile")
            hist = np.asarray(historical_LE, dtype=np.float64)
            if hist.shape != (L, E):
                raise ValueError(f"historical load must be [L, E] = [{L}, {E}], got {hist.shape}")
            self.historical_LE = hist
        self._plan = PLANNERS[cfg.planner]
        self._online = PLANNERS[cfg.online_planner]
        if self.uses_hosts:  # the node-aware planners (eplb_layout has no node-aware form)
            bad = [n for n in (cfg.planner, cfg.online_planner) if not PLANNERS[n].node_aware]
            if bad:
                aware = " or ".join(repr(n) for n, pl in PLANNERS.items() if pl.node_aware)
                raise ValueError(f"strategy {self.name!r} plans node-aware: planner and online_planner must be "
                                 f"{aware}, got {bad[0]!r} (use the eplb-hier strategy for EPLB)")
            kw = {"device_host": cfg.device_host, "cross_weight": cfg.cross_weight}
            self._plan = functools.partial(self._plan, **kw)
            self._online = functools.partial(self._online, **kw)
        self.resident: list[list[frozenset[int]]] = [[frozenset()] * N for _ in range(L)]

    # ---------------------------------------------------------------- loads
    def _no_loads(self) -> tuple[tuple[int, ...], ...]:
        return tuple(() for _ in range(self.cfg.num_devices))

    def _commit(self, layer: int, p: Placement) -> tuple[tuple[int, ...], ...]:
        """Make ``p`` the resident layout of ``layer``; return the experts each device loads."""
        held = p.device_experts
        loads = tuple(tuple(sorted(set(held[d]) - self.resident[layer][d])) for d in range(len(held)))
        self.resident[layer] = [frozenset(h) for h in held]
        return loads

    def origin(self, by_rank_PE: np.ndarray | None) -> np.ndarray | None:
        """[H, E] the tokens each host sends each expert, from per-rank figures [N, E]
        (ranks are devices), for a strategy that plans with hosts; None otherwise."""
        hosts = self.cfg.device_host
        if not self.uses_hosts or by_rank_PE is None or hosts is None:
            return None
        by_rank = np.asarray(by_rank_PE, dtype=np.float64)
        out = np.zeros((max(hosts) + 1, by_rank.shape[1]))
        np.add.at(out, list(hosts), by_rank)
        return out

    def _replan(self, layer: int, load_E: np.ndarray, by_rank_PE: np.ndarray | None = None
                ) -> tuple[Placement, tuple[tuple[int, ...], ...]]:
        """An online plan from ``load_E`` (per rank ``by_rank_PE``, when known: the token
        origin of a node-aware plan), relabelled and made resident, with its loads."""
        cfg = self.cfg
        o = self.origin(by_rank_PE)
        kw = {} if o is None else {"origin_HE": o}
        p = relabel(self._online(load_E, cfg.num_devices, cfg.slots, **kw), self.resident[layer], load_E)
        return p, self._commit(layer, p)

    # ---------------------------------------------------------------- phases
    @abstractmethod
    def phase1(self, layer: int, estimated_E: Sequence[float] | np.ndarray | None = None,
               estimated_PE: np.ndarray | None = None) -> tuple[Placement | None, tuple[tuple[int, ...], ...]]:
        """Before gating: the placement planned for ``layer`` and the experts each device
        must load for it (None and no loads when the strategy plans only after gating).
        ``estimated_PE``: the estimate per source rank (its sum is ``estimated_E``), which
        a strategy that plans with hosts takes as the token origin."""

    @abstractmethod
    def decide(self, layer: int, phase1: Placement | None, actual_E: Sequence[float] | np.ndarray,
               estimated_E: Sequence[float] | np.ndarray | None = None,
               actual_PE: np.ndarray | None = None) -> LayerDecision:
        """After gating: the placement used for ``layer`` given its actual load (device
        loads of the result are the actual ones), and the loads on the critical path.
        ``actual_PE``: the actual load per source rank (the token origin, as above)."""

    def planned_from(self, layer: int, estimated_E: np.ndarray | None) -> np.ndarray | None:
        """The load ``layer``'s placement was planned from before gating (its estimation
        accuracy compares it with the actual load), or None if it had none."""
        return None


class _FixedPlacement(PlacementStrategy):
    """A layout per layer made before inference: loaded once, never changed."""

    def __init__(self, cfg: PolicyConfig, historical_LE: np.ndarray | None = None) -> None:
        super().__init__(cfg, historical_LE)
        self.fixed: list[Placement] = [self._layout(j) for j in range(cfg.num_layers)]

    @abstractmethod
    def _layout(self, layer: int) -> Placement:
        """The fixed layout of ``layer``."""

    def phase1(self, layer, estimated_E=None, estimated_PE=None):
        p = self.fixed[layer]
        return p, self._commit(layer, p)

    def decide(self, layer, phase1, actual_E, estimated_E=None, actual_PE=None):
        assert phase1 is not None, f"{self.name} decides on its fixed layout"
        return LayerDecision(phase1.with_load(np.asarray(actual_E, dtype=np.float64)), False, None,
                             self._no_loads())


class StaticPlacement(_FixedPlacement):
    """DeepSpeed's layout: E/N contiguous experts per device."""

    name = "static"

    def _layout(self, layer):
        cfg = self.cfg
        return static_placement(cfg.num_experts, cfg.num_devices, slots_per_device=cfg.slots)


class EplbPlacement(_FixedPlacement):
    """``planner`` on the historical mean load of each layer, fixed for the run."""

    name = "eplb"
    needs_profile = True

    def _layout(self, layer):
        return self._plan(self.historical_LE[layer], self.cfg.num_devices, self.cfg.slots)

    def planned_from(self, layer, estimated_E):
        return self.historical_LE[layer]


class LinaPlacement(PlacementStrategy):
    """Phase 1 from the path estimate (layer 0: the historical load), phase 2 re-plans
    from the actual load when the top-2k overlap falls below ``threshold``."""

    name = "lina"
    needs_profile = True
    loads_online = True
    estimates_paths = True

    def estimate(self, layer: int, estimated_E=None) -> np.ndarray:
        """The load phase 1 assumes for ``layer``: ``estimated_E``, or when no path
        estimate exists (layer 0) the historical mean (only its shape matters to the
        planner)."""
        return self.historical_LE[layer] if estimated_E is None else np.asarray(estimated_E, dtype=np.float64)

    def phase1(self, layer, estimated_E=None, estimated_PE=None):
        return self._replan(layer, self.estimate(layer, estimated_E), None if estimated_E is None else estimated_PE)

    def decide(self, layer, phase1, actual_E, estimated_E=None, actual_PE=None):
        assert phase1 is not None, "lina needs its phase-1 placement"
        actual = np.asarray(actual_E, dtype=np.float64)
        d = phase2_decision(self.estimate(layer, estimated_E), actual, self.cfg.k, self.cfg.threshold)
        if not d.replan:
            return LayerDecision(phase1.with_load(actual), False, d.overlap, self._no_loads())
        p, loads = self._replan(layer, actual, actual_PE)
        return LayerDecision(p, True, d.overlap, loads)

    def planned_from(self, layer, estimated_E):
        return self.estimate(layer, estimated_E)


class OraclePlacement(PlacementStrategy):
    """Planned from the actual load after gating, every layer."""

    name = "oracle"
    loads_online = True

    def phase1(self, layer, estimated_E=None, estimated_PE=None):
        return None, self._no_loads()

    def decide(self, layer, phase1, actual_E, estimated_E=None, actual_PE=None):
        p, loads = self._replan(layer, np.asarray(actual_E, dtype=np.float64), actual_PE)
        return LayerDecision(p, True, None, loads)


class EplbHierPlacement(EplbPlacement):
    """DeepSeek's hierarchical EPLB (:func:`eplb_hier_layout`) on the historical mean load and
    the run's hosts, fixed for the run (one host: EPLB's global policy)."""

    name = "eplb-hier"

    def _layout(self, layer):
        cfg = self.cfg
        hosts = cfg.device_host or (0,) * cfg.num_devices
        return eplb_hier_layout(self.historical_LE[layer], cfg.num_devices, cfg.slots, hosts)


class LinaNodePlacement(LinaPlacement):
    """``lina`` with the node-aware planner (``device_host``, ``cross_weight``): host-local
    placements, relabelled within hosts; the token origin of each plan is the per-rank
    estimate (phase 1) or the per-rank counts (phase 2), summed per host; layer 0's phase
    1 (the historical load, no ranks) assumes tokens spread evenly."""

    name = "lina-node"
    uses_hosts = True


for _cls in (StaticPlacement, EplbPlacement, LinaPlacement, OraclePlacement, EplbHierPlacement,
             LinaNodePlacement):
    STRATEGIES.register(_cls.name, _cls)
del _cls


def strategy_class(name: str) -> type[PlacementStrategy]:
    """The strategy called ``name`` in :data:`STRATEGIES` (a ValueError naming the known ones)."""
    if name not in STRATEGIES:
        raise ValueError(f"placement strategy must be one of {STRATEGIES.names}, got {name!r}")
    return STRATEGIES[name]
