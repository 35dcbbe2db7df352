"""The training modes (``--mode``): one registered config class per mode, which builds its exchange.

=========  ===========================  ==============================================
mode       config -> exchange           what crosses the wire
=========  ===========================  ==============================================
vanilla    VanillaConfig                full-precision rows, blocking (exact)
adaqp      AdaQPConfig -> AdaQPExch.    widths solved on rank 0 every ``period``; overlap
adaqp-q    AdaQPQConfig                 the same widths, no overlap (exchange, then compute)
adaptive   AdaptiveConfig -> Adaptive.  per group: dropped, 1-bit signs (error feedback),
                                        2/4/8-bit or float32, solved on rank 0 every
                                        ``period`` on the probed links; overlap
adaqp-p    AsyncVanillaConfig           full precision with overlap: equals vanilla exactly
uniform    UniformConfig                every message at ``--bits``; overlap
random     RandomConfig                 widths drawn from BITS every period; overlap
onebit     OneBitConfig                 signs + a per-row scale, error feedback; overlap
nocomm     ZeroConfig                   TIMING ONLY: nothing; remote rows are zeros
pipegcn    PipeGCNConfig (stale.py)     full precision in the background; training uses
                                        last epoch's halo rows and gradients (PipeGCN)
bns        BNSConfig (bns.py)           full-precision rows of a random ``--boundary-rate``
                                        share of the boundary nodes per epoch (BNS-GCN)
=========  ===========================  ==============================================

A mode is one :class:`ExchangeConfig` subclass and one entry in :data:`MODES` (a
:class:`commsched.configurable.Registry` of config classes). The config's fields are that
mode's options (the command line's flags are generated from them, docs/design.md); its
class attributes say what the mode is (``timing_only``, ``quantized``: it quantizes
float32 rows itself, so it takes no wire dtype); its ``check_run`` / ``check_layers`` hold
the checks that involve the rest of the run (``--pattern``, ``--dtype``, the layers), once;
``build(book, ...)`` makes the exchange. Adding a mode::

    @dataclass(frozen=True, kw_only=True)
    class HalfConfig(ExchangeConfig):
        rate: float = option(0.5, "share of rows sent", flag="--half-rate")

        def build(self, book, *, group=None, pattern="direct", device=None, **_):
            return HalfExchange(book, rate=self.rate, group=group, pattern=pattern, device=device)

    MODES.register("half", HalfConfig)

Allowed combinations: ``onebit`` and the AdaQP modes take float32 rows only (no ``--dtype
bfloat16``); ``pipegcn`` and ``bns`` take ``--dtype float32|float64|bfloat16`` (bf16 rows
on the wire, as Vanilla) and every layer but attention for ``bns``; ``pipegcn`` needs
``--pattern direct``. Each is a mode of its own, so none composes with AdaQP's widths nor
with another (stale quantized rows, sampled stale rows or stale 1-bit rows are not
implemented).

This module is the only one that knows both the plain exchanges (:mod:`.halo`) and
AdaQP's (:mod:`.adaqp`); neither of those imports the other's mode names. PipeGCN's
(:mod:`.stale`) and BNS-GCN's (:mod:`.bns`) exchanges extend the Vanilla one. ``onebit``
(:mod:`.onebit`): Sylvie's 1-bit messages (Zhang et al. 2023) with error feedback, without
Sylvie's bounded staleness (docs/gnn.md, "onebit").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from ..configurable import Config, Registry, check, option
from ..quant.assign_joint import parse_techniques
from .adaptive import AdaptiveExchange
from .adaqp import AdaQPExchange
from .adaqp_plan import LINK_COST_SOURCES, AdaQPOptions
from .bns import BNSExchange, BNSOptions
from .book import PartitionBook
from .halo import HaloExchange, VanillaExchange, ZeroExchange
from .onebit import OneBitExchange
from .stale import PipeGCNExchange, PipeGCNOptions, check_pattern

# the option sets a config may be given as (TrainConfig(exchange=AdaQPOptions(...)))
OPTION_SETS = (AdaQPOptions, PipeGCNOptions, BNSOptions)


@dataclass(frozen=True, kw_only=True)
class ExchangeConfig(Config):
    """Base of a mode's config: its fields are the mode's options; ``build`` makes its
    :class:`HaloExchange` for one rank's book.

    Class attributes: ``timing_only`` (the model trained is wrong on purpose), ``quantized``
    (it quantizes float32 rows itself: no wire dtype, no ``--dtype bfloat16``)."""

    compile: bool = option(True, "AdaQP and onebit modes: compile the quantization codec at "
                           "start-up (--no-compile: the uncompiled codec, the same bits, slower "
                           "per epoch; COMMSCHED_COMPILE=0 does the same for every codec call)")

    timing_only: ClassVar[bool] = False
    quantized: ClassVar[bool] = False

    def check_run(self, mode: str, *, pattern: str = "direct", mixed: bool = False) -> None:
        """The checks that involve the rest of the run (a ValueError naming the flags)."""
        check(not (mixed and self.quantized),
              f"--dtype bfloat16 is an option of the full-precision modes ({', '.join(full_precision_modes())}); "
              f"--mode {mode} quantizes float32 rows: use --dtype float32")

    def check_layers(self, mode: str, layer_names: Sequence[str]) -> None:
        """The checks that involve the layers the exchange serves (class names)."""

    def build(self, book: PartitionBook, *, group=None, pattern: str = "direct", seed: int = 0,
              norm: str | None = None, device: torch.device | str | None = None,
              wire_dtype: torch.dtype | None = None) -> HaloExchange:
        raise NotImplementedError(f"{type(self).__name__} builds no exchange")


def _no_wire(mode: str, cfg: ExchangeConfig, wire_dtype) -> None:
    check(wire_dtype is None, f"--mode {mode} quantizes its rows: it takes no wire dtype (the "
          "bfloat16 wire is an option of vanilla and adaqp-p)")


@dataclass(frozen=True, kw_only=True)
class VanillaConfig(ExchangeConfig):
    """``vanilla``: full-precision rows, blocking (exact)."""

    asynchronous: ClassVar[bool] = False

    def build(self, book, *, group=None, pattern="direct", seed=0, norm=None, device=None,
              wire_dtype=None) -> HaloExchange:
        return VanillaExchange(book, group=group, pattern=pattern, asynchronous=self.asynchronous,
                               wire_dtype=wire_dtype, device=device)


@dataclass(frozen=True, kw_only=True)
class AsyncVanillaConfig(VanillaConfig):
    """``adaqp-p``: full precision in the background, overlapped (equals vanilla)."""

    asynchronous: ClassVar[bool] = True


@dataclass(frozen=True, kw_only=True)
class ZeroConfig(ExchangeConfig):
    """``nocomm``: TIMING ONLY, nothing crosses the wire; remote rows are zeros."""

    timing_only: ClassVar[bool] = True

    def build(self, book, *, group=None, pattern="direct", seed=0, norm=None, device=None,
              wire_dtype=None) -> HaloExchange:
        return ZeroExchange(book, group=group, pattern=pattern, device=device)


@dataclass(frozen=True, kw_only=True)
class AdaQPConfig(ExchangeConfig, AdaQPOptions):
    """``adaqp``: AdaQP's exchange (the fields: :class:`AdaQPOptions`); ``scheme`` and
    ``overlap`` (class attributes) tell its modes apart."""

    quantized: ClassVar[bool] = True
    scheme: ClassVar[str] = "adaptive"
    overlap: ClassVar[bool] = True

    @property
    def options(self) -> AdaQPOptions:
        """The plain :class:`AdaQPOptions` of these fields."""
        return AdaQPOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(AdaQPOptions)})

    def build(self, book, *, group=None, pattern="direct", seed=0, norm=None, device=None,
              wire_dtype=None) -> HaloExchange:
        _no_wire(mode_name(self), self, wire_dtype)
        check(norm is not None, f"--mode {mode_name(self)} weighs its messages by the model's edge "
              "normalisation: pass norm= (the layer's norm, e.g. \"gcn\" or \"mean\")")
        return AdaQPExchange(book, scheme=self.scheme, overlap=self.overlap, norm=norm,
                             options=self.options, seed=seed, group=group, pattern=pattern,
                             device=device)


WARMUPS = ("sign", "2", "4", "8", "fp32")  # adaptive's --warmup


@dataclass(frozen=True, kw_only=True)
class AdaptiveConfig(AdaQPConfig):
    """``adaptive``: every message group picks dropped, 1-bit signs with error feedback,
    2/4/8-bit stochastic or float32 from one assignment per period that minimises the
    predicted exchange time on the probed links under ``--error-budget``
    (:mod:`commsched.gnn.adaptive`); overlap. Its own defaults: ``--link-costs topology``."""

    link_costs: str = option("topology", "AdaQP's link costs: ring (probe_link_costs), topology "
                             "(every pair timed alone, its own cost) or averaged (that probe, one "
                             "mean cost for every pair)", choices=LINK_COST_SOURCES)
    assign_time_limit_s: float = option(0.25, cli=False)
    error_budget: float = option(2.0, "adaptive: each exchange's modelled error (dropped rows, "
                                 "1-bit residuals, quantization variance) at most this share of "
                                 "its rows' weighted energy")
    techniques: str = option("drop,sign,2,4,8,fp32", "adaptive: the techniques a message group "
                             "may take, comma-separated from drop, sign, 2, 4, 8, fp32 (fp32 is "
                             "always offered)")
    warmup: str = option("2", "adaptive: the technique of every row before the first assignment "
                         "(sign, 2, 4, 8 or fp32; where --techniques does not offer it, the "
                         "narrowest offered width)", choices=WARMUPS)
    joint_solver: str = option("cp-sat", cli=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            parse_techniques(self.techniques)
        except ValueError as e:
            check(False, f"--techniques: {e}")
        check(self.error_budget >= 0, f"--error-budget must be >= 0 (a share of each exchange's "
              f"energy), got {self.error_budget}")
        check(self.joint_solver in ("cp-sat", "greedy"),
              f"joint_solver must be 'cp-sat' or 'greedy', got {self.joint_solver!r}")

    def build(self, book, *, group=None, pattern="direct", seed=0, norm=None, device=None,
              wire_dtype=None) -> HaloExchange:
        _no_wire(mode_name(self), self, wire_dtype)
        check(norm is not None, f"--mode {mode_name(self)} weighs its messages by the model's edge "
              "normalisation: pass norm= (the layer's norm, e.g. \"gcn\" or \"mean\")")
        return AdaptiveExchange(book, norm=norm, options=self.options,
                                error_budget=self.error_budget, solver=self.joint_solver,
                                techniques=self.techniques, warmup=self.warmup,
                                seed=seed, group=group, pattern=pattern, device=device)


@dataclass(frozen=True, kw_only=True)
class AdaQPQConfig(AdaQPConfig):
    """``adaqp-q``: AdaQP's widths, no overlap (exchange, then compute)."""

    overlap: ClassVar[bool] = False


