"""The timeline records of :class:`~commsched.priority.runtime.executor.GradScheduler`: one
:class:`OpRecord` per communication operation of a step, their clock, and the step's
timings computed from them.

Legend: none (times are seconds from the step start).

Clock. On the CPU a field is stamped with a host clock reading (``time.perf_counter``
minus the step start). On CUDA it is stamped with a CUDA event (:class:`commsched.clock.Clock`,
recorded on the current stream or the one given) and set to 0 until :meth:`RecordsMixin._resolve_marks`,
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


def sort_records(recs: Sequence[OpRecord]) -> list[OpRecord]:
    """The records in timeline order (ready time, kind, key)."""
    return sorted(recs, key=lambda r: (r.ready_s, r.kind, r.key))


class RecordsMixin:
    """The scheduler's record keeping (a mixin of GradScheduler: it sets ``self.clock``,
    ``self._cuda`` and holds the lock around these calls)."""

    clock: Any
    _cuda: bool

    def _reset_records(self) -> None:
        """A new step: no records (its clock starts at :meth:`_start_clock`)."""
        self.records: list[OpRecord] = []
        self._rec: dict[tuple[str, int], OpRecord] = {}
        self._marks: dict[tuple[str, int, str], Any] = {}  # CUDA: (kind, key, field) -> event
        self._a2a_blocked_s = 0.0
        self._blocked_marks: list[tuple[Any, Any]] = []  # CUDA: blocked intervals to resolve

    def _start_clock(self) -> None:
        """The step starts now: the host clock's origin, on CUDA an event too."""
        self._t0 = time.perf_counter()
        if self._cuda:
            self._t0_mark = self.clock.mark()

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _stamp(self, rec: OpRecord, field: str, stream: Any = None) -> None:
        """Set ``rec.<field>`` to now: the host clock on the CPU; on CUDA a CUDA event
        (recorded on ``stream``, default the current one) resolved in :meth:`finish`."""
        if self._cuda:
            self._marks[(rec.kind, rec.key, field)] = self.clock.mark(stream)
            setattr(rec, field, 0.0)
        else:
            setattr(rec, field, self._now())

    def _resolve_marks(self, end_mark: Any) -> tuple[float, float]:
        """CUDA: turn this step's events into seconds from the step start; returns (end of
        the backward pass, end of the allreduce wait). Waits for the current stream."""
        done_mark = self.clock.mark()
        sec = self.clock.seconds
        t_done = sec(self._t0_mark, done_mark)  # synchronises: every earlier event has happened
        for (kind, key, fld), ev in self._marks.items():
            rec = self._rec.get((kind, key))
            if rec is not None:
                setattr(rec, fld, sec(self._t0_mark, ev))
        self._marks = {}
        return sec(self._t0_mark, end_mark), t_done

    def _resolve_blocked(self) -> None:
        """Add the blocked intervals held as marks (every event has happened: no wait)."""
        for a, b in self._blocked_marks:
            self._a2a_blocked_s += self.clock.seconds(a, b)
        self._blocked_marks = []


__all__ = ["OpRecord", "RecordsMixin", "sort_records", "step_timings", "union_s"]
