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
minibatch  MiniBatchConfig              no halo rows in training: sampled mini-batches
                                        from a replicated graph, gradients averaged
                                        (:mod:`commsched.gnn.train.minibatch`); evaluation
                                        full-graph, as vanilla
=========  ===========================  ==============================================

A mode is one :class:`ExchangeConfig` subclass and one entry in :data:`MODES` (a
:class:`commsched.configurable.Registry` of config classes). The config's fields are that
mode's options (the command line's flags are generated from them, docs/design.md); its
class attributes say what the mode is (``timing_only``, ``quantized``: it quantizes
float32 rows itself, so it takes no wire dtype); its ``check_run`` / ``check_layers`` hold
the checks that involve the rest of the run (``--pattern``, ``--dtype``, the layers), once;
``build(ctx)`` makes the exchange from the run's
:class:`~commsched.gnn.context.ExchangeContext` (book, group, pattern, seed, norm, device,
wire dtype: the same for every mode). Adding a mode::

    @dataclass(frozen=True, kw_only=True)
    class HalfConfig(ExchangeConfig):
        rate: float = option(0.5, "share of rows sent", flag="--half-rate")

        def build(self, ctx):
            return HalfExchange(ctx, rate=self.rate)

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
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from ...configurable import Config, Registry, check, config_of, option
from ...quant.reference import BITS
from ...quant.widths.joint import parse_techniques
from ..context import ExchangeContext
from ..graph.book import PartitionBook
from ..graph.sample import DEFAULT_BATCH_SIZE, default_fanouts, parse_fanouts
from .adaptive import AdaptiveExchange
from .adaqp import AdaQPExchange
from .adaqp_plan import LINK_COST_SOURCES
from .bns import DEFAULT_BOUNDARY_RATE, BNSExchange
from .halo import HaloExchange, VanillaExchange, ZeroExchange
from .onebit import OneBitExchange
from .stale import PipeGCNExchange, check_pattern


@dataclass(frozen=True, kw_only=True)
class ExchangeConfig(Config):
    """Base of a mode's config: its fields are the mode's options (whoever needs them reads
    them here or on the exchange built); ``build(ctx)`` makes its :class:`HaloExchange`
    from one rank's :class:`~commsched.gnn.context.ExchangeContext`.

    Class attributes: ``timing_only`` (the model trained is wrong on purpose), ``quantized``
    (it quantizes float32 rows itself: no wire dtype, no ``--dtype bfloat16``)."""

    compile: bool = option(True, "AdaQP and onebit modes: compile the quantization codec at "
                           "start-up (--no-compile: the uncompiled codec, the same bits, slower "
                           "per epoch; COMMSCHED_COMPILE=0 does the same for every codec call)")

    timing_only: ClassVar[bool] = False
    quantized: ClassVar[bool] = False
    # trains on sampled mini-batches of a graph every rank holds whole (the trainer of
    # commsched.gnn.train.minibatch); the exchange serves the full-graph evaluation
    sampled: ClassVar[bool] = False

    def check_run(self, mode: str, *, pattern: str = "direct", mixed: bool = False) -> None:
        """The checks that involve the rest of the run (a ValueError naming the flags)."""
        check(not (mixed and self.quantized),
              f"--dtype bfloat16 is an option of the full-precision modes ({', '.join(full_precision_modes())}); "
              f"--mode {mode} quantizes float32 rows: use --dtype float32")

    def check_layers(self, mode: str, layer_names: Sequence[str]) -> None:
        """The checks that involve the layers the exchange serves (class names)."""

    def build(self, ctx: ExchangeContext) -> HaloExchange:
        """The mode's exchange for the run's ``ctx``."""
        raise NotImplementedError(f"{type(self).__name__} builds no exchange")

    def _quantizing(self, ctx: ExchangeContext, *, norm: bool = True) -> ExchangeContext:
        """``ctx``, checked for a mode that quantizes float32 rows itself (no wire dtype;
        ``norm``: it weighs its messages by the model's edge normalisation)."""
        mode = mode_name(self)
        check(ctx.wire_dtype is None, f"--mode {mode} quantizes its rows: it takes no wire dtype "
              "(the bfloat16 wire is an option of vanilla and adaqp-p)")
        check(not norm or ctx.norm is not None, f"--mode {mode} weighs its messages by the model's "
              "edge normalisation: pass norm= (the layer's norm, e.g. \"gcn\" or \"mean\")")
        return ctx


