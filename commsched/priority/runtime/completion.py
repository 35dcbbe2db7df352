"""Completion tracking of :class:`~commsched.priority.runtime.executor.GradScheduler`: how the
executor learns that a launched allreduce has finished, and its own thread.

Legend: none.

On the CPU (gloo) a launched ``Work``'s future completes when the allreduce is done, so
completion is its done-callback (``completion="callback"``, the default) or
``work.is_completed()`` polled by the executor thread (``"poll"``). On CUDA (NCCL) that
future completes at *enqueue*, so instead the executor thread makes a side stream wait for
the collective, records a CUDA event there and polls it (``event.query()``): the event
completes when the reduction has. The thread polls what is in flight first after
:data:`POLL_MIN_S`, then ever less often (doubling while nothing completes) up to
:data:`POLL_MAX_S`; otherwise it sleeps until a launch, a completion or ``close()`` wakes
it, and after every wake-up it launches what the policy allows (``_pump``). Completion
callbacks only record and wake that thread. A thread that cannot start, or dies, is
raised at the next call (:meth:`CompletionMixin._check_alive`), never a silent timeout.

:class:`CompletionMixin` is a mixin of GradScheduler: it uses the scheduler's lock
(``self._cv``), policy, step state and records, and calls its ``_pump``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ...dist import CommError
from ..hier import GATHER, INTRA


def _with_index(device: torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` becomes ``cuda:<current device>`` (the
    executor thread's ``torch.cuda.set_device`` needs an index)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# launch(flat_gradient, group) -> a torch.distributed Work (or anything with wait(),
# get_future() and is_completed()); the default is an asynchronous all_reduce. A launcher
# with ``takes_op = True`` is called launch(flat, group, op=seq): the operation's number,
# the same on every rank and in every mode (CompressedLauncher keys its rounding by it)
Launcher = Callable[[torch.Tensor, Any], Any]


def _all_reduce(flat: torch.Tensor, group) -> Any:
    return dist.all_reduce(flat, group=group, async_op=True)


def group_size(g) -> int:
    """Ranks of ``g`` (None: the default group); any object with ``size()`` works too."""
    if g is None or isinstance(g, dist.ProcessGroup):
        return dist.get_world_size(g)
    return int(g.size())

# the executor thread polls completions in flight (is_completed / CUDA events) first after
# POLL_MIN_S, then ever less often (doubling while nothing completes) up to POLL_MAX_S: a long
# reduction costs a few hundred wake-ups a second at most, not 10^4 (each takes the lock and the GIL)
POLL_MIN_S, POLL_MAX_S = 1e-4, 2e-3


def current_rank() -> int:
    """This process's rank in the default group (0 before there is one): the rank error messages name."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class CompletionMixin:
    """Done-callbacks, polling and the executor thread (module docstring)."""

    def _make_done(self, seq: int):
        def done(fut) -> None:
            err = None
            try:
                fut.value()
            except BaseException as e:  # handed to finish()
                err = e
            with self._cv:
                if err is not None and self._error is None:
                    self._error = CommError(f"rank {current_rank()}: allreduce {seq} failed: {err}")
                self._completed(seq, error=self._error if err is not None else None)
        return done

    def _completed(self, seq: int, end_mark: Any = None, error: BaseException | None = None) -> None:
        """Allreduce ``seq`` is done (caller holds the lock); for a hierarchical operation on
        the CPU its phase across hosts is, and the gather follows (:meth:`_hier_done`)."""
        staged = self._op_hier[seq] and not self._chained
        if self._hier_step is not None and self._op_hier[seq]:
            self._hier_step.inter_done(seq)
        if self._on_complete is not None and (not staged or error is not None):
            self._on_complete(seq, error)
        rec = self._rec.get(("allreduce", seq))
        if rec is not None:
            if end_mark is not None:
                self._marks[("allreduce", seq, "end_s")] = end_mark
                rec.end_s = 0.0
            else:
                rec.end_s = self._now()
        try:
            self._policy.allreduce_done(seq)
        except ValueError:
            pass
        self._thread_wake = True
        self._cv.notify_all()

    def _hier_done(self, phase: str, seq: int, err: BaseException | None) -> None:
        """Phase ``intra`` or ``gather`` of hierarchical operation ``seq`` finished (a backend
        thread, or the caller's with the lock held): the policy may launch its phase across
        hosts, or the operation is done."""
        with self._cv:
            if err is not None:
                if self._error is None:
                    self._error = CommError(f"rank {current_rank()}: hierarchical reduction of operation {seq} "
                                            f"failed in its {phase} phase: {err}")
                if self._on_complete is not None:
                    self._on_complete(seq, self._error)
            elif phase == INTRA:
                self._policy.allreduce_ready(seq, self._state[seq].spec.nbytes)
            elif phase == GATHER:
                self._hier_step.gathered(seq)
                rec = self._rec.get(("allreduce", seq))
                if rec is not None:
                    rec.end_s = self._now()
                if self._on_complete is not None:
                    self._on_complete(seq, None)
            self._thread_wake = True
            self._cv.notify_all()

    def _poll(self) -> None:
        """Check the polled completions (executor thread, lock held)."""
        for seq, w in list(self._polled.items()):
            if self._cuda:
                if not self._is_mark(w):
                    ev = self._event_after(w)
                    if ev is None:
                        continue  # its host part still runs: never a blocking wait under the lock
                    self._polled[seq] = w = ev
                if w.query():
                    del self._polled[seq]
                    self._completed(seq, w)
            elif w.is_completed():
                del self._polled[seq]
                self._completed(seq)

    @staticmethod
    def _is_mark(w: Any) -> bool:
        return isinstance(w, torch.cuda.Event)

    def _event_after(self, w: Any) -> Any:
        """A CUDA event on the side stream that completes with Work ``w`` (executor thread,
        lock held), or None while ``w``'s host part still runs. A Work with a host future and
        an event (``stream_wait``: CompressedLauncher's) is skipped until ``is_completed()``,
        then the side stream waits on its event; any other Work's ``wait()`` is NCCL's
        non-blocking stream wait."""
        with torch.cuda.stream(self._side):
            if hasattr(w, "stream_wait"):
                if not w.is_completed():
                    return None
                w.stream_wait(self._side)
            else:
                w.wait()
            return self.clock.mark(self._side)

    def _thread_setup(self) -> None:
        """The executor thread's first act: on CUDA its device (its events and streams)."""
        if self._cuda:
            torch.cuda.set_device(self.device)

    def _loop(self) -> None:
        try:
            self._thread_setup()
        except BaseException as e:  # the thread cannot run: say so at the next call, not at a timeout
            with self._cv:
                self._dead = CommError(f"rank {current_rank()}: the GradScheduler thread could not start on "
                                       f"{self.device}: {type(e).__name__}: {e}")
                self._error = self._dead
                self._cv.notify_all()
            return
        try:
            poll_s = POLL_MIN_S
            with self._cv:
                while not self._closed:
                    # completions in flight are polled with a growing period (POLL_MIN_S ..
                    # POLL_MAX_S); otherwise the thread sleeps until a launch, a completion or
                    # close() wakes it
                    woken = self._cv.wait_for(lambda: self._thread_wake or self._closed,
                                              timeout=poll_s if self._polled else None)
                    self._thread_wake = False
                    if self._active and not self._closed:
                        try:
                            if self._polled:
                                before = len(self._polled)
                                self._poll()
                                self._thread_wake = False
                                progressed = woken or len(self._polled) < before
                                poll_s = POLL_MIN_S if progressed else min(2 * poll_s, POLL_MAX_S)
                            self._pump()
                        except BaseException as e:  # handed to finish()
                            self._error = e
                            self._cv.notify_all()
        except BaseException as e:  # never a silent death: finish() and begin_step() raise it
            with self._cv:
                self._dead = CommError(f"rank {current_rank()}: the GradScheduler thread died: "
                                       f"{type(e).__name__}: {e}")
                self._error = self._error or self._dead
                self._cv.notify_all()

    def _check_alive(self) -> None:
        """Raise the executor thread's death (lock held), so that a step never waits for it."""
        if self._dead is not None:
            raise self._dead



__all__ = ["POLL_MAX_S", "POLL_MIN_S", "CompletionMixin", "current_rank", "group_size"]
