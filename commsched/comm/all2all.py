"""Uneven all-to-all: the direct and ring patterns, autograd, async handles (plans:
:mod:`commsched.comm.plan`, re-exported here).

Legend: R rows (dim 0), P ranks in the group, S segments per peer, B bytes.

Rows of ``x_R*`` are grouped by destination in rank order: ``send_counts[p]`` rows go
to rank p. The result holds the rows received from rank 0, then rank 1, and so on.

* ``direct`` issues one ``all_to_all_single`` (never the list form, which gloo rejects
  for uneven sizes).
* ``ring`` runs P-1 rounds; in round i a rank sends to rank+i and receives from rank-i
  (AdaQP's order: each round pairs every rank with exactly one sender and one receiver).

Both give identical results. The exchange is differentiable: the backward pass is the
same exchange with send and receive counts swapped.

Transport (``transport=``, :data:`TRANSPORTS`): how the messages travel, one connection per
rank pair or two (:mod:`commsched.comm.transport`); ``"auto"`` picks the fast one.

``observer`` (an :class:`~commsched.comm.observe.A2AObserver`) is told when the exchange starts and
ends, forward and backward; ``backward_block`` (``"begin"`` / ``"end"``) makes the backward
exchange open / close an MoE layer's expert block (docs/design.md, "Observers of the exchange").

``wire`` (a :class:`Wire`) sends the rows in a shorter form: ``wire.forward`` (a
:class:`RowFormat`) encodes the rows before the exchange and decodes them after it,
``wire.backward`` does the same for the reverse exchange of the backward pass (None: that
direction travels as it is). The gradient passes the encoding straight through (the
backward pass of decode(encode(x)) is taken as the identity), so an unbiased format gives
an unbiased gradient. The exchange, its counters and its observer see the encoded rows:
the bytes reported are those on the wire, and a shorter exchange is measured as shorter.
:data:`BF16` (a cast to bfloat16 and back) is here; the 8-bit rows of the shared codec are
:class:`commsched.quant.rowwire.QuantRows` (the core does not import the codec).
``wire=None`` (and a wire whose two formats are None) is the plain exchange, bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from ..agree import DTYPE_CODES as _DTYPE_CODES
from ..clock import Clock
from ..dist import CommError, comm_guard
from .observe import A2AObserver, A2AReport, check_observer
from .plan import A2APlan, _agree, make_plan
from .transport import (
    TRANSPORTS,
    _RawHandle,
    check_ring_device,
    p2p_direct,
    resolve_transport,
    reverse_group,
    ring,
    ring_post_all,
)

PATTERNS = ("direct", "ring")

# --------------------------------------------------------------------------- wire formats
@runtime_checkable
class RowFormat(Protocol):
    """How rows travel: ``encode`` before the exchange, ``decode`` after it.

    ``encode(x_R*)`` returns ``w_RW``: one encoded row per row of ``x`` (R unchanged), of a
    dtype the exchange carries (uint8 records, bfloat16, ...); ``decode(w_RW, row_shape,
    dtype)`` returns ``[R, *row_shape]`` rows of ``dtype``. Neither may read a device value
    back on the host (no synchronisation in the exchange's hot path). ``name`` is what
    reports call it (``"bf16"``, ``"q8"``)."""

    name: str

    def encode(self, x: torch.Tensor) -> torch.Tensor: ...

    def decode(self, w: torch.Tensor, row_shape: torch.Size, dtype: torch.dtype) -> torch.Tensor: ...


@dataclass(frozen=True)
class CastRows:
    """Rows sent in ``dtype`` (a narrower float: bfloat16 halves float32's bytes) and cast
    back to the caller's dtype on arrival (round to nearest even, both ways exact for rows
    already in ``dtype``)."""

    dtype: torch.dtype = torch.bfloat16
    name: str = "bf16"

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def decode(self, w: torch.Tensor, row_shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return w.to(dtype)


BF16 = CastRows(torch.bfloat16, "bf16")


@dataclass(frozen=True)
class Wire:
    """The formats of one exchange: ``forward`` for its rows, ``backward`` for the rows
    (gradients) of its reverse exchange in the backward pass; None: sent as they are."""

    forward: RowFormat | None = None
    backward: RowFormat | None = None

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            f = getattr(self, name)
            if f is not None and not isinstance(f, RowFormat):
                raise TypeError(f"Wire.{name} must be a RowFormat (encode, decode, name) or None, "
                                f"got {type(f).__name__}")

    @property
    def plain(self) -> bool:
        """True when neither direction is encoded (the plain exchange)."""
        return self.forward is None and self.backward is None


def _check_wire(wire) -> "Wire | None":
    if wire is None:
        return None
    if not isinstance(wire, Wire):
        raise TypeError(f"wire must be a commsched.comm.all2all.Wire or None, got {type(wire).__name__}")
    return None if wire.plain else wire


def _fmt(wire: "Wire | None", direction: str) -> "RowFormat | None":
    """``wire``'s format of ``direction`` ("forward" or "backward"); None without a wire."""
    return None if wire is None else getattr(wire, direction)


def encode_rows(x: torch.Tensor, fmt: RowFormat | None) -> torch.Tensor:
    """``x`` encoded by ``fmt`` (unchanged for None), without autograd: the rows to exchange."""
    if fmt is None:
        return x
    with torch.no_grad():
        w = fmt.encode(x.detach())
    if w.shape[0] != x.shape[0]:
        raise ValueError(f"row format {fmt.name!r} encoded {x.shape[0]} rows into {w.shape[0]}; "
                         "a format must keep one encoded row per row")
    return w


def decode_rows(w: torch.Tensor, fmt: RowFormat | None, row_shape: torch.Size,
                dtype: torch.dtype) -> torch.Tensor:
    """Rows received in ``fmt`` decoded to ``[R, *row_shape]`` of ``dtype`` (``w`` for None)."""
    if fmt is None:
        return w
    with torch.no_grad():
        return fmt.decode(w, row_shape, dtype)


# --------------------------------------------------------------------------- counters
@dataclass
class CommStats:
    """Per-peer bytes and per-round times; cheap enough to stay on (a few adds per call).

    ``round_time_s[0]`` is the local copy / whole direct exchange, ``round_time_s[i]`` the
    accumulated time of ring round i.
    """

    world_size: int
    bytes_sent: list[int] = field(default_factory=list)
    bytes_recv: list[int] = field(default_factory=list)
    round_time_s: list[float] = field(default_factory=list)
    calls: int = 0
    time_s: float = 0.0
    # CUDA intervals not yet added: (round or None for the whole call, start event, end event)
    _pending: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        P = self.world_size
        self.bytes_sent = self.bytes_sent or [0] * P
        self.bytes_recv = self.bytes_recv or [0] * P
        self.round_time_s = self.round_time_s or [0.0] * P

    def reset(self) -> None:
        self.__init__(self.world_size)  # type: ignore[misc]

    def add_time(self, round_i: int | None, a, b) -> None:
        """Add the interval from mark ``a`` to mark ``b`` (:class:`commsched.clock.Clock`
        marks) to round ``round_i`` (None: the call's total). Host times are added now;
        CUDA events when :meth:`settle` is called, so recording never blocks the host."""
        if isinstance(a, float):
            self._add(round_i, b - a)
        else:
            self._pending.append((round_i, a, b))

    def _add(self, round_i: int | None, dt: float) -> None:
        if round_i is None:
            self.time_s += dt
        else:
            self.round_time_s[round_i] += dt

    def settle(self) -> "CommStats":
        """Add the CUDA intervals recorded so far (waits for their end events); a no-op on
        the CPU. :meth:`as_dict` settles first."""
        for round_i, a, b in self._pending:
            b.synchronize()
            self._add(round_i, a.elapsed_time(b) / 1e3)
        self._pending.clear()
        return self

    @property
    def total_bytes_sent(self) -> int:
        return sum(self.bytes_sent)

    def as_dict(self) -> dict:
        self.settle()
        return {"calls": self.calls, "time_s": self.time_s, "bytes_sent": list(self.bytes_sent),
                "bytes_recv": list(self.bytes_recv), "round_time_s": list(self.round_time_s)}


def _record_bytes(stats: CommStats | None, plan: A2APlan, row_bytes: int) -> None:
    if stats is None:
        return
    for p in range(plan.world_size):
        if p != plan.rank:
            stats.bytes_sent[p] += plan.send_counts[p] * row_bytes
            stats.bytes_recv[p] += plan.recv_counts[p] * row_bytes
    stats.calls += 1


# --------------------------------------------------------------------------- exchange
def _row_numel(x: torch.Tensor) -> int:
    return int(torch.Size(x.shape[1:]).numel())


def _check_x(x: torch.Tensor, plan: A2APlan) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"all_to_all expects a tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("all_to_all expects a tensor of at least one dimension (rows first)")
    if x.shape[0] != plan.total_send:
        raise ValueError(f"all_to_all: tensor has {x.shape[0]} rows but the send counts "
                         f"{plan.send_counts} sum to {plan.total_send}")


def _peer_bytes(x: torch.Tensor, plan: A2APlan) -> int:
    """Bytes this rank sends to its peers (its own rows stay here)."""
    return plan.peer_rows * _row_numel(x) * x.element_size()


def _exchange(x: torch.Tensor, plan: A2APlan, group, pattern: str,
              stats: CommStats | None, observer: A2AObserver | None = None,
              transport: str = "auto") -> torch.Tensor:
    """Blocking exchange (no autograd), reported to ``observer`` from start to completion."""
    _check_x(x, plan)
    report = A2AReport(observer, _peer_bytes(x, plan), x.device)
    return report.finish(lambda: _start(x, plan, group, pattern, stats,
                                        transport=transport)._finish())


def _backward(ctx, g: torch.Tensor) -> torch.Tensor:
    """The reverse exchange of an exchange's backward pass, reported like the forward one,
    with the expert block it opens or closes (``ctx.block``), in the wire's backward format."""
    obs, block = ctx.observer, ctx.block
    if obs is not None and block == "begin":
        obs.block_begin()
    fmt = _fmt(ctx.wire, "backward")
    g = g.contiguous()
    w = _exchange(encode_rows(g, fmt), ctx.plan.reversed(), ctx.group, ctx.pattern, ctx.stats, obs,
                  ctx.transport)
    out = decode_rows(w, fmt, g.shape[1:], g.dtype)
    if obs is not None and block == "end":
        obs.block_end()
    return out


def _posts_all_rounds(device: torch.device) -> bool:
    """Whether an async ring exchange on ``device`` posts every round at once from the
    caller's thread (a device backend, NCCL: the communicator keeps the rounds in order)
    rather than running them one by one on a background thread (gloo on the CPU)."""
    return device.type == "cuda"


def _start(x: torch.Tensor, plan: A2APlan, group, pattern: str, stats: CommStats | None,
           background: bool = False, transport: str = "auto") -> _RawHandle:
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    _check_x(x, plan)
    check_ring_device(pattern, x.device, group)
    duplex = resolve_transport(transport, group, x.device) == "duplex"
    x = x.contiguous()
    out = x.new_empty((plan.total_recv, *x.shape[1:]))
    row_bytes = _row_numel(x) * x.element_size()
    _record_bytes(stats, plan, row_bytes)
    t0 = Clock(x.device).mark()
    if plan.world_size == 1:
        out.copy_(x)
        return _RawHandle(out, plan, stats, t0)
    reverse = reverse_group(group) if duplex else None  # here: never on the ring's thread
    if pattern == "direct" and duplex:
        works = p2p_direct(x, out, plan, group, reverse)
        return _RawHandle(out, plan, stats, t0, works=works, what="all_to_all (direct, duplex)")
    if pattern == "direct":
        with comm_guard("all_to_all (direct)", group):
            work = dist.all_to_all_single(out, x, list(plan.recv_counts), list(plan.send_counts),
                                          group=group, async_op=True)
        return _RawHandle(out, plan, stats, t0, works=[work], what="all_to_all (direct)")
    if not background:
        ring(x, out, plan, group, stats, reverse)
        return _RawHandle(out, plan, stats, t0)
    if _posts_all_rounds(x.device) and reverse is None:
        # a device backend: every round posted now, from this thread, on a stream of its own
        # (which first waits for the one that made x); no thread issuing ops on the caller's
        # stream later, after more compute was queued there
        side = None
        if x.device.type == "cuda":
            side = torch.cuda.Stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            works = ring_post_all(x, out, plan, group)
        if side is not None:  # the allocator must not reuse them before the side stream is done
            x.record_stream(side)
            out.record_stream(side)
        return _RawHandle(out, plan, stats, t0, works=works, what="all_to_all (ring)", stream=side)
    err: list = []

    def run() -> None:
        try:
            ring(x, out, plan, group, stats, reverse)
        except BaseException as e:  # re-raised in the caller's thread by wait()
            err.append(e)

    th = threading.Thread(target=run, name="commsched-ring", daemon=True)
    th.start()
    return _RawHandle(out, plan, stats, t0, thread=th, err=err)


class _A2AFn(torch.autograd.Function):
    """x (for the gradient) and w, its rows as encoded by ``wire.forward`` (x itself when
    plain): exchanges w, decodes; backward: the reverse exchange in ``wire.backward``."""

    @staticmethod
    def forward(ctx, x, w, plan, group, pattern, stats, observer, block, transport, wire):  # noqa: D401
        ctx.plan, ctx.group, ctx.pattern, ctx.stats = plan, group, pattern, stats
        ctx.observer, ctx.block, ctx.transport, ctx.wire = observer, block, transport, wire
        out = _exchange(w, plan, group, pattern, stats, observer, transport)
        return decode_rows(out, _fmt(wire, "forward"), x.shape[1:], x.dtype)

    @staticmethod
    def backward(ctx, g):
        return _backward(ctx, g), None, None, None, None, None, None, None, None, None


class _WaitFn(torch.autograd.Function):
    """Joins an async exchange into the autograd graph: forward waits (and decodes the
    rows of ``wire.forward``), backward reverses."""

    @staticmethod
    def forward(ctx, x, handle, group, pattern, observer, block, transport, wire):
        ctx.plan, ctx.group, ctx.pattern, ctx.stats = handle.plan, group, pattern, handle.stats
        ctx.observer, ctx.block, ctx.transport, ctx.wire = observer, block, transport, wire
        return decode_rows(handle._finish(), _fmt(wire, "forward"), x.shape[1:], x.dtype)

    @staticmethod
    def backward(ctx, g):
        return _backward(ctx, g), None, None, None, None, None, None, None


def _prepare(x: torch.Tensor, send_counts, group, observer, block, wire):
    """The checks and the set-up both entry points share: (the checked wire, the rows to
    exchange, encoded by ``wire.forward``, and the plan, made from a list of counts once)."""
    check_observer(observer, block)
    wire = _check_wire(wire)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"all_to_all expects a tensor, got {type(x).__name__}")
    if isinstance(send_counts, A2APlan) and send_counts.agreed:
        _check_x(x, send_counts)
        w = encode_rows(x, _fmt(wire, "forward"))
        _check_bound(w, send_counts, group)
        return wire, w, send_counts
    w = encode_rows(x, _fmt(wire, "forward"))
    if isinstance(send_counts, A2APlan):  # built by the caller: checked against the peers' (A2APlan)
        plan = send_counts
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            # every rank takes part: a 0-d tensor is a row total that matches no plan (-1)
            _agree(plan.send_counts, group=group, rows=w.shape[0] if w.dim() else -1,
                   dtype=w.dtype if w.dtype in _DTYPE_CODES else None, row_numel=_row_numel(w),
                   recv_counts=plan.recv_counts, device=w.device, plan_rank=plan.rank)
        _check_x(w, plan)
        return wire, w, plan
    if w.dtype not in _DTYPE_CODES:
        raise TypeError(f"all_to_all: unsupported dtype {w.dtype}")
    if w.dim() < 1:
        raise ValueError("all_to_all expects a tensor of at least one dimension (rows first)")
    return wire, w, make_plan(send_counts, group=group, rows=w.shape[0], dtype=w.dtype,
                              row_numel=_row_numel(w), device=w.device)


