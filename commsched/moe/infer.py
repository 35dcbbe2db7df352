"""Distributed MoE inference with expert placement (Lina's two-phase scheduling).

    torchrun --nproc_per_node 4 -m commsched.moe.infer --placement lina --out DIR
    torchrun --nproc_per_node 4 -m commsched.moe.infer --driver model --checkpoint CKPT \
        --placement oracle --out DIR

Legend: N ranks (= devices), E experts, L MoE layers, k experts per token, S slots (experts
of one layer a device may hold at once), T tokens on a rank, D row width, B sequences.

Every rank serves its own share of each batch. Per MoE layer:

1. gating (the model's router, or the recorded choices of a routing trace);
2. one small exchange of this rank's expert counts, *plus* (lina) its estimate of the
   next layer's expert load from its tokens' paths and a checksum of the previous
   placement: every rank now holds the same global counts and estimates;
3. the placement of the layer, from the run's placement strategy (a class of
   :mod:`~commsched.moe.placement_policy`, chosen by ``--placement``): fixed (static,
   eplb), planned from the actual counts (oracle), or (lina) the phase-1 plan made from
   the estimate exchanged one layer earlier -- planned while that layer's device
   computed, its expert loads prefetched by a background thread -- kept, or re-planned
   when the estimated and actual top-2k experts overlap less than ``--threshold``. The planners are deterministic and their
   inputs identical on every rank, so every rank computes the same plan and nothing is
   broadcast (the checksum in the next exchange verifies it);
4. experts the device lacks are loaded from host memory into its S slots (pipelined:
   by the background thread, while the device computes the experts it already holds);
5. :func:`~commsched.moe.placed.placed_moe`: tokens of a replicated expert split evenly
   over its replicas across all ranks, dispatch through the uneven all-to-all with a
   plan derived from the exchanged counts (no count exchange of its own), expert
   compute, combine. Pipelined (``--exchange pipelined``, the default), the rows a rank
   routes to its own device skip both exchanges and are computed while they run.
   ``--exchange sequential`` is the first runtime (ring ``all_gather`` of the counts,
   loads on the critical path, dispatch then compute then combine), kept as a twin.

Two drivers:

* ``--driver trace`` (default) replays a routing trace (``--trace FILE``, or a synthetic
  one from the generator) with synthetic hidden states. Expert compute is either an
  emulated accelerator (``--compute emulated``: the device is busy ``--us-per-row``
  microseconds per row it computes, loading an expert takes ``--load-ms``; the rows
  still travel through the real all-to-all and are transformed by a per-expert affine
  map so that routing errors show) or real FFNs (``--compute real``).
* ``--driver model`` runs a trained MoE language model (``--checkpoint``, written by
  ``python -m commsched.moe.record``) on held-out text, real expert FFNs.

``--device auto|cpu|cuda`` (default auto) chooses where the experts compute: on CUDA the
bank's slots, the rows and the index tensors live on the GPU and loads are asynchronous
copies on a copy stream (docs/moe_inference.md, "Devices"); ``--compute emulated``
always runs on the CPU.

This module is the entry point: the run's configuration (:class:`InferConfig` and its
nested sub-configs), :func:`build`, :func:`run`, the metrics (:class:`InferMetrics`) and
the CLI. Steps 2-5 are :class:`~commsched.moe.runtime.Runtime`; the experts are an
:class:`~commsched.moe.banks.ExpertBank`.

Writes ``DIR/metrics.json`` (rank 0, an :class:`InferMetrics` record): ``placement``,
``latency_ms`` (p50/p95/p99 of the batch latency, max over ranks), ``imbalance`` (mean over batches and layers of max/mean
device rows), ``estimation_accuracy`` (top-k overlap of the load the strategy planned
from and the actual load), ``replans`` (per layer: share of batches planned after
gating), ``model_latency_ms`` (sum over layers of the busiest device's rows x per-row
cost: the expert-compute latency on dedicated devices), a time breakdown, and per-layer
heat-map data (``expert_load_share``, ``replicas``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .. import dist as cdist
from ..clock import Clock
from ..config import read_env
from ..dist import DEVICE_CHOICES, check_same_config, group_device, init_distributed
from ..results import Progress, Record, mark_failed, median, prepare_out
from ..topology import Topology
from .banks import EmulatedBank, ExpertBank, FFNBank
from .placed import device_rows
from .placement_policy import (
    PLANNERS,
    STRATEGIES,
    PlacementStrategy,
    PolicyConfig,
    cross_host_weight,
    default_slots,
    strategy_class,
)
from .popularity import DEFAULT_REPLAN_THRESHOLD, PopularityEstimator, topk_overlap
from .runtime import Runtime, model_forward, model_weights, row_cost, trace_forward
from .traces import RoutingTrace, SyntheticTraceConfig, load_trace, synthetic_trace

DRIVERS = ("trace", "model")
COMPUTES = ("emulated", "real")
EXCHANGES = ("pipelined", "sequential")


# --------------------------------------------------------------------------- config
@dataclass(frozen=True)
class PlacementConfig:
    """Where experts go: ``strategy`` (a name in
    :data:`~commsched.moe.placement_policy.STRATEGIES`), ``slots`` S (None: ceil(E/N) +
    2), the phase-2 ``threshold`` and ``path_length`` of strategies that estimate paths,
    the planners before (``planner``) and during (``online_planner``) inference, and for
    the node-aware strategies the weight of a row crossing hosts (``cross_weight``; None:
    :func:`~commsched.moe.placement_policy.cross_host_weight` of the run's topology, its
    row size and compute per row) and the inter-host rate that weight assumes
    (``inter_rate``, tc syntax; None: the topology's placeholder inter-host class)."""

    strategy: str = "lina"
    slots: int | None = None
    threshold: float = DEFAULT_REPLAN_THRESHOLD
    path_length: int = 3
    planner: str = "full"
    online_planner: str = "greedy"
    cross_weight: float | None = None
    inter_rate: str | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--placement must be one of {tuple(STRATEGIES)}, got {self.strategy!r}")
        if not 1 <= self.path_length <= 8:
            raise ValueError(f"--path-length must be in 1..8, got {self.path_length}")
        if self.cross_weight is not None and not (np.isfinite(self.cross_weight) and self.cross_weight >= 0):
            raise ValueError(f"--cross-weight must be a finite number >= 0, got {self.cross_weight}")
        if self.inter_rate is not None:
            from ..netem import parse_rate

            parse_rate(self.inter_rate)  # a ValueError that says how to write a rate

    @property
    def strategy_class(self) -> type[PlacementStrategy]:
        return strategy_class(self.strategy)


@dataclass(frozen=True)
class EmulationConfig:
    """The emulated device (``--compute emulated``): busy ``us_per_row`` microseconds per
    computed row, ``load_ms`` per expert loaded."""

    us_per_row: float = 20.0
    load_ms: float = 0.5

    def __post_init__(self) -> None:
        if self.us_per_row < 0 or self.load_ms < 0:
            raise ValueError("--us-per-row and --load-ms must be >= 0")


@dataclass(frozen=True)
class TraceDriverConfig:
    """The trace driver: the trace (``path``, or a synthetic one), its profiling share,
    tokens per batch (all ranks together), and the rows' and (``--compute real``) the
    FFNs' widths."""

    path: str | None = None
    synthetic: SyntheticTraceConfig = field(default_factory=SyntheticTraceConfig)
    profile_fraction: float = 0.5
    tokens_per_batch: int = 2048
    d_model: int = 64
    expert_hidden: int = 256

    def __post_init__(self) -> None:
        if not 0.0 < self.profile_fraction < 1.0:
            raise ValueError(f"--profile-fraction must lie in (0, 1), got {self.profile_fraction}")
        if self.tokens_per_batch < 1:
            raise ValueError("--tokens-per-batch must be >= 1")


@dataclass(frozen=True)
class ModelDriverConfig:
    """The model driver: the checkpoint, the text, sequences per rank per batch, and the
    profile (a recorded trace, or ``profile_tokens`` tokens recorded at start-up)."""

    checkpoint: str | None = None
    corpus: str | None = None
    batch_size: int = 8
    profile_trace: str | None = None
    profile_tokens: int = 16384

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.profile_tokens < 1:
            raise ValueError("--batch-size and --profile-tokens must be >= 1")


@dataclass(frozen=True)
class InferConfig:
    """One inference run: the driver, the expert compute, the exchange, the batches, the
    device (``--device``: auto, cpu or cuda; see :attr:`device_choice`), and the
    sub-configs of placement, emulated device and the two drivers."""

    driver: str = "trace"
    compute: str = "emulated"
    exchange: str = "pipelined"
    device: str = "auto"
    batches: int = 30
    warmup: int = 2
    seed: int = 0
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    trace: TraceDriverConfig = field(default_factory=TraceDriverConfig)
    model: ModelDriverConfig = field(default_factory=ModelDriverConfig)

    def __post_init__(self) -> None:
        if self.driver not in DRIVERS:
            raise ValueError(f"--driver must be one of {DRIVERS}, got {self.driver!r}")
        if self.compute not in COMPUTES:
            raise ValueError(f"--compute must be one of {COMPUTES}, got {self.compute!r}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"--exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"--device must be one of {DEVICE_CHOICES}, got {self.device!r}")
        if self.device == "cuda" and self.compute == "emulated":
            raise ValueError("--compute emulated is the CPU model of an accelerator and runs on the CPU: use "
                             "--compute real with --device cuda (real expert FFNs on the GPU), or --device cpu")
        if self.driver == "model" and self.compute != "real":
            raise ValueError("--driver model computes the model's real experts: use --compute real")
        if self.batches < 1 or not 0 <= self.warmup < self.batches:
            raise ValueError(f"need batches >= 1 and 0 <= warmup < batches, got {self.batches}, {self.warmup}")

    @property
    def device_choice(self) -> str:
        """The ``--device`` the job starts with: ``device``, except that ``auto`` is the
        CPU for the emulated device (an emulation of an accelerator on the CPU)."""
        return "cpu" if self.compute == "emulated" else self.device


def job_device(cfg: InferConfig, group=None) -> torch.device:
    """The device of a run on an already initialised group: :func:`commsched.dist.group_device`
    of the device ``cfg`` chooses (:attr:`InferConfig.device_choice`)."""
    return group_device(cfg.device_choice, group)


# --------------------------------------------------------------------------- drivers
def _even_split(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class TraceDriver:
    """``batches`` batches of a routing trace (after its profiling part), each split over
    the ranks by whole sequences."""

    def __init__(self, cfg: TraceDriverConfig, batches: int, seed: int, world: int):
        trace = load_trace(cfg.path) if cfg.path else synthetic_trace(cfg.synthetic, seed)
        self.trace = trace
        self.profile, test = trace.split(cfg.profile_fraction)
        self.batches = test.batches(cfg.tokens_per_batch)
        if len(self.batches) < batches:
            raise ValueError(f"the held-out part of the trace has {len(self.batches)} batches of "
                             f">= {cfg.tokens_per_batch} tokens, fewer than --batches {batches}: "
                             "use a longer trace, a smaller --tokens-per-batch or fewer --batches")
        self.batches = self.batches[:batches]
        self.world, self.seed = world, seed
        self.E, self.L, self.k = trace.num_experts, trace.num_layers, trace.k

    def shard(self, b: int, rank: int) -> RoutingTrace:
        tr = self.batches[b]
        bounds = tr._sequence_bounds()
        q = len(bounds) - 1
        sizes = _even_split(q, self.world)
        lo = sum(sizes[:rank])
        return tr.select(slice(int(bounds[lo]), int(bounds[lo + sizes[rank]])))

    def inputs(self, b: int, rank: int, d: int, device: torch.device | str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_TD, expert_TLK, gate_TK) of this rank's share of batch b, on ``device``
        (default: the CPU). Drawn from a seeded CPU generator and moved in one copy each,
        so every device serves the same numbers."""
        sh = self.shard(b, rank)
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + b) * 1009 + rank)
        x = torch.randn(sh.num_tokens, d, generator=g)
        gate = torch.rand(sh.num_tokens, sh.k, generator=g) + 0.5
        gate = gate / gate.sum(dim=1, keepdim=True)
        ex = torch.from_numpy(sh.experts)
        if device is not None and torch.device(device).type != "cpu":
            x, ex, gate = (t.to(device) for t in (x, ex, gate))
        return x, ex, gate


# --------------------------------------------------------------------------- setup
def _load_model(cfg: ModelDriverConfig):
    from .record import load_checkpoint

    if cfg.checkpoint is None:
        raise ValueError("--driver model needs --checkpoint (write one with python -m commsched.moe.record "
                         "--train-steps N --save-checkpoint FILE)")
    model, _ = load_checkpoint(cfg.checkpoint)
    return model


@dataclass(frozen=True)
class Setup:
    """What a rank builds before inference, identically on every rank.

    driver: the :class:`TraceDriver`, or the corpus of the model driver; model: the
    language model (model driver); strategy: this run's placement strategy (fresh: no
    expert resident); estimator: the path estimator of a strategy that estimates paths."""

    driver: Any
    model: Any
    bank: ExpertBank
    strategy: PlacementStrategy
    estimator: PopularityEstimator | None


def build(cfg: InferConfig, rank: int, world: int, device: torch.device | str = "cpu",
          device_host: Sequence[int] | None = None, cross_weight: float | None = None) -> Setup:
    """Everything a rank needs (see :class:`Setup`), built identically on every rank; the
    bank's slots and the model on ``device`` (the expert weights' master copies stay in
    host memory). ``device_host``: the host of each rank (None: one host);
    ``cross_weight``: the node-aware strategies' weight (None: ``cfg``'s, else 0)."""
    pc, tc, mc = cfg.placement, cfg.trace, cfg.model
    device = torch.device(device)
    cls = pc.strategy_class
    if cfg.driver == "trace":
        drv = TraceDriver(tc, cfg.batches, cfg.seed, world)
        E, L, k = drv.E, drv.L, drv.k
        profile = drv.profile
        S = pc.slots or default_slots(E, world)
        if cfg.compute == "emulated":
            em = cfg.emulation
            bank: ExpertBank = EmulatedBank(L, E, tc.d_model, S, em.us_per_row, em.load_ms, cfg.seed,
                                            device=device)
        else:
            g = torch.Generator().manual_seed(cfg.seed + 104729)
            D, H = tc.d_model, tc.expert_hidden
            weights = [(torch.randn(E, D, H, generator=g) * D ** -0.5, torch.zeros(E, H),
                        torch.randn(E, H, D, generator=g) * H ** -0.5, torch.zeros(E, D)) for _ in range(L)]
            bank = FFNBank(weights, S, device=device)
        model = None
    else:
        from .data import load_corpus
        from .record import record_trace

        model = _load_model(mc).eval()
        E, k = model.cfg.num_experts, model.cfg.k
        L = len(model.moe_layers())
        S = pc.slots or default_slots(E, world)
        bank = FFNBank(model_weights(model), S, device=device)  # host copies: the CPU model's weights
        corpus = load_corpus(mc.corpus)
        if mc.profile_trace:
            profile = load_trace(mc.profile_trace)
        elif cls.needs_profile:
            profile = record_trace(model, corpus, mc.profile_tokens, split="train", seed=cfg.seed + 1)
        else:
            profile = None
        if profile is not None and (profile.num_experts, profile.num_layers, profile.k) != (E, L, k):
            raise ValueError(f"the profile trace has E={profile.num_experts}, L={profile.num_layers}, "
                             f"k={profile.k}; the model E={E}, L={L}, k={k}")
        if device.type != "cpu":  # after the profile (recorded on the CPU, where the corpus is)
            model = model.to(device)
        drv = corpus
    w = cross_weight if cross_weight is not None else (pc.cross_weight or 0.0)
    pcfg = PolicyConfig(E, world, L, k, S, pc.threshold, pc.planner, pc.online_planner,
                        None if device_host is None else tuple(device_host), float(w))
    est = hist = None
    if profile is not None:
        hist = profile.loads().astype(np.float64) / max(1, profile.num_tokens)
        if cls.estimates_paths:
            est = PopularityEstimator.fit(profile, max_path=pc.path_length)
    return Setup(drv, model, bank, cls(pcfg, hist), est)


def run(cfg: InferConfig, out: Path | None = None, *, group=None, device: torch.device | None = None,
        return_outputs: bool = False) -> dict:
    """Run inference on the initialised process group; every rank returns the metrics
    (the dict ``metrics.json`` holds). ``device``: where this rank computes (default:
    :func:`job_device`; the CLI passes the device ``init_distributed`` chose).
    ``return_outputs`` adds this rank's final outputs per batch under ``"outputs"`` (on
    the device; tests compare them with the single-process model)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    check_same_config(dataclasses.asdict(cfg), group, what="inference configuration")
    dev = torch.device(device) if device is not None else job_device(cfg, group)
    t_wall = time.perf_counter()
    topo = Topology.from_env(group)  # the hosts of the ranks (one all_gather of host names)
    host_P = tuple(topo.hosts.index(h) for h in topo.hosts_P)
    s = build(cfg, rank, world, dev, host_P)
    bank = s.bank
    row_cost_s = row_cost(bank, rank, world, group)
    weight = _cross_weight(cfg, s, topo, row_cost_s)
    if s.strategy.uses_hosts and weight != s.strategy.cfg.cross_weight:  # the weight needs the row cost
        st = s.strategy
        s = dataclasses.replace(s, strategy=type(st)(dataclasses.replace(st.cfg, cross_weight=weight),
                                                     st.historical_LE))
    rt = Runtime(s.strategy, bank, s.estimator, path_length=cfg.placement.path_length,
                 pipelined=cfg.exchange == "pipelined", rank=rank, world=world, group=group, device=dev)
    clock = Clock(dev)  # batch latency: CUDA events on a GPU, the host clock on the CPU
    outputs = []
    bar = Progress(cfg.batches, f"moe-infer {cfg.placement.strategy}", "batch",
                   enabled=read_env().progress and rank == 0 and out is not None)
    # no garbage collection inside a timed batch: a collection pass on one rank stalls
    # every rank at the next exchange; collect between batches instead
    gc.collect()
    gc.freeze()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.inference_mode():
            for b in range(cfg.batches):
                gc.collect()
                if cfg.driver == "trace":
                    x, ex, gate = s.driver.inputs(b, rank, cfg.trace.d_model, dev)
                    T = x.shape[0]
                else:
                    tokens, _ = s.driver.batch(cfg.model.batch_size, s.model.cfg.seq_len, seed=cfg.seed,
                                               step=b, rank=rank, split="val")
                    tokens = tokens.to(dev) if dev.type != "cpu" else tokens
                    T = tokens.numel()
                rt.begin_batch(b, T)
                cdist.barrier("aligning ranks before a batch", group)
                t0 = clock.mark()
                if cfg.driver == "trace":
                    y = trace_forward(x, ex, gate, rt.moe)
                else:
                    y = model_forward(s.model, tokens, rt.moe)
                rt.end_batch(clock.seconds(t0, clock.mark()))
                if return_outputs:
                    outputs.append(y.clone())
                bar.update(1)
    finally:
        if gc_was_enabled:
            gc.enable()
        gc.unfreeze()
        rt.close()
        bar.close()
    mine = rt.records if rank == 0 else [{k: v for k, v in r.items() if k != "layers"} for r in rt.records]
    gathered = cdist.all_gather_object({"records": mine, "loaded": sum(bank.loaded_L)},
                                       "gathering the inference records", group)
    metrics = summarise(cfg, s.strategy, gathered, row_cost_s, wall_clock_s=time.perf_counter() - t_wall,
                        device=dev.type, host_P=host_P)
    if out is not None and rank == 0:
        metrics.write(Path(out) / "metrics.json")
    m = metrics.to_dict()
    if return_outputs:
        m["outputs"] = outputs
    return m


