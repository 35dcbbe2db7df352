"""One step interface for every gradient schedule: the optimizer and its scheduler together.

Legend: none (parameters and gradients keep their own shapes).

Under ``fifo``, ``lina`` and ``serial`` a step reduces every gradient
(:meth:`GradScheduler.finish <commsched.priority.runtime.executor.GradScheduler.finish>`) and then
steps one optimizer; under ``lina-overlap`` the reduction runs into the next forward pass
and one optimizer per module steps there (:mod:`commsched.priority.runtime.overlap`). A training
loop should not care which: :class:`GradStep` is what both look like from the loop, as
torchtitan's ``OptimizersContainer`` and its optimizers-in-backward twin share one
``step()``. :func:`make_grad_step` picks the implementation from the schedule::

    gs = make_grad_step(model, entries, cfg, lambda ps: torch.optim.Adam(ps, lr=1e-3))
    gs.load_state_dict(saved)                  # optional: before open(), no collective
    with gs, events.register(gs.scheduler):    # opening builds the scheduler (collective)
        for step, (x, y) in enumerate(batches):
            gs.before_forward()                # reduce-then-step: the scheduler's begin_step
            loss = model(x, y)                 # overlap: each module waits for its update
            prev = gs.before_backward()        # overlap: the previous step ends (its timings)
            loss.backward()
            st = gs.after_backward(sync=last)  # this step's timings, None while it runs on
        gs.synchronize()

Timings are the dictionaries of :meth:`GradScheduler.finish` (``a2a_time_s``,
``a2a_blocked_s``, ``allreduce_time_s``, ``allreduce_wait_s``, ``backward_end_s``,
``allreduce_in_backward_share``, ...); :attr:`GradStep.records` are the timeline records of
the step whose timings were returned last. :meth:`GradStep.state_dict` is the optimizer's
own (one ``torch.optim`` state, or :class:`~commsched.priority.runtime.overlap.OverlapOptimizer`'s
list of them), so checkpoints are what they were before this interface.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..dist import all_gather_object
from .fallback import PROBE_WARMUP, Decision, FallbackProbe
from .policy import OverlapPolicy, ScheduleConfig
from .runtime.executor import GradScheduler
from .runtime.overlap import OverlapOptimizer, OverlapScheduler
from .runtime.records import OpRecord

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class GradStep:
    """The step interface (module docstring). ``entries``, ``cfg`` and ``sched_kw`` are the
    scheduler's (:class:`~commsched.priority.runtime.executor.GradScheduler`); it is built by
    :meth:`open` (collective over the ranks, as every scheduler's construction is)."""

    def __init__(self, entries: Sequence[tuple], cfg: ScheduleConfig, **sched_kw: Any):
        self._entries, self.cfg, self._sched_kw = entries, cfg, sched_kw
        self._sched: GradScheduler | None = None
        # the measured A/B against fifo's launching (priority/fallback.py)
        self.probe = FallbackProbe(PROBE_WARMUP, cfg.probes, skip_switches=isinstance(self, OverlapStep))
        self._step = -1
        self._t_last: float | None = None
        self._probe_times: list[float] = []
        self._mode_listeners: list[Callable[[bool], None]] = []
        self._now: Callable[[], float] = time.perf_counter  # the probe's clock (tests script it)

    # ------------------------------------------------------------------ life
    @property
    def scheduler(self) -> GradScheduler:
        """The open scheduler (an :class:`~commsched.comm.observe.A2AObserver`: register it with
        the MoE layers' events)."""
        if self._sched is None:
            raise RuntimeError("GradStep is not open: `with make_grad_step(...) as gs:`")
        return self._sched

    def _make_scheduler(self) -> GradScheduler:
        return GradScheduler(self._entries, self.cfg, **self._sched_kw)

    def open(self) -> "GradStep":
        if self._sched is None:
            self._sched = self._make_scheduler()
            if self._sched.launch_rule != "completion":  # program rule (NCCL): no A/B, every rank alike
                self.probe = FallbackProbe(PROBE_WARMUP, 0)
        return self

    def _tick(self) -> None:
        """A step begins: time the one that ended, decide when the probe is over, and put
        this step in its mode."""
        now = self._now()
        if self._t_last is not None and self.probe.probing(self._step):
            self._probe_times.append(now - self._t_last)
        self._t_last = now
        self._step += 1
        if self.probe.enabled and self._step == self.probe.decide_at and self.probe.decided is None:
            self._decide()
        self._set_mode(self.probe.fallback_at(self._step))

    def _decide(self) -> None:
        group = self._sched_kw.get("run_group")
        on = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        times = (all_gather_object(self._probe_times, "comparing the schedule's probe steps with fifo's launching",
                                   group) if on else [self._probe_times])
        d = self.probe.decide(times)
        if not on or dist.get_rank(group) == 0:
            print(f"commsched: {d.message(self.cfg.name, self.probe.first, self.probe.decide_at - 1)}",
                  file=sys.stderr, flush=True)

    def _set_mode(self, fallback: bool) -> None:
        self.scheduler.set_fallback(fallback)
        for fn in self._mode_listeners:
            fn(fallback)

    def on_mode(self, fn: Callable[[bool], None]) -> None:
        """Call ``fn(fallback)`` as every step begins (before its forward pass) with the mode
        the step runs in: True in the probe's fallback steps and, once the probe chose it,
        in every later step. What else the fallback should switch registers here (the MoE
        trainer's ``--fallback-exchange``: its all-to-all to fifo's exchange)."""
        self._mode_listeners.append(fn)

    # ------------------------------------------------------------------ the probe in checkpoints
    def probe_state(self) -> dict:
        """The probe's progress, for a checkpoint taken once step ``k`` (the last one begun)
        completed: ``{"step": k, "times": [...], "decided": None or {"fallback", "primary_s",
        "fallback_s"}}``. A step of the probe that has not been timed yet (``k`` itself) is
        timed up to now. :meth:`load_probe_state` in the resumed run carries on from it, so
        its steps run in the modes the interrupted run's would have (the decision kept, or
        taken at the same step from the same number of probe times), which is what makes a
        resume exact when the mode changes the arithmetic (the MoE trainer's
        ``--fallback-exchange``). Pure host state; JSON-able."""
        times = list(self._probe_times)
        if self._t_last is not None and self.probe.probing(self._step):
            times.append(self._now() - self._t_last)
        d = self.probe.decided
        return {"step": int(self._step), "times": [float(t) for t in times],
                "decided": None if d is None else {"fallback": bool(d.fallback),
                                                   "primary_s": float(d.primary_s),
                                                   "fallback_s": float(d.fallback_s)}}

    def load_probe_state(self, st: dict) -> None:
        """Carry on from :meth:`probe_state` of the interrupted run (before :meth:`open`, no
        collective). Raises ValueError naming what is wrong with a malformed state."""
        try:
            step, times, d = int(st["step"]), [float(t) for t in st["times"]], st["decided"]
            decided = None if d is None else Decision(bool(d["fallback"]), float(d["primary_s"]),
                                                      float(d["fallback_s"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"the gradient schedule's probe state is damaged ({type(e).__name__}: {e}); "
                             "expected {'step': int, 'times': [float], 'decided': None or "
                             "{'fallback', 'primary_s', 'fallback_s'}}") from None
        if step < -1 or (self.probe.enabled and len(times) > 2 * self.probe.probes):
            raise ValueError(f"the gradient schedule's probe state does not fit this schedule: step "
                             f"{step}, {len(times)} probe times for {self.probe.probes} probe pairs")
        self._step, self._probe_times, self._t_last = step, times, None
        self.probe.decided = decided

    @property
    def fallen_back(self) -> bool | None:
        """Whether the probe chose fifo's launching (None: not decided, or no probe)."""
        return None if self.probe.decided is None else self.probe.decided.fallback

    def close(self) -> None:
        if self._sched is not None:
            self._sched.close()
            self._sched = None

    def __enter__(self) -> "GradStep":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the step
    def before_forward(self) -> None:
        """A step begins (before its forward pass)."""
        self._tick()

    def before_backward(self) -> dict | None:
        """After the forward pass, before the backward pass: the timings of an earlier step
        that ended only now (None when none did)."""
        return None

    def after_backward(self, *, sync: bool = False) -> dict | None:
        """After the backward pass: reduce and step. Returns this step's timings, or None
        when its reduction runs on (``sync``: make it end here, as before a checkpoint or
        at the last step)."""
        raise NotImplementedError

    def synchronize(self) -> dict | None:
        """Every parameter updated (evaluation, checkpoints); the timings of a step that
        ended only now, else None."""
        return None

    @property
    def records(self) -> list[OpRecord]:
        """The timeline records of the step whose timings were returned last."""
        raise NotImplementedError

    # ------------------------------------------------------------------ optimizer state
    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, sd: dict) -> None:
        raise NotImplementedError


class ReduceThenStep(GradStep):
    """``fifo``, ``lina``, ``serial``: :meth:`after_backward` waits for the whole reduction
    (``finish``), then steps one optimizer over every parameter of ``model``
    (``make_optimizer(list(model.parameters()))``) and clears the gradients."""

    def __init__(self, model: nn.Module, entries: Sequence[tuple], cfg: ScheduleConfig,
                 make_optimizer: MakeOptimizer, **sched_kw: Any):
        super().__init__(entries, cfg, **sched_kw)
        self.optimizer = make_optimizer(list(model.parameters()))

    def before_forward(self) -> None:
        self._tick()
        self.scheduler.begin_step()

    def after_backward(self, *, sync: bool = False) -> dict | None:
        st = self.scheduler.finish()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return st

    @property
    def records(self) -> list[OpRecord]:
        return self.scheduler.records

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.optimizer.load_state_dict(sd)


class OverlapStep(GradStep):
    """``lina-overlap``: an :class:`~commsched.priority.runtime.overlap.OverlapOptimizer` (one
    optimizer per module, built by ``make_optimizer``) bound to an
    :class:`~commsched.priority.runtime.overlap.OverlapScheduler`. :meth:`before_backward` ends the
    previous step (normally nothing is left); :meth:`after_backward` returns at once unless
    ``sync``. Closing removes the optimizer's forward pre-hooks."""

    def __init__(self, model: nn.Module, entries: Sequence[tuple], cfg: ScheduleConfig,
                 make_optimizer: MakeOptimizer, **sched_kw: Any):
        super().__init__(entries, cfg, **sched_kw)
        self.optimizer = OverlapOptimizer(model, make_optimizer)
        self._overlap0 = self.optimizer.overlap

    def _make_scheduler(self) -> GradScheduler:
        sched = OverlapScheduler(self._entries, self.cfg, **self._sched_kw)
        self.optimizer.bind(sched)
        return sched

    def close(self) -> None:
        super().close()
        self.optimizer.close()  # the pre-hooks go

    def _set_mode(self, fallback: bool) -> None:
        super()._set_mode(fallback)  # applied at this step's begin_step (in before_backward)
        # fallback: the whole reduction waited for at the backward's end (clipping does so always)
        self.optimizer.overlap = self._overlap0 and not fallback

    def before_backward(self) -> dict | None:
        return self.optimizer.begin_backward()

    def after_backward(self, *, sync: bool = False) -> dict | None:
        self.optimizer.end_backward()  # returns at once: the reduction runs into the next forward pass
        if not self.optimizer.overlap:  # the fallback (or clipping): the step completed in end_backward
            return self.optimizer.complete_step()  # its timings, now rather than a step late
        return self.optimizer.synchronize() if sync else None

    def synchronize(self) -> dict | None:
        return self.optimizer.synchronize()

    @property
    def records(self) -> list[OpRecord]:
        return self.optimizer.last_records

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.optimizer.load_state_dict(sd)


def make_grad_step(model: nn.Module, entries: Sequence[tuple], cfg: ScheduleConfig,
                   make_optimizer: MakeOptimizer, **sched_kw: Any) -> GradStep:
    """The :class:`GradStep` of the schedule ``cfg``: :class:`OverlapStep` for one whose policy
    runs the reduction into the next forward pass (an :class:`OverlapPolicy`: ``lina-overlap``),
    :class:`ReduceThenStep` for the others. ``sched_kw`` go to the scheduler (``device``,
    ``hier``, ``timeout_s``, ...)."""
    cls = OverlapStep if isinstance(cfg.build(), OverlapPolicy) else ReduceThenStep
    return cls(model, entries, cfg, make_optimizer, **sched_kw)


__all__ = ["GradStep", "OverlapStep", "ReduceThenStep", "make_grad_step"]