def _check_bound(w: torch.Tensor, plan: A2APlan, group) -> None:
    """The rows of an agreed plan: not on the meta device; those it is bound to (a plan of
    :func:`make_plan` used for the first time, in either direction: checked against the
    peers' rows now, on every rank alike, then bound)."""
    if w.device.type == "meta":
        raise ValueError("all_to_all: rows on the meta device (no data): pass rows on a real device")
    if plan._rows is None:
        return  # vouched for by its maker (agreed=True)
    key = (w.dtype, _row_numel(w))
    bound = plan._rows[0]
    if bound is None:
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            _agree(plan.send_counts, group=group, rows=w.shape[0],
                   dtype=w.dtype if w.dtype in _DTYPE_CODES else None, row_numel=key[1],
                   recv_counts=plan.recv_counts, device=w.device, plan_rank=plan.rank)
        plan._rows[0] = key
    elif bound != key:
        raise ValueError(f"all_to_all: the plan was made for {bound[0]} rows of {bound[1]} elements, got "
                         f"{w.dtype} rows of {key[1]}: make a plan for these rows (make_plan)")


def all_to_all(x_RD: torch.Tensor, send_counts: Sequence[int] | A2APlan, *, group=None,
               pattern: str = "direct", stats: CommStats | None = None,
               observer: A2AObserver | None = None, backward_block: str | None = None,
               transport: str = "auto", wire: Wire | None = None) -> torch.Tensor:
    """Uneven all-to-all of the rows of ``x_RD`` (see the module docstring).

    ``send_counts`` is a list with one count per rank, or an :class:`A2APlan` to reuse
    (no count exchange for one from :func:`make_plan`; one you built is checked against the
    peers' at each call: :class:`A2APlan`). Returns a new tensor [sum(recv_counts), *x.shape[1:]].
    Differentiable. Disagreeing counts, dtypes or row shapes raise ValueError on every rank;
    a dead or stuck peer raises :class:`CommError` within the group's timeout.
    ``observer`` / ``backward_block``: who is told about this exchange and its backward
    (module docstring); the count exchange of a list ``send_counts`` is not reported.
    ``transport``: one of :data:`TRANSPORTS` (module docstring; ``"auto"`` is the fast one).
    ``wire``: the rows' formats on the wire, forward and backward (module docstring); the
    result has ``x_RD``'s dtype and shape either way. With a list ``send_counts`` the count
    exchange checks the encoded rows, so ranks whose wires differ get the same ValueError.
    """
    wire, w, plan = _prepare(x_RD, send_counts, group, observer, backward_block, wire)
    if x_RD.requires_grad and torch.is_grad_enabled():
        return _A2AFn.apply(x_RD, w, plan, group, pattern, stats, observer, backward_block, transport, wire)
    out = _exchange(w, plan, group, pattern, stats, observer, transport)
    return decode_rows(out, _fmt(wire, "forward"), x_RD.shape[1:], x_RD.dtype)


