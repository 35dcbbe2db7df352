"""Lina's schedule inside ``torch.nn.parallel.DistributedDataParallel``: a communication hook.

Legend: none (gradients are flat views of DDP's bucket buffers).

An existing DDP job gets all-to-all-first micro-op scheduling with one line::

    ddp = LinaDDP(model, events=events)                 # instead of DistributedDataParallel(model)

or, keeping its own ``DistributedDataParallel`` (expert parameters must be left out of it
before it is built, since DDP broadcasts rank 0's parameters at construction)::

    ignore_grouped_params(model)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(LinaState(ddp, events=events), lina_hook)

Design: a real ``register_comm_hook`` hook can carry the policy. DDP hands the hook each
bucket (in bucket order, once every gradient of it is ready) and waits for the returned
futures only at the end of the backward pass. :func:`lina_hook` reports the bucket's
gradients (views of its buffer) to one :class:`~commsched.priority.runtime.executor.GradScheduler`,
which cuts them into micro-ops and launches them when the policy allows -- after the
all-to-all that the MoE layers report to the same state (it is an
:class:`~commsched.comm.observe.A2AObserver`: register it with the layers' ``A2AEvents``) --
and returns a future completed when the bucket's last micro-op is done. The micro-ops go
over a process group of their own (DDP's ranks; made by the state, or ``group=``), never
DDP's group itself: the all-to-all often uses that one (an expert group of all ranks is
the default group), and two collectives issued on one group in different orders on two
ranks deadlock -- which Lina's holding and credit would do. What the hook
cannot change is DDP's readiness unit: a micro-op becomes ready when its *bucket* does
(a smaller ``bucket_cap_mb`` gives the policy finer readiness). The last bucket
(``bucket.is_last()``) ends the backward pass for the policy, so nothing is held back
while DDP waits for the futures. Schedules: the micro-op ones (``lina``, ``serial``) and
``fifo`` (:class:`~commsched.priority.policy.FifoConfig`: fused buckets of ``bucket_bytes``
launched as soon as they are ready, the baseline of an expert-parallel model, whose experts
a plain DDP cannot hold). An operation can carry gradients of several DDP buckets (fifo's
buckets are not DDP's); each bucket's future completes after the last operation that
carries any of its gradients.

Step boundaries follow DDP's: a forward pass of the DDP module with grad enabled outside
``no_sync()`` opens a step, and an autograd callback queued by the first hook call closes it
at the end of that backward pass (:meth:`GradScheduler.finish`). Inside ``ddp.no_sync()``
DDP calls no hook and the state opens no step, so every gradient, expert ones included,
only accumulates; the next synchronising backward reduces the sums exactly as DDP does.
Two synchronising backward passes in one optimizer step (no ``no_sync()`` and no
``zero_grad()`` between) are exact too, as in DDP: the expert gradients' reduced sum of the
first is set aside while the second step reduces only its own gradients, then added back
(without that, the sum would be scaled by 1/world and re-reduced: about 40% off with
expert-data-parallel groups of 2 in 4 ranks). Local accumulation on top of a reduced sum
(``no_sync()`` passes after a synchronising one, without ``zero_grad()``) cannot be split
and raises a RuntimeError at the next synchronising forward pass.
DDP's rebuilt bucket order (after its first iteration) is learnt from the hook calls and
the scheduler's operation order follows it from the next step (every rank sees DDP's
order, which DDP takes from rank 0, so every rank rebuilds alike).

Grouped parameters. A parameter marked with :func:`set_grad_group` (the expert-parallel
:class:`~commsched.moe.model.layer.MoELayer` marks its experts) is not data-parallel over DDP's
group: each rank holds different values. :func:`ignore_grouped_params` (done by
:class:`LinaDDP`) keeps DDP away from them -- no broadcast from rank 0 at construction, no
averaging -- and the state reduces their gradients itself: scaled by 1 / (DDP's world size)
and summed over their own group (the expert-data-parallel group of ranks holding the same
experts; none when the expert-parallel group spans every rank), as
:mod:`commsched.moe.train.trainer` and DeepSpeed MoE do. They are hooked directly (their gradient
does not pass through DDP's buckets) and reduced after DDP's buckets. :func:`check_ddp`
(called by the MoE layer's forward pass) raises when a plain DDP reduces such parameters
or leaves their gradients to nobody.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..comm.observe import A2AEvents
from ..dist import new_group
from .policy import FifoConfig, LinaConfig, MicroOpConfig, ScheduleConfig
from .runtime.executor import GradScheduler, group_size

GRAD_GROUP_ATTR = "_commsched_grad_group"  # on a parameter: its GradGroup
STATE_ATTR = "_commsched_lina"  # on a DistributedDataParallel: its LinaState
_CHECKED_ATTR = "_commsched_ddp_checked"  # on a layer: id of the DDP it was checked under


@dataclass(frozen=True)
class GradGroup:
    """Where a parameter's gradient is reduced instead of DDP's group: summed over ``group``
    (a process group, or :data:`~commsched.priority.runtime.executor.LOCAL` for no communication)
    after scaling by 1 / ``world``, the data-parallel world size the layout assumes (for
    experts: expert-parallel size x expert-data-parallel group size)."""

    group: Any
    world: int


def set_grad_group(params: Iterable[torch.Tensor], group: Any, world: int) -> None:
    """Mark ``params`` as reduced over ``group`` rather than by DDP (see :class:`GradGroup`)."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive number of ranks, got {world!r}")
    for p in params:
        setattr(p, GRAD_GROUP_ATTR, GradGroup(group, world))


