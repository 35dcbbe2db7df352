"""Named execution lanes (compute, communication; pass names= for more) with record/wait events.

On CUDA a lane is a stream: ``submit`` makes the lane's stream wait for the work queued so
far on the caller's stream, launches the work on the lane's stream and returns an
event-backed :class:`LaneEvent`; ``event.wait()`` makes the current stream *of the lane's
device* wait for it (no host sync) and returns the work's result. Memory follows the
caching allocator's rule for side streams: every tensor handed to the work, and every
tensor it returns, is marked with ``record_stream`` for the stream that uses it, so its
memory is not reused while that stream may still read it.

On every device an exception raised by the work reaches whoever waits for its event
(``wait()`` re-raises it), never the submitter.

On CPU a lane other than ``compute`` is one worker thread that runs submitted work in
order, so communication progresses in the background while the
caller's thread computes; ``event.wait()`` blocks until the work is done and re-raises
its exception. ``compute`` always runs inline in the caller's thread.

Legend: none (no tensors of fixed shape here).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch

DEFAULT_LANES = ("compute", "comm")


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj`` (a tensor, or lists, tuples and dict values of them, nested)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


class LaneEvent:
    """Completion of one piece of lane work; ``wait()`` returns its result or raises its
    exception."""

    def __init__(self, future: Future | None = None, cuda_event=None, value: Any = None,
                 error: BaseException | None = None, device: torch.device | None = None):
        self._future, self._cuda_event, self._value = future, cuda_event, value
        self._error, self._device = error, device

    def done(self) -> bool:
        if self._error is not None:
            return True
        if self._future is not None:
            return self._future.done()
        if self._cuda_event is not None:
            return bool(self._cuda_event.query())
        return True

    def wait(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._future is not None:
            return self._future.result()
        if self._cuda_event is not None:
            consumer = torch.cuda.current_stream(self._device)
            consumer.wait_event(self._cuda_event)
            for t in tensors_in(self._value):
                if t.device.type == "cuda":
                    t.record_stream(consumer)  # made on the lane's stream, read on this one
        return self._value


class _CpuWorker:
    """One thread running submitted callables in order."""

    def __init__(self, name: str):
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._loop, name=f"commsched-lane-{name}", daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to the waiter
                fut.set_exception(e)

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        fut: Future = Future()
        self._q.put((fut, fn, args, kwargs))
        return fut

    def close(self) -> None:
        self._q.put(None)
        self._t.join(timeout=5)


class Lanes:
    """A set of named lanes on one device. Use as a context manager or call ``close()``.

    >>> with Lanes(torch.device("cpu")) as lanes:
    ...     ev = lanes.submit("comm", lambda: 1 + 1)
    ...     ev.wait()
    2
    """

    def __init__(self, device: torch.device | str = "cpu", names=DEFAULT_LANES):
        self.device = torch.device(device)
        if "compute" not in names:
            raise ValueError(f"lanes need a 'compute' lane, got {tuple(names)}")
        self.names = tuple(names)
        self._cuda = self.device.type == "cuda"
        self._streams: dict[str, Any] = {}
        self._workers: dict[str, _CpuWorker] = {}
        for n in self.names:
            if self._cuda:
                self._streams[n] = (torch.cuda.current_stream(self.device) if n == "compute"
                                    else torch.cuda.Stream(self.device))
            elif n != "compute":
                self._workers[n] = _CpuWorker(n)

    def submit(self, lane: str, fn: Callable, *args, **kwargs) -> LaneEvent:
        """Run ``fn(*args, **kwargs)`` on ``lane``; returns its completion event."""
        if lane not in self.names:
            raise ValueError(f"unknown lane {lane!r}; lanes are {self.names}")
        if self._cuda:
            s = self._streams[lane]
            s.wait_stream(torch.cuda.current_stream(self.device))
            for t in tensors_in((args, kwargs)):
                if t.device.type == "cuda":
                    t.record_stream(s)  # the caller's tensor is read on the lane's stream
            with torch.cuda.device(self.device), torch.cuda.stream(s):
                try:
                    value = fn(*args, **kwargs)
                except Exception as e:  # handed to the waiter, like a worker thread's
                    return LaneEvent(error=e)
                ev = torch.cuda.Event()
                ev.record(s)
            return LaneEvent(cuda_event=ev, value=value, device=self.device)
        if lane == "compute":
            try:
                return LaneEvent(value=fn(*args, **kwargs))
            except Exception as e:
                return LaneEvent(error=e)
        return LaneEvent(future=self._workers[lane].submit(fn, *args, **kwargs))

    def record(self, lane: str = "compute") -> LaneEvent:
        """An event that completes when the work submitted to ``lane`` so far is done."""
        return self.submit(lane, lambda: None)

    def close(self) -> None:
        for w in self._workers.values():
            w.close()
        self._workers.clear()

    def __enter__(self) -> "Lanes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
