"""Timing that means the same on every device.

On CUDA the host clock measures when work was *enqueued*, not when it ran (NCCL
collectives and kernels return at once), so time on a CUDA device is taken with CUDA
events recorded on the current stream; on the CPU it is the host's monotonic clock.

    clock = Clock(device)
    a = clock.mark()
    ...                         # work on the device
    b = clock.mark()
    seconds = clock.seconds(a, b)   # waits for b on CUDA (call it off the hot path)
"""

from __future__ import annotations

import time
from typing import Any, Union

import torch

Mark = Union[float, Any]  # a host time in seconds, or a recorded torch.cuda.Event


class Clock:
    """Marks and intervals on ``device`` (CUDA events on CUDA, ``perf_counter`` on the CPU)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def mark(self, stream: Any = None) -> Mark:
        """Now, on ``stream`` (default: the current stream of the clock's device)."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def seconds(self, a: Mark, b: Mark) -> float:
        """Seconds from mark ``a`` to mark ``b`` (on CUDA, waits until ``b`` has happened)."""
        return interval_s(a, b)

    def sync(self) -> None:
        """Wait for all work queued on the device (nothing to wait for on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)


def interval_s(a: Mark, b: Mark) -> float:
    """Seconds from mark ``a`` to mark ``b`` of any :class:`Clock`: host seconds subtracted,
    CUDA events timed (waits until ``b`` has happened). Code that keeps marks to resolve
    later (``CommStats``, ``PlacedTimes``, the all-to-all observers) resolves them with it."""
    if isinstance(a, (float, int)):
        return float(b - a)
    b.synchronize()
    return a.elapsed_time(b) / 1e3


__all__ = ["Clock", "Mark", "interval_s"]
