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
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

BREAKDOWN_KEYS = ("comm", "quant", "central", "marginal", "reduce", "assign")


class Breakdown:
    """Accumulates seconds per key; the trainer makes a fresh one for every pass (its
    :class:`~commsched.gnn.context.PassContext`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(BREAKDOWN_KEYS, 0.0)

    def add(self, key: str, dt: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + dt

    @contextmanager
    def time(self, key: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - t)

    def as_dict(self) -> dict[str, float]:
        return dict(self.seconds)