@dataclass(frozen=True, kw_only=True)
class VanillaConfig(ExchangeConfig):
    """``vanilla``: full-precision rows, blocking (exact)."""

    asynchronous: ClassVar[bool] = False

    def build(self, ctx) -> HaloExchange:
        return VanillaExchange(ctx, asynchronous=self.asynchronous)


@dataclass(frozen=True, kw_only=True)
class AsyncVanillaConfig(VanillaConfig):
    """``adaqp-p``: full precision in the background, with overlap (equals vanilla)."""

    asynchronous: ClassVar[bool] = True


@dataclass(frozen=True, kw_only=True)
class ZeroConfig(ExchangeConfig):
    """``nocomm``: TIMING ONLY, nothing crosses the wire; remote rows are zeros."""

    timing_only: ClassVar[bool] = True

    def build(self, ctx) -> HaloExchange:
        return ZeroExchange(ctx)


@dataclass(frozen=True, kw_only=True)
class AdaQPConfig(ExchangeConfig):
    """``adaqp``: AdaQP's exchange (:class:`~commsched.gnn.exchange.adaqp.AdaQPExchange`);
    ``scheme`` and ``overlap`` (class attributes) tell its modes apart.

    bits: the width of ``uniform``; period: epochs between re-assignments (adaptive) or
    redraws (random); group_size, lam: the assignment problem's (messages per group, the
    variance/time trade-off); assign_time_limit_s: CP-SAT's limit per problem;
    probe_sizes, probe_repeats: the start-up link probe's message sizes (bytes) and repeats;
    link_costs (``--link-costs``, one of :data:`~commsched.gnn.exchange.adaqp_plan.LINK_COST_SOURCES`):
    where the assigner's per-peer costs come from (``topology``/``averaged`` probe with
    ``TOPOLOGY_PROBE_SIZES`` and ``probe_repeats``); equal_variance (``--equal-variance``,
    needs ``topology``): widths as fast as the per-pair costs allow at no more variance
    than the averaged-cost assignment (``adaqp_plan.solve_widths``).
    """

    bits: int = option(max(BITS), "the width of --mode uniform", foreign=(
        "--bits is the width of --mode uniform (AdaQP's exchange); --mode {mode} does not "
        "quantize to a chosen width and would ignore --bits {value}: drop it"))
    period: int = option(50, "AdaQP re-assignment period (epochs); the first period sends 8 bits, the "
                                 "widest, so at the default a 100-epoch run assigns widths for its second half only")
    group_size: int = option(100, "AdaQP message group size")
    lam: float = option(0.5, "AdaQP variance/time trade-off")
    assign_time_limit_s: float = option(2.0, cli=False)
    probe_sizes: tuple[int, ...] = option((1 << 12, 1 << 16, 1 << 19), cli=False)
    probe_repeats: int = option(2, cli=False)
    link_costs: str = option("ring", "AdaQP's link costs: ring (probe_link_costs), topology (every "
                             "pair timed alone, its own cost) or averaged (that probe, one mean "
                             "cost for every pair)", choices=LINK_COST_SOURCES)
    equal_variance: bool = option(False, "with --link-costs topology: the fastest widths at no "
                                  "more variance than the averaged-cost assignment")

    quantized: ClassVar[bool] = True
    scheme: ClassVar[str] = "adaptive"
    overlap: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check(self.link_costs in LINK_COST_SOURCES, f"--link-costs must be one of "
              f"{', '.join(LINK_COST_SOURCES)}, got {self.link_costs!r}")
        check(not self.equal_variance or self.link_costs == "topology",
              "--equal-variance caps the variance of topology-aware widths at that of the "
              f"averaged-cost ones: it needs --link-costs topology, got --link-costs {self.link_costs}")
        check(self.bits in BITS, f"--bits must be one of {', '.join(map(str, BITS))}, got {self.bits}")
        check(self.period >= 1 and self.group_size >= 1, "--period and --group-size must be >= 1")
        check(0.0 <= self.lam <= 1.0, f"--lam must lie in [0, 1], got {self.lam}")
        check(self.assign_time_limit_s > 0 and self.probe_repeats >= 1 and bool(self.probe_sizes),
              "assign_time_limit_s must be > 0, probe_repeats >= 1 and probe_sizes non-empty")
        object.__setattr__(self, "probe_sizes", tuple(int(s) for s in self.probe_sizes))

    def build(self, ctx) -> HaloExchange:
        return AdaQPExchange(self._quantizing(ctx), self)