def grad_group(p: torch.Tensor) -> GradGroup | None:
    """The :class:`GradGroup` of ``p``, or None for an ordinary data-parallel parameter."""
    return getattr(p, GRAD_GROUP_ATTR, None)


def grouped_param_names(module: nn.Module) -> list[str]:
    """Fully qualified names of the marked parameters of ``module``."""
    return [n for n, p in module.named_parameters() if grad_group(p) is not None]


def ignore_grouped_params(module: nn.Module) -> list[str]:
    """Tell DDP to leave ``module``'s marked parameters alone (call before wrapping it);
    names already ignored are kept. Returns the marked names."""
    names = grouped_param_names(module)
    # DDP's reducer spells a parameter of the root module ".name" ("{module_name}.{param_name}"
    # with an empty module name) where the rest of DDP says "name": give both
    spelled = names + ["." + n for n in names if "." not in n]
    old = list(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, old + [n for n in spelled if n not in old])
    return names


def _reduced_by_ddp(ddp: DistributedDataParallel) -> list[tuple[str, nn.Parameter]]:
    ignore = set(getattr(ddp, "parameters_to_ignore", ()))
    return [(n, p) for n, p in ddp.module.named_parameters() if n not in ignore and p.requires_grad]


def check_ddp(owner: nn.Module, params: Iterable[torch.Tensor]) -> None:
    """Inside the forward pass of a ``DistributedDataParallel`` (none: nothing to check),
    raise a ValueError unless that DDP leaves ``params`` to a :class:`LinaState`. Checked
    once per DDP module and ``owner``."""
    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None or getattr(owner, _CHECKED_ATTR, None) == id(ddp):
        return
    ids = {id(p) for p in params}
    reduced = [n for n, p in _reduced_by_ddp(ddp) if id(p) in ids]
    fix = ("wrap the model in commsched.priority.LinaDDP(model, ...) instead of DistributedDataParallel "
           "(or call commsched.priority.ignore_grouped_params(model) before DistributedDataParallel(model) "
           "and register commsched.priority.lina_hook with a LinaState)")
    if reduced:
        raise ValueError(
            f"{type(owner).__name__} holds this rank's own experts, but DistributedDataParallel reduces them "
            f"({', '.join(reduced[:3])}{', ...' if len(reduced) > 3 else ''}): DDP replaced every rank's experts "
            f"with rank 0's when it was built and would average expert gradients over the expert-parallel ranks; {fix}")
    if getattr(ddp, STATE_ATTR, None) is None:
        raise ValueError(
            f"{type(owner).__name__} holds this rank's own experts, which DistributedDataParallel ignores, but no "
            f"commsched LinaState reduces their gradients (they would be neither scaled nor averaged over the "
            f"ranks holding the same experts); {fix}")
    setattr(owner, _CHECKED_ATTR, id(ddp))


