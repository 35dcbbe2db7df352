"""Observers of the expert all-to-all: who is told when an exchange starts and ends.

An MoE layer reports each of its exchanges (``a2a_begin`` / ``a2a_end``), the expert block
of its backward pass (``block_begin`` / ``block_end``) and the time its compute thread
spent blocked on an exchange (``a2a_blocked``) to the :class:`A2AObserver` it was built
with. Implementations: the gradient scheduler of :mod:`commsched.priority.runtime.executor` and
:class:`A2ATimer`. ``commsched.all_to_all(..., observer=)`` and ``all_to_all_async`` report
to one in both directions (the forward exchange and the reverse one of the backward pass),
through :class:`A2AReport`, so any expert-parallel layer built on them is observed.

A model lives longer than the schedulers that watch it (a run times its steps under one
schedule, then probes the all-to-all alone under another), so it is built with an
:class:`A2AEvents`, which passes every report on to the observers registered with it at
that moment::

    events = A2AEvents()
    model = MoETransformerLM(cfg, expert_group=eg, observer=events)
    with GradScheduler(params, sched_cfg) as sched, events.register(sched):
        ...
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

from ..clock import Clock
from ..clock import interval_s as _seconds

T = TypeVar("T")

# ``backward_block`` of an observed exchange: its backward pass opens ("begin") or closes
# ("end") the expert block of an MoE layer (see :class:`A2AReport`)
BLOCK_MARKS = ("begin", "end")


class A2AObserver(Protocol):
    """Told about the expert exchanges of a layer."""

    def a2a_begin(self, nbytes: int) -> object:
        """An exchange sending ``nbytes`` to peers starts; returns a token for :meth:`a2a_end`."""
        ...

    def a2a_end(self, token: object) -> None: ...

    def block_begin(self) -> None: ...

    def block_end(self) -> None: ...

    def a2a_blocked(self, seconds: float) -> None:
        """The compute thread just spent ``seconds`` blocked waiting for an exchange."""
        ...

    # optional: ``a2a_blocked_interval(a, b)``, the same report as two
    # :class:`commsched.clock.Clock` marks (host seconds on the CPU, recorded CUDA events on
    # CUDA) that the observer resolves when it reports, so that no exchange synchronises the
    # device; an observer without it gets ``a2a_blocked(seconds)`` (which waits for ``b``)


class A2AEvents:
    """An :class:`A2AObserver` that passes every report on to the observers registered now.

    :meth:`register` returns a handle whose ``remove()`` (or leaving its ``with`` block)
    unregisters the observer, like a torch hook. An exchange that began is ended on the
    observers that saw it begin.
    """

    def __init__(self) -> None:
        self._observers: OrderedDict[int, A2AObserver] = OrderedDict()

    def register(self, observer: A2AObserver) -> RemovableHandle:
        handle = RemovableHandle(self._observers)
        self._observers[handle.id] = observer
        return handle

    @property
    def observers(self) -> tuple[A2AObserver, ...]:
        return tuple(self._observers.values())

    def a2a_begin(self, nbytes: int) -> object:
        return tuple((o, o.a2a_begin(nbytes)) for o in self.observers)

    def a2a_end(self, token: object) -> None:
        for o, tok in token:  # type: ignore[attr-defined]
            o.a2a_end(tok)

    def block_begin(self) -> None:
        for o in self.observers:
            o.block_begin()

    def block_end(self) -> None:
        for o in self.observers:
            o.block_end()

    def a2a_blocked(self, seconds: float) -> None:
        for o in self.observers:
            fn = getattr(o, "a2a_blocked", None)
            if fn is not None:
                fn(seconds)

    def a2a_blocked_interval(self, a, b) -> None:
        """Pass the marks on (see :class:`A2AObserver`); observers that only take seconds get
        them, resolved once for all of them."""
        seconds = None
        for o in self.observers:
            fn = getattr(o, "a2a_blocked_interval", None)
            if fn is not None:
                fn(a, b)
            elif getattr(o, "a2a_blocked", None) is not None:
                seconds = _seconds(a, b) if seconds is None else seconds
                o.a2a_blocked(seconds)


def check_observer(observer: object, backward_block: str | None = None) -> None:
    """A TypeError unless ``observer`` is None or has ``a2a_begin`` / ``a2a_end`` (and, with a
    ``backward_block``, ``block_begin`` / ``block_end``); a ValueError for a bad ``backward_block``."""
    if backward_block is not None and backward_block not in BLOCK_MARKS:
        raise ValueError(f"backward_block must be one of {BLOCK_MARKS} or None, got {backward_block!r}")
    if observer is None:
        return
    need = ("a2a_begin", "a2a_end") + (("block_begin", "block_end") if backward_block else ())
    missing = [m for m in need if not callable(getattr(observer, m, None))]
    if missing:
        raise TypeError(f"observer {type(observer).__name__} lacks {', '.join(missing)}: an all-to-all "
                        "observer needs a2a_begin(nbytes) -> token and a2a_end(token) (see "
                        "commsched.comm.observe.A2AObserver)")


def report_blocked(observer: object, a, b) -> None:
    """Tell ``observer`` the caller was blocked from mark ``a`` to mark ``b``: the marks when it
    takes them (``a2a_blocked_interval``, resolved later, no device sync here), else the
    seconds (``a2a_blocked``), else nothing."""
    fn = getattr(observer, "a2a_blocked_interval", None)
    if fn is not None:
        fn(a, b)
        return
    fn = getattr(observer, "a2a_blocked", None)
    if fn is not None:
        fn(_seconds(a, b))


class A2AReport:
    """One exchange as an observer sees it: ``a2a_begin(nbytes)`` when made, then
    :meth:`finish` runs the wait, reports the time the caller was blocked in it
    (``a2a_blocked``, when the observer has it) and ``a2a_end``. ``observer`` None: a no-op.

    The blocked time is the host clock on the CPU and CUDA events on the current stream of
    ``device`` on CUDA, handed over as marks (:func:`report_blocked`): an observer with
    ``a2a_blocked_interval`` resolves them later, as :class:`~commsched.comm.all2all.CommStats`
    settles its intervals, so an observed exchange never synchronises the device.
    ``finish`` reports once, however often it is called.
    """

    __slots__ = ("observer", "token", "device", "_open")

    def __init__(self, observer: A2AObserver | None, nbytes: int, device: torch.device | str = "cpu"):
        self.observer, self.device = observer, torch.device(device)
        self.token = observer.a2a_begin(int(nbytes)) if observer is not None else None
        self._open = observer is not None

    def finish(self, wait: Callable[[], T]) -> T:
        """``wait()``'s result, with the blocked time and the end reported (once)."""
        if not self._open:
            return wait()
        clock = Clock(self.device)
        t0 = clock.mark()
        try:
            return wait()
        finally:  # a failed exchange ends too: the observer must not hold its work for it
            self._open = False
            report_blocked(self.observer, t0, clock.mark())
            self.observer.a2a_end(self.token)  # type: ignore[union-attr]