@dataclass(frozen=True, kw_only=True)
class UniformConfig(AdaQPConfig):
    """``uniform``: every message at ``--bits``; overlap."""

    scheme: ClassVar[str] = "uniform"


@dataclass(frozen=True, kw_only=True)
class RandomConfig(AdaQPConfig):
    """``random``: widths drawn from BITS every period; overlap."""

    scheme: ClassVar[str] = "random"


@dataclass(frozen=True, kw_only=True)
class OneBitConfig(ExchangeConfig):
    """``onebit``: signs and a per-row scale with error feedback; overlap."""

    quantized: ClassVar[bool] = True
    overlap: ClassVar[bool] = True

    def build(self, book, *, group=None, pattern="direct", seed=0, norm=None, device=None,
              wire_dtype=None) -> HaloExchange:
        _no_wire("onebit", self, wire_dtype)
        return OneBitExchange(book, overlap=self.overlap, group=group, pattern=pattern,
                              device=device, compile=self.compile)


@dataclass(frozen=True, kw_only=True)
class PipeGCNConfig(ExchangeConfig, PipeGCNOptions):
    """``pipegcn``: stale full-precision rows (the fields: :class:`PipeGCNOptions`)."""

    def check_run(self, mode, *, pattern="direct", mixed=False) -> None:
        super().check_run(mode, pattern=pattern, mixed=mixed)
        check_pattern(pattern, mode)

    def build(self, book, *, group=None, pattern="direct", seed=0, norm=None, device=None,
              wire_dtype=None) -> HaloExchange:
        opts = PipeGCNOptions(delay=self.delay, smoothing=self.smoothing)
        return PipeGCNExchange(book, options=opts, group=group, pattern=pattern,
                               wire_dtype=wire_dtype, device=device)


