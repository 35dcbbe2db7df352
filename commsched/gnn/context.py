"""The contexts an exchange is given: what it is built for, and what one pass needs to know.

:class:`ExchangeContext` is what every mode's exchange is built from, once
(``MODES[mode](...).build(ctx)``): the rank's book, the process group, the pattern, the
run's seed, the model's edge normalisation, the device and the wire dtype.

The trainer builds one :class:`PassContext` for every training epoch and every
evaluation pass and hands it to the model, which hands it to each layer and to the halo
exchange (``exchange.start(h, layer, ctx)``, ``transfer(..., ctx)``, ``begin_epoch(ctx)``).
Nothing per-pass is stored on the exchange or the local graph, so an exchange or a graph
can serve any number of passes without being rewired.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..comm.all2all import CommStats
from .timing import Breakdown

if TYPE_CHECKING:
    from .graph.book import PartitionBook


@dataclass(frozen=True)
class ExchangeContext:
    """What a halo exchange is built for (the same for every mode).

    book: this rank's :class:`~commsched.gnn.graph.book.PartitionBook`; group: the process group
    (None: the default one); pattern: ``direct`` or ``ring``; seed: the run's (AdaQP's
    widths and rounding, BNS's samples); norm: the model's edge normalisation, by which the
    quantized modes weigh their messages (None: not known; those modes refuse it); device:
    where the exchange's indices live (None: the CPU); wire_dtype: the dtype full-precision
    rows cross the wire in (None: the rows' own; only the full-precision modes take one).
    """

    book: PartitionBook
    group: Any = None
    pattern: str = "direct"
    seed: int = 0
    norm: str | None = None
    device: torch.device | str | None = None
    wire_dtype: torch.dtype | None = None


@dataclass(frozen=True, eq=False)
class PassContext:
    """One pass of the model.

    epoch: the training epoch this pass belongs to (dropout masks, the period of AdaQP's
    widths; an evaluation pass carries the last epoch trained). training: a training pass
    (dropout on, quantized AdaQP exchanges, a backward pass follows) or an evaluation pass
    (no dropout, full-precision exchanges). timer: where the pass's seconds go, by
    :data:`~commsched.gnn.timing.BREAKDOWN_KEYS` (the timer accumulates; the context only
    names it). stats: the halo exchanges' byte counters, or None for traffic that is not
    counted (evaluation). events: an :class:`~commsched.comm.observe.A2AObserver` told of every
    backward halo exchange (launch to arrival), so a gradient scheduler holds the
    allreduce behind them (``TrainConfig.schedule``); None: nobody is told.

    The default, ``PassContext()``, is a training pass of epoch 0 with a scratch timer and
    no byte counting: what a layer or an exchange used on its own (in a test) gets.
    """

    epoch: int = 0
    training: bool = True
    timer: Breakdown = field(default_factory=Breakdown)
    stats: CommStats | None = None
    events: Any = None


__all__ = ["ExchangeContext", "PassContext"]