WARMUPS = ("sign", "2", "4", "8", "fp32")  # adaptive's --warmup


@dataclass(frozen=True, kw_only=True)
class AdaptiveConfig(AdaQPConfig):
    """``adaptive``: every message group picks dropped, 1-bit signs with error feedback,
    2/4/8-bit stochastic or float32 from one assignment per period that minimises the
    predicted exchange time on the probed links under ``--error-budget``
    (:mod:`commsched.gnn.exchange.adaptive`); overlap. Its own defaults: ``--link-costs topology``."""

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

    def build(self, ctx) -> HaloExchange:
        return AdaptiveExchange(self._quantizing(ctx), self)


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

    def build(self, ctx) -> HaloExchange:
        return OneBitExchange(self._quantizing(ctx, norm=False), overlap=self.overlap,
                              compile=self.compile)


_STALE = "--stale-delay and --stale-smoothing are options of --mode pipegcn, not of --mode {mode}"


@dataclass(frozen=True, kw_only=True)
class PipeGCNConfig(ExchangeConfig):
    """``pipegcn``: stale full-precision rows (:class:`~commsched.gnn.exchange.stale.PipeGCNExchange`).
    ``delay`` (``--stale-delay``; 1: PipeGCN, one epoch stale; 0: every epoch's own rows,
    equal to vanilla) and ``smoothing`` (``--stale-smoothing``; gamma in [0, 1) of the
    moving average of stale rows and gradients; 0: off)."""

    delay: int = option(1, "--mode pipegcn: 1 uses the previous epoch's halo rows and gradients; "
                        "0 this epoch's (exact, equal to vanilla)", flag="--stale-delay", foreign=_STALE)
    smoothing: float = option(0.0, "--mode pipegcn: moving average of the stale rows and gradients, "
                              "s = GAMMA s + (1 - GAMMA) received, GAMMA in [0, 1) (0: off)",
                              flag="--stale-smoothing", foreign=_STALE)

    def __post_init__(self) -> None:
        check(not isinstance(self.delay, bool) and self.delay in (0, 1),
              f"--stale-delay must be 0 (exact) or 1 (one epoch stale), got {self.delay!r}")
        check(isinstance(self.smoothing, (int, float)) and math.isfinite(self.smoothing)
              and 0.0 <= self.smoothing < 1.0,
              f"--stale-smoothing must be a number in [0, 1) (0: off), got {self.smoothing!r}")
        check(not (self.delay == 0 and self.smoothing > 0), "--stale-smoothing needs stale rows "
              "to smooth: it is an option of --stale-delay 1, not of the exact --stale-delay 0")

    def check_run(self, mode, *, pattern="direct", mixed=False) -> None:
        super().check_run(mode, pattern=pattern, mixed=mixed)
        check_pattern(pattern, mode)

    def build(self, ctx) -> HaloExchange:
        return PipeGCNExchange(ctx, self)