def _any_nonzero(tensors: list[torch.Tensor]) -> bool:
    """Whether any element of ``tensors`` is nonzero (NaN counts): the per-tensor flags are
    stacked on each device and read back once per device, not once per tensor."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t.ne(0).any())
    return any(bool(torch.stack(flags).any()) for flags in by_device.values())


class LinaState:
    """The state of :func:`lina_hook` on ``ddp``: one :class:`GradScheduler` over DDP's
    parameters (reported by the hook) and the marked ones (hooked), and the observer the
    MoE layers report their all-to-alls to (``events``: registered with it here).

    ``schedule``: ``lina``, ``serial`` or ``fifo`` (default ``LinaConfig()``); ``timeout_s``:
    the scheduler's (default ``COMMSCHED_TIMEOUT_S``). ``last_stats``: the timings
    :meth:`GradScheduler.finish` returned for the last step. ``group``: the process group of
    the gradient micro-ops, over DDP's ranks and used by no all-to-all (default: a new one,
    :func:`commsched.dist.new_group`). Construction is collective over the default group
    (the new group, the scheduler's registration check)."""

    def __init__(self, ddp: DistributedDataParallel, schedule: ScheduleConfig | None = None, *,
                 events: A2AEvents | None = None, timeout_s: float | None = None, group: Any = None):
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"LinaState needs a torch.nn.parallel.DistributedDataParallel, got {type(ddp).__name__}")
        cfg = schedule or LinaConfig()
        if not isinstance(cfg, (MicroOpConfig, FifoConfig)):
            raise ValueError(f"schedule {cfg.name!r} cannot run in a DDP communication hook: the hook runs the "
                             "micro-op schedules ('lina', 'serial') and 'fifo' (buckets launched as soon as ready)")
        if getattr(ddp, STATE_ATTR, None) is not None:
            raise ValueError("this DistributedDataParallel already has a commsched LinaState")
        self.ddp, self.cfg, self.timeout_s = ddp, cfg, timeout_s
        self.world = group_size(ddp.process_group)
        if group is None:
            group = new_group(dist.get_process_group_ranks(ddp.process_group), timeout_s=timeout_s)
        elif group_size(group) != self.world:
            raise ValueError(f"group has {group_size(group)} ranks, DDP's process group {self.world}")
        self.group = group
        named = _reduced_by_ddp(ddp)
        bad = [n for n, p in named if grad_group(p) is not None]
        if bad:
            raise ValueError(
                f"DistributedDataParallel reduces {len(bad)} expert (grouped) parameters ({', '.join(bad[:3])}"
                f"{', ...' if len(bad) > 3 else ''}), so it replaced each rank's experts with rank 0's when it was "
                "built: call commsched.priority.ignore_grouped_params(model) before DistributedDataParallel(model), "
                "or use commsched.priority.LinaDDP(model)")
        self._names = {id(p): n for n, p in ddp.module.named_parameters()}
        self._ddp_params = {id(p): p for _, p in named}
        self._grouped = [(n, p, grad_group(p)) for n, p in ddp.module.named_parameters()
                         if grad_group(p) is not None and p.requires_grad]
        for n, _, gg in self._grouped:
            if gg.world != self.world:
                raise ValueError(
                    f"expert parameter {n!r} is laid out for {gg.world} data-parallel ranks (expert-parallel size x "
                    f"expert-data-parallel group size) but DDP's group has {self.world}: give the MoE layers the group "
                    "of ranks that hold the same experts (expert_dp_group)")
        self._lock = threading.Lock()
        self._futs: dict[int, list] = {}  # bucket index -> [future, buffer, operations left]
        self._bucket_of: dict[int, list[int]] = {}  # operation -> the buckets it carries gradients of
        self._seen: list[int] = []  # this step's parameter order, as DDP's buckets brought them
        self._queued = False
        self.last_stats: dict | None = None
        self._sched: GradScheduler | None = None
        # grouped parameter -> (its gradient tensor, that tensor's version) right after a step
        # reduced it; a step that opens with the same, untouched tensor adds to a reduced sum
        self._reduced: dict[int, tuple[weakref.ref, int]] = {}
        self._stash: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._build([id(p) for _, p in reversed(named)])
        self._fwd = ddp.register_forward_hook(self._after_forward)
        self._events = events.register(self) if events is not None else None
        setattr(ddp, STATE_ATTR, self)

    def _build(self, order: list[int]) -> None:
        if self._sched is not None:
            self._sched.close()
        ddp_ps = [self._ddp_params[i] for i in order]
        entries = [(p, self.group, 1.0 / self.world) for p in ddp_ps]
        entries += [(p, gg.group, 1.0 / self.world) for _, p, gg in self._grouped]
        names = [self._names[id(p)] for p, _, _ in entries]
        device = ddp_ps[0].device if ddp_ps else None
        self._order = order
        self._sched = GradScheduler(entries, self.cfg, timeout_s=self.timeout_s, device=device, names=names,
                                    external=ddp_ps, on_complete=self._op_done)

    @property
    def scheduler(self) -> GradScheduler:
        return self._sched

    # ------------------------------------------------------------------ step boundaries
    def _after_forward(self, module, inputs, output) -> None:
        if not (torch.is_grad_enabled() and self.ddp.require_backward_grad_sync):
            return  # DDP synchronises nothing after this forward pass (no_sync, eval)
        if self._sched.active:
            return  # a forward pass without a backward pass: the open step serves
        if self._seen and self._seen != self._order and len(self._seen) == len(self._order):
            self._build(self._seen)  # DDP rebuilt its buckets: follow their order
        self._seen = []
        self._stash_reduced()
        self._sched.begin_step()

    def _stash_reduced(self) -> None:
        """Two synchronising backward passes in one optimizer step (no ``no_sync``, no
        ``zero_grad`` between): DDP's dense gradients come out exact (rank-equal sum plus the
        new average), but a grouped (expert) gradient that still holds the last step's
        reduced sum would be scaled by 1/world and summed over its group again. So the
        reduced sum is set aside while the step reduces only the new gradient, and added
        back at its end (exact, as DDP). A reduced sum that local accumulation was added to
        since (``no_sync`` passes without ``zero_grad``) cannot be split again: refused."""
        self._stash = []
        moved: list[tuple[str, torch.Tensor]] = []  # written since the reduction: zeroed, or added to
        for name, p, _ in self._grouped:
            rec = self._reduced.get(id(p))
            g = p.grad
            if rec is None or g is None or rec[0]() is not g:
                continue
            if g._version == rec[1]:
                self._stash.append((p, g))
                p.grad = None
            else:
                moved.append((name, g))
        self._reduced.clear()
        # zero_grad(set_to_none=False) moves every version each step: one device read per step
        # and device for all of them (not one per parameter), the culprit named only on error
        if moved and _any_nonzero([g for _, g in moved]):
            name = next(n for n, g in moved if bool(g.any()))
            raise RuntimeError(
                f"LinaDDP: the gradient of expert parameter {name!r} holds the last step's reduced sum "
                "with local gradients added since (backward passes inside no_sync() after a "
                "synchronising one, without zero_grad): its parts cannot be told apart. Call "
                "optimizer.zero_grad() after each optimizer step, or run every micro-batch but the "
                "last inside no_sync()")

    def _bucket(self, bucket) -> torch.futures.Future:
        sched = self._sched
        if not sched.active:
            raise RuntimeError("lina_hook was called outside a step: the backward pass must follow a forward pass "
                               "of the DistributedDataParallel module that carries this LinaState")
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True
        buf = bucket.buffer()
        params = bucket.parameters()
        fut = torch.futures.Future(devices=[buf.device]) if buf.device.type == "cuda" else torch.futures.Future()
        # an operation may carry several parameters, of this bucket and of others (fifo's
        # buckets are not DDP's): the bucket waits for each of its operations once
        ops = list(dict.fromkeys(seq for p in params for seq in sched.ops_of(p)))
        with self._lock:
            self._futs[bucket.index()] = [fut, buf, len(ops)]
            for seq in ops:
                self._bucket_of.setdefault(seq, []).append(bucket.index())
        off = 0
        for p in params:
            self._seen.append(id(p))
            sched.grad_ready(p, buf[off:off + p.numel()].view_as(p))
            off += p.numel()
        if bucket.is_last():
            sched.end_backward()
        if not ops:
            self._complete(bucket.index(), None)
        return fut

    def _op_done(self, seq: int, error: BaseException | None) -> None:
        """An operation is done (the scheduler's lock held): complete the future of each bucket
        it carries after that bucket's last operation, or fail it."""
        for b in self._bucket_of.get(seq, ()):  # none: an operation of grouped (expert) parameters
            with self._lock:
                entry = self._futs.get(b)
                if entry is None:
                    continue
                entry[2] -= 1
                last = entry[2] <= 0 or error is not None
            if last:
                self._complete(b, error)

    def _complete(self, b: int, error: BaseException | None) -> None:
        with self._lock:
            entry = self._futs.pop(b, None)
        if entry is None:
            return
        fut, buf, _ = entry
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(buf)

    def _end_of_backward(self) -> None:
        self._queued = False
        try:
            self.last_stats = self._sched.finish()
            for p, prev in self._stash:  # the set-aside reduced sum, plus this step's
                if p.grad is not None:
                    prev.add_(p.grad)
                p.grad = prev
            self._stash = []
            for _, p, _ in self._grouped:
                if p.grad is not None:
                    self._reduced[id(p)] = (weakref.ref(p.grad), p.grad._version)
        finally:
            with self._lock:
                left, self._futs, self._bucket_of = self._futs, {}, {}
            for fut, _, _ in left.values():  # only after a failure: never leave DDP waiting
                if not fut.done():
                    fut.set_exception(RuntimeError("the step ended before this bucket was reduced"))

    # ------------------------------------------------------------------ observer (the MoE layers)
    def a2a_begin(self, nbytes: int) -> object:
        return self._sched.a2a_begin(nbytes)

    def a2a_end(self, token: object) -> None:
        self._sched.a2a_end(token)

    def a2a_blocked(self, seconds: float) -> None:
        self._sched.a2a_blocked(seconds)

    def a2a_blocked_interval(self, a, b) -> None:
        self._sched.a2a_blocked_interval(a, b)

    def block_begin(self) -> None:
        self._sched.block_begin()

    def block_end(self) -> None:
        self._sched.block_end()

    def close(self) -> None:
        """Stop the scheduler's thread and remove the hooks (the DDP keeps its comm hook)."""
        self._fwd.remove()
        if self._events is not None:
            self._events.remove()
        self._sched.close()


