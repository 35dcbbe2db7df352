"""The configuration of an inference run (:mod:`commsched.moe.infer`): frozen dataclasses,
one per concern (the placement strategy's options, the emulated device, each driver),
nested in :class:`InferConfig`. Each checks its own values; the flags of
:mod:`commsched.moe.infer.cli` are generated from their fields (help, defaults and choices:
the strategies and planners from their registries).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...cluster.device import DeviceModel, load_device_model
from ...configurable import Config, option
from ...dist import DEVICE_CHOICES, group_device
from ..record.traces import SyntheticTraceConfig
from .policy import STRATEGIES, StrategyConfig

# the expert computes each driver runs, its default (--compute not given) first
DRIVER_COMPUTES: dict[str, tuple[str, ...]] = {"trace": ("emulated", "real"), "model": ("real",)}
DRIVERS = tuple(DRIVER_COMPUTES)
COMPUTES = ("emulated", "real")
EXCHANGES = ("pipelined", "sequential")


DEFAULT_LOAD_MS = 0.5  # an expert load without a device model (--load-ms not given)


@dataclass(frozen=True, kw_only=True)
class EmulationConfig(Config):
    """The emulated device (``--compute emulated``): busy ``us_per_row`` microseconds per
    computed row, ``load_ms`` per expert loaded (None: :data:`DEFAULT_LOAD_MS`); or, with
    ``device_model`` (a built-in GPU model or a model file,
    :func:`~commsched.cluster.device.load_device_model`), each expert's rows cost its FFN's
    GEMMs on that GPU's roofline (the trace driver's ``d_model`` and ``expert_hidden``) and
    a load costs the expert's bytes over the model's host-to-device link
    (:meth:`~commsched.cluster.device.DeviceModel.h2d_time`) unless ``load_ms`` is given,
    every device time (loads included) times the time dilation ``dilation``."""

    us_per_row: float = option(20.0, "expert compute per row, microseconds (without --device-model)")
    load_ms: float | None = option(
        None, "time to load one expert into a slot, ms (default: with --device-model the expert's bytes over "
              f"the model's host link, else {DEFAULT_LOAD_MS})")
    device_model: str | None = option(
        None, "GPU model of the emulated device: a built-in name (a100, h100, h200) or a model file "
              "(JSON); each expert's rows then cost its FFN's GEMMs (--d-model x --expert-hidden) on it")
    dilation: float = option(1.0, "time dilation k (with --device-model): every device time, loads included, "
                                  "times k")

    def __post_init__(self) -> None:
        if self.us_per_row < 0 or (self.load_ms is not None and self.load_ms < 0):
            raise ValueError("--us-per-row and --load-ms must be >= 0")
        if not (self.dilation > 0 and math.isfinite(self.dilation)):
            raise ValueError(f"--dilation must be a finite number > 0, got {self.dilation}")
        if self.device_model is None and self.dilation != 1.0:
            raise ValueError("--dilation scales a GPU model's times: give --device-model too")
        if self.device_model is not None:
            gpu = self.gpu()  # an unknown name or a malformed file is refused here
            if self.load_ms is None and gpu.host_link_bw is None:
                raise ValueError(f"device model {gpu.name!r} gives no host_link_bw, from which an expert's load "
                                 "time is derived: add it to the model file or give --load-ms")

    def gpu(self) -> DeviceModel | None:
        """The GPU model of ``device_model`` (None without one)."""
        return None if self.device_model is None else load_device_model(self.device_model)


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
    expert_hidden: int = option(256, "FFN width (--compute real, or emulated with --device-model)")

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
    """One inference run: the placement strategy (``placement``, a name in
    :data:`~commsched.moe.infer.policy.STRATEGIES`; ``strategy``, its options: the
    strategy's ``Config``, default its defaults), the slots S per device (None: ceil(E/N) +
    2), the experts of a layer a device keeps resident (``resident``, None: S), the driver,
    the expert compute, the exchange, the batches, the device (``--device``:
    auto, cpu or cuda; see :attr:`device_choice`), and the sub-configs of the emulated device
    and the two drivers."""

    placement: str = option("lina", "placement strategy", choices=STRATEGIES)
    slots: int | None = option(None, "experts of one layer per device (default ceil(E/N)+2)")
    resident: int | None = option(None, "experts of one layer a device keeps in its memory, at least --slots "
                                        "(default --slots): the least recently held are evicted beyond it")

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
    strategy: StrategyConfig | None = option(None, cli=False)
    emulation: EmulationConfig = option(default_factory=EmulationConfig, cli=False)
    trace: TraceDriverConfig = option(default_factory=TraceDriverConfig, cli=False)
    model: ModelDriverConfig = option(default_factory=ModelDriverConfig, cli=False)

    def __post_init__(self) -> None:
        if self.placement not in STRATEGIES:
            raise ValueError(f"--placement must be one of {tuple(STRATEGIES)}, got {self.placement!r}")
        st = STRATEGIES[self.placement]() if self.strategy is None else self.strategy
        if type(st) is not STRATEGIES[self.placement]:
            raise TypeError(f"strategy must be the options of --placement {self.placement} "
                            f"({STRATEGIES[self.placement].__qualname__}), got {type(st).__qualname__}")
        object.__setattr__(self, "strategy", st)
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
        if self.compute not in DRIVER_COMPUTES[self.driver]:  # the model driver: its real experts only
            raise ValueError(f"--driver {self.driver} computes the model's real experts: use --compute "
                             f"{DRIVER_COMPUTES[self.driver][0]}")
        for f in ("slots", "resident"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"--{f} must be an int >= 1, got {v!r}")
        if self.slots is not None and self.resident is not None and self.resident < self.slots:
            raise ValueError(f"--resident ({self.resident}) must be at least --slots ({self.slots})")
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


__all__ = ["DEFAULT_LOAD_MS", "DRIVERS", "DRIVER_COMPUTES", "COMPUTES", "EXCHANGES", "EmulationConfig",
           "TraceDriverConfig", "ModelDriverConfig", "InferConfig", "job_device"]
