"""Placement strategies of the inference runtime, as pure per-run state machines.

Legend: E experts, N devices, S slots per device (experts of one layer a device may hold
at once), L MoE layers, k experts per token.

A placement strategy (a :class:`PlacementStrategy` subclass) answers, for each MoE layer
of each batch, *which devices hold which experts*. It has no process group: every rank
builds the same strategy from the same inputs and calls it with the same global numbers
(gathered by the runtime), so every rank computes the same placement and no placement
is ever broadcast. The strategies (``STRATEGIES``, name -> the strategy's ``Config``):

* ``static`` -- DeepSpeed's layout, E/N contiguous experts per device, never changes.
* ``eplb``   -- ``planner`` (default :func:`~commsched.moe.placement.plan_placement`;
  ``"eplb"``: DeepSeek's algorithm, :func:`eplb_layout`) on the historical mean load of
  the layer (from the profiling trace), fixed for the whole run.
* ``lina``   -- phase 1: ``online_planner`` on the layer's load *estimated* from tokens'
  cross-layer paths of ``path_length`` experts, before gating (the runtime computes it
  while the previous layer is still running); phase 2: after gating, if the estimated and
  actual top-2k experts overlap by less than ``threshold``, re-plan from the actual load.
* ``oracle`` -- ``online_planner`` on the actual load after gating, every layer (the bound
  a runtime can reach; its planning sits on the critical path).
* ``eplb-hier`` -- ``eplb`` with DeepSeek's hierarchical policy on the run's hosts
  (:func:`eplb_hier_layout`: experts packed onto hosts first, replicated within them).
* ``lina-node`` -- ``lina`` with the node-aware planner: the host of each device and the
  weight of a row that crosses hosts (``cross_weight``; default
  :func:`cross_host_weight` of the run's topology, its inter-host class at ``inter_rate``,
  the row size and the measured compute per row) go to the planner, whose placements
  split each expert's tokens over the replicas on the tokens' own host when there are any.

Each strategy has a nested ``Config`` (a frozen, keyword-only
:class:`~commsched.configurable.Config`) holding its own options and nothing else; the
flags of ``python -m commsched.moe.infer`` are generated from them, and an option given to
a strategy whose config lacks it is refused naming the strategies that take it
(:func:`~commsched.configurable.config_of`). ``Config.build(...)`` makes the strategy of one
run from the run's inputs, all keyword-only: the sizes (``num_experts``, ``num_devices``,
``num_layers``, ``k``, ``slots``), the profile (``profile``, a routing trace, or its mean
load ``historical_LE``), the hosts (``device_host``) and what the node-aware weight is
measured from (``topology``, ``row_bytes``, ``row_cost_s``). Each class states what the
runtime must do for it: ``needs_profile`` (it plans from the historical load of a
profiling trace), ``loads_online`` (it may plan after gating, so experts are loaded during
inference), ``estimates_paths`` (its phase 1 is planned one layer ahead from the path
estimate, :meth:`LinaPlacement.path_estimate`, and prefetched). A new strategy is one
subclass (its ``Config``: the parent's, unless it declares options of its own) registered
in ``STRATEGIES`` (a :class:`~commsched.configurable.Registry`) and one test::

    class HalfPlacement(OraclePlacement):  # re-planned on odd layers, static on the others
        name = "half"

        def decide(self, layer, phase1, actual_E, estimated_E=None, actual_PE=None):
            if layer % 2:
                return super().decide(layer, phase1, actual_E, estimated_E, actual_PE)
            p = static_placement(self.num_experts, self.num_devices, self.slots)
            return LayerDecision(p.with_load(actual_E), False, None, self._commit(layer, p))

    STRATEGIES.register(HalfPlacement.name, HalfPlacement.Config)

Plans made once before inference (eplb) use ``planner`` (default the full
``plan_placement``); plans made during inference (lina's phases, oracle) use
``online_planner`` (default the greedy: much faster than the full planner for a maximum
load under 1% higher; docs/moe_inference.md has the figures).

Resident experts. A placement puts at most S experts of a layer on a device; a device
keeps at most R >= S experts of each layer resident in its memory (``resident``, default
S), loaded from host memory: a new placement loads the experts a device lacks, and when
more than R would be resident the least recently held ones are evicted
(:func:`keep_resident`). R >= E (every expert of the layer fits the GPU's memory): every
expert is loaded onto every device at start-up (the banks' ``preload``, outside the timed
batches), and no placement loads anything. Devices are interchangeable, so before a new plan is used its
device labels are permuted (:func:`relabel`) to keep as many experts where they already
are as possible; that lowers the number of loads without changing any device's load.
The strategy tracks every device's resident set, so all ranks agree on it too. A
host-local placement is relabelled within hosts only (a device's host is fixed).

Load cost. A plan made during inference is worth its loads only when the time they take
is less than the imbalance it removes. Given the seconds per computed row
(``row_cost_s``) and per expert load (``load_cost_s``, both > 0), an online strategy
compares the new plan with keeping the current one (lina's phase 1: the layer's previous
placement; phase 2: phase 1's; oracle: the previous placement) by :func:`plan_cost`, the
busiest device's rows times the row cost plus its loads times the load cost, and keeps
the current one unless the new one costs less. With either cost 0 every plan is taken.
"""

