"""Halo exchange: owned boundary rows forward, their gradients backward, as autograd.

Legend: n owned nodes of this rank, R remote (halo) nodes, T rows sent per exchange,
F feature width of the layer input.

A layer calls ``handle = exchange.start(h_nF, layer)``, may compute whatever needs no
remote rows (the central aggregation), then ``h_RF = handle.wait()``. The result is
differentiable: in backward the gradient of the remote rows goes back to their owners,
which add it into the rows they sent (``index_add`` at ``send_idx``).

The backward exchange overlaps too. ``start`` puts a *send* node into the graph (before
the central aggregation) and ``wait`` a *receive* node (after it), joined by an empty
token tensor. Autograd runs a ready node with a later creation first, so in backward
the receive node launches the gradient exchange, the central aggregation's backward
runs while it is in flight, and the send node then waits for it and scatters the
received rows into the owned rows' gradient. The maths is the same as a blocking
exchange; only the gradient contributions of ``h_nF`` may be summed in another order.

The exchange is a *strategy*: :class:`HaloExchange` is the transport-agnostic base
(gather, autograd, timing); a subclass implements :meth:`HaloExchange.transfer` (how a
block of rows crosses the wire for one layer and direction). :class:`VanillaExchange`
sends full-precision rows with one ``commsched.all_to_all``, blocking or in the
background (``asynchronous=True``); :class:`ZeroExchange` sends nothing (timing only).
Quantized exchanges are further subclasses in their own modules; this module knows none
of them. :mod:`commsched.gnn.exchange.modes` maps ``--mode`` to a strategy.

Per-pass state -- epoch, training or evaluation, the timer, the byte counters -- comes
with every call in a :class:`~commsched.gnn.context.PassContext`; an exchange holds only
what its book and its own schedule determine.

**State across epochs.** What an exchange carries from one epoch to the next (rounding
counters, error-feedback residuals, stale rows, width assignments) is its
:meth:`HaloExchange.state_dict`: plain values and CPU tensors, this rank's own. A training
checkpoint holds every rank's, and a resumed run hands each rank its own back
(:meth:`HaloExchange.load_state_dict`), so it continues exactly as an uninterrupted run.
Entries keyed by (layer, direction) are stored as lists (:func:`keyed_items`,
:func:`keyed_dict`).

**Context.** An exchange is built from one :class:`~commsched.gnn.context.ExchangeContext`
(book, group, pattern, seed, norm, device, wire dtype), the same for every mode.

**Device.** An exchange lives on one device (the context's, or :meth:`HaloExchange.to`):
its index tensors (``send_idx``) are moved there once, and the rows it is given are on
it. "comm" is timed with the pass timer's clock (CUDA events on CUDA, where a host clock
would only see the enqueue of an NCCL collective).
"""

from __future__ import annotations

from typing import Callable

import torch

from ...comm.all2all import A2APlan, all_to_all, all_to_all_async, make_plan
from ..context import ExchangeContext, PassContext
from ..graph.book import PartitionBook

DIRECTIONS = ("forward", "backward")


def keyed_items(d: dict, fn: Callable = lambda v: v) -> list[list]:
    """``{(layer, direction): v}`` as ``[[layer, direction, fn(v)], ...]`` (a checkpoint's
    plain values; CPU tensors for tensors: :func:`cpu`)."""
    return [[int(k[0]), str(k[1]), fn(v)] for k, v in d.items()]


def keyed_dict(items: list, fn: Callable = lambda v: v) -> dict:
    """The inverse of :func:`keyed_items` (a ValueError for a malformed list)."""
    try:
        return {(int(layer), str(direction)): fn(v) for layer, direction, v in items}
    except (TypeError, ValueError) as e:
        raise ValueError(f"the exchange state is damaged ({type(e).__name__}: {e})") from None


