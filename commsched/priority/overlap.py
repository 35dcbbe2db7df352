"""``lina-overlap``: the gradient reduction's tail overlapped with the next forward pass.

Legend: none (parameters and gradients keep their own shapes).

Lina (``lina``) waits for every gradient before the optimizer step, so once the backward
pass has ended the link carries nothing but allreduce and the compute thread waits. Yet
the next forward pass needs its first layer's parameters first, and only those. This
module lets the step end with its reduction still running:

* :class:`OverlapScheduler` -- a :class:`~commsched.priority.executor.GradScheduler`
  under the ``lina-overlap`` policy (:class:`~commsched.priority.policy.OverlapPolicy`):
  Lina's rule in the backward pass; :meth:`OverlapScheduler.end_backward_async` ends the
  backward pass *without waiting*; the micro-ops still to launch then go in the order the
  next forward pass needs their parameters, under the credit and behind every all-to-all
  of this rank (those of the next forward pass included). Under the ``completion`` launch
  rule the ranks have launched different numbers of micro-ops when their backward passes
  end, so one small asynchronous ``all_gather`` on a control group of its own tells every
  rank the largest count and, in the same message, which parameters each rank used (the
  ``find_unused_parameters`` flags, needed before a group's optimizer step, not after the
  whole reduction); no micro-op waits for it but those of the tail. The tail runs on twins
  of the reduction's process groups, so its first micro-ops do not queue behind those
  launched during the backward pass (gloo runs a group's collectives in launch order).
* :class:`OverlapOptimizer` -- one optimizer per module that holds parameters (any
  optimizer whose update is per parameter: Adam, AdamW, SGD with momentum and weight
  decay; built by a factory), a forward pre-hook on every module, and the stepping: the
  first forward pass records the order in which modules start (the ranks adopt rank 0's);
  a parameter belongs to the first module, itself or an ancestor, that starts in the
  forward pass (the stacked experts of a pipelined MoE layer, which its autograd function
  reads directly, belong to the MoE layer). In the next forward pass a module's pre-hook
  waits until its parameters are reduced and steps their optimizers there, on the compute
  thread (so on CUDA the caller's stream orders everything; no host sync); groups whose
  reduction has ended are stepped at every such point, as soon as the compute thread
  passes one. :meth:`OverlapOptimizer.synchronize` waits for everything and steps what is
  left: evaluation, checkpoints and the end of training call it.

Exactness: each parameter is updated by the same optimizer arithmetic from the same reduced
gradient as under ``fifo`` / ``lina`` (Adam's and SGD's updates are per parameter), so
after k steps the parameters equal ``lina``'s bit for bit, and ``fifo``'s where the sums
are formed in the same order (tests/moe/test_train.py, tests/priority/test_overlap.py). Global
gradient-norm clipping needs every gradient before any step: with ``clip_grad_norm`` the
overlap is off (a warning says so once) and the optimizer steps after the whole reduction.

Limits: a parameter must be used inside the forward pass of the module that holds it (or
of an ancestor that starts first); one read elsewhere before that module starts would see
its old value. The forward order is learned in the first step and kept.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..dist import (
    CommError,
    all_gather_object,
    control_device,
    control_group,
    peer_failure_hint,
    unresponsive_note,
)
from .bind import bind_new_group
from .buckets import LOCAL
from .executor import GradScheduler
from .policy import OverlapPolicy, ScheduleConfig
from .records import OpRecord

# the forward pass waits for parameters in these records of the step (timeline kinds)
UPDATE = "update"    # one group's optimizer step: ready = its module reached, start = reduced, end = stepped
FORWARD = "forward"  # the next step's forward pass: ready = start = its first module, end = complete_step()


def _with_liveness(err: BaseException) -> CommError:
    """``err`` as a CommError naming the rank that stopped answering when it reads as a
    peer's failure (a timeout, a closed connection), as ``comm_guard`` does; gloo's own
    text is cut to its first line."""
    msg = " ".join(str(err).split(". This is typically")[0].split())
    if ("did not finish within" in msg or peer_failure_hint(msg) is not None) \
            and "stopped answering" not in msg and "is alive" not in msg:
        msg += unresponsive_note()
    return CommError(msg)


class OverlapScheduler(GradScheduler):
    """:class:`~commsched.priority.executor.GradScheduler` under ``lina-overlap`` (module
    docstring); the arguments are its, ``cfg.policy`` must be ``"lina-overlap"``;
    ``tail_threads``: gloo worker threads of the tail's twin groups (:meth:`_make_tail_groups`).

    A step: :meth:`begin_step`, the backward pass, :meth:`end_backward_async` (returns at
    once), then, while the next forward pass runs, :meth:`wait_params` per module and
    finally :meth:`complete` (what :meth:`finish` is to the other schedules: it waits for
    the rest and returns the step's timings). :class:`OverlapOptimizer` drives these."""

    _OVERLAP = True

    def __init__(self, params: Sequence[tuple], cfg: ScheduleConfig, *, tail_threads: int | None = 8, **kw: Any):
        if not cfg.overlapped:
            raise ValueError(f"OverlapScheduler runs the 'lina-overlap' schedule, got {cfg.policy!r}; use "
                             "GradScheduler for the others")
        if kw.get("external"):
            raise ValueError("OverlapScheduler does not take external gradients (a DDP hook's buckets are "
                             "reduced inside DDP's step); use GradScheduler with lina")
        super().__init__(params, cfg, **kw)
        assert isinstance(self._policy, OverlapPolicy)
        self._find_unused_flags, self._find_unused = self._find_unused, False  # exchanged at end_backward_async
        dist_on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # every rank makes the control group here, at construction, like every group: gloo
        # (CPU agreement tensors only), so a CUDA job gives it no NCCL communicator
        self._ctrl = control_group(list(range(dist.get_world_size()))) if dist_on else None
        self._members: list[tuple[int, ...] | None] = []
        for g in self._groups:
            if g is LOCAL or not dist_on or (g is not None and not isinstance(g, dist.ProcessGroup)):
                self._members.append(None)  # this rank's own flag
            elif g is None:
                self._members.append(tuple(range(dist.get_world_size())))
            else:
                self._members.append(tuple(dist.get_process_group_ranks(g)))
        self._tail_group = self._make_tail_groups(tail_threads) if dist_on else {}
        self._agreed = True
        self._used_final: list[bool] = [True] * len(self._params)
        self._remaining: list[int] = [len(o) for o in self._ops_of_param]
        self._ctrl_work: Any = None
        self._prio_param: list[int] | None = None  # set_priorities' per parameter
        self._t_end = 0.0
        self._end_mark: Any = None

    def _make_tail_groups(self, threads: int | None) -> dict[int, Any]:
        """A twin of every communicating group for the tail (collective: every rank makes
        the twins of every rank's groups, in one order). Micro-ops launched before the
        backward pass ended stay queued on the original groups (gloo runs a group's
        collectives in launch order, ``threads`` at a time); on the twins the tail's first
        micro-ops start at once instead of queuing behind them."""
        mine = sorted({m for m, g in zip(self._members, self._groups) if m is not None and g is not LOCAL})
        every = sorted({tuple(m) for ms in all_gather_object(mine, "listing the groups of lina-overlap's tail")
                        for m in ms})
        made = {m: bind_new_group(list(m), self.cfg.reduce_address, threads) for m in every}
        return {id(g): made[m] for m, g in zip(self._members, self._groups) if m is not None and g is not LOCAL}

    def _retarget_tail(self, agreed: int) -> None:
        """Operations from ``agreed`` on (the reordered tail, the same on every rank) go to
        the twin groups (lock held)."""
        for st in self._state[agreed:]:
            st.group = self._tail_group.get(id(st.group), st.group)

    # ------------------------------------------------------------------ priorities
    def set_priorities(self, prio: Sequence[int] | None) -> None:
        """``prio[i]``: when the next forward pass needs parameter ``i`` of
        :attr:`params` (smaller first); the tail of every later step follows it. Must be the
        same on every rank (:class:`OverlapOptimizer` agrees on it)."""
        if prio is not None and len(prio) != len(self._params):
            raise ValueError(f"{len(prio)} priorities for {len(self._params)} parameters")
        with self._cv:
            self._prio_param = None if prio is None else list(prio)
            self._map_priorities()

    def _map_priorities(self) -> None:
        """The per-parameter priorities as the policy's per-operation ones, for the operations
        of the current mode (lock held)."""
        prio = self._prio_param
        self._policy.set_priorities(None if prio is None else
                                    [min(prio[pc.tensor] for pc in op.pieces) for op in self.ops])

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters in the scheduler's order (communicated first, then scale-only)."""
        return list(self._params)

    def index_of(self, p: torch.Tensor) -> int:
        try:
            return self._index[id(p)]
        except KeyError:
            raise ValueError("a parameter the scheduler does not hold") from None

    # ------------------------------------------------------------------ the step
    def begin_step(self) -> None:
        two = True in self._layouts  # fallback_buckets: this step's operations may be the other layout's
        if two:
            with self._cv:
                self._policy.set_priorities(None)
        super().begin_step()
        with self._cv:
            if two:
                self._map_priorities()
            self._remaining = [len(o) for o in self._ops_of_param]
            self._agreed = False
            self._used_final = [True] * len(self._params)

    def end_backward_async(self) -> None:
        """The backward pass has ended: mark the parameters no gradient reached (they
        contribute zeros), start the ranks' agreement and let the tail go; returns at once."""
        t_end = self._now()
        mark = self.clock.mark() if self._cuda else None
        with self._cv:
            if not self._active:
                raise RuntimeError("end_backward_async() without begin_step()")
            if not self._sync:
                raise RuntimeError("end_backward_async() inside no_sync(): run the last micro-batch's backward "
                                   "pass outside it")
            if self._policy._ended:
                return
            self._t_end, self._end_mark = t_end, mark
            for i in range(len(self._params)):
                if not self._param_ready[i]:
                    self._grad_ready(i)
            if not self._policy.wants_agreement:  # program rule: the count is already the same everywhere
                self._retarget_tail(self._policy.launched_count)
            self._policy.end_backward()
            if self._ctrl is None:
                self._agree([[self._policy.launched_count, *(int(u) for u in self._used)]])
            else:
                self._start_agreement()
            self._pump()

    def _start_agreement(self) -> None:
        """One asynchronous all_gather of [launched count, used flags] (lock held)."""
        dev = control_device(self._ctrl)
        mine = torch.tensor([self._policy.launched_count, *(int(u) for u in self._used)], dtype=torch.int64,
                            device=dev)
        outs = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        try:
            work = dist.all_gather(outs, mine, group=self._ctrl, async_op=True)
        except RuntimeError as e:
            self._error = CommError(f"rank {dist.get_rank()}: starting the end-of-backward agreement failed: {e}")
            self._cv.notify_all()
            return
        self._ctrl_work = work

        def done(fut) -> None:
            with self._cv:
                try:
                    fut.value()
                    self._agree([o.tolist() for o in outs])
                except BaseException as e:  # handed to whoever waits
                    if self._error is None:
                        self._error = CommError(f"rank {dist.get_rank()}: the end-of-backward agreement failed: {e}")
                self._thread_wake = True
                self._cv.notify_all()

        work.get_future().add_done_callback(done)

    def _agree(self, rows: list[list[int]]) -> None:
        """Every rank's [launched count, used flags...] (lock held)."""
        if self._policy.wants_agreement:
            agreed = max(r[0] for r in rows)
            self._retarget_tail(agreed)
            self._policy.agree(agreed)
        me = dist.get_rank() if self._ctrl is not None else 0
        for i, ranks in enumerate(self._members):
            if self._find_unused_flags:
                self._used_final[i] = bool(rows[me][1 + i]) if ranks is None else any(rows[r][1 + i] for r in ranks)
        self._agreed = True

    def _completed(self, seq: int, end_mark: Any = None, error: BaseException | None = None) -> None:
        for t in self.ops[seq].tensors:
            self._remaining[t] -= 1
        super()._completed(seq, end_mark, error)

    def reduced(self, idx: Iterable[int]) -> bool:
        """Whether the parameters ``idx`` (indices of :attr:`params`) are reduced (lock free read)."""
        return self._agreed and all(self._remaining[i] <= 0 for i in idx)

    def wait_params(self, idx: Sequence[int]) -> None:
        """Return once the parameters ``idx`` are reduced (their gradients final; ``grad``
        None where no rank of the group used one); on CUDA the current stream then waits
        for their reductions."""
        idx = list(idx)
        seqs = sorted({s for i in idx for s in self._ops_of_param[i]})
        with self._cv:
            if not self._active:
                return
            self._policy.need(seqs)
            self._pump()
            ok = self._cv.wait_for(lambda: self._error is not None or self.reduced(idx), timeout=self.timeout_s)
            err = None
            if self._error is not None or not ok:
                err = self._error or CommError(f"rank {dist.get_rank() if self._ctrl is not None else 0}: the "
                                               f"reduction of {self.names[idx[0]]!r} did not finish within "
                                               f"{self.timeout_s:.0f} s: a peer did not take part")
                self._error = None
            else:
                works = [self._state[s].work for s in seqs]
        if err is not None:  # outside the lock: asking who is alive takes a moment
            raise _with_liveness(err)
        for w in works:
            if w is not None:
                try:
                    w.wait()
                except RuntimeError as e:
                    raise _with_liveness(CommError(f"rank {dist.get_rank()}: the reduction of "
                                                   f"{self.names[idx[0]]!r} failed: {e}")) from None
        self._apply_unused(idx)

    def _apply_unused(self, idx: Iterable[int]) -> None:
        for i in idx:
            if not self._used_final[i]:
                self._params[i].grad = None

    def complete(self) -> dict:
        """Wait for the rest of the step's reduction; its timings (:meth:`finish`'s keys,
        with the backward pass's end where :meth:`end_backward_async` was called)."""
        with self._cv:
            self._policy.need(range(len(self.ops)))
            self._pump()
        st = self.finish()
        if self._ctrl_work is not None:
            try:
                self._ctrl_work.wait()
            except RuntimeError as e:
                raise _with_liveness(CommError(f"rank {dist.get_rank()}: the end-of-backward "
                                               f"agreement failed: {e}")) from None
            finally:
                self._ctrl_work = None
        self._apply_unused(range(len(self._params)))
        t_end = self._t_end
        if self._cuda and self._end_mark is not None:
            t_end = self.clock.seconds(self._t0_mark, self._end_mark)
        ar = [r for r in self.records if r.kind == "allreduce" and r.end_s >= 0]
        total = sum(r.nbytes for r in ar)
        st.update(backward_end_s=t_end,
                  allreduce_in_backward_share=sum(r.nbytes for r in ar if r.end_s <= t_end) / total if total else 1.0)
        return st

    # ------------------------------------------------------------------ records of the next forward pass
    def note(self, kind: str, key: int) -> OpRecord | None:
        """A record of this step (``UPDATE`` or ``FORWARD``) stamped ready now; None outside a step."""
        with self._cv:
            if not self._active:
                return None
            rec = self._rec[(kind, key)] = OpRecord(kind, key, 0, 0.0)
            self._stamp(rec, "ready_s")
            return rec

    def stamp(self, rec: OpRecord | None, field: str) -> None:
        if rec is not None:
            with self._cv:
                if self._active:
                    self._stamp(rec, field)


class OverlapOptimizer:
    """Per-module optimizer steps and the forward pass's waits of ``lina-overlap`` (module
    docstring).

    ``model``: the module whose forward pass runs the step; ``make_optimizer(params)``
    builds the optimizer of one module's parameters (e.g. ``lambda ps:
    torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01)``); ``clip_grad_norm``: clip the
    global gradient norm to this before stepping -- which needs every gradient, so the
    overlap is off. Use::

        opt = OverlapOptimizer(model, lambda ps: torch.optim.Adam(ps, lr=1e-3))
        with OverlapScheduler(entries, ScheduleConfig(policy="lina-overlap")) as sched, opt.bind(sched):
            for x, y in batches:
                loss = model(x, y)     # waits, module by module, for the previous update
                opt.begin_backward()   # the previous step's rest (usually nothing), then begin_step
                loss.backward()
                opt.end_backward()     # returns at once: the reduction runs into the next forward
            opt.synchronize()          # before evaluation, a checkpoint, the end
    """

    def __init__(self, model: nn.Module, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], *,
                 clip_grad_norm: float | None = None):
        if not callable(make_optimizer):
            raise TypeError(f"make_optimizer must build an optimizer from a list of parameters, got "
                            f"{type(make_optimizer).__name__}")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0 or None, got {clip_grad_norm}")
        self.clip_grad_norm = clip_grad_norm
        self.overlap = clip_grad_norm is None
        if not self.overlap:
            warnings.warn("lina-overlap: gradient clipping by global norm needs every gradient before any "
                          "optimizer step, so the overlap is off (the optimizer steps after the whole reduction)",
                          RuntimeWarning, stacklevel=2)
        self.model = model
        seen: set[int] = set()
        self._mods = list(model.modules())
        self._owned: list[list[nn.Parameter]] = []
        for m in self._mods:
            ps = [p for p in m.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in ps)
            self._owned.append(ps)
        self._opt_of_mod: dict[int, int] = {}  # module index -> its optimizer's index
        self._mod_of_opt: list[int] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        for mi, ps in enumerate(self._owned):
            if ps:
                self._opt_of_mod[mi] = len(self.optimizers)
                self._mod_of_opt.append(mi)
                self.optimizers.append(make_optimizer(list(ps)))
        self._parent = {}
        for pi, m in enumerate(self._mods):
            for c in m.children():
                ci = next(i for i, x in enumerate(self._mods) if x is c)
                self._parent.setdefault(ci, pi)
        self._hooks = [m.register_forward_pre_hook(self._make_pre_hook(mi)) for mi, m in enumerate(self._mods)]
        self._sched: OverlapScheduler | None = None
        self._recorded: list[int] | None = None  # modules in the order they started, first forward pass
        self._recorded_set: set[int] = set()
        self._groups: list[list[int]] | None = None  # wait group -> optimizer indices (forward order)
        self._group_of_mod: dict[int, int] = {}
        self._pending = False
        self._stepped: list[bool] = []
        self._last: dict | None = None
        self.last_records: list[OpRecord] = []  # the records of the step complete_step() finished last
        self._wait_s = 0.0
        self._recs: dict[int, OpRecord | None] = {}
        self._fwd_rec: OpRecord | None = None

    # ------------------------------------------------------------------ binding
    def bind(self, sched: OverlapScheduler) -> "OverlapOptimizer":
        """Drive ``sched`` (it must hold every trainable parameter of the model); usable as a
        context manager that synchronizes at its exit."""
        if not isinstance(sched, OverlapScheduler):
            raise TypeError(f"OverlapOptimizer needs an OverlapScheduler, got {type(sched).__name__}")
        for ps in self._owned:
            for p in ps:
                sched.index_of(p)  # ValueError for a parameter the scheduler does not hold
        self._sched = sched
        if self._recorded is None:
            self._recorded = []  # the next forward pass is recorded
        return self

    def __enter__(self) -> "OverlapOptimizer":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.synchronize()
        self._sched = None

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ forward pass
    def _make_pre_hook(self, mi: int):
        def pre_hook(module, args) -> None:
            if self._sched is None:
                return
            if self._recorded is not None and self._groups is None and mi not in self._recorded_set:
                self._recorded.append(mi)
                self._recorded_set.add(mi)
            if self._pending:
                if self._fwd_rec is None:
                    self._fwd_rec = self._sched.note(FORWARD, 0)
                    self._sched.stamp(self._fwd_rec, "start_s")
                g = self._group_of_mod.get(mi)
                if g is not None and not self._stepped[g]:
                    self._ensure(g)
        return pre_hook

    def _params_of(self, g: int) -> list[int]:
        return [self._need_sched().index_of(p) for oi in self._groups[g] for p in self._owned[self._mod_of_opt[oi]]]

    def _ensure(self, g: int) -> None:
        """Step wait group ``g`` (waiting for its reduction) and every group already reduced."""
        sched = self._sched
        rec = self._recs[g] = sched.note(UPDATE, g)
        t = time.perf_counter()
        sched.wait_params(self._idx[g])
        self._wait_s += time.perf_counter() - t
        sched.stamp(rec, "start_s")
        self._step_group(g)
        sched.stamp(rec, "end_s")
        self._step_reduced()

    def _step_group(self, g: int) -> None:
        for oi in self._groups[g]:
            opt = self.optimizers[oi]
            opt.step()
            opt.zero_grad(set_to_none=True)
        self._stepped[g] = True

    def _step_reduced(self) -> None:
        """Step the groups whose reduction has ended (forward order), without waiting."""
        sched = self._sched
        for g in range(len(self._groups)):
            if not self._stepped[g] and sched.reduced(self._idx[g]):
                sched.wait_params(self._idx[g])  # returns at once: reduced; applies the used flags
                self._step_group(g)

    # ------------------------------------------------------------------ the step
    def begin_backward(self) -> dict | None:
        """Before the backward pass: finish the previous step (what the forward pass did not
        already wait for, normally nothing) and begin this one. Returns the previous step's
        timings (None for the first)."""
        sched = self._need_sched()
        st = self.complete_step()
        sched.begin_step()
        return st

    def _need_sched(self) -> OverlapScheduler:
        if self._sched is None:
            raise RuntimeError("OverlapOptimizer is not bound: `with OverlapScheduler(...) as s, opt.bind(s):`")
        return self._sched

    def end_backward(self) -> None:
        """After the backward pass: let the reduction run on (returns at once), or, with
        ``clip_grad_norm``, wait for all of it, clip and step."""
        sched = self._need_sched()
        if self._groups is None:
            self._make_groups()
        sched.end_backward_async()
        self._pending = True
        self._stepped = [False] * len(self._groups)
        self._recs, self._fwd_rec, self._wait_s = {}, None, 0.0
        if not self.overlap:
            self.complete_step()
        else:
            self._step_reduced()

    def complete_step(self) -> dict | None:
        """Wait for the pending step's whole reduction and step every group not stepped
        yet; its timings (``allreduce_wait_s``: the time the compute thread waited for
        reductions since the backward pass ended). Nothing pending: the last step's
        timings, once (then None)."""
        if not self._pending:
            st, self._last = self._last, None
            return st
        sched = self._need_sched()
        t = time.perf_counter()
        sched.stamp(self._fwd_rec, "end_s")
        st = sched.complete()
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for ps in self._owned for p in ps if p.grad is not None],
                                           self.clip_grad_norm)
        for g in range(len(self._groups)):
            if not self._stepped[g]:
                self._step_group(g)
        self._pending = False
        st["allreduce_wait_s"] = self._wait_s + (time.perf_counter() - t)
        self.last_records = sched.records
        self._last = st
        return st

    def synchronize(self) -> dict | None:
        """Every parameter updated (evaluation, checkpoints, the end of training); the
        pending step's timings, as :meth:`complete_step`."""
        if not self._pending:
            return None
        return self.complete_step()

    def _make_groups(self) -> None:
        """Wait groups from the recorded forward order, the same on every rank (rank 0's)."""
        sched = self._need_sched()
        order = list(self._recorded or [])
        if sched._ctrl is not None:
            order = all_gather_object(order, "agreeing on the forward order of lina-overlap", group=sched._ctrl)[0]
        fired = {mi: k for k, mi in enumerate(order)}
        owner_group: dict[int, int] = {}  # optimizer index -> wait group (position in the order)
        for mi, oi in self._opt_of_mod.items():
            a = mi
            while a is not None and a not in fired:
                a = self._parent.get(a)
            owner_group[oi] = fired[a] if a is not None else len(order)  # never started: waited at the end
        used = sorted(set(owner_group.values()))
        pos = {k: i for i, k in enumerate(used)}
        self._groups = [[] for _ in used]
        for oi, k in sorted(owner_group.items()):
            self._groups[pos[k]].append(oi)
        self._group_of_mod = {mi: pos[k] for mi, k in fired.items() if k in pos}
        self._idx = [self._params_of(g) for g in range(len(self._groups))]
        prio = [len(self._groups)] * len(sched.params)
        for g, idx in enumerate(self._idx):
            for i in idx:
                prio[i] = g
        sched.set_priorities(prio)

    # ------------------------------------------------------------------ optimizer protocol
    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, sd: dict) -> None:
        opts = sd.get("optimizers") if isinstance(sd, dict) else None
        if not isinstance(opts, list) or len(opts) != len(self.optimizers):
            raise ValueError(f"an OverlapOptimizer state holds one optimizer state per module with parameters "
                             f"({len(self.optimizers)} here); got "
                             f"{len(opts) if isinstance(opts, list) else type(sd).__name__}")
        for opt, s in zip(self.optimizers, opts):
            opt.load_state_dict(s)


__all__ = ["FORWARD", "UPDATE", "OverlapOptimizer", "OverlapScheduler"]
