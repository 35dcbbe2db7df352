"""Urgent and background communication of one rank under one policy (Lina's, beyond MoE).

Legend: none (operations are whatever the caller launches).

The policy of :mod:`commsched.priority.policy` knows two kinds of operations, and nothing in
it is specific to MoE:

* *urgent* operations -- what the policy calls all-to-alls: ones the compute thread is
  about to wait for (an expert all-to-all, a pipeline-parallel send or receive of
  activations, any collective on the critical path). They are launched at once.
* *background* operations -- the allreduce micro-ops of
  :class:`~commsched.priority.executor.GradScheduler`: a gradient reduction cut into
  equal micro-ops (``ScheduleConfig.microop_bytes``), each launched by the scheduler's
  ``launch`` (an asynchronous ``all_reduce`` by default, any collective on the chunk
  otherwise). Under ``lina`` none is launched while an urgent operation is waiting or in
  flight, and the ones already in flight never exceed the credit
  (``ScheduleConfig.credit``; under the ``program`` launch rule, at most ``gap_budget``
  launched per gap). So an urgent operation never waits behind more than the credit.

:func:`urgent` (also ``GradScheduler.urgent``) is the one entry point: it tells the
scheduler -- or any :class:`~commsched.observe.A2AObserver`, an
:class:`~commsched.observe.A2AEvents` included -- that an urgent operation begins, starts
it, and reports its end when :meth:`UrgentOp.wait` returns::

    with GradScheduler(params, ScheduleConfig(policy="lina")) as sched:
        sched.begin_step()
        loss.backward()                 # gradients ready: background micro-ops start
        op = sched.urgent(dist.isend, act, dst, group=pp_group, nbytes=act.numel() * act.element_size())
        op.wait()                       # the send had the link, within the credit
        sched.finish()

In ``sched.records`` an urgent operation is an :class:`~commsched.priority.executor.OpRecord`
of kind ``"a2a"`` (the policy's name for the urgent kind), with its ready, start and end
times.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..observe import A2AObserver, A2AReport, check_observer


def _wait_all(started: Any) -> Any:
    """Wait for what a start function returned: a ``Work`` (anything with ``wait()``), a
    list or tuple of them (``dist.batch_isend_irecv``), or a finished result (returned)."""
    if isinstance(started, (list, tuple)) and started and all(hasattr(w, "wait") for w in started):
        for w in started:
            w.wait()
        return started
    if hasattr(started, "wait") and not isinstance(started, torch.Tensor):
        started.wait()
    return started


class UrgentOp:
    """An urgent operation in flight; :meth:`wait` waits for it and reports its end (once).
    Also a context manager whose exit waits."""

    def __init__(self, report: A2AReport, started: Any):
        self._report, self.started, self._done = report, started, False

    def wait(self) -> Any:
        """Wait for the operation; returns what its start function returned."""
        if not self._done:
            self._done = True
            return self._report.finish(lambda: _wait_all(self.started))
        return self.started

    def is_completed(self) -> bool:
        if self._done:
            return True
        ws = self.started if isinstance(self.started, (list, tuple)) else [self.started]
        return all(bool(w.is_completed()) for w in ws if hasattr(w, "is_completed"))

    def __enter__(self) -> "UrgentOp":
        return self

    def __exit__(self, *exc) -> None:
        self.wait()


def urgent(observer: A2AObserver, start: Callable[..., Any], *args: Any, nbytes: int = 0,
           device: torch.device | str | None = None, **kwargs: Any) -> UrgentOp:
    """Launch ``start(*args, **kwargs)`` as an urgent operation of ``observer`` (a
    :class:`~commsched.priority.executor.GradScheduler`, or any all-to-all observer).

    The observer is told first (``a2a_begin(nbytes)``), so from now until
    :meth:`UrgentOp.wait` returns a ``lina`` scheduler launches no background micro-op
    (``fifo`` and ``serial`` never hold for urgent work); then
    ``start`` runs at once. ``start`` returns a ``Work`` (``dist.isend``, an ``async_op=True``
    collective), a list of them (``dist.batch_isend_irecv``), or anything else when it
    completed by itself (a blocking call): the operation then ends at ``wait()``.
    ``nbytes``: bytes it puts on the wire (recorded, and what the observer is told);
    ``device``: where the time blocked in ``wait()`` is measured (default: the observer's
    ``device``, else the CPU). On NCCL urgent operations and micro-ops are collectives on
    different communicators: keep the ``program`` launch rule (the default on CUDA), under
    which every rank launches them in the same interleaving.
    """
    if not callable(start):
        raise TypeError(f"urgent() needs a function that starts the operation, got {type(start).__name__}; "
                        "pass it with its arguments: sched.urgent(dist.isend, tensor, dst)")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0 (bytes the urgent operation sends), got {nbytes!r}")
    if observer is None:
        raise TypeError("urgent() needs the scheduler (or another all-to-all observer) to tell, got None")
    check_observer(observer)
    dev = device if device is not None else getattr(observer, "device", "cpu")
    report = A2AReport(observer, nbytes, dev)
    try:
        started = start(*args, **kwargs)
    except BaseException:
        report.finish(lambda: None)  # ended: the scheduler must not hold background work for it
        raise
    return UrgentOp(report, started)


__all__ = ["UrgentOp", "urgent"]