from __future__ import annotations

import math
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np

from ...configurable import Config, Registry, check, option
from ..placement import Placement, device_loads, static_placement
from ..placement.checks import check_hosts
from ..placement.registry import PLANNERS, eplb_hier_layout, eplb_layout
from ..record.traces import RoutingTrace
from .popularity import DEFAULT_REPLAN_THRESHOLD, PopularityEstimator, phase2_decision

# an option given to a strategy whose config lacks it (configurable.config_of)
_FOREIGN = "{flag} is an option of --placement {owners}, not of --placement {name}"


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
    "StrategyConfig",
    "LayerDecision",
    "PlacementStrategy",
    "StaticPlacement",
    "EplbPlacement",
    "LinaPlacement",
    "OraclePlacement",
    "EplbHierPlacement",
    "LinaNodePlacement",
    "relabel",
    "placement_digest",
    "default_slots",
    "keep_resident",
    "plan_cost",
]


def keep_resident(order: Sequence[int], held: Sequence[int], capacity: int
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One device's resident experts of a layer after it is given the experts ``held``:
    ``(new order, loaded)``. ``order``: the resident experts, most recently held first;
    the new order is ``held`` (ascending), then the others of ``order`` in their order, cut
    at ``capacity`` (the least recently held evicted); ``loaded``: the experts of ``held``
    that were not resident (ascending). Pure; ValueError when ``held`` exceeds ``capacity``."""
    want = sorted(set(int(e) for e in held))
    if len(want) > capacity:
        raise ValueError(f"{len(want)} experts do not fit {capacity} slots")
    have = set(int(e) for e in order)
    wanted = set(want)
    new = tuple(want) + tuple(int(e) for e in order if int(e) not in wanted)
    return new[:capacity], tuple(e for e in want if e not in have)


def plan_cost(device_load_N: Sequence[float] | np.ndarray, loads_N: Sequence[Sequence[int]], row_cost_s: float,
              load_cost_s: float) -> float:
    """Seconds of the busiest device under a placement: max over devices of its rows
    (``device_load_N``) x ``row_cost_s`` + its expert loads (``len(loads_N[d])``) x
    ``load_cost_s``. Pure."""
    dl = np.asarray(device_load_N, dtype=np.float64)
    if dl.ndim != 1 or len(loads_N) != dl.size:
        raise ValueError(f"{dl.size} device loads but loads for {len(loads_N)} devices")
    if row_cost_s < 0 or load_cost_s < 0:
        raise ValueError(f"costs are non-negative, got row {row_cost_s}, load {load_cost_s}")
    return float(max(dl[d] * row_cost_s + len(loads_N[d]) * load_cost_s for d in range(dl.size)))


def default_slots(num_experts: int, num_devices: int) -> int:
    """ceil(E/N) + 2: the static layout plus two spare slots per device for replicas."""
    return math.ceil(num_experts / num_devices) + 2


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


# name -> the strategy's Config class; the command lines' --placement choices are its names
STRATEGIES: Registry[type["StrategyConfig"]] = Registry("placement strategy", flag="--placement")


@dataclass(frozen=True, kw_only=True)
class StrategyConfig(Config):
    """Base of a strategy's ``Config``: its fields are the strategy's options;
    ``build(**inputs)`` makes the strategy of one run (:class:`PlacementStrategy`'s inputs)."""

    strategy: ClassVar[type["PlacementStrategy"]]

    def build(self, **inputs: Any) -> "PlacementStrategy":
        return self.strategy(self, **inputs)


class PlacementStrategy(ABC):
    """One run's placement decisions (see the module docstring); subclasses are the
    strategies. Call, per layer of each batch: :meth:`phase1` before gating (None for
    strategies that plan only after it), then :meth:`decide` after gating. Layers are
    independent: phase 1 of layer j+1 may run while layer j is decided.

    Made by ``Config.build`` from the run's inputs (keyword-only): the sizes E, N, L, k,
    S; ``historical_LE`` [L, E], the mean load per layer from profiling (default: that of
    ``profile``, a routing trace), required when ``needs_profile`` (eplb plans from it;
    lina uses it for layer 0, which has no path to estimate from), ignored otherwise;
    ``device_host`` [N], the host of each device (None: one host); ``topology``,
    ``row_bytes`` and ``row_cost_s``, what the node-aware weight is measured from;
    ``resident`` R, the experts of a layer a device keeps in memory (default S);
    ``load_cost_s``, seconds per expert load, which with ``row_cost_s`` weighs a new
    plan's loads against its balance (:func:`plan_cost`; 0: every plan taken).
    """

    name: ClassVar[str]
    Config: ClassVar[type[StrategyConfig]] = StrategyConfig
    needs_profile: ClassVar[bool] = False    # plans from the historical load of a profile
    loads_online: ClassVar[bool] = False     # may plan after gating: loads during inference
    estimates_paths: ClassVar[bool] = False  # phase 1 from the path estimate, one layer ahead
    cross_weight: float | None = None        # the node-aware weight planned with (None: flat plans)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Config" not in cls.__dict__:  # no options of its own: its parent's, building it
            cls.Config = dataclass(frozen=True, kw_only=True)(type("Config", (cls.Config,), {
                "__module__": cls.__module__, "__qualname__": f"{cls.__qualname__}.Config"}))
        cls.Config.strategy = cls

    def __init__(self, cfg: StrategyConfig, *, num_experts: int, num_devices: int, num_layers: int, k: int,
                 slots: int, historical_LE: np.ndarray | None = None, profile: RoutingTrace | None = None,
                 device_host: Sequence[int] | None = None, topology: Any = None, row_bytes: float = 0.0,
                 row_cost_s: float = 0.0, resident: int | None = None, load_cost_s: float = 0.0) -> None:
        self.cfg = cfg
        for key, v in (("num_experts", num_experts), ("num_devices", num_devices), ("num_layers", num_layers),
                       ("k", k), ("slots", slots)):
            check(not isinstance(v, bool) and isinstance(v, int) and v >= 1, f"{key} must be a positive int, got {v!r}")
        check(slots * num_devices >= num_experts, f"{num_devices} devices x {slots} slots cannot hold {num_experts} "
                                                  f"experts: raise --slots to at least {math.ceil(num_experts / num_devices)}")
        self.num_experts, self.num_devices, self.num_layers, self.k, self.slots = (
            num_experts, num_devices, num_layers, k, slots)
        R = slots if resident is None else resident
        check(not isinstance(R, bool) and isinstance(R, int) and R >= slots,
              f"resident experts per layer ({R!r}) must be an int >= the slots ({slots})")
        self.resident_cap = min(R, num_experts)
        for key, v in (("row_cost_s", row_cost_s), ("load_cost_s", load_cost_s)):
            check(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0,
                  f"{key} must be a finite number >= 0, got {v!r}")
        self.row_cost_s, self.load_cost_s = float(row_cost_s), float(load_cost_s)
        self.device_host = None if device_host is None else check_hosts(device_host, num_devices)
        self.profile = profile
        if historical_LE is None and profile is not None:
            historical_LE = profile.loads().astype(np.float64) / max(1, profile.num_tokens)
        self.historical_LE: np.ndarray | None = None
        if self.needs_profile:
            if historical_LE is None:
                raise ValueError(f"strategy {self.name!r} needs the historical load of a profile")
            hist = np.asarray(historical_LE, dtype=np.float64)
            if hist.shape != (num_layers, num_experts):
                raise ValueError(f"historical load must be [L, E] = [{num_layers}, {num_experts}], got {hist.shape}")
            self.historical_LE = hist
        # per layer and device the resident experts, most recently held first (keep_resident);
        # all of them, preloaded at start-up, when they all fit
        self.preloaded = R >= num_experts
        first = tuple(range(num_experts)) if self.preloaded else ()
        self.resident: list[list[tuple[int, ...]]] = [[first] * num_devices for _ in range(num_layers)]
        self.current: list[Placement | None] = [None] * num_layers  # each layer's last placement

    # ---------------------------------------------------------------- loads
    def _no_loads(self) -> tuple[tuple[int, ...], ...]:
        return tuple(() for _ in range(self.num_devices))

    def _loads(self, layer: int, p: Placement) -> tuple[tuple[int, ...], ...]:
        """The experts each device would load for ``p`` (nothing changes)."""
        res = self.resident[layer]
        return tuple(tuple(sorted(set(h) - set(res[d]))) for d, h in enumerate(p.device_experts))

    def _commit(self, layer: int, p: Placement) -> tuple[tuple[int, ...], ...]:
        """Make ``p`` ``layer``'s placement (its experts resident, :func:`keep_resident`);
        return the experts each device loads."""
        out = [keep_resident(self.resident[layer][d], h, self.resident_cap) for d, h in enumerate(p.device_experts)]
        self.resident[layer] = [o for o, _ in out]
        self.current[layer] = p
        return tuple(x for _, x in out)

    def _worth(self, layer: int, new: Placement, keep: Placement | None, load_E: np.ndarray) -> bool:
        """Whether ``new`` (planned for ``load_E``) is worth its loads against keeping
        ``keep`` (:func:`plan_cost`; always without a current plan or a cost)."""
        if keep is None or self.row_cost_s <= 0 or self.load_cost_s <= 0:
            return True
        kept = keep.with_load(load_E)
        c_new = plan_cost(new.device_load, self._loads(layer, new), self.row_cost_s, self.load_cost_s)
        c_keep = plan_cost(kept.device_load, self._loads(layer, kept), self.row_cost_s, self.load_cost_s)
        return c_new < c_keep

    def _online(self, load_E: np.ndarray, by_rank_PE: np.ndarray | None) -> Placement:
        """The online planner's plan of ``load_E`` (``by_rank_PE``: the load per rank, when known)."""
        return PLANNERS[self.cfg.online_planner](load_E, self.num_devices, self.slots)

    def _replan(self, layer: int, load_E: np.ndarray, by_rank_PE: np.ndarray | None = None,
                keep: Placement | None = None) -> tuple[Placement, tuple[tuple[int, ...], ...], bool]:
        """An online plan from ``load_E`` (per rank ``by_rank_PE``, when known: the token
        origin of a node-aware plan), relabelled; made resident when it is worth its loads
        against keeping ``keep`` (:meth:`_worth`), else ``keep`` with the load of
        ``load_E``. Returns (placement, its loads, whether the new plan was taken)."""
        load_E = np.asarray(load_E, dtype=np.float64)
        p = relabel(self._online(load_E, by_rank_PE), self.resident[layer], load_E)
        if not self._worth(layer, p, keep, load_E):
            p = keep.with_load(load_E)
            return p, self._commit(layer, p), False
        return p, self._commit(layer, p), True

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


@dataclass(frozen=True, kw_only=True)
class _OnlineConfig(StrategyConfig):
    """The options of a strategy that plans during inference."""

    online_planner: str = option("greedy", "planner during inference (lina phases 1 and 2, oracle)",
                                 choices=PLANNERS, foreign=_FOREIGN)

    def __post_init__(self) -> None:
        check(self.online_planner in PLANNERS,
              f"--online-planner must be one of {tuple(PLANNERS)}, got {self.online_planner!r}")


class _FixedPlacement(PlacementStrategy):
    """A layout per layer made before inference: loaded once, never changed."""

    def __init__(self, cfg: StrategyConfig, **inputs: Any) -> None:
        super().__init__(cfg, **inputs)
        self.fixed: list[Placement] = [self._layout(j) for j in range(self.num_layers)]

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
        return static_placement(self.num_experts, self.num_devices, slots_per_device=self.slots)


class EplbPlacement(_FixedPlacement):
    """``planner`` on the historical mean load of each layer, fixed for the run."""

    name = "eplb"
    needs_profile = True

    @dataclass(frozen=True, kw_only=True)
    class Config(StrategyConfig):
        planner: str = option("full", "planner of the layouts fixed before inference (eplb)", choices=PLANNERS,
                              foreign=_FOREIGN)

        def __post_init__(self) -> None:
            check(self.planner in PLANNERS, f"--planner must be one of {tuple(PLANNERS)}, got {self.planner!r}")

    def _layout(self, layer):
        return PLANNERS[self.cfg.planner](self.historical_LE[layer], self.num_devices, self.slots)

    def planned_from(self, layer, estimated_E):
        return self.historical_LE[layer]


class LinaPlacement(PlacementStrategy):
    """Phase 1 from the path estimate (layer 0: the historical load), phase 2 re-plans
    from the actual load when the top-2k overlap falls below ``threshold``."""

    name = "lina"
    needs_profile = True
    loads_online = True
    estimates_paths = True

    @dataclass(frozen=True, kw_only=True)
    class Config(_OnlineConfig):
        threshold: float = option(DEFAULT_REPLAN_THRESHOLD, "lina phase-2 re-plan threshold", foreign=_FOREIGN)
        path_length: int = option(3, "lina: experts of the path (l)", foreign=_FOREIGN)

        def __post_init__(self) -> None:
            super().__post_init__()
            check(0.0 <= self.threshold <= 1.0, f"--threshold is a fraction in [0, 1], got {self.threshold}")
            check(1 <= self.path_length <= 8, f"--path-length must be in 1..8, got {self.path_length}")

    def __init__(self, cfg: StrategyConfig, **inputs: Any) -> None:
        super().__init__(cfg, **inputs)
        # the path estimator, fitted on the profile (None without one: phase 1 then takes the estimates given)
        self.estimator = None if self.profile is None else PopularityEstimator.fit(
            self.profile, max_path=cfg.path_length)

    def path_estimate(self, history_TJ: np.ndarray, layer: int) -> np.ndarray:
        """[E] the load of ``layer`` the path estimator expects from the tokens' top-1 experts
        of the layers before it (``history_TJ``, J = ``layer``), paths of ``path_length``."""
        if self.estimator is None:
            raise ValueError(f"strategy {self.name!r} estimates paths: build it with a profile")
        return self.estimator.estimate_load(history_TJ, layer, self.cfg.path_length)

    def estimate(self, layer: int, estimated_E=None) -> np.ndarray:
        """The load phase 1 assumes for ``layer``: ``estimated_E``, or when no path
        estimate exists (layer 0) the historical mean (only its shape matters to the
        planner)."""
        return self.historical_LE[layer] if estimated_E is None else np.asarray(estimated_E, dtype=np.float64)

    def phase1(self, layer, estimated_E=None, estimated_PE=None):
        p, loads, _ = self._replan(layer, self.estimate(layer, estimated_E),
                                   None if estimated_E is None else estimated_PE, keep=self.current[layer])
        return p, loads

    def decide(self, layer, phase1, actual_E, estimated_E=None, actual_PE=None):
        assert phase1 is not None, "lina needs its phase-1 placement"
        actual = np.asarray(actual_E, dtype=np.float64)
        d = phase2_decision(self.estimate(layer, estimated_E), actual, self.k, self.cfg.threshold)
        if not d.replan:
            return LayerDecision(phase1.with_load(actual), False, d.overlap, self._no_loads())
        p, loads, taken = self._replan(layer, actual, actual_PE, keep=phase1)
        return LayerDecision(p, taken, d.overlap, loads)

    def planned_from(self, layer, estimated_E):
        return self.estimate(layer, estimated_E)


class OraclePlacement(PlacementStrategy):
    """Planned from the actual load after gating, every layer."""

    name = "oracle"
    loads_online = True

    @dataclass(frozen=True, kw_only=True)
    class Config(_OnlineConfig):
        """The online planner only."""

    def phase1(self, layer, estimated_E=None, estimated_PE=None):
        return None, self._no_loads()

    def decide(self, layer, phase1, actual_E, estimated_E=None, actual_PE=None):
        p, loads, taken = self._replan(layer, np.asarray(actual_E, dtype=np.float64), actual_PE,
                                       keep=self.current[layer])
        return LayerDecision(p, taken, None, loads)


class EplbHierPlacement(EplbPlacement):
    """DeepSeek's hierarchical EPLB (:func:`eplb_hier_layout`) on the historical mean load and
    the run's hosts, fixed for the run (one host: EPLB's global policy)."""

    name = "eplb-hier"

    @dataclass(frozen=True, kw_only=True)
    class Config(StrategyConfig):
        """No options: the layout is EPLB's on the run's hosts."""

    def _layout(self, layer):
        hosts = self.device_host or (0,) * self.num_devices
        return eplb_hier_layout(self.historical_LE[layer], self.num_devices, self.slots, hosts)


class LinaNodePlacement(LinaPlacement):
    """``lina`` with the node-aware planner (the run's hosts, ``cross_weight``): host-local
    placements, relabelled within hosts; the token origin of each plan is the per-rank
    estimate (phase 1) or the per-rank counts (phase 2), summed per host; layer 0's phase
    1 (the historical load, no ranks) assumes tokens spread evenly."""

    name = "lina-node"

    @dataclass(frozen=True, kw_only=True)
    class Config(LinaPlacement.Config):
        cross_weight: float | None = option(None, "node-aware strategies (lina-node): weight of a row crossing "
                                                  "hosts, in rows of device compute (default: from the topology's "
                                                  "link classes and the row cost)", foreign=_FOREIGN)
        inter_rate: str | None = option(None, "inter-host link rate the default --cross-weight assumes (tc "
                                              "syntax, e.g. 1gbit; default: the topology's placeholder "
                                              "inter-host class)", foreign=_FOREIGN)

        def __post_init__(self) -> None:
            super().__post_init__()
            if not PLANNERS[self.online_planner].node_aware:  # eplb_layout has no node-aware form
                aware = " or ".join(repr(n) for n, pl in PLANNERS.items() if pl.node_aware)
                raise ValueError(f"strategy 'lina-node' plans node-aware: --online-planner must be {aware}, got "
                                 f"{self.online_planner!r} (use the eplb-hier strategy for EPLB)")
            w = self.cross_weight
            check(w is None or (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0),
                  f"--cross-weight must be a finite number >= 0, got {w!r}")
            if self.inter_rate is not None:
                from ...cluster.netem import parse_rate

                parse_rate(self.inter_rate)  # a ValueError that says how to write a rate

    def __init__(self, cfg: StrategyConfig, *, topology: Any = None, row_bytes: float = 0.0,
                 row_cost_s: float = 0.0, **inputs: Any) -> None:
        super().__init__(cfg, **inputs)
        w = cfg.cross_weight
        if w is None and topology is not None:  # measured: the topology's links, the row cost
            if cfg.inter_rate is not None and "inter" in topology.links:
                from ...cluster.costmodel import LinkCost
                from ...cluster.netem import parse_rate
                from ...cluster.topology import Topology

                links = dict(topology.links)
                links["inter"] = LinkCost(gamma=links["inter"].gamma, theta=8.0 / parse_rate(cfg.inter_rate))
                topology = Topology(topology.hosts_P, links, source=topology.source)
            w = cross_host_weight(topology, row_bytes, row_cost_s)
        self.cross_weight = float(w or 0.0)

    def origin(self, by_rank_PE: np.ndarray | None) -> np.ndarray | None:
        """[H, E] the tokens each host sends each expert, from per-rank figures [N, E]
        (ranks are devices); None without them or without hosts."""
        hosts = self.device_host
        if by_rank_PE is None or hosts is None:
            return None
        by_rank = np.asarray(by_rank_PE, dtype=np.float64)
        out = np.zeros((max(hosts) + 1, by_rank.shape[1]))
        np.add.at(out, list(hosts), by_rank)
        return out

    def _online(self, load_E, by_rank_PE):
        o = self.origin(by_rank_PE)
        kw = {} if o is None else {"origin_HE": o}
        return PLANNERS[self.cfg.online_planner](load_E, self.num_devices, self.slots, device_host=self.device_host,
                                                 cross_weight=self.cross_weight, **kw)


for _cls in (StaticPlacement, EplbPlacement, LinaPlacement, OraclePlacement, EplbHierPlacement,
             LinaNodePlacement):
    STRATEGIES.register(_cls.name, _cls.Config)
del _cls