class A2AHandle:
    """An all-to-all in flight. ``wait()`` returns the received rows (differentiable) and,
    for an observed exchange, reports its end to the observer."""

    def __init__(self, x: torch.Tensor, raw: _RawHandle, group, pattern: str,
                 post: Callable[[torch.Tensor], object] | None = None, report: A2AReport | None = None,
                 backward_block: str | None = None, transport: str = "auto", wire: Wire | None = None):
        self._x, self._raw, self._group, self._pattern, self._post = x, raw, group, pattern, post
        self._report, self._block, self._transport, self._wire = report, backward_block, transport, wire
        self._result = None

    @property
    def plan(self) -> A2APlan:
        return self._raw.plan

    def is_completed(self) -> bool:
        return self._raw.is_completed()

    def wait(self):
        if self._result is None:
            obs = self._report.observer if self._report is not None else None

            def join() -> torch.Tensor:
                if self._x.requires_grad and torch.is_grad_enabled():
                    return _WaitFn.apply(self._x, self._raw, self._group, self._pattern, obs,
                                         self._block, self._transport, self._wire)
                return decode_rows(self._raw._finish(), _fmt(self._wire, "forward"), self._x.shape[1:],
                                   self._x.dtype)

            out = self._report.finish(join) if self._report is not None else join()
            self._result = self._post(out) if self._post is not None else out
        return self._result