def lina_hook(state, bucket):
    """DDP communication hook (``ddp.register_comm_hook(state, lina_hook)``, ``state`` a
    :class:`LinaState`): reduce ``bucket`` (a ``dist.GradBucket``) through Lina's policy;
    returns a ``torch.futures.Future`` of the reduced buffer. Module docstring: the design."""
    return state._bucket(bucket)


class LinaDDP(DistributedDataParallel):
    """``DistributedDataParallel`` with :func:`lina_hook` registered and the marked (expert)
    parameters left out of DDP's reduction: ``LinaDDP(model, events=events, **ddp_kwargs)``.
    ``schedule``, ``events``, ``timeout_s``, ``group``: :class:`LinaState`; ``self.lina`` is the state.
    Everything else is DDP's (``no_sync()``, ``find_unused_parameters``, ``bucket_cap_mb``)."""

    def __init__(self, module: nn.Module, *, schedule: ScheduleConfig | None = None, events: A2AEvents | None = None,
                 timeout_s: float | None = None, group: Any = None, **ddp_kwargs):
        ignore_grouped_params(module)
        super().__init__(module, **ddp_kwargs)
        self.lina = LinaState(self, schedule, events=events, timeout_s=timeout_s, group=group)
        self.register_comm_hook(self.lina, lina_hook)

    def close(self) -> None:
        self.lina.close()


__all__ = ["GRAD_GROUP_ATTR", "GradGroup", "LinaDDP", "LinaState", "check_ddp", "grad_group", "grouped_param_names",
           "ignore_grouped_params", "lina_hook", "set_grad_group"]
