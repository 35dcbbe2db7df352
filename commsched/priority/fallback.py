"""Whether a schedule pays for itself here: a short measured A/B against fifo's launching (pure).

Legend: S probe steps, R ranks.

Lina's rule (hold the allreduce while an all-to-all is on the wire) and lina-overlap's
(the reduction's tail under the next forward pass) win only where the all-to-all suffers
from the concurrent allreduce and the link, not the compute, bounds the step. Where they do
not, holding micro-ops back only delays the reduction, and lina-overlap's per-module
optimizer steps and forward waits cost time of their own. A training run cannot know in
advance which case it is in (the link, the ranks' skew, the model), so it measures: after
``warmup`` steps, ``2 * probes`` steps run the schedule as configured (*primary*) and its
*fallback* in the order P F F P P F F P ... (so that a steady trend of the step times,
such as the first steps' warm-up, favours neither) -- every micro-op launched as soon as it is ready, as ``fifo`` launches its
buckets, and under lina-overlap the whole reduction waited for at the end of the backward
pass -- and the run keeps whichever took less time, summed over its probe steps, each step
timed as its slowest rank. Ties keep the primary. The decision is the same on every rank
(every rank computes it from the same gathered times) and is announced once.

:class:`FallbackProbe` is the pure part: which mode a step runs in, and the decision from
the gathered step times. :class:`~commsched.priority.step.GradStep` drives it
(``ScheduleConfig.fallback_probes``; 0 turns it off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Decision:
    """The probe's verdict: ``fallback`` (True: fifo's launching from now on), and the
    summed step times (seconds, slowest rank per step) of the primary and fallback steps."""

    fallback: bool
    primary_s: float
    fallback_s: float

    def message(self, schedule: str, first: int, last: int) -> str:
        verb = "falls back to fifo's launching" if self.fallback else "keeps its schedule"
        return (f"{schedule}: probe steps {first}-{last} took {self.primary_s:.3f} s as {schedule} against "
                f"{self.fallback_s:.3f} s with every micro-op launched when ready (fifo's rule); the run {verb} "
                "from here on")


PROBE_WARMUP = 2  # steps before the probe: the first ones are slower (connections, allocator)


class FallbackProbe:
    """Steps ``warmup .. warmup + 2 * probes - 1`` run primary and fallback in pairs, P F
    then F P (:meth:`fallback_at`); :attr:`decide_at` is the first step run as decided."""

    def __init__(self, warmup: int = PROBE_WARMUP, probes: int = 2):
        if warmup < 0 or probes < 0:
            raise ValueError(f"warmup and probes must be >= 0, got {warmup}, {probes}")
        self.warmup, self.probes = int(warmup), int(probes)
        self.decided: Decision | None = None

    @property
    def enabled(self) -> bool:
        return self.probes > 0

    @property
    def first(self) -> int:
        return self.warmup

    @property
    def decide_at(self) -> int:
        return self.warmup + 2 * self.probes

    def probing(self, step: int) -> bool:
        return self.enabled and self.first <= step < self.decide_at

    def fallback_at(self, step: int) -> bool:
        """Whether step ``step`` runs the fallback."""
        if self.probing(step):
            k = step - self.first
            return (k % 2 == 1) != ((k // 2) % 2 == 1)  # P F, F P, P F, ...
        if self.decided is not None and step >= self.decide_at:
            return self.decided.fallback
        return False

    def decide(self, times_RS: Sequence[Sequence[float]]) -> Decision:
        """``times_RS[r][s]``: rank r's time of probe step s (s = 0 .. 2 * probes - 1, the
        steps from :attr:`first` on). Every rank passes the same gathered list, so every
        rank decides alike."""
        n = 2 * self.probes
        if not times_RS or any(len(t) != n for t in times_RS):
            raise ValueError(f"decide() needs {n} probe-step times from every rank, got "
                             f"{[len(t) for t in times_RS]}")
        slowest_S = [max(t[s] for t in times_RS) for s in range(n)]
        fb = [self.fallback_at(self.first + s) for s in range(n)]
        primary = sum(t for t, f in zip(slowest_S, fb) if not f)
        fallback = sum(t for t, f in zip(slowest_S, fb) if f)
        self.decided = Decision(fallback < primary, primary, fallback)
        return self.decided


__all__ = ["Decision", "FallbackProbe"]