def _cross_weight(cfg: InferConfig, s: Setup, topo: Topology, row_cost_s: float) -> float:
    """The node-aware weight of a run: ``--cross-weight``, else
    :func:`~commsched.moe.placement_policy.cross_host_weight` of the topology (its inter-host
    class at ``--inter-rate`` when given), the row size on the wire (float32 rows of the
    model width) and the compute time per row (``row_cost_s``)."""
    pc = cfg.placement
    if pc.cross_weight is not None:
        return float(pc.cross_weight)
    if pc.inter_rate is not None and "inter" in topo.links:
        from ..costmodel import LinkCost
        from ..netem import parse_rate

        links = dict(topo.links)
        links["inter"] = LinkCost(gamma=links["inter"].gamma, theta=8.0 / parse_rate(pc.inter_rate))
        topo = Topology(topo.hosts_P, links, source=topo.source)
    width = cfg.trace.d_model if cfg.driver == "trace" else s.model.cfg.d_model
    return cross_host_weight(topo, 4.0 * width, row_cost_s)


# --------------------------------------------------------------------------- metrics
@dataclass(frozen=True)
class InferMetrics(Record):
    """``metrics.json`` of an inference run: the documented keys, and in ``extra`` the
    rest (see the module docstring and docs/moe_inference.md, "Metrics")."""

    placement: str
    latency_ms: dict[str, float]           # p50, p95, p99, mean of the batch latency, max over ranks
    imbalance: float                       # mean over batches and layers of max/mean device rows
    estimation_accuracy: float | None      # top-k overlap of the planned-from and actual load
    replans: list[float]                   # per layer: share of batches planned after gating
    extra: dict[str, Any] = field(default_factory=dict)