def all_to_all_async(x_RD: torch.Tensor, send_counts: Sequence[int] | A2APlan, *, group=None,
                     pattern: str = "direct", stats: CommStats | None = None,
                     observer: A2AObserver | None = None, backward_block: str | None = None,
                     transport: str = "auto", wire: Wire | None = None) -> A2AHandle:
    """Start an all-to-all and return at once; compute while the bytes move, then ``wait()``.

    The direct pattern posts its messages asynchronously (the backend's all_to_all_single,
    or every peer's send and receive on the duplex transport); the ring pattern runs its
    rounds on a background thread on the CPU, and on CUDA (NCCL) posts every round at once
    from this thread, one ``batch_isend_irecv`` each, on a side stream that first waits for
    the current one (the communicator keeps the rounds in order). Do not issue other collectives on the same
    group from another thread while a ring exchange is in flight. ``observer`` is told the
    exchange began now and ended when ``wait()`` returns (the time blocked in ``wait()``
    with it); the backward pass's reverse exchange is reported like
    :func:`all_to_all`'s, with ``backward_block``. ``wire``: as :func:`all_to_all`'s (the
    rows are encoded now, decoded by ``wait()``).
    """
    wire, w, plan = _prepare(x_RD, send_counts, group, observer, backward_block, wire)
    _check_x(w, plan)
    report = A2AReport(observer, _peer_bytes(w, plan), w.device)
    try:
        raw = _start(w, plan, group, pattern, stats, background=True, transport=transport)
    except BaseException:
        report.finish(lambda: None)  # never left open: the observer would hold its work for it
        raise
    return A2AHandle(x_RD, raw, group, pattern, report=report, backward_block=backward_block,
                     transport=transport, wire=wire)


