"""The gradient-communication executor on real process groups, driven by a policy.

Legend: none (gradients are flat views of parameter tensors).

:class:`GradScheduler` registers a post-accumulate-grad hook on every parameter it
synchronises. When a gradient is ready the hook scales it by 1 / (group size) and marks
the allreduce operations that carry it ready; the policy (:mod:`commsched.priority.policy`)
decides when each is launched, always in the same sequence on every rank, as an
asynchronous ``all_reduce`` on the parameter's own process group -- a group separate from
the one the expert all-to-all uses, so both can be on the wire at once, as on a cluster.
The MoE layers report their all-to-alls and expert blocks through the observer methods
(:meth:`a2a_begin`, :meth:`a2a_end`, :meth:`block_begin`, :meth:`block_end`).
:meth:`finish` ends the backward pass and waits for every allreduce, so the optimizer step
that follows sees fully reduced gradients.

Agreement. Construction is collective over the default process group when one is
initialised: the ranks compare (name, shape, dtype, group size) of every entry once, and a
rank that registered other parameters, or the same ones in another order, makes every rank
raise one ValueError naming the first mismatching rank, index and name -- instead of
mismatched collectives (gloo's "collective mismatch" abort, or two swapped same-sized
parameters silently reduced into each other).

Accumulation. A step reduces the gradient one backward pass leaves. To accumulate several
micro-batches, run all but the last backward inside :meth:`no_sync` (the hooks only let
autograd accumulate there); the last backward, outside it, reduces the sum -- exactly what
``DistributedDataParallel.no_sync`` does. Two backward passes that both reach a parameter
between :meth:`begin_step` and :meth:`finish` outside ``no_sync`` raise a RuntimeError
from the second backward (the first one's partial gradient was already on the wire).

Unused parameters. A parameter no gradient reached on this rank contributes zeros, so every
rank launches the same collectives; the reduced gradient is that sum. With
``find_unused_parameters`` (the default) :meth:`finish` also exchanges one small used-flag
tensor per group and leaves ``grad`` None for a parameter no rank of its group used
(scale-only parameters: unused here), as ``DistributedDataParallel(find_unused_parameters=True)``
does; a parameter used on some ranks only gets the sum of their gradients.

External readiness. Parameters named in ``external`` get no hook: their caller reports
each gradient with :meth:`grad_ready` (a tensor of the parameter's shape, such as a view
into a ``DistributedDataParallel`` bucket), which is scaled and reduced in place;
``on_complete(seq, error)`` is called (lock held) when operation ``seq`` is done.
:mod:`commsched.priority.ddp` drives the scheduler this way from a DDP communication hook.

Schedules: ``lina`` (micro-ops, all-to-all first, credit), ``fifo`` (DDP-style fused
buckets launched as soon as ready), ``serial`` (micro-ops, launched only after the
backward pass). All three compute the same sums; only the timing differs.

Hierarchy. With ``ScheduleConfig.hier_reduce`` (``hier=``: the groups of
:func:`commsched.priority.hier.make_hier`; default: built from ``Topology.from_env``) an
operation over all ranks runs in three phases (:mod:`commsched.priority.hier`): inside the
host, across hosts, inside again. The policy sees only the phase across hosts: on the CPU
an operation becomes ready for it when its phase inside the host has finished, and the
gather inside the host follows its completion; on CUDA the three are issued together at
the policy's launch, ordered on the side stream.

Launches happen under one lock, from the compute thread (hooks, observer calls) or from
the executor's own thread (after a completion), so the launch order is the policy's order.

Rooms. This module is the scheduling core (registration, hooks, readiness, launches, the
observer methods, the end of the step). The scheduler holds a
:class:`~commsched.priority.runtime.completion.CompletionTracker` (done-callbacks on the CPU, polled
CUDA events on CUDA, the executor thread) and a :class:`~commsched.priority.runtime.records.Recorder`
(host clock or CUDA events); the bucket layout is :mod:`~commsched.priority.runtime.buckets`; the
groups it makes (bound twins, the hierarchy's) live in a :class:`~commsched.dist.RunGroups`.
On CUDA the policy runs the ``program`` launch rule by default (:mod:`commsched.priority.policy`):
every launch happens at a point of the program, in the same order on every rank, as NCCL
needs. :meth:`finish` calls ``work.wait()`` on every launched ``Work`` before it returns (on
CUDA the caller's stream then waits for the reduction).
"""