def cpu(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` that shares nothing with it (what a state dict holds)."""
    return t.detach().to("cpu", copy=True)


class Pending:
    """Rows in flight; ``wait()`` returns them (a plain tensor, no autograd)."""

    def __init__(self, fn: Callable[[], torch.Tensor]):
        self._fn = fn
        self._out: torch.Tensor | None = None

    @classmethod
    def ready(cls, t: torch.Tensor) -> "Pending":
        p = cls(lambda: t)
        p._out = t
        return p

    def wait(self) -> torch.Tensor:
        if self._out is None:
            self._out = self._fn()
        return self._out


class HaloExchange:
    """Base strategy. Subclasses override :meth:`transfer`; everything else is shared.

    Every call that moves rows takes the pass's :class:`PassContext`: its ``timer``
    receives the blocked time ("comm"), its ``stats`` (bytes per peer, see
    :class:`commsched.CommStats`; None for evaluation) the traffic.
    """

    name = "base"
    # an EmulatedCompute (--compute emulated, commsched.gnn.nn.emulated): the exchange's own
    # kernels (the backward scatter, the codec) are queued on its device clock instead of
    # run; the rows it sends are real. None: real compute
    compute = None

    def __init__(self, ctx: ExchangeContext | PartitionBook):
        """``ctx``: what the exchange is built for (a bare book: the defaults around it)."""
        self.ctx = ctx = ctx if isinstance(ctx, ExchangeContext) else ExchangeContext(ctx)
        self.book, self.group, self.pattern = ctx.book, ctx.group, ctx.pattern
        self.plan = A2APlan(self.book.send_counts, self.book.recv_counts, self.book.rank,
                            agreed=True)  # the books agree: validate() checks it once
        self.device = torch.device("cpu")
        self.send_idx = torch.from_numpy(self.book.send_idx)
        if ctx.device is not None:
            self.to(ctx.device)

    def to(self, device: torch.device | str) -> "HaloExchange":
        """Move the exchange's index tensors to ``device`` (once, at set-up); returns self.
        Subclasses with device state of their own extend it."""
        device = torch.device(device)
        if device != self.device:
            self.device = device
            self.send_idx = torch.from_numpy(self.book.send_idx).to(device)
        return self

    @property
    def world_size(self) -> int:
        return self.book.num_parts

    @property
    def overlaps(self) -> bool:
        """Whether ``start`` returns before the rows arrived (work between ``start`` and
        ``wait``, the central aggregation, then overlaps the wire)."""
        return False

    def validate(self, *, dtype: torch.dtype | None = None, row_numel: int | None = None) -> None:
        """Check once, collectively, that every rank's book agrees with its peers'
        (send counts of each pair match the receiver's expectation) and, when given, that
        every rank exchanges rows of the same ``dtype`` and ``row_numel`` elements (the
        first layer's width): a disagreement is the same ValueError on every rank, not a
        size mismatch inside the backend."""
        if self.world_size > 1:
            make_plan(self.book.send_counts, group=self.group, recv_counts=self.book.recv_counts,
                      dtype=dtype, row_numel=row_numel)

    # ---- the pluggable part ------------------------------------------------------------
    def prepare(self, dims: list[int]) -> None:
        """Set-up before the first epoch (untimed); ``dims`` is the input row width of each
        layer. A place to warm caches or compile kernels; nothing by default."""

    def set_layer_norm(self, layer: int, norm: str) -> None:
        """``layer`` normalises its edges by ``norm``, not the context's (an exchange that
        weighs its messages by it takes note; nothing by default)."""

    def begin_epoch(self, ctx: PassContext) -> None:
        """Called at the start of every training epoch (``ctx`` is its pass), inside its
        timed region: the place for periodic work such as bit-width re-assignment (time it
        under "assign" in ``ctx.timer``). Collective if the subclass makes it so."""

    def end_epoch(self, ctx: PassContext) -> None:
        """Called after every training epoch's optimizer step (inside the timed region)."""

    def report(self) -> dict:
        """Extra entries for metrics.json (rank 0's view); none by default."""
        return {}

    def run_report(self, *, wall_s: float, epoch_time_s_RE: list[list[float]],
                   first_epoch: int = 0) -> dict:
        """:meth:`report` at the end of a run of ``wall_s`` seconds whose epochs from
        ``first_epoch`` on took ``epoch_time_s_RE[r][e]`` on rank r (an exchange with
        periodic work adds what it cost); collective-free."""
        return self.report()

    def state_dict(self) -> dict:
        """What this rank's exchange carries from one epoch to the next, as plain values and
        CPU tensors (module doc, "State across epochs"); ``{}`` for a stateless exchange.
        Called between epochs."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (between epochs, before the first one run); a
        ValueError for a state this exchange does not keep (another mode's, or damaged)."""
        self._state_keys(state, ())

    def _state_keys(self, state: dict, keys: tuple[str, ...]) -> dict:
        """``state``, checked to hold exactly ``keys`` (else the ValueError of
        :meth:`load_state_dict`)."""
        if not isinstance(state, dict) or set(state) != set(keys):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"{self.name}: the exchange state holds {got}, this exchange keeps "
                             f"{sorted(keys)}: a checkpoint of another mode, or a damaged one")
        return state

    def transfer(self, rows: torch.Tensor, layer: int, direction: str, ctx: PassContext) -> Pending:
        """Move ``rows`` for ``layer`` in ``direction`` during the pass ``ctx``.

        forward: ``rows`` [T, F] are the sent rows grouped by destination peer
        (``plan.send_counts``); returns the remote rows [R, F] grouped by source peer.
        backward: ``rows`` [R, F] are gradients of the remote rows; returns [T, F], the
        gradients of the rows this rank sent. ``rows`` never requires grad.
        """
        raise NotImplementedError

    # ---- shared machinery --------------------------------------------------------------
    def start(self, h_nF: torch.Tensor, layer: int, ctx: PassContext | None = None) -> "HaloHandle":
        """Send the owned boundary rows of ``h_nF`` [n, F] for ``layer``; the handle's
        ``wait()`` gives the remote rows [R, F]. ``ctx``: the pass (default: a training pass
        with a scratch timer and no byte counting)."""
        ctx = ctx if ctx is not None else PassContext()
        if h_nF.shape[0] != self.book.num_owned:
            raise ValueError(f"halo exchange expects the {self.book.num_owned} owned rows, got "
                             f"{h_nF.shape[0]}")
        if self.compute is not None:  # emulated: the rows' values do not matter, their size does
            rows = self.compute.zeros((int(self.send_idx.numel()), *h_nF.shape[1:]), h_nF.dtype, h_nF.device)
        else:
            rows = h_nF.detach().index_select(0, self.send_idx)
        t = ctx.timer.mark()
        pend = self._transfer(rows, layer, "forward", ctx)
        ctx.timer.add_span("comm", t, ctx.timer.mark())
        link = _BackwardLink(self, layer, ctx)
        token = (_HaloSend.apply(h_nF, link) if h_nF.requires_grad and torch.is_grad_enabled()
                 else None)
        return HaloHandle(link, pend, token)

    def zeros(self, rows: torch.Tensor, direction: str) -> torch.Tensor:
        """What arrives when nothing does: zeros shaped like the result of a ``direction``
        transfer of ``rows`` ([R, F] forward, [T, F] backward)."""
        n = self.book.num_remote if direction == "forward" else int(self.send_idx.numel())
        return rows.new_zeros((n, *rows.shape[1:]))

    def _transfer(self, rows: torch.Tensor, layer: int, direction: str, ctx: PassContext) -> Pending:
        if self.world_size == 1:  # nothing to send, nobody to wait for
            return Pending.ready(self.zeros(rows, direction))
        return self.transfer(rows, layer, direction, ctx)

    def backward_rows(self, g_RF: torch.Tensor, layer: int, ctx: PassContext | None = None) -> torch.Tensor:
        """Send the remote rows' gradients to their owners; return [n, F] gradient of the
        owned rows (sum over the peers each row was sent to). Blocking."""
        link = _BackwardLink(self, layer, ctx if ctx is not None else PassContext())
        link.launch(g_RF)
        return link.finish(g_RF.dtype)


class _BackwardLink:
    """The exchanges of one layer call in one pass: the forward wait, and the backward
    exchange launched by the receive node and finished by the send node (see the module
    doc)."""

    def __init__(self, ex: HaloExchange, layer: int, ctx: PassContext):
        self.ex, self.layer, self.ctx = ex, layer, ctx
        self.pend: Pending | None = None
        self.row_shape: tuple[int, ...] = ()
        self.device = ex.device
        self.token: object = None  # the backward exchange, as ctx.events was told of it

    def launch(self, g_RF: torch.Tensor) -> None:
        timer = self.ctx.timer
        t = timer.mark()
        self.row_shape, self.device = tuple(g_RF.shape[1:]), g_RF.device
        events = self.ctx.events
        if events is not None and self.ex.world_size > 1:  # on the critical path: before the allreduce
            self.token = events.a2a_begin(g_RF.numel() * g_RF.element_size())
        self.pend = self.ex._transfer(g_RF.contiguous(), self.layer, "backward", self.ctx)
        timer.add_span("comm", t, timer.mark())

    def wait_forward(self, pend: Pending) -> torch.Tensor:
        """The forward rows of ``pend``, the blocked time counted as "comm"."""
        timer = self.ctx.timer
        t = timer.mark()
        out = pend.wait()
        timer.add_span("comm", t, timer.mark())
        return out

    def finish(self, dtype: torch.dtype) -> torch.Tensor | None:
        """[n, F] gradient of the owned rows: the received rows added at ``send_idx`` (None
        under emulated compute: the scatter is queued on the device, its values unused).
        The send node gets its gradient only through the receive node, so ``launch``
        always ran first; anything else is a bug in the graph, and raises."""
        n = self.ex.book.num_owned
        if self.pend is None:
            raise RuntimeError("halo backward: the receive node did not run before the send node")
        timer = self.ctx.timer
        t = timer.mark()
        rows = self.pend.wait()
        timer.add_span("comm", t, timer.mark())
        self.pend = None
        if self.token is not None:
            self.ctx.events.a2a_end(self.token)
            self.token = None
        emu = self.ex.compute
        if emu is not None:  # the scatter-add, on the emulated device; its values are not needed
            emu.copy(int(rows.shape[0]), int(rows[0].numel()) if rows.shape[0] else 0, times=3.0)
            return None
        out = torch.zeros((n, *self.row_shape), dtype=dtype, device=self.device)
        return out.index_add_(0, self.ex.send_idx, rows.to(dtype))


class HaloHandle:
    """A forward exchange in flight; ``wait()`` returns the remote rows [R, F]."""

    def __init__(self, link: _BackwardLink, pend: Pending, token: torch.Tensor | None):
        self._link, self._pend, self._token = link, pend, token
        self._out: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._out is None:
            if self._token is not None and torch.is_grad_enabled():
                self._out = _HaloRecv.apply(self._token, self._link, self._pend)
            else:
                self._out = self._link.wait_forward(self._pend)
        return self._out


class _HaloSend(torch.autograd.Function):
    """Forward: an empty token tied to ``h_nF``. Backward: wait for the gradient exchange
    the receive node launched and return the owned rows' share of it."""

    @staticmethod
    def forward(ctx, h_nF, link):  # noqa: D401
        ctx.link, ctx.dtype = link, h_nF.dtype
        return h_nF.new_empty((0,))

    @staticmethod
    def backward(ctx, g_token):
        return ctx.link.finish(ctx.dtype), None


class _HaloRecv(torch.autograd.Function):
    """Forward: the remote rows (waits for the forward exchange). Backward: launch the
    gradient exchange of the remote rows and return at once."""

    @staticmethod
    def forward(ctx, token, link, pend):  # noqa: D401
        ctx.link = link
        return link.wait_forward(pend)

    @staticmethod
    def backward(ctx, g_RF):
        ctx.link.launch(g_RF)
        return g_RF.new_empty((0,)), None, None


class VanillaExchange(HaloExchange):
    """Full-precision rows, one uneven all_to_all per layer and direction: blocking, or
    launched in the background (``asynchronous``: the central aggregation, forward and
    backward, overlaps the wire). Both orders compute the same sums, so they train
    bit-identically.

    The context's ``wire_dtype`` (``torch.bfloat16`` for ``--dtype bfloat16``): rows cross
    the wire in that dtype, both directions, and are cast back to the rows' dtype on arrival
    (a bf16 Vanilla sends half the bytes of an fp32 one); None (default): the rows as they are."""

    name = "vanilla"

    def __init__(self, ctx: ExchangeContext | PartitionBook, *, asynchronous: bool = False):
        super().__init__(ctx)
        self.asynchronous = asynchronous
        self.wire_dtype = self.ctx.wire_dtype

    @property
    def overlaps(self) -> bool:
        return self.asynchronous

    def transfer(self, rows: torch.Tensor, layer: int, direction: str, ctx: PassContext) -> Pending:
        return self._wire(rows, self.plan if direction == "forward" else self.plan.reversed(), ctx)

    def _wire(self, rows: torch.Tensor, plan: A2APlan, ctx: PassContext) -> Pending:
        """``rows`` across the wire with ``plan`` (in ``wire_dtype`` when one is set, cast back
        on arrival): the one send of every Vanilla-based exchange."""
        wire = self.wire_dtype
        if wire is not None and wire != rows.dtype:
            back, inner = rows.dtype, self._send(rows.to(wire), plan, ctx)
            return Pending(lambda: inner.wait().to(back))
        return self._send(rows, plan, ctx)

    def _send(self, rows: torch.Tensor, plan: A2APlan, ctx: PassContext) -> Pending:
        if self.asynchronous:
            h = all_to_all_async(rows, plan, group=self.group, pattern=self.pattern, stats=ctx.stats)
            return Pending(h.wait)
        return Pending.ready(all_to_all(rows, plan, group=self.group, pattern=self.pattern,
                                        stats=ctx.stats))


class ZeroExchange(HaloExchange):
    """TIMING ONLY (``--mode nocomm``): remote rows and their gradients are zeros and
    nothing is sent, so the model trained is wrong; it measures the epoch without any
    communication, the limit a faster exchange approaches."""

    name = "nocomm"

    def transfer(self, rows: torch.Tensor, layer: int, direction: str, ctx: PassContext) -> Pending:
        return Pending.ready(self.zeros(rows, direction))


__all__ = ["DIRECTIONS", "HaloExchange", "HaloHandle", "Pending", "VanillaExchange", "ZeroExchange", "cpu",
           "keyed_dict", "keyed_items"]