@dataclass(frozen=True, kw_only=True)
class BNSConfig(ExchangeConfig):
    """``bns``: a random ``--boundary-rate`` share (``rate``, in (0, 1]) of the boundary rows
    per epoch (:class:`~commsched.gnn.exchange.bns.BNSExchange`), drawn from the run's seed."""

    rate: float = option(DEFAULT_BOUNDARY_RATE, "--mode bns: fraction in (0, 1] of each part's "
                         "boundary nodes kept per epoch (1 equals vanilla)", flag="--boundary-rate",
                         foreign="--boundary-rate is an option of --mode bns, not of --mode {mode}")

    def __post_init__(self) -> None:
        check(isinstance(self.rate, (int, float)) and not isinstance(self.rate, bool)
              and math.isfinite(self.rate) and 0.0 < self.rate <= 1.0,
              f"--boundary-rate must be a fraction in (0, 1] (1 keeps every boundary node), "
              f"got {self.rate!r}")

    def check_layers(self, mode, layer_names) -> None:
        attention = [n for n in layer_names if n in ("GATConv", "GATv2Conv")]
        check(not attention, f"mode={mode!r} drops boundary rows by sending zeros in their "
              f"place, which a weighted-sum aggregation ignores but "
              f"{attention[0] if attention else ''}'s attention does not: use bns with GCNConv, "
              "SAGEConv, GINConv or GraphConv")

    def build(self, ctx) -> HaloExchange:
        return BNSExchange(ctx, self)


_MB = "--fanouts and --batch-size are options of --mode minibatch, not of --mode {mode}"


@dataclass(frozen=True, kw_only=True)
class MiniBatchConfig(ExchangeConfig):
    """``minibatch``: data-parallel mini-batch training with neighbour sampling
    (:class:`commsched.gnn.train.minibatch.MiniBatchTrainer`): ``fanouts`` (``--fanouts``,
    neighbours per node and hop from the seeds outwards, -1 all; empty: by layer count,
    :data:`~commsched.gnn.graph.sample.DEFAULT_FANOUTS`), ``batch_size`` (``--batch-size``,
    seeds per rank and step). Its exchange (Vanilla's) serves the full-graph evaluation."""

    fanouts: str = option("", "--mode minibatch: neighbours sampled per node at each hop, from "
                          "the seeds outwards, comma-separated, -1 every neighbour (default by "
                          "--layers: 25,10 for 2, 15,10,5 for 3)", flag="--fanouts", foreign=_MB)
    batch_size: int = option(DEFAULT_BATCH_SIZE, "--mode minibatch: seed nodes per rank and step",
                             flag="--batch-size", foreign=_MB)

    sampled: ClassVar[bool] = True

    def __post_init__(self) -> None:
        parse_fanouts(self.fanouts)
        check(not isinstance(self.batch_size, bool) and isinstance(self.batch_size, int)
              and self.batch_size >= 1, f"--batch-size must be an integer >= 1, got {self.batch_size!r}")

    def fanouts_for(self, layers: int) -> tuple[int, ...]:
        """The fan-out of every hop of an ``layers``-layer model (a ValueError when
        ``--fanouts`` gives another number of hops)."""
        got = parse_fanouts(self.fanouts)
        if not got:
            return default_fanouts(layers)
        check(len(got) == layers, f"--fanouts gives {len(got)} hop(s) ({self.fanouts}) for "
              f"--layers {layers}: give one fan-out per layer")
        return got

    def build(self, ctx) -> HaloExchange:
        return VanillaExchange(ctx)


def _registry() -> Registry[type[ExchangeConfig]]:
    reg: Registry[type[ExchangeConfig]] = Registry("mode")
    for name, cls in (("vanilla", VanillaConfig), ("adaqp", AdaQPConfig), ("adaqp-q", AdaQPQConfig),
                      ("adaqp-p", AsyncVanillaConfig), ("uniform", UniformConfig),
                      ("random", RandomConfig), ("nocomm", ZeroConfig), ("onebit", OneBitConfig),
                      ("pipegcn", PipeGCNConfig), ("bns", BNSConfig),
                      ("adaptive", AdaptiveConfig), ("minibatch", MiniBatchConfig)):
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


