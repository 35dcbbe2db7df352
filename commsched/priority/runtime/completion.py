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
it, and after every wake-up it launches what the policy allows (``pump``). Completion
callbacks only record and wake that thread. A thread that cannot start, or dies, is
raised at the next call (:meth:`CompletionTracker.check_alive`), never a silent timeout.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...dist import CommError, current_rank


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


def outcome(fut: Any) -> BaseException | None:
    """The exception a completed future holds, or None."""
    try:
        fut.value()
    except BaseException as e:
        return e
    return None


class CompletionTracker:
    """Done-callbacks, polling and the executor thread of one scheduler (module docstring),
    sharing its lock ``cv``. ``mode``: ``"callback"``, ``"poll"`` or ``"event"`` (CUDA:
    events on ``side``, timed by ``clock``). It calls back ``completed(seq, end_mark, error)``
    (``end_mark``: the CUDA event), ``pump()`` (launch what the policy allows), ``fail(error,
    keep_first)`` (hand an error to whoever waits) and ``active()`` (a step is open). Its
    thread starts at once; every method but :meth:`close` runs with ``cv`` held."""

    def __init__(self, cv: Any, mode: str, device: torch.device, clock: Any, side: Any, *,
                 completed: Callable[[int, Any, BaseException | None], None], pump: Callable[[], None],
                 fail: Callable[[BaseException, bool], None], active: Callable[[], bool]):
        self.cv, self.mode, self.device, self.clock, self.side = cv, mode, device, clock, side
        self._completed, self._pump, self._fail, self._active = completed, pump, fail, active
        self.polled: dict[int, Any] = {}  # seq -> CUDA event or Work, polled by the thread
        self._wake = False
        self._closed = False
        self.dead: CommError | None = None  # the thread's death, when it died
        self._thread = threading.Thread(target=self._loop, name="commsched-gradsched", daemon=True)
        self._thread.start()

    def watch(self, seq: int, work: Any) -> None:
        """Operation ``seq`` was launched as ``work``: learn when it is done."""
        if self.mode == "callback":
            work.get_future().add_done_callback(lambda fut: self._done(seq, fut))
        else:  # the thread polls it (on CUDA it first records an event after it)
            self.polled[seq] = work
            self.wake()

    def wake(self) -> None:
        """Let the thread look again (a launch, a completion)."""
        self._wake = True
        self.cv.notify_all()

    def _done(self, seq: int, fut: Any) -> None:
        err = outcome(fut)  # handed to finish()
        with self.cv:
            self._completed(seq, None, err)

    def _poll(self) -> None:
        """Check the polled completions (executor thread, lock held)."""
        for seq, w in list(self.polled.items()):
            if self.mode == "event":
                if not self._is_mark(w):
                    ev = self._event_after(w)
                    if ev is None:
                        continue  # its host part still runs: never a blocking wait under the lock
                    self.polled[seq] = w = ev
                if w.query():
                    del self.polled[seq]
                    self._completed(seq, w, None)
            elif w.is_completed():
                del self.polled[seq]
                self._completed(seq, None, None)

    @staticmethod
    def _is_mark(w: Any) -> bool:
        return isinstance(w, torch.cuda.Event)

    def _event_after(self, w: Any) -> Any:
        """A CUDA event on the side stream that completes with Work ``w`` (executor thread,
        lock held), or None while ``w``'s host part still runs. A Work with a host future and
        an event (``stream_wait``: CompressedLauncher's) is skipped until ``is_completed()``,
        then the side stream waits on its event; any other Work's ``wait()`` is NCCL's
        non-blocking stream wait."""
        with torch.cuda.stream(self.side):
            if hasattr(w, "stream_wait"):
                if not w.is_completed():
                    return None
                w.stream_wait(self.side)
            else:
                w.wait()
            return self.clock.mark(self.side)

    def _setup(self) -> None:
        """The executor thread's first act: on CUDA its device (its events and streams)."""
        if self.mode == "event":
            torch.cuda.set_device(self.device)

    def _loop(self) -> None:
        try:
            self._setup()
        except BaseException as e:  # the thread cannot run: say so at the next call, not at a timeout
            with self.cv:
                self.dead = CommError(f"rank {current_rank()}: the GradScheduler thread could not start on "
                                      f"{self.device}: {type(e).__name__}: {e}")
                self._fail(self.dead, False)
            return
        try:
            poll_s = POLL_MIN_S
            with self.cv:
                while not self._closed:
                    # completions in flight are polled with a growing period (POLL_MIN_S ..
                    # POLL_MAX_S); otherwise the thread sleeps until a launch, a completion or
                    # close() wakes it
                    woken = self.cv.wait_for(lambda: self._wake or self._closed,
                                             timeout=poll_s if self.polled else None)
                    self._wake = False
                    if self._active() and not self._closed:
                        try:
                            if self.polled:
                                before = len(self.polled)
                                self._poll()
                                self._wake = False
                                progressed = woken or len(self.polled) < before
                                poll_s = POLL_MIN_S if progressed else min(2 * poll_s, POLL_MAX_S)
                            self._pump()
                        except BaseException as e:  # handed to finish()
                            self._fail(e, False)
        except BaseException as e:  # never a silent death: finish() and begin_step() raise it
            with self.cv:
                self.dead = CommError(f"rank {current_rank()}: the GradScheduler thread died: "
                                      f"{type(e).__name__}: {e}")
                self._fail(self.dead, True)

    def check_alive(self) -> None:
        """Raise the executor thread's death (lock held), so that a step never waits for it."""
        if self.dead is not None:
            raise self.dead

    def close(self) -> None:
        with self.cv:
            self._closed = True
            self.cv.notify_all()
        self._thread.join(timeout=5)


__all__ = ["POLL_MAX_S", "POLL_MIN_S", "CompletionTracker", "current_rank", "group_size"]