@dataclass
class A2ATimer:
    """An observer that adds up exchange time (wall time from start to completion seen by
    this rank, overlapping exchanges counted once), the time the compute thread was
    blocked waiting for exchanges, and bytes sent to peers. On CUDA the blocked time of
    exchanges reported as events is added by :meth:`settle` (it waits for them)."""

    time_s: float = 0.0
    blocked_s: float = 0.0
    bytes_sent: int = 0
    calls: int = 0
    intervals: list[tuple[float, float, int]] | None = None  # (start, end, bytes) when recording
    _open: dict[int, tuple[float, int]] = field(default_factory=dict)
    _next: int = 0
    _busy_since: float | None = None
    _pending: list = field(default_factory=list, repr=False)  # CUDA (start, end) events to add

    def a2a_begin(self, nbytes: int) -> object:
        t = time.perf_counter()
        tok = self._next
        self._next += 1
        if not self._open:
            self._busy_since = t
        self._open[tok] = (t, nbytes)
        self.bytes_sent += nbytes
        self.calls += 1
        return tok

    def a2a_end(self, token: object) -> None:
        t = time.perf_counter()
        t0, nbytes = self._open.pop(token)  # type: ignore[arg-type]
        if self.intervals is not None:
            self.intervals.append((t0, t, nbytes))
        if not self._open and self._busy_since is not None:
            self.time_s += t - self._busy_since
            self._busy_since = None

    def block_begin(self) -> None:
        pass

    def block_end(self) -> None:
        pass

    def a2a_blocked(self, seconds: float) -> None:
        self.blocked_s += seconds

    def a2a_blocked_interval(self, a, b) -> None:
        if isinstance(a, float):
            self.blocked_s += b - a
        else:
            self._pending.append((a, b))

    def settle(self) -> "A2ATimer":
        """Add the blocked time of the CUDA intervals recorded so far (waits for them)."""
        for a, b in self._pending:
            self.blocked_s += _seconds(a, b)
        self._pending.clear()
        return self

    def reset(self) -> None:
        self.time_s, self.blocked_s, self.bytes_sent, self.calls = 0.0, 0.0, 0, 0
        self._pending = []
        if self.intervals is not None:
            self.intervals = []


__all__ = ["A2AEvents", "A2AObserver", "A2AReport", "A2ATimer", "BLOCK_MARKS", "check_observer",
           "report_blocked"]