def _pct(xs: Sequence[float]) -> dict[str, float]:
    a = np.asarray(xs, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def _layer_view(lr: dict, k: int) -> dict:
    """Per-layer figures of one batch from what the runtime recorded."""
    counts, p = lr["counts"], lr["placement"]
    actual = counts.sum(axis=0).astype(np.float64)
    rows = device_rows(counts, p)
    pf = lr["planned_from"]
    ok = pf is not None and actual.sum() > 0
    return {"rows": rows, "load": actual, "replicas": p.replica_counts, "replanned": lr["replanned"],
            "overlap": lr["overlap"], "loads": lr["loads"],
            "acc": topk_overlap(pf, actual, k) if ok else None,
            "acc2k": topk_overlap(pf, actual, 2 * k) if ok else None}


def summarise(cfg: InferConfig, strategy: PlacementStrategy, per_rank: list[dict], row_cost_s: float,
              *, wall_clock_s: float, device: str = "cpu", host_P: Sequence[int] | None = None) -> InferMetrics:
    """The run's metrics from every rank's records (rank 0's with per-layer detail).
    ``host_P``: the host of each rank, to count the bytes that crossed hosts (default: one)."""
    pcfg = strategy.cfg
    N, L, E = pcfg.num_devices, pcfg.num_layers, pcfg.num_experts
    recs0 = per_rank[0]["records"]
    timed = range(cfg.warmup, len(recs0))
    lat = [1e3 * max(per_rank[r]["records"][b]["latency_s"] for r in range(N)) for b in timed]
    layers = [[_layer_view(recs0[b]["layers"][j], pcfg.k) for j in range(L)] for b in timed]
    imb = np.array([[max(lr["rows"]) / (sum(lr["rows"]) / N) if sum(lr["rows"]) else 1.0 for lr in bl]
                    for bl in layers])  # [batches, L]
    crit_rows = [int(sum(max(lr["rows"]) for lr in bl)) for bl in layers]
    model_lat = [1e3 * r * row_cost_s for r in crit_rows]
    replans = [float(np.mean([bl[j]["replanned"] for bl in layers])) for j in range(L)]
    acc = [lr["acc"] for bl in layers for lr in bl if lr["acc"] is not None]
    acc2 = [lr["acc2k"] for bl in layers for lr in bl if lr["acc2k"] is not None]
    acc_layer = [(float(np.mean([bl[j]["acc"] for bl in layers])) if layers[0][j]["acc"] is not None else None)
                 for j in range(L)]
    overl = [lr["overlap"] for bl in layers for lr in bl if lr["overlap"] is not None]
    load = np.array([[lr["load"] for lr in bl] for bl in layers], dtype=np.float64)  # [B, L, E]
    share = (load / np.maximum(load.sum(axis=2, keepdims=True), 1e-300)).mean(axis=0)
    reps = np.array([[lr["replicas"] for lr in bl] for bl in layers], dtype=np.float64).mean(axis=0)
    dev_rows = np.array([[lr["rows"] for lr in bl] for bl in layers], dtype=np.float64)  # [B, L, N]
    dev_share = (dev_rows / np.maximum(dev_rows.sum(axis=2, keepdims=True), 1e-300)).mean(axis=0)
    parts = list(recs0[0]["parts_s"])
    breakdown = {p: median(float(np.mean([per_rank[r]["records"][b]["parts_s"][p] for r in range(N)]))
                           for b in timed) for p in parts}
    loads_per_batch = float(np.mean([sum(lr["loads"] for lr in bl) for bl in layers]))
    hosts = tuple(host_P) if host_P is not None else (0,) * N
    cross = np.array([[hosts[q] != hosts[r] for q in range(N)] for r in range(N)])

    def peer_bytes(b: int, inter: bool) -> int:  # both row exchanges, all ranks, as the exchanges counted
        return int(sum(x for r in range(N) for q, x in enumerate(per_rank[r]["records"][b].get("peer_bytes", []))
                       if cross[r, q] == inter))
    paths = strategy.estimates_paths
    return InferMetrics(
        placement=strategy.name,
        latency_ms=_pct(lat),
        imbalance=float(imb.mean()),
        estimation_accuracy=float(np.mean(acc)) if acc else None,
        replans=replans,
        extra={
            "driver": cfg.driver,
            "compute": cfg.compute,
            "device": device,
            "world_size": N,
            "num_experts": E,
            "num_layers": L,
            "k": pcfg.k,
            "slots_per_device": pcfg.slots,
            "threshold": pcfg.threshold if paths else None,
            "path_length": cfg.placement.path_length if paths else None,
            "batches": len(lat),
            "warmup": cfg.warmup,
            "latency_ms_per_batch": lat,
            "per_batch": {
                "model_latency_ms": model_lat,
                "replanned_layers": [int(sum(lr["replanned"] for lr in bl)) for bl in layers],
                "critical_loads": [int(sum(lr["loads"] for lr in bl)) for bl in layers],
                "parts_ms_max_over_ranks": {p: [1e3 * max(per_rank[r]["records"][b]["parts_s"][p]
                                                          for r in range(N)) for b in timed] for p in parts},
            },
            "model_latency_ms": _pct(model_lat),
            "row_cost_us": row_cost_s * 1e6,
            "critical_rows": _pct(crit_rows),
            "imbalance_p95": float(np.percentile(imb, 95)),
            "imbalance_per_layer": imb.mean(axis=0).tolist(),
            "estimation_accuracy_top2k": float(np.mean(acc2)) if acc2 else None,
            "estimation_accuracy_per_layer": acc_layer,
            "phase2_overlap": float(np.mean(overl)) if overl else None,
            "replan_rate": float(np.mean(replans)),
            "expert_loads_per_batch": loads_per_batch,
            "expert_loads_total": int(sum(p["loaded"] for p in per_rank)),
            "breakdown_s": breakdown,
            "bytes_sent_per_batch": float(np.mean([sum(per_rank[r]["records"][b]["bytes_sent"] for r in range(N))
                                                   for b in timed])),
            "host_of_rank": list(hosts),
            "hosts": len(set(hosts)),
            "cross_weight": strategy.cfg.cross_weight if strategy.uses_hosts else None,
            "inter_host_bytes_per_batch": float(np.mean([peer_bytes(b, True) for b in timed])),
            "intra_host_bytes_per_batch": float(np.mean([peer_bytes(b, False) for b in timed])),
            "expert_load_share": share.tolist(),
            "replicas": reps.tolist(),
            "device_rows_share": dev_share.tolist(),
            "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
            "wall_clock_s": wall_clock_s,
        },
    )


run_inference = run  # the name exported by commsched.moe

__all__ = ["InferConfig", "PlacementConfig", "EmulationConfig", "TraceDriverConfig", "ModelDriverConfig",
           "InferMetrics", "Setup", "TraceDriver", "build", "run", "run_inference", "summarise", "job_device"]


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    d, s = InferConfig(), SyntheticTraceConfig()
    dp, de, dt, dm = d.placement, d.emulation, d.trace, d.model
    p = argparse.ArgumentParser(prog="python -m commsched.moe.infer", description=__doc__.splitlines()[0])
    p.add_argument("--placement", choices=tuple(STRATEGIES), default=dp.strategy)
    p.add_argument("--driver", choices=DRIVERS, default=d.driver)
    p.add_argument("--compute", choices=COMPUTES, default=None,
                   help="expert compute: emulated device or real FFNs (default: emulated for the trace "
                        "driver, real for the model)")
    p.add_argument("--slots", type=int, default=None, help="experts of one layer per device (default ceil(E/N)+2)")
    p.add_argument("--threshold", type=float, default=dp.threshold, help="lina phase-2 re-plan threshold")
    p.add_argument("--path-length", type=int, default=dp.path_length, help="lina: experts of the path (l)")
    p.add_argument("--planner", choices=tuple(PLANNERS), default=dp.planner,
                   help="planner of the layouts fixed before inference (eplb)")
    p.add_argument("--online-planner", choices=tuple(PLANNERS), default=dp.online_planner,
                   help="planner during inference (lina phases 1 and 2, oracle)")
    p.add_argument("--cross-weight", type=float, default=None,
                   help="node-aware strategies (lina-node): weight of a row crossing hosts, in rows of "
                        "device compute (default: from the topology's link classes and the row cost)")
    p.add_argument("--inter-rate", default=None,
                   help="inter-host link rate the default --cross-weight assumes (tc syntax, e.g. 1gbit; "
                        "default: the topology's placeholder inter-host class)")
    p.add_argument("--exchange", choices=EXCHANGES, default=d.exchange,
                   help="pipelined: count exchange in one step, own rows computed while the row exchanges "
                        "run, loads after gating in the background; sequential: the first runtime (ring "
                        "all_gather, dispatch, compute, combine, loads on the critical path)")
    p.add_argument("--device", choices=DEVICE_CHOICES, default=d.device,
                   help="where the experts compute: auto (CUDA when every local rank has its own GPU, "
                        "else the CPU), cpu or cuda; --compute emulated always runs on the CPU")
    p.add_argument("--batches", type=int, default=d.batches)
    p.add_argument("--warmup", type=int, default=d.warmup, help="batches left out of the metrics")
    p.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("emulated device (--compute emulated)")
    g.add_argument("--us-per-row", type=float, default=de.us_per_row, help="expert compute per row, microseconds")
    g.add_argument("--load-ms", type=float, default=de.load_ms, help="time to load one expert into a slot")
    g = p.add_argument_group("trace driver")
    g.add_argument("--trace", default=None, help="routing trace npz (default: a synthetic trace)")
    g.add_argument("--profile-fraction", type=float, default=dt.profile_fraction,
                   help="leading share of the trace's sequences used for profiling (eplb, lina)")
    g.add_argument("--tokens-per-batch", type=int, default=dt.tokens_per_batch, help="tokens per batch, all ranks")
    g.add_argument("--d-model", type=int, default=dt.d_model, help="row width (floats per token)")
    g.add_argument("--expert-hidden", type=int, default=dt.expert_hidden, help="FFN width (--compute real)")
    g.add_argument("--experts", type=int, default=s.num_experts, help="synthetic trace: E")
    g.add_argument("--layers", type=int, default=s.num_layers, help="synthetic trace: L")
    g.add_argument("--k", type=int, default=s.k, help="synthetic trace: experts per token")
    g.add_argument("--trace-tokens", type=int, default=None,
                   help="synthetic trace: tokens (default: enough for --batches after profiling)")
    g.add_argument("--seq-len", type=int, default=s.seq_len, help="synthetic trace: tokens per sequence")
    g.add_argument("--popularity", choices=("zipf", "lognormal"), default=s.popularity)
    g.add_argument("--zipf", type=float, default=s.zipf_s)
    g.add_argument("--sigma", type=float, default=s.lognormal_sigma)
    g.add_argument("--stickiness", type=float, default=s.stickiness)
    g.add_argument("--cluster-concentration", type=float, default=s.cluster_concentration)
    g = p.add_argument_group("model driver")
    g.add_argument("--checkpoint", default=None, help="model checkpoint (python -m commsched.moe.record)")
    g.add_argument("--corpus", default=None, help="text file (default: the Python standard library's sources)")
    g.add_argument("--batch-size", type=int, default=dm.batch_size, help="sequences per rank per batch")
    g.add_argument("--profile-trace", default=None, help="recorded trace for eplb/lina (default: record one)")
    g.add_argument("--profile-tokens", type=int, default=dm.profile_tokens)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in OUT (else a folder holding metrics.json is refused)")
    return p


def config_from_args(a: argparse.Namespace) -> InferConfig:
    n_tok = a.trace_tokens
    if n_tok is None:  # the held-out part must hold --batches batches of whole sequences
        n_tok = SyntheticTraceConfig().num_tokens
        if 0.0 < a.profile_fraction < 1.0:  # otherwise TraceDriverConfig says what is wrong
            need = (a.batches + 1) * (a.tokens_per_batch + a.seq_len) / (1.0 - a.profile_fraction)
            n_tok = max(n_tok, int(need * 1.05))
    syn = SyntheticTraceConfig(num_experts=a.experts, num_layers=a.layers, k=a.k, num_tokens=n_tok,
                               seq_len=a.seq_len, popularity=a.popularity, zipf_s=a.zipf,
                               lognormal_sigma=a.sigma, stickiness=a.stickiness,
                               cluster_concentration=a.cluster_concentration)
    compute = a.compute or ("emulated" if a.driver == "trace" else "real")
    return InferConfig(
        driver=a.driver, compute=compute, exchange=a.exchange, device=a.device, batches=a.batches,
        warmup=min(a.warmup, a.batches - 1), seed=a.seed,
        placement=PlacementConfig(strategy=a.placement, slots=a.slots, threshold=a.threshold,
                                  path_length=a.path_length, planner=a.planner,
                                  online_planner=a.online_planner, cross_weight=a.cross_weight,
                                  inter_rate=a.inter_rate),
        emulation=EmulationConfig(us_per_row=a.us_per_row, load_ms=a.load_ms),
        trace=TraceDriverConfig(path=a.trace, synthetic=syn, profile_fraction=a.profile_fraction,
                                tokens_per_batch=a.tokens_per_batch, d_model=a.d_model,
                                expert_hidden=a.expert_hidden),
        model=ModelDriverConfig(checkpoint=a.checkpoint, corpus=a.corpus, batch_size=a.batch_size,
                                profile_trace=a.profile_trace, profile_tokens=a.profile_tokens))


PROG = "commsched.moe.infer"


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        return cdist.cli_error(PROG, e)
    torch.set_num_threads(1)
    try:
        info = init_distributed(device=cfg.device_choice)
    except ValueError as e:  # --device cuda without (enough) GPUs
        return cdist.cli_error(PROG, e)
    try:
        prepare_out(a.out, overwrite=a.overwrite)  # made (or refused) before any work
    except ValueError as e:
        dist.destroy_process_group()
        return cdist.cli_error(PROG, e)
    if cfg.device == "auto" and cfg.compute == "emulated" and info.rank == 0 and torch.cuda.is_available():
        print("commsched.moe.infer: --compute emulated runs on the CPU (the emulated accelerator); "
              "--compute real computes on the GPU", file=sys.stderr, flush=True)
    try:
        m = run(cfg, a.out, device=info.device)
        if dist.get_rank() == 0:
            print(json.dumps({k: m[k] for k in ("placement", "world_size", "latency_ms", "model_latency_ms",
                                                 "imbalance", "estimation_accuracy", "replan_rate")}), flush=True)
    except (ValueError, cdist.CommError) as e:
        return cdist.cli_error(PROG, e, a.out)
    except BaseException as e:  # not one of ours: the traceback stays, the folder says it failed
        mark_failed(a.out, f"{PROG} (rank {info.rank}): {type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