@dataclass(frozen=True, kw_only=True)
class BNSConfig(ExchangeConfig, BNSOptions):
    """``bns``: a random ``--boundary-rate`` share of the boundary rows (the fields:
    :class:`BNSOptions`), drawn from the run's seed."""

    def check_layers(self, mode, layer_names) -> None:
        attention = [n for n in layer_names if n in ("GATConv", "GATv2Conv")]
        check(not attention, f"mode={mode!r} drops boundary rows by sending zeros in their "
              f"place, which a weighted-sum aggregation ignores but "
              f"{attention[0] if attention else ''}'s attention does not: use bns with GCNConv, "
              "SAGEConv, GINConv or GraphConv")

    def build(self, book, *, group=None, pattern="direct", seed=0, norm=None, device=None,
              wire_dtype=None) -> HaloExchange:
        return BNSExchange(book, options=BNSOptions(rate=self.rate), seed=seed, group=group,
                           pattern=pattern, wire_dtype=wire_dtype, device=device)


def _registry() -> Registry[type[ExchangeConfig]]:
    reg: Registry[type[ExchangeConfig]] = Registry("mode")
    for name, cls in (("vanilla", VanillaConfig), ("adaqp", AdaQPConfig), ("adaqp-q", AdaQPQConfig),
                      ("adaqp-p", AsyncVanillaConfig), ("uniform", UniformConfig),
                      ("random", RandomConfig), ("nocomm", ZeroConfig), ("onebit", OneBitConfig),
                      ("pipegcn", PipeGCNConfig), ("bns", BNSConfig),
                      ("adaptive", AdaptiveConfig)):
        reg.register(name, cls)
    return reg