def mode_config(mode: str, options: Any = None, *, strict: bool = True, given: bool = False,
                modes: Registry | None = None, **values: Any) -> ExchangeConfig:
    """The config of ``mode`` made from ``options`` (another mode's config: the fields the
    mode has carry over) and ``values``
    (field name -> value). A field the mode does not have is dropped, unless it declares
    its refusal (``option(..., foreign=...)``: ``--bits``, ``--stale-*``,
    ``--boundary-rate``) and ``strict`` and its value differs from the field's default
    (``given``: any value; the command line passes only the flags given): then it is that
    ValueError, naming the modes that take it. The one place the rule lives (the CLI and
    TrainConfig use it); AdaQP's tuning flags (``--period``, ``--lam``, ...), which scripts
    pass to every mode they compare, are ignored by the modes without them."""
    modes = modes or MODES
    modes[mode]  # an unknown mode names the known ones before anything else
    vals: dict[str, Any] = {}
    if options is not None:
        if not dataclasses.is_dataclass(options) or isinstance(options, type):
            raise TypeError(f"exchange options must be an ExchangeConfig (MODES[{mode!r}]), got "
                            f"{type(options).__name__}")
        vals.update({f.name: getattr(options, f.name) for f in dataclasses.fields(options)})
    vals.update(values)
    return config_of(modes, mode, vals, given=given, strict=strict)


def resolve_config(mode: str, config: Any = None, *, strict: bool = True,
                   modes: Registry | None = None) -> ExchangeConfig:
    """``config`` itself when it is the config of ``mode`` (or of a mode no registry of
    ``modes`` holds: a config is data, the registry only names it), else
    :func:`mode_config` of it."""
    modes = modes or MODES
    if isinstance(config, ExchangeConfig) and (mode not in modes or type(config) is modes[mode]):
        return config
    return mode_config(mode, config, strict=strict, modes=modes)


def make_exchange(mode: str, book: PartitionBook, *, config: Any = None,
                  modes: Registry | None = None, **context: Any) -> HaloExchange:
    """The exchange of ``mode`` for one rank's ``book``: the mode's config
    (:func:`resolve_config` of ``config``: the mode's own config, or another mode's whose
    fields the mode has carry over, the others ignored; default the mode's defaults)
    ``.build(ExchangeContext(book, **context))``; ``context``: the other fields of
    :class:`~commsched.gnn.context.ExchangeContext` (group, pattern, seed, norm, device,
    wire_dtype; default the CPU and no norm); ``modes``: the registry (default :data:`MODES`)."""
    return resolve_config(mode, config, strict=False, modes=modes).build(ExchangeContext(book, **context))


# the option groups a run's record also lists at its top level (metrics.json's config.adaqp, ...)
RECORDED = {"adaqp": AdaQPConfig, "pipegcn": PipeGCNConfig, "bns": BNSConfig}


def recorded_options(cfg: ExchangeConfig) -> dict[str, dict[str, Any]]:
    """{group: {field: value}} of :data:`RECORDED`: each group's own fields (and
    ``compile`` for a quantizing one), from ``cfg`` where it has them, the group's
    defaults otherwise."""
    base = {f.name for f in dataclasses.fields(ExchangeConfig)}
    have = {f.name for f in dataclasses.fields(cfg)}
    out = {}
    for name, cls in RECORDED.items():
        own = [f.name for f in dataclasses.fields(cls) if f.init and (cls.quantized or f.name not in base)]
        view = cls(**{k: getattr(cfg, k) for k in own if k in have})
        out[name] = {k: getattr(view, k) for k in own}
    return out


__all__ = ["MODES", "MODE_NAMES", "RECORDED", "AdaQPConfig", "AdaQPQConfig", "AdaptiveConfig", "AsyncVanillaConfig",
           "BNSConfig", "ExchangeConfig", "MiniBatchConfig", "OneBitConfig", "PipeGCNConfig", "RandomConfig",
           "UniformConfig", "VanillaConfig", "ZeroConfig", "full_precision_modes", "make_exchange",
           "mode_config", "mode_name", "mode_spec", "modes_copy", "option_owners", "recorded_options", "resolve_config"]
