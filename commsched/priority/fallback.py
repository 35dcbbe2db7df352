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
pass -- and the run keeps whichever took less time per step, each step timed as its slowest
rank. Ties keep the primary. One stall (a GC pause, a co-tenant, a checkpoint write, a
rank stopped for seconds) must not decide the run, so each mode's figure is the median of
its counted steps once any step slower than :data:`STALL_FACTOR` times the median of all
the counted steps is left out (a mode none of whose steps is left keeps them all): with
two steps per mode a plain mean, or a median, is the stall's. Under an overlapped
schedule (lina-overlap) a step run right after a switch of mode carries the other mode's
tail (the step after P -> F waits for the overlapped reduction of the P step and then for
its own; the step after F -> P leaves its tail to a step that may not be counted), so with
``skip_switches`` only the steps run in the same mode as the step before them count: in
P F F P, the first P and the second F (with one pair, P F, the F step counts as it is). The decision is the same on every rank
(every rank computes it from the same gathered times) and is announced once.

:class:`FallbackProbe` is the pure part: which mode a step runs in, and the decision from
the gathered step times. :class:`~commsched.priority.step.GradStep` drives it
(``LinaConfig.fallback_probes``; 0 turns it off).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

STALL_FACTOR = 3.0  # a probe step slower than this times the median of the counted steps is a stall


@dataclass(frozen=True)
class Decision:
    """The probe's verdict: ``fallback`` (True: fifo's launching from now on), and the
    median step times (seconds, slowest rank per step) of the counted primary and fallback
    steps, stalls left out; ``stalls``: ``(probe step index, seconds)`` of the steps left
    out as stalls."""

    fallback: bool
    primary_s: float
    fallback_s: float
    stalls: tuple[tuple[int, float], ...] = ()

    def message(self, schedule: str, first: int, last: int) -> str:
        verb = "falls back to fifo's launching" if self.fallback else "keeps its schedule"
        left = "; ".join(f"step {first + s} ({t:.3f} s)" for s, t in self.stalls)
        stalls = (f"; left out as stalls (over {STALL_FACTOR:g}x the probe's median step): {left}"
                  if self.stalls else "")
        return (f"{schedule}: probe steps {first}-{last} took {self.primary_s:.3f} s a step (median, slowest "
                f"rank) as {schedule} against {self.fallback_s:.3f} s with every micro-op launched when ready "
                f"(fifo's rule){stalls}; the run {verb} from here on")


PROBE_WARMUP = 2  # steps before the probe: the first ones are slower (connections, allocator)


class FallbackProbe:
    """Steps ``warmup .. warmup + 2 * probes - 1`` run primary and fallback in pairs, P F
    then F P (:meth:`fallback_at`); :attr:`decide_at` is the first step run as decided.
    ``skip_switches``: count only the probe steps run in the mode of the step before them
    (the warm-up steps run the primary), for a schedule whose reduction runs into the next
    step."""

    def __init__(self, warmup: int = PROBE_WARMUP, probes: int = 2, skip_switches: bool = False):
        if warmup < 0 or probes < 0:
            raise ValueError(f"warmup and probes must be >= 0, got {warmup}, {probes}")
        self.warmup, self.probes = int(warmup), int(probes)
        self.skip_switches = bool(skip_switches)
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
        counted = [not self.skip_switches or fb[s] == (fb[s - 1] if s else False) for s in range(n)]
        # a mode none of whose steps counts (P F): all its steps
        steps = {mode: [s for s in range(n) if fb[s] == mode and counted[s]] or
                 [s for s in range(n) if fb[s] == mode] for mode in (False, True)}
        limit = STALL_FACTOR * statistics.median(slowest_S[s] for s in steps[False] + steps[True])
        stalls: list[tuple[int, float]] = []

        def figure(mode: bool) -> float:
            kept = [s for s in steps[mode] if slowest_S[s] <= limit]
            if kept:
                stalls.extend((s, slowest_S[s]) for s in steps[mode] if s not in kept)
            return statistics.median(slowest_S[s] for s in kept or steps[mode])

        primary, fallback = figure(False), figure(True)
        self.decided = Decision(fallback < primary, primary, fallback, tuple(sorted(stalls)))
        return self.decided


__all__ = ["STALL_FACTOR", "Decision", "FallbackProbe"]