from __future__ import annotations

import datetime
import functools
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from ...clock import Clock
from ...config import read_env
from ...dist import (
    CommError,
    RunGroups,
    all_gather_object,
    comm_guard,
    peer_failure_hint,
    unresponsive_note,
)
from ..bind import bound_twins
from ..hier import GATHER, INTRA, HierGroups, HierStep, make_hier
from ..microops import CommOp
from ..policy import FifoConfig, OverlapPolicy, Policy, ScheduleConfig, make_policy
from ..transfer import UrgentOp, urgent
from .buckets import LOCAL, GradSlot, describe, group_ids, plan_buckets, registration_mismatch
from .completion import (
    CompletionTracker,
    Launcher,
    _all_reduce,
    _with_index,
    current_rank,
    group_size,
)
from .records import OpRecord, Recorder


class _Op:
    __slots__ = ("spec", "group", "views", "flat", "missing", "work")

    def __init__(self, spec: CommOp, group, n_tensors: int):
        self.spec, self.group = spec, group
        self.views: list[torch.Tensor] = []
        self.flat: torch.Tensor | None = None
        self.missing = n_tensors
        self.work: Any = None


class GradScheduler:
    """Synchronise the gradients of ``params`` (in launch order) over their groups.

    ``params``: entries ``(parameter, group)`` or ``(parameter, group, scale)``. ``group``
    is a process group (None: the default group) or :data:`LOCAL` for a gradient that is
    only scaled, never communicated. The gradient is multiplied by ``scale`` (default
    1 / group size: a plain average) when it is ready, then summed over the group. The
    scheduler is an :class:`~commsched.comm.observe.A2AObserver`: register it with the
    :class:`~commsched.comm.observe.A2AEvents` the MoE layers were built with. ``timeout_s``:
    how long :meth:`finish` waits for the allreduce (default: ``COMMSCHED_TIMEOUT_S``, see
    :func:`commsched.config.read_env`). ``device``: where the gradients live (default: the
    first parameter's device); it picks the completion tracking and the timing (module
    docstring) and, through ``cfg.launch_rule``, the launch rule. ``launch``: how an
    operation is started (default: an asynchronous ``all_reduce``; tests inject slow fakes).
    ``completion``: ``"callback"`` (the ``Work``'s future) or ``"poll"``
    (``work.is_completed()``, polled by the executor thread); default: the callback on the
    CPU. On CUDA completion is always a polled CUDA event. ``names``: one name per entry
    (default ``param{i}``), used by the construction check's error. ``find_unused_parameters``,
    ``external``, ``on_complete``: module docstring. ``groups``: the :class:`~commsched.dist.RunGroups`
    the scheduler makes its groups in (default: its own, closed with it). ``run_group``: the
    ranks that run this scheduler together (default: every rank), over which they compare
    what they registered (a run on a sub-group passes it).
    """

    def __init__(self, params: Sequence[tuple], cfg: ScheduleConfig, *, timeout_s: float | None = None,
                 device: torch.device | str | None = None, launch: Launcher | None = None,
                 completion: str | None = None, names: Sequence[str] | None = None,
                 find_unused_parameters: bool = True, external: Iterable[torch.Tensor] = (),
                 on_complete: Callable[[int, BaseException | None], None] | None = None,
                 hier: HierGroups | None = None, fallback_buckets: bool = False, groups: RunGroups | None = None,
                 run_group=None):
        self.cfg = cfg
        if device is None:
            device = params[0][0].device if len(params) else torch.device("cpu")
        self.device = _with_index(torch.device(device))
        self._policy = self._make_policy(cfg)
        if names is not None and len(names) != len(params):
            raise ValueError(f"{len(names)} names for {len(params)} parameters")
        self.timeout_s = timeout_s if timeout_s is not None else read_env().timeout_s
        self._cuda = self.device.type == "cuda"
        self.groups, self._own_groups = groups if groups is not None else RunGroups(), groups is None
        # hierarchical operations: all three phases issued at the launch, ordered on the side
        # stream (CUDA); else phase by phase on completions (gloo; priority/hier.py)
        self._chained = self._cuda
        if completion not in (None, "callback", "poll"):
            raise ValueError(f"completion must be 'callback', 'poll' or None, got {completion!r}")
        self._completion = "event" if self._cuda else (completion or "callback")
        self._launch = launch or _all_reduce
        # a launcher that keys its work by the operation (CompressedLauncher) is given it
        self._launch_takes_op = bool(getattr(self._launch, "takes_op", False))
        self.clock = Clock(self.device)
        self.launch_rule = cfg.launch_rule(self.device.type)
        # a launcher that issues its collectives itself (CompressedLauncher) follows the launch
        # rule: under ``program`` from the launching thread, flushed at the end of each program point
        bind = getattr(self._launch, "bind_launch_rule", None)
        if bind is not None:
            bind(self.launch_rule)
        self._launch_flush = getattr(self._launch, "flush", None)
        entries, described = [], []
        for i, e in enumerate(params):
            if not isinstance(e, (tuple, list)) or len(e) not in (2, 3) or not isinstance(e[0], torch.Tensor):
                raise TypeError(f"GradScheduler entry {i} must be (parameter, group) or (parameter, group, scale), "
                                f"got {type(e).__name__}")
            p, g = e[0], e[1]
            n = 1 if g is LOCAL else group_size(g)
            scale = float(e[2]) if len(e) > 2 else 1.0 / n
            entries.append((p, g if n > 1 else LOCAL, scale, names[i] if names is not None else f"param{i}"))
            described.append(describe(entries[-1][3], p, n))
        # every rank must register the same list, in its given order (collective when several
        # ranks); group identity may differ (each rank has its own expert-data-parallel group),
        # its size may not
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(run_group) > 1:
            msg = registration_mismatch(all_gather_object(
                described, "comparing the parameters every rank's GradScheduler registered", run_group))
            if msg is not None:
                raise ValueError(f"GradScheduler: {msg}")
        # the layout (priority/runtime/buckets.py): communicated parameters first (in the order given),
        # then the scale-only ones; operations never span two groups (nor, for buckets, two dtypes)
        ids = group_ids([g for _, g, _, _ in entries])
        slots = [GradSlot(k, str(p.dtype), p.numel(), p.element_size()) for (p, _, _, _), k in zip(entries, ids)]
        layout = plan_buckets(slots, cfg)
        entries = [entries[i] for i in layout.order]
        self._params = [p for p, _, _, _ in entries]
        self._groups = [g for _, g, _, _ in entries]
        # cfg.reduce_address: reduce over twins of the groups bound to that address (priority/bind.py)
        twins = bound_twins([g for g in self._groups if g is not LOCAL], cfg.reduce_address, self.groups)
        self._groups = [twins.get(id(g), g) if g is not LOCAL else g for g in self._groups]
        self._scale = [s for _, _, s, _ in entries]
        self.names = [nm for _, _, _, nm in entries]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._find_unused = bool(find_unused_parameters)
        self._on_complete = on_complete
        ext = {id(p) for p in external}
        if not ext <= set(self._index):
            raise ValueError("external parameters must be among the scheduler's parameters")
        self._external = [id(p) in ext for p in self._params]
        # the hierarchy of cfg.hier_reduce: hier when given, else built from the ranks' hosts
        # (collective); None: reduce flat
        if hier is not None and not cfg.hier_reduce:
            raise ValueError("GradScheduler got hier= but its ScheduleConfig has hier_reduce=False")
        if hier is None and cfg.hier_reduce:
            from ...cluster.topology import Topology

            hier = make_hier(Topology.from_env(), run=self.groups)
        self._hier = hier
        # the operations of each mode (set_fallback): the schedule's own; with
        # fallback_buckets the fallback's are fifo's buckets (the same parameter order)
        self._layouts = {False: self._derive(layout)}
        if fallback_buckets and cfg.probes:
            fifo = plan_buckets(slots, FifoConfig())
            assert fifo.order == layout.order, "the bucket layouts must keep the parameters' order"
            self._layouts[True] = self._derive(fifo)
        self.ops, self._op_groups, self._op_hier, self._ops_of_param = self._layouts[False]
        self._hier_step: HierStep | None = None
        p = self._policy
        self._holds = (p.hold_for_a2a, p.hold_in_block, p.credit_bytes)
        self._fallback = False
        self._side = torch.cuda.Stream(self.device) if self._cuda else None
        self._cv = threading.Condition()
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(self._params) if not self._external[i]]
        self._error: BaseException | None = None
        self._active = False
        self._sync = True  # False inside no_sync(): backward passes only accumulate
        self._a2a_key = 0
        self.recorder = Recorder(self.clock, self._cuda)
        self.tracker = CompletionTracker(self._cv, self._completion, self.device, self.clock, self._side,
                                         completed=self._completed, pump=self._pump, fail=self._fail,
                                         active=lambda: self._active)

    def _make_policy(self, cfg: ScheduleConfig) -> Policy:
        """The policy of ``cfg`` on this device; every schedule but ``lina-overlap``."""
        policy = make_policy(cfg, self.device.type)
        if isinstance(policy, OverlapPolicy):
            raise ValueError("the 'lina-overlap' schedule leaves the reduction running into the next forward "
                             "pass: run it with commsched.priority.runtime.overlap.OverlapScheduler and OverlapOptimizer")
        return policy

    @property
    def records(self) -> list[OpRecord]:
        """The last finished step's records, in timeline order."""
        return self.recorder.records

    def _fail(self, err: BaseException, keep_first: bool = False) -> None:
        """Hand ``err`` to whoever waits (lock held); ``keep_first``: unless one is there."""
        if not keep_first or self._error is None:
            self._error = err
        self._cv.notify_all()

    def _derive(self, layout) -> tuple[list[CommOp], list, list[bool], list[list[int]]]:
        """(operations, their groups, whether each goes through the hierarchy, the operations
        of each parameter) of one bucket layout. Operations over all ranks go through the
        hierarchy (priority/hier.py) when there is one, unless they are too small for it to
        pay (ScheduleConfig.hier_min_bytes)."""
        ops = list(layout.ops)
        groups = [self._groups[k] for k in layout.op_first]
        hier = [self._hier is not None and group_size(g) == self._hier.world_size
                and spec.nbytes >= self.cfg.hier_min_bytes for spec, g in zip(ops, groups)]
        return ops, groups, hier, [list(o) for o in layout.ops_of_param]

    # ------------------------------------------------------------------ step
    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @property
    def active(self) -> bool:
        """Whether a step is open (between :meth:`begin_step` and :meth:`finish`)."""
        return self._active

    def ops_of(self, p: torch.Tensor) -> list[int]:
        """Sequence numbers of the operations that carry ``p``'s gradient."""
        return list(self._ops_of_param[self._index[id(p)]])

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients; the next one outside reduces the
        sum (module docstring, "Accumulation"). Usable before or after :meth:`begin_step`."""
        if not self._sync:
            raise RuntimeError("GradScheduler.no_sync() is already active (it does not nest)")
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def begin_step(self) -> None:
        with self._cv:
            self.tracker.check_alive()
            if self._active:
                raise RuntimeError("begin_step called twice without finish()")
            self._apply_fallback()
            self._policy.begin_step(len(self.ops))
            self._state = [_Op(spec, g, len(spec.tensors)) for spec, g in zip(self.ops, self._op_groups)]
            self._param_ready = [False] * len(self._params)
            self._src: list[torch.Tensor | None] = [None] * len(self._params)
            self._used = [False] * len(self._params)
            self.recorder.reset()
            self.tracker.polled = {}
            if self._hier is not None:
                self._hier_step = HierStep(self._hier, self._hier_done, chained=self._chained)
                self._hier_step.expect([s for s, h in enumerate(self._op_hier) if h])
            self.recorder.start()
            self._active = True

    def set_fallback(self, on: bool) -> None:
        """From the next :meth:`begin_step` on: launch every operation as soon as it is ready
        (fifo's rule, on this schedule's micro-ops, or with ``fallback_buckets`` on fifo's
        buckets) when ``on``, else the schedule's own rule again (priority/fallback.py
        decides). Every rank must set the same."""
        with self._cv:
            self._fallback = bool(on)

    def _apply_fallback(self) -> None:
        p = self._policy
        self.ops, self._op_groups, self._op_hier, self._ops_of_param = \
            self._layouts[self._fallback and True in self._layouts]
        if self._fallback:
            p.hold_for_a2a, p.hold_in_block, p.credit_bytes = False, False, None
        else:
            p.hold_for_a2a, p.hold_in_block, p.credit_bytes = self._holds

    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if not self._active:
                return
            with self._cv:
                if self._check_second_gradient(i):
                    return
                self._grad_ready(i)
                self._pump()
        return hook

    def _check_second_gradient(self, i: int) -> bool:
        """True inside no_sync (nothing to do); raises when parameter ``i`` was already reduced
        in this step (lock held, step active)."""
        if self._param_ready[i]:
            raise RuntimeError(
                f"GradScheduler: parameter {self.names[i]!r} received a second gradient in one step: its "
                "first backward pass's gradient is already being reduced. Run the backward passes of all "
                "micro-batches but the last inside `with scheduler.no_sync():`, then finish()")
        return not self._sync

    def grad_ready(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """An ``external`` parameter's gradient is ready in ``grad`` (its shape; reduced in place)."""
        i = self._index[id(p)]
        if not self._external[i]:
            raise ValueError(f"parameter {self.names[i]!r} is not external: its hook reports it")
        if grad.shape != p.shape:
            raise ValueError(f"gradient of {self.names[i]!r} has shape {list(grad.shape)}, the parameter "
                             f"{list(p.shape)}")
        with self._cv:
            if not self._active:
                raise RuntimeError("grad_ready() outside a step: call begin_step() first")
            if self._check_second_gradient(i):
                return
            self._grad_ready(i, grad)
            self._pump()

    def end_backward(self) -> None:
        """Tell the policy the backward pass is over (no all-to-all follows before the
        optimizer step), so it holds nothing back; :meth:`finish` does this too."""
        with self._cv:
            if self._active:
                self._policy.end_backward()
                self._pump()

    def _grad_ready(self, i: int, src: torch.Tensor | None = None) -> None:
        if self._param_ready[i]:
            return
        self._param_ready[i] = True
        p = self._params[i]
        self._used[i] = src is not None or p.grad is not None
        if src is None:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            src = p.grad
        self._src[i] = src
        if self._scale[i] != 1.0:
            src.mul_(self._scale[i])
        for seq in self._ops_of_param[i]:
            st = self._state[seq]
            st.missing -= 1
            if st.missing == 0:
                st.views = [self._src[pc.tensor].view(-1)[pc.offset:pc.offset + pc.numel] for pc in st.spec.pieces]
                st.flat = st.views[0] if len(st.views) == 1 else torch.cat(st.views)
                # a hierarchical operation is ready for the policy once its host-local phase is done
                if not self._op_hier[seq] or self._hier_step.ready(seq, st.flat, st.spec.nbytes):
                    self._policy.allreduce_ready(seq, st.spec.nbytes)
                self.recorder.open("allreduce", seq, st.spec.nbytes)

    def _pump(self) -> None:
        """Launch what the policy allows now (caller holds the lock)."""
        if self._hier_step is not None:
            self._hier_step.pump()  # the host-local phases, in sequence order
        for launch in self._policy.next_ops():
            if launch.kind == "a2a":
                self.recorder.stamp("a2a", launch.key, "start_s")
                continue
            seq = int(launch.key)  # type: ignore[arg-type]
            st = self._state[seq]
            self.recorder.stamp("allreduce", seq, "start_s")
            try:
                launch = functools.partial(self._launch, op=seq) if self._launch_takes_op else self._launch
                if not self._op_hier[seq]:
                    work = launch(st.flat, st.group)
                elif self._chained:  # all three phases now, ordered on the side stream
                    work = self._hier_step.launch_chained(seq, launch, self._side)
                else:  # the phase across hosts: this rank's shard over its cross group
                    work = launch(self._hier_step.inter_tensor(seq), self._hier_step.cross)
            except RuntimeError as e:
                self._fail(CommError(f"rank {current_rank()}: launching allreduce {seq} failed: {e}"))
                if self._on_complete is not None:
                    self._on_complete(seq, self._error)
                continue
            st.work = work
            self.tracker.watch(seq, work)
        if self._launch_flush is not None:
            # the launches of this program point, summed together now (CompressedLauncher)
            self._launch_flush()

    # ------------------------------------------------------------------ completions (CompletionTracker)
    def _completed(self, seq: int, end_mark: Any = None, error: BaseException | None = None) -> None:
        """Allreduce ``seq`` is done (lock held), or failed with ``error``; ``end_mark``: its
        CUDA event. For a hierarchical operation on the CPU its phase across hosts is, and
        the gather follows (:meth:`_hier_done`)."""
        if error is not None:
            if self._error is None:
                self._error = CommError(f"rank {current_rank()}: allreduce {seq} failed: {error}")
            error = self._error
        staged = self._op_hier[seq] and not self._chained
        if self._hier_step is not None and self._op_hier[seq]:
            self._hier_step.inter_done(seq)
        if self._on_complete is not None and (not staged or error is not None):
            self._on_complete(seq, error)
        self.recorder.stamp("allreduce", seq, "end_s", end_mark)
        try:
            self._policy.allreduce_done(seq)
        except ValueError:
            pass
        self.tracker.wake()

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
                self.recorder.stamp("allreduce", seq, "end_s")
                if self._on_complete is not None:
                    self._on_complete(seq, None)
            self.tracker.wake()

    # ------------------------------------------------------------------ observer (compute thread)
    def a2a_begin(self, nbytes: int) -> object:
        with self._cv:
            key = self._a2a_key
            self._a2a_key += 1
            if self._active:
                self.recorder.open("a2a", key, nbytes)
            self._policy.a2a_waiting(key, nbytes)
            self._pump()
            return key

    def a2a_end(self, token: object) -> None:
        with self._cv:
            self._policy.a2a_done(token)
            self.recorder.stamp("a2a", token, "end_s")
            if self._active:
                self._pump()

    def a2a_blocked(self, seconds: float) -> None:
        self.recorder.blocked_s += seconds  # compute thread only

    def a2a_blocked_interval(self, a: Any, b: Any) -> None:
        """The blocked time as two clock marks (:meth:`Recorder.blocked`)."""
        self.recorder.blocked(a, b)

    def block_begin(self) -> None:
        with self._cv:
            self._policy.block_begin()

    def block_end(self) -> None:
        with self._cv:
            self._policy.block_end()
            if self._active:
                self._pump()

    # ------------------------------------------------------------------ end of step
    def finish(self) -> dict:
        """End the backward pass, wait for every allreduce, return this step's timings.

        Returns only after ``work.wait()`` of every launched operation: on the CPU the
        reduced values are then in place; on CUDA the caller's current stream waits for the
        reductions, so whatever it runs next (the copy-back here, the optimizer step) reads
        reduced gradients."""
        t_end = self.recorder.now()
        end_mark = self.clock.mark() if self._cuda else None
        with self._cv:
            if not self._active:
                raise RuntimeError("finish() without begin_step()")
            if not self._sync:
                raise RuntimeError("finish() inside GradScheduler.no_sync(): leave the no_sync block and run the "
                                   "last micro-batch's backward pass outside it, then finish()")
            for i in range(len(self._params)):
                if not self._param_ready[i]:  # no gradient reached this parameter on this rank
                    self._grad_ready(i)
            self._policy.end_backward()
            self._pump()
            hs = self._hier_step
            ok = self._cv.wait_for(lambda: self._error is not None or (
                self._policy.finished and (hs is None or hs.pending == 0)), timeout=self.timeout_s)
            self._active = False
            failure = None
            if self._error is not None:
                failure, self._error = self._error, None
            elif not ok:
                hanging = sorted(self._policy._ar_inflight)
                failure = CommError(f"rank {current_rank()}: gradient allreduce did not finish within "
                                    f"{self.timeout_s:.0f} s ({self._policy.allreduce_pending} not "
                                    f"launched; launched and not complete: operations {hanging[:8]}"
                                    f"{' ...' if len(hanging) > 8 else ''}): a peer did not take part")
            state = self._state
        if failure is not None:
            # let every launched operation end (each fails by the backend's own timeout at
            # the latest) before the error leaves: a Work still running when the process
            # groups are destroyed aborts the process ("terminate ... gloo::IoException");
            # a Work that takes a timeout gets a bounded one, so the error does leave
            grace = datetime.timedelta(seconds=min(self.timeout_s, 10.0))
            for st in state:
                if st.work is not None:
                    try:
                        st.work.wait(grace)
                    except TypeError:
                        try:
                            st.work.wait()
                        except RuntimeError:
                            pass
                    except RuntimeError:
                        pass
                    st.work = None
            if hs is not None:
                hs.wait_quietly()
            msg = str(failure)
            peer = not ok or peer_failure_hint(msg) is not None
            if peer and "stopped answering" not in msg and "is alive" not in msg:
                msg += unresponsive_note()
            raise CommError(msg) from (failure if not isinstance(failure, CommError) else None)
        # wait on every Work outside the lock (a slow wait must not block the executor thread)
        for st in state:
            if st.work is not None:
                try:
                    st.work.wait()
                except RuntimeError as e:
                    note = unresponsive_note() if peer_failure_hint(str(e)) else ""
                    raise CommError(f"rank {current_rank()}: allreduce {st.spec.seq} failed: {e}{note}") from None
                st.work = None
        if hs is not None:
            try:
                hs.wait_all()
            except RuntimeError as e:
                raise CommError(f"rank {current_rank()}: hierarchical reduction failed: {e}") from None
        with self._cv:
            if hs is not None:
                hs.copy_back()  # padded operations' sums into their buffers
            for st in state:
                if len(st.views) > 1:
                    off = 0
                    for v in st.views:
                        v.copy_(st.flat[off:off + v.numel()])
                        off += v.numel()
                st.views, st.flat = [], None
            used = list(self._used)
            self._src = [None] * len(self._params)
        if self._find_unused:
            self._clear_unused(used)
        with self._cv:
            return self.recorder.timings(t_end, end_mark)

    def _clear_unused(self, used: list[bool]) -> None:
        """Leave ``grad`` None where no rank of the parameter's group used it: one used-flag
        all_reduce per communicated group with hooked parameters (the same on every rank, in
        the order of the list; external parameters are always used). Groups that are not
        process groups (test stand-ins) keep this rank's flags."""
        flags = torch.tensor(used, dtype=torch.int32, device=self.device)
        groups: list[Any] = []
        for g in self._groups:
            if g is not LOCAL and not any(g is h for h in groups):
                groups.append(g)
        for g in groups:
            idx = [i for i, h in enumerate(self._groups) if h is g]
            if all(self._external[i] for i in idx) or not (g is None or isinstance(g, dist.ProcessGroup)):
                continue
            sub = flags[idx].clone()
            with comm_guard("exchanging which parameters were used (GradScheduler.finish)", g):
                dist.all_reduce(sub, group=g)
            flags[idx] = sub
        for i, n in enumerate(flags.tolist()):
            if not n:
                self._params[i].grad = None

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.tracker.close()
        if self._own_groups:
            self.groups.close()

    def __enter__(self) -> "GradScheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ urgent operations
    def urgent(self, start: Callable[..., Any], *args: Any, nbytes: int = 0, **kwargs: Any) -> UrgentOp:
        """Launch ``start(*args, **kwargs)`` now as an urgent operation (a pipeline send, an
        all-to-all): under ``lina`` no micro-op is launched until its ``wait()`` returns, and
        those in flight are within the credit. See :func:`commsched.priority.transfer.urgent`."""
        return urgent(self, start, *args, nbytes=nbytes, **kwargs)


# re-exported: their homes are priority/runtime/buckets.py, records.py and completion.py (group_size)
__all__ = ["LOCAL", "GradScheduler", "OpRecord", "group_size", "registration_mismatch"]

