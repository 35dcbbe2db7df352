"""The configuration of an inference run (:mod:`commsched.moe.infer`): frozen dataclasses,
one per concern (placement, the emulated device, each driver), nested in :class:`InferConfig`.
Each checks its own values; the flags of :mod:`commsched.moe.infer_cli` are generated from
their fields (help, defaults and choices: the strategies and planners from their registries).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..configurable import Config, option
from ..dist import DEVICE_CHOICES, group_device
from .placement_policy import PLANNERS, STRATEGIES, PlacementStrategy, strategy_class
from .popularity import DEFAULT_REPLAN_THRESHOLD
from .traces import SyntheticTraceConfig

# the expert computes each driver runs, its default (--compute not given) first
DRIVER_COMPUTES: dict[str, tuple[str, ...]] = {"trace": ("emulated", "real"), "model": ("real",)}
DRIVERS = tuple(DRIVER_COMPUTES)
COMPUTES = ("emulated", "real")
EXCHANGES = ("pipelined", "sequential")


@dataclass(frozen=True, kw_only=True)
class PlacementConfig(Config):
    """Where experts go: ``strategy`` (a name in
    :data:`~commsched.moe.placement_policy.STRATEGIES`), ``slots`` S (None: ceil(E/N) +
    2), the phase-2 ``threshold`` and ``path_length`` of strategies that estimate paths,
    the planners before (``planner``) and during (``online_planner``) inference, and for
    the node-aware strategies the weight of a row crossing hosts (``cross_weight``; None:
    :func:`~commsched.moe.placement_policy.cross_host_weight` of the run's topology, its
    row size and compute per row) and the inter-host rate that weight assumes
    (``inter_rate``, tc syntax; None: the topology's placeholder inter-host class)."""

    strategy: str = option("lina", "placement strategy", choices=STRATEGIES, flag="--placement")
    slots: int | None = option(None, "experts of one layer per device (default ceil(E/N)+2)")
    threshold: float = option(DEFAULT_REPLAN_THRESHOLD, "lina phase-2 re-plan threshold")
    path_length: int = option(3, "lina: experts of the path (l)")
    planner: str = option("full", "planner of the layouts fixed before inference (eplb)", choices=PLANNERS)
    online_planner: str = option("greedy", "planner during inference (lina phases 1 and 2, oracle)",
                                 choices=PLANNERS)
    cross_weight: float | None = option(None, "node-aware strategies (lina-node): weight of a row crossing "
                                              "hosts, in rows of device compute (default: from the topology's "
                                              "link classes and the row cost)")
    inter_rate: str | None = option(None, "inter-host link rate the default --cross-weight assumes (tc syntax, "
                                          "e.g. 1gbit; default: the topology's placeholder inter-host class)")

    def __post_init__(self) -> None:
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


@dataclass(frozen=True, kw_only=True)
class EmulationConfig(Config):
    """The emulated device (``--compute emulated``): busy ``us_per_row`` microseconds per
    computed row, ``load_ms`` per expert loaded."""

    us_per_row: float = option(20.0, "expert compute per row, microseconds")
    load_ms: float = option(0.5, "time to load one expert into a slot")

    def __post_init__(self) -> None:
        if self.us_per_row < 0 or self.load_ms < 0:
            raise ValueError("--us-per-row and --load-ms must be >= 0")


@dataclass(frozen=True, kw_only=True)
class TraceDriverConfig(Config):
    """The trace driver: the trace (``path``, or a synthetic one), its profiling share,
    tokens per batch (all ranks together), and the rows' and (``--compute real``) the
    FFNs' widths."""

    path: str | None = option(None, "routing trace npz (default: a synthetic trace)", flag="--trace")
    synthetic: SyntheticTraceConfig = option(default_factory=SyntheticTraceConfig, cli=False)
    profile_fraction: float = option(0.5, "leading share of the trace's sequences used for profiling (eplb, lina)")
    tokens_per_batch: int = option(2048, "tokens per batch, all ranks")
    d_model: int = option(64, "row width (floats per token)")
    expert_hidden: int = option(256, "FFN width (--compute real)")

    def __post_init__(self) -> None:
        if not 0.0 < self.profile_fraction < 1.0:
            raise ValueError(f"--profile-fraction must lie in (0, 1), got {self.profile_fraction}")
        if self.tokens_per_batch < 1:
            raise ValueError("--tokens-per-batch must be >= 1")


@dataclass(frozen=True, kw_only=True)
class ModelDriverConfig(Config):
    """The model driver: the checkpoint, the text, sequences per rank per batch, and the
    profile (a recorded trace, or ``profile_tokens`` tokens recorded at start-up)."""

    checkpoint: str | None = option(None, "model checkpoint (python -m commsched.moe.record)")
    corpus: str | None = option(None, "text file (default: the Python standard library's sources)")
    batch_size: int = option(8, "sequences per rank per batch")
    profile_trace: str | None = option(None, "recorded trace for eplb/lina (default: record one)")
    profile_tokens: int = option(16384, "tokens recorded for the profile (without --profile-trace)")

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.profile_tokens < 1:
            raise ValueError("--batch-size and --profile-tokens must be >= 1")


@dataclass(frozen=True, kw_only=True)
class InferConfig(Config):
    """One inference run: the driver, the expert compute, the exchange, the batches, the
    device (``--device``: auto, cpu or cuda; see :attr:`device_choice`), and the
    sub-configs of placement, emulated device and the two drivers."""

    driver: str = option("trace", "what drives the run: a routing trace or the trained model", choices=DRIVERS)
    compute: str = option("emulated", "expert compute: emulated device or real FFNs (default: emulated for the "
                                      "trace driver, real for the model)", choices=COMPUTES)
    exchange: str = option("pipelined", "pipelined: count exchange in one step, own rows computed while the row "
                                        "exchanges run, loads after gating in the background; sequential: the "
                                        "first runtime (ring all_gather, dispatch, compute, combine, loads on the "
                                        "critical path)", choices=EXCHANGES)
    device: str = option("auto", "where the experts compute: auto (CUDA when every local rank has its own GPU, "
                                 "else the CPU), cpu or cuda; --compute emulated always runs on the CPU",
                         choices=DEVICE_CHOICES)
    batches: int = option(30, "batches served")
    warmup: int = option(2, "batches left out of the metrics")
    seed: int = option(0, "seed of the run")
    placement: PlacementConfig = option(default_factory=PlacementConfig, cli=False)
    emulation: EmulationConfig = option(default_factory=EmulationConfig, cli=False)
    trace: TraceDriverConfig = option(default_factory=TraceDriverConfig, cli=False)
    model: ModelDriverConfig = option(default_factory=ModelDriverConfig, cli=False)

    def __post_init__(self) -> None:
        if self.device == "cuda" and self.compute == "emulated":
            raise ValueError("--compute emulated is the CPU model of an accelerator and runs on the CPU: use "
                             "--compute real with --device cuda (real expert FFNs on the GPU), or --device cpu")
        if self.compute not in DRIVER_COMPUTES[self.driver]:  # the model driver: its real experts only
            raise ValueError(f"--driver {self.driver} computes the model's real experts: use --compute "
                             f"{DRIVER_COMPUTES[self.driver][0]}")
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


__all__ = ["DRIVERS", "DRIVER_COMPUTES", "COMPUTES", "EXCHANGES", "PlacementConfig", "EmulationConfig",
           "TraceDriverConfig", "ModelDriverConfig", "InferConfig", "job_device"]
