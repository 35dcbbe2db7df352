"""The training modes (``--mode``) and the exchange each one builds.

=========  ===========================  ==============================================
mode       exchange                     what crosses the wire
=========  ===========================  ==============================================
vanilla    VanillaExchange              full-precision rows, blocking (exact)
adaqp      AdaQPExchange adaptive       widths solved on rank 0 every ``period``; overlap
adaqp-q    AdaQPExchange adaptive       the same widths, no overlap (exchange, then compute)
adaqp-p    VanillaExchange asynchronous full precision with overlap: equals vanilla exactly
uniform    AdaQPExchange uniform        every message at ``--bits``; overlap
random     AdaQPExchange random         widths drawn from BITS every period; overlap
onebit     OneBitExchange               signs + a per-row scale, error feedback; overlap
nocomm     ZeroExchange                 TIMING ONLY: nothing; remote rows are zeros
pipegcn    PipeGCNExchange (stale.py)   full precision in the background; training uses
                                        last epoch's halo rows and gradients (PipeGCN)
bns        BNSExchange (bns.py)         full-precision rows of a random ``--boundary-rate``
                                        share of the boundary nodes per epoch (BNS-GCN)
=========  ===========================  ==============================================

Allowed combinations: ``onebit`` takes float32 rows only (no ``--dtype bfloat16``);
``pipegcn`` and ``bns`` take ``--dtype float32|float64|bfloat16`` (bf16 rows on the wire,
as Vanilla) and both models; ``pipegcn`` needs ``--pattern direct``. Each is a mode of its
own, so none composes with AdaQP's widths nor with another (stale quantized rows, sampled
stale rows or stale 1-bit rows are not implemented).

This module is the only one that knows both the plain exchanges (:mod:`.halo`) and
AdaQP's (:mod:`.adaqp`); neither of those imports the other's mode names. PipeGCN's
(:mod:`.stale`) and BNS-GCN's (:mod:`.bns`) exchanges extend the Vanilla one. ``onebit``
(:mod:`.onebit`): Sylvie's 1-bit messages (Zhang et al. 2023) with error feedback, without
Sylvie's bounded staleness (docs/gnn.md, "onebit").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adaqp import AdaQPExchange
from .adaqp_plan import AdaQPOptions
from .bns import BNSExchange, BNSOptions
from .book import PartitionBook
from .halo import HaloExchange, VanillaExchange, ZeroExchange
from .onebit import OneBitExchange
from .stale import PipeGCNExchange, PipeGCNOptions

QUANTIZED_EXCHANGES = ("adaqp", "onebit")  # exchanges that quantize float32 rows (no wire dtype)


@dataclass(frozen=True)
class Mode:
    """One row of :data:`MODES`.

    exchange: "vanilla", "adaqp", "onebit", "zero", "pipegcn" or "bns" (the strategy class);
    asynchronous: the vanilla exchange in the background; scheme, overlap: the AdaQP width scheme and
    whether its exchange overlaps the central aggregation; timing_only: the model trained
    is wrong on purpose (never a training mode)."""

    exchange: str
    asynchronous: bool = False
    scheme: str | None = None
    overlap: bool = False
    timing_only: bool = False

    @property
    def quantized(self) -> bool:
        """Whether the mode quantizes float32 rows itself (it takes no ``--dtype bfloat16``)."""
        return self.exchange in QUANTIZED_EXCHANGES


MODES: dict[str, Mode] = {
    "vanilla": Mode("vanilla"),
    "adaqp": Mode("adaqp", scheme="adaptive", overlap=True),
    "adaqp-q": Mode("adaqp", scheme="adaptive", overlap=False),
    "adaqp-p": Mode("vanilla", asynchronous=True),
    "uniform": Mode("adaqp", scheme="uniform", overlap=True),
    "random": Mode("adaqp", scheme="random", overlap=True),
    "nocomm": Mode("zero", timing_only=True),
    "onebit": Mode("onebit", overlap=True),
    "pipegcn": Mode("pipegcn"),
    "bns": Mode("bns"),
}
MODE_NAMES: tuple[str, ...] = tuple(MODES)


def mode_spec(mode: str) -> Mode:
    """The row of ``mode``; a ValueError naming the known modes otherwise."""
    if mode not in MODES:
        raise ValueError(f"--mode {mode} is not known (available: {', '.join(MODE_NAMES)})")
    return MODES[mode]


def make_exchange(mode: str, book: PartitionBook, *, group=None, pattern: str = "direct",
                  options: AdaQPOptions | None = None, seed: int = 0,
                  norm: str | None = None, device: torch.device | str | None = None,
                  wire_dtype: torch.dtype | None = None, pipegcn: PipeGCNOptions | None = None,
                  bns: BNSOptions | None = None) -> HaloExchange:
    """The exchange strategy of ``mode`` for one rank's ``book``, on ``device`` (default:
    the CPU).

    options, seed: the run's AdaQP options and seed (``TrainConfig.adaqp``, ``.seed``);
    norm: the model's edge normalisation (the conv class's ``norm``), which the quantized
    modes need to weigh their messages. The other modes ignore all three (but bns: seed). wire_dtype: the
    dtype full-precision rows cross the wire in (``--dtype bfloat16``: ``torch.bfloat16``);
    only the Vanilla exchanges (vanilla, adaqp-p, pipegcn, bns) take one. pipegcn, bns: the
    options of those modes (``TrainConfig.pipegcn``, ``.bns``; default: their defaults); bns
    draws its boundary samples from ``seed``."""
    spec = mode_spec(mode)
    if wire_dtype is not None and spec.quantized:
        raise ValueError(f"--mode {mode} quantizes its rows: it takes no wire dtype (the "
                         "bfloat16 wire is an option of vanilla and adaqp-p)")
    if spec.exchange == "vanilla":
        return VanillaExchange(book, group=group, pattern=pattern, asynchronous=spec.asynchronous,
                               wire_dtype=wire_dtype, device=device)
    if spec.exchange == "zero":
        return ZeroExchange(book, group=group, pattern=pattern, device=device)
    if spec.exchange == "onebit":
        return OneBitExchange(book, overlap=spec.overlap, group=group, pattern=pattern, device=device,
                              compile=options.compile if options is not None else True)
    if spec.exchange == "pipegcn":
        return PipeGCNExchange(book, options=pipegcn, group=group, pattern=pattern,
                               wire_dtype=wire_dtype, device=device)
    if spec.exchange == "bns":
        return BNSExchange(book, options=bns, seed=seed, group=group, pattern=pattern,
                           wire_dtype=wire_dtype, device=device)
    if norm is None:
        raise ValueError(f"--mode {mode} weighs its messages by the model's edge normalisation: "
                         "pass norm= (the layer's norm, e.g. \"gcn\" or \"mean\")")
    return AdaQPExchange(book, scheme=spec.scheme, overlap=spec.overlap, norm=norm,
                         options=options, seed=seed, group=group, pattern=pattern, device=device)


__all__ = ["MODES", "MODE_NAMES", "QUANTIZED_EXCHANGES", "Mode", "make_exchange", "mode_spec"]
