"""Per-epoch time breakdown shared by the trainer, the layers and the exchange strategies.

Keys (seconds, summed over an epoch, forward and backward together):

| key      | what                                                                 |
|----------|----------------------------------------------------------------------|
| comm     | time a rank spends blocked in halo exchanges (forward and backward)  |
| quant    | quantization and dequantization of exchanged rows (0 in Vanilla)     |
| central  | aggregation into central nodes (needs no remote rows)                |
| marginal | aggregation into marginal nodes (needs the remote rows)              |
| reduce   | data-parallel allreduce of the parameter gradients                   |
| assign   | bit-width assignment (0 in Vanilla)                                  |

Intervals are taken with a :class:`commsched.clock.Clock` of the run's device: on the
CPU its marks are ``perf_counter`` readings and every interval is added at once (the
host clock, as before devices existed); on CUDA they are events on the current stream
(the host clock would measure enqueue time), kept until :meth:`Breakdown.as_dict`
resolves them with one wait at the end of the pass.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ..clock import Clock, Mark

BREAKDOWN_KEYS = ("comm", "quant", "central", "marginal", "reduce", "assign")
_CPU_CLOCK = Clock("cpu")  # stateless: perf_counter marks


class Breakdown:
    """Accumulates seconds per key; the trainer makes a fresh one for every pass (its
    :class:`~commsched.gnn.context.PassContext`). ``clock``: the run device's clock
    (default: the host clock)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock if clock is not None else _CPU_CLOCK
        self.seconds: dict[str, float] = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
        self._pending: list[tuple[str, float, Mark, Mark]] = []  # CUDA spans not yet resolved

    def add(self, key: str, dt: float) -> None:
        """Add ``dt`` host seconds (work the host itself did or waited for) to ``key``."""
        self.seconds[key] = self.seconds.get(key, 0.0) + dt

    def mark(self) -> Mark:
        """Now, on the clock's device (see :class:`commsched.clock.Clock`)."""
        return self.clock.mark()

    def add_span(self, key: str, a: Mark, b: Mark, sign: float = 1.0) -> None:
        """Add ``sign`` times the interval from mark ``a`` to mark ``b`` to ``key``
        (``sign=-1``: take out a part already counted under another key)."""
        if self.clock.cuda:
            self._pending.append((key, sign, a, b))
        else:
            self.add(key, b - a if sign == 1.0 else sign * (b - a))

    @contextmanager
    def time(self, key: str) -> Iterator[None]:
        a = self.mark()
        try:
            yield
        finally:
            self.add_span(key, a, self.mark())

    def as_dict(self) -> dict[str, float]:
        """Seconds per key (on CUDA: waits for the pass's last recorded event once)."""
        for key, sign, a, b in self._pending:
            self.add(key, sign * self.clock.seconds(a, b))
        self._pending.clear()
        return dict(self.seconds)