# --------------------------------------------------------------------------- segments
@dataclass(frozen=True)
class SegmentLayout:
    """Byte sizes of the segments exchanged with each peer: ``sizes[p][s]``.

    Both sides derive it from metadata they share (for example group counts and their
    bit widths), so no size exchange is needed while it does not change.
    """

    sizes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(tuple(int(b) for b in row) for row in self.sizes))
        if any(b < 0 for row in self.sizes for b in row):
            raise ValueError(f"segment sizes must be >= 0, got {self.sizes}")

    def peer_totals(self) -> tuple[int, ...]:
        return tuple(sum(row) for row in self.sizes)


def segment_plan(send: SegmentLayout, recv: SegmentLayout, rank: int) -> A2APlan:
    """A byte-level plan built from two layouts, without any communication."""
    return A2APlan(send.peer_totals(), recv.peer_totals(), rank)


def _split_segments(buf_B: torch.Tensor, layout: SegmentLayout) -> list[list[torch.Tensor]]:
    out, off = [], 0
    for row in layout.sizes:
        segs = []
        for b in row:
            segs.append(buf_B[off:off + b])
            off += b
        out.append(segs)
    return out


def pack_segments(send_segments: Sequence[Sequence[torch.Tensor]], *,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, SegmentLayout]:
    """Concatenate per-peer byte segments into one uint8 buffer, peers in rank order
    (on the segments' device; on ``device``, default the CPU, when there are none)."""
    flat, sizes = [], []
    for p, segs in enumerate(send_segments):
        row = []
        for s, t in enumerate(segs):
            if t.dtype != torch.uint8 or t.dim() != 1:
                raise TypeError(f"segment {s} for peer {p} must be a 1-D uint8 tensor, got "
                                f"{t.dtype} of shape {tuple(t.shape)}")
            flat.append(t)
            row.append(t.numel())
        sizes.append(tuple(row))
    buf = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=device)
    return buf, SegmentLayout(tuple(sizes))


