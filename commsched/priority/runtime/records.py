"""The timeline records of :class:`~commsched.priority.runtime.executor.GradScheduler`: one
:class:`OpRecord` per communication operation of a step, their clock, and the step's
timings computed from them.

Legend: none (times are seconds from the step start).

Clock. On the CPU a field is stamped with a host clock reading (``time.perf_counter``
minus the step start). On CUDA it is stamped with a CUDA event (:class:`commsched.clock.Clock`,
recorded on the current stream or the one given) and set to 0 until :meth:`Recorder.timings`,
called once in ``finish`` (which synchronises anyway), turns every event into seconds:
an all-to-all's begin and end are events recorded on the current stream when the layer
reports them (the end completes after the exchange, which the current stream waits for),
an allreduce's start is an event recorded where it is launched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass
class OpRecord:
    """One communication operation of a step, times relative to the step start (seconds)."""

    kind: str  # "a2a" or "allreduce"
    key: int
    nbytes: int
    ready_s: float
    start_s: float = -1.0
    end_s: float = -1.0


def union_s(spans: Sequence[tuple[float, float]]) -> float:
    """Total length of the union of the intervals ``(start, end)``."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def step_timings(recs: Sequence[OpRecord], *, t_end: float, t_done: float, a2a_blocked_s: float) -> dict:
    """A step's timings from its records (what ``GradScheduler.finish`` returns): ``t_end``
    the end of the backward pass, ``t_done`` the end of the wait for the allreduce."""
    a2a = [(r.ready_s, r.end_s) for r in recs if r.kind == "a2a" and r.end_s >= 0]
    ar_recs = [r for r in recs if r.kind == "allreduce" and r.end_s >= 0]
    ar = [(r.start_s, r.end_s) for r in ar_recs]
    ar_bytes = sum(r.nbytes for r in ar_recs)
    in_bwd = sum(r.nbytes for r in ar_recs if r.end_s <= t_end)
    return {"a2a_time_s": union_s(a2a), "a2a_blocked_s": a2a_blocked_s,
            "allreduce_time_s": union_s(ar),
            "allreduce_wait_s": t_done - t_end, "backward_end_s": t_end,
            # share of the allreduce bytes already reduced when the backward pass ended
            "allreduce_in_backward_share": in_bwd / ar_bytes if ar_bytes else 1.0,
            "a2a_count": len(a2a), "allreduce_count": len(ar)}


def contended_slowdowns(recs: Sequence[OpRecord], alone: Sequence[OpRecord], *,
                        min_overlap: float = 0.5) -> list[float]:
    """The slowdown of each all-to-all that ran beside a gradient allreduce (pure): for the
    i-th exchange of ``recs`` whose time on the wire (launch to end) had an allreduce in
    flight for at least ``min_overlap`` of it, its time over the i-th exchange's time in
    ``alone`` (the same step's exchanges with no allreduce running). The Lina paper's
    contention figure is the median of these (1.83x); empty when the two steps' exchanges
    do not pair up (another count) or none ran beside an allreduce."""
    def wire(r: OpRecord) -> tuple[float, float]:
        return (r.start_s if r.start_s >= 0 else r.ready_s), r.end_s

    a2a = [wire(r) for r in recs if r.kind == "a2a" and r.end_s >= 0]
    ref = [wire(r) for r in alone if r.kind == "a2a" and r.end_s >= 0]
    if len(a2a) != len(ref):
        return []
    ar = [(r.start_s, r.end_s) for r in recs if r.kind == "allreduce" and r.start_s >= 0 and r.end_s >= 0]
    out = []
    for (s, e), (s0, e0) in zip(a2a, ref):
        if e <= s or e0 <= s0:
            continue
        beside = union_s([(max(s, a), min(e, b)) for a, b in ar if a < e and b > s])
        if beside >= min_overlap * (e - s):
            out.append((e - s) / (e0 - s0))
    return out


def sort_records(recs: Sequence[OpRecord]) -> list[OpRecord]:
    """The records in timeline order (ready time, kind, key)."""
    return sorted(recs, key=lambda r: (r.ready_s, r.kind, r.key))


class Recorder:
    """A scheduler's step records on ``clock`` (CUDA events when ``cuda``), under its lock;
    ``records``: the last finished step's, in timeline order."""

    def __init__(self, clock: Any, cuda: bool):
        self.clock, self.cuda = clock, cuda
        self.t0 = time.perf_counter()
        self.t0_mark: Any = None
        self.reset()

    def reset(self) -> None:
        """A new step: no records (its clock starts at :meth:`start`)."""
        self.records: list[OpRecord] = []
        self._rec: dict[tuple[str, int], OpRecord] = {}
        self._marks: dict[tuple[str, int, str], Any] = {}  # CUDA: (kind, key, field) -> event
        self.blocked_s = 0.0
        self._blocked_marks: list[tuple[Any, Any]] = []  # CUDA: blocked intervals to resolve

    def start(self) -> None:
        """The step starts now: the host clock's origin, on CUDA an event too."""
        self.t0 = time.perf_counter()
        if self.cuda:
            self.t0_mark = self.clock.mark()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def open(self, kind: str, key: int, nbytes: int) -> OpRecord:
        """A new record of this step, stamped ready now."""
        rec = self._rec[(kind, key)] = OpRecord(kind, key, nbytes, 0.0)
        self.stamp(kind, key, "ready_s")
        return rec

    def stamp(self, kind: str, key: Any, field: str, mark: Any = None) -> None:
        """Set the field of record (``kind``, ``key``) of this step, if there is one, to now:
        the host clock on the CPU; on CUDA a CUDA event (``mark``, default one recorded on
        the current stream now) resolved in :meth:`timings`."""
        rec = self._rec.get((kind, key))
        if rec is not None and (self.cuda or mark is not None):
            self._marks[(kind, key, field)] = mark if mark is not None else self.clock.mark()
            setattr(rec, field, 0.0)
        elif rec is not None:
            setattr(rec, field, self.now())

    def blocked(self, a: Any, b: Any) -> None:
        """The all-to-all blocked from ``a`` to ``b``: host seconds are added now, CUDA events
        in :meth:`timings` (which synchronises once anyway), never at the exchange."""
        if isinstance(a, float):
            self.blocked_s += b - a
        else:
            self._blocked_marks.append((a, b))

    def seconds(self, mark: Any) -> float:
        """CUDA: seconds from the step start to event ``mark``."""
        return self.clock.seconds(self.t0_mark, mark)

    def timings(self, t_end: float, end_mark: Any) -> dict:
        """End the step: its records in :attr:`records` and its timings (:func:`step_timings`;
        ``t_end``/``end_mark``: the end of the backward pass). On CUDA every event is turned
        into seconds from the step start (waits for the current stream)."""
        t_done = self.now()
        recs = list(self._rec.values())
        if self.cuda:
            t_done = self.seconds(self.clock.mark())  # synchronises: every earlier event has happened
            for (kind, key, fld), ev in self._marks.items():
                setattr(self._rec[(kind, key)], fld, self.seconds(ev))
            t_end = self.seconds(end_mark)
        self.blocked_s += sum(self.clock.seconds(a, b) for a, b in self._blocked_marks)
        self._marks, self._blocked_marks = {}, []
        self.records = sort_records(recs)
        return step_timings(recs, t_end=t_end, t_done=t_done, a2a_blocked_s=self.blocked_s)


__all__ = ["OpRecord", "Recorder", "contended_slowdowns", "sort_records", "step_timings", "union_s"]