# --mode name -> its config class (a copy, ``modes_copy()``, takes test-local modes)
MODES: Registry[type[ExchangeConfig]] = _registry()
MODE_NAMES: tuple[str, ...] = MODES.names


def modes_copy() -> Registry[type[ExchangeConfig]]:
    """A fresh registry holding the built-in modes (to register more without touching
    :data:`MODES`: a test's, an experiment's)."""
    return _registry()


def mode_name(cfg: ExchangeConfig, modes: Registry | None = None) -> str:
    """The ``--mode`` name of a config (its class's first registered name)."""
    for name, cls in (modes or MODES).items():
        if type(cfg) is cls:
            return name
    return type(cfg).__name__


def mode_spec(mode: str, modes: Registry | None = None) -> type[ExchangeConfig]:
    """The config class of ``mode``; a ValueError naming the known modes otherwise."""
    return (modes or MODES)[mode]


def full_precision_modes(modes: Registry | None = None) -> tuple[str, ...]:
    return tuple(n for n, c in (modes or MODES).items() if not c.quantized)


def option_owners(name: str, modes: Registry | None = None) -> tuple[str, ...]:
    """The modes whose config has a field ``name``."""
    return tuple(m for m, c in (modes or MODES).items()
                 if name in {f.name for f in dataclasses.fields(c)})


def _field_of(name: str, modes: Registry) -> dataclasses.Field | None:
    for c in modes.values():
        for f in dataclasses.fields(c):
            if f.name == name:
                return f
    return None