def exchange_segments(send_segments: Sequence[Sequence[torch.Tensor]], recv_layout: SegmentLayout,
                      *, group=None, pattern: str = "direct", stats: CommStats | None = None,
                      async_op: bool = False, validate: bool = False,
                      device: torch.device | str | None = None, transport: str = "auto"):
    """Send several byte segments per peer as one message per peer.

    ``send_segments[p]`` is the list of 1-D uint8 tensors for rank p; ``recv_layout``
    the sizes this rank expects from each peer. Returns ``recv[p][s]`` (views into one
    buffer), or a handle whose ``wait()`` returns it when ``async_op``. With
    ``validate`` the byte counts are checked against the peers' (one small all_gather),
    which is worth doing the first time a layout is used. ``device`` is where the buffer
    lives when this rank sends no segment at all (pass the job's device on CUDA: NCCL
    needs a CUDA buffer on every rank). ``transport``: as :func:`all_to_all`'s.
    """
    buf, send_layout = pack_segments(send_segments, device=device)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if len(send_layout.sizes) != len(recv_layout.sizes):
        raise ValueError(f"{len(send_layout.sizes)} peers in send_segments but "
                         f"{len(recv_layout.sizes)} in recv_layout")
    if validate:
        plan = make_plan(send_layout.peer_totals(), group=group, rows=buf.numel(),
                         dtype=torch.uint8, row_numel=1, recv_counts=recv_layout.peer_totals())
    else:
        plan = segment_plan(send_layout, recv_layout, rank)
    raw = _start(buf, plan, group, pattern, stats, background=async_op, transport=transport)
    if not async_op:
        return _split_segments(raw._finish(), recv_layout)
    return A2AHandle(buf, raw, group, pattern, post=lambda out: _split_segments(out, recv_layout))


__all__ = [
    "A2APlan", "A2AHandle", "BF16", "CastRows", "CommError", "CommStats", "RowFormat", "SegmentLayout",
    "Wire", "all_to_all", "all_to_all_async", "decode_rows", "encode_rows", "exchange_segments",
    "make_plan", "pack_segments", "segment_plan", "PATTERNS", "TRANSPORTS",
]