def mode_config(mode: str, options: Any = None, *, strict: bool = True, given: bool = False,
                modes: Registry | None = None, **values: Any) -> ExchangeConfig:
    """The config of ``mode`` made from ``options`` (another mode's config or an option set
    such as :class:`AdaQPOptions`: the fields the mode has carry over) and ``values``
    (field name -> value). A field the mode does not have is dropped, unless it declares
    its refusal (``option(..., foreign=...)``: ``--bits``, ``--stale-*``,
    ``--boundary-rate``) and ``strict`` and its value differs from the field's default
    (``given``: any value; the command line passes only the flags given): then it is that
    ValueError, naming the modes that take it. The one place the rule lives (the CLI and
    TrainConfig use it); AdaQP's tuning flags (``--period``, ``--lam``, ...), which scripts
    pass to every mode they compare, are ignored by the modes without them."""
    modes = modes or MODES
    cls = modes[mode]
    vals: dict[str, Any] = {}
    if options is not None:
        if not dataclasses.is_dataclass(options) or isinstance(options, type):
            raise TypeError(f"exchange options must be an ExchangeConfig (MODES[{mode!r}]) or one of "
                            f"{', '.join(c.__name__ for c in OPTION_SETS)}, got {type(options).__name__}")
        vals.update({f.name: getattr(options, f.name) for f in dataclasses.fields(options)})
    vals.update(values)
    own = {f.name for f in dataclasses.fields(cls) if f.init}
    foreign = {}
    for name, value in vals.items():
        if name in own:
            continue
        f = _field_of(name, modes)
        if f is None:
            raise TypeError(f"--mode {mode}: no mode has an option {name!r}")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.metadata.get("foreign") and (given or value != default):
            foreign[name] = (f, value)
    if strict and foreign:
        name, (f, value) = next(iter(foreign.items()))
        flag = f.metadata.get("flag") or "--" + name.replace("_", "-")
        msg = f.metadata["foreign"]
        raise ValueError(msg.format(flag=flag, owners=", ".join(option_owners(name, modes)),
                                    mode=mode, value=value))
    return cls(**{k: v for k, v in vals.items() if k in own})


def resolve_config(mode: str, config: Any = None, *, strict: bool = True,
                   modes: Registry | None = None) -> ExchangeConfig:
    """``config`` itself when it is the config of ``mode`` (or of a mode no registry of
    ``modes`` holds: a config is data, the registry only names it), else
    :func:`mode_config` of it."""
    modes = modes or MODES
    if isinstance(config, ExchangeConfig) and (mode not in modes or type(config) is modes[mode]):
        return config
    return mode_config(mode, config, strict=strict, modes=modes)


def make_exchange(mode: str, book: PartitionBook, *, config: Any = None, group=None,
                  pattern: str = "direct", seed: int = 0, norm: str | None = None,
                  device: torch.device | str | None = None, wire_dtype: torch.dtype | None = None,
                  modes: Registry | None = None) -> HaloExchange:
    """The exchange of ``mode`` for one rank's ``book``, on ``device`` (default: the CPU):
    the mode's config (:func:`resolve_config` of ``config``: the mode's own config, or an
    option set such as :class:`AdaQPOptions` whose fields the mode has carry over, the
    others ignored; default the mode's defaults) ``.build(book, ...)``; ``modes``: the
    registry (default :data:`MODES`).

    seed: the run's (AdaQP's widths and rounding, BNS's samples); norm: the model's edge
    normalisation, which the quantized modes need to weigh their messages; wire_dtype: the
    dtype full-precision rows cross the wire in (only the full-precision exchanges take one)."""
    cfg = resolve_config(mode, config, strict=False, modes=modes)
    return cfg.build(book, group=group, pattern=pattern, seed=seed, norm=norm, device=device,
                     wire_dtype=wire_dtype)


__all__ = ["MODES", "MODE_NAMES", "OPTION_SETS", "AdaQPConfig", "AdaQPQConfig", "AdaptiveConfig", "AsyncVanillaConfig",
           "BNSConfig", "ExchangeConfig", "OneBitConfig", "PipeGCNConfig", "RandomConfig",
           "UniformConfig", "VanillaConfig", "ZeroConfig", "full_precision_modes", "make_exchange",
           "mode_config", "mode_name", "mode_spec", "modes_copy", "option_owners", "resolve_config"]
