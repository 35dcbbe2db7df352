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

Schedules: ``lina`` (micro-ops, all-to-all first, credit), ``fifo`` (DDP-style fused
buckets launched as soon as ready), ``serial`` (micro-ops, launched only after the
backward pass). All three compute the same sums; only the timing differs.

Launches happen under one lock, from the compute thread (hooks, observer calls) or from
the executor's own thread (after a completion), so the launch order is the policy's
order. Completion callbacks only record and wake that thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ..config import read_env
from ..dist import CommError
from .microops import CommOp
from .policy import ScheduleConfig, allreduce_ops, make_policy

LOCAL = "local"  # group of a gradient that is scaled but not communicated


@dataclass
class OpRecord:
    """One communication operation of a step, times relative to the step start (seconds)."""

    kind: str  # "a2a" or "allreduce"
    key: int
    nbytes: int
    ready_s: float
    start_s: float = -1.0
    end_s: float = -1.0


def _union_s(spans: Sequence[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


class _Op:
    __slots__ = ("spec", "group", "views", "flat", "missing")

    def __init__(self, spec: CommOp, group, n_tensors: int):
        self.spec, self.group = spec, group
        self.views: list[torch.Tensor] = []
        self.flat: torch.Tensor | None = None
        self.missing = n_tensors


class GradScheduler:
    """Synchronise the gradients of ``params`` (in launch order) over their groups.

    ``params``: entries ``(parameter, group)`` or ``(parameter, group, scale)``. ``group``
    is a process group (None: the default group) or :data:`LOCAL` for a gradient that is
    only scaled, never communicated. The gradient is multiplied by ``scale`` (default
    1 / group size: a plain average) when it is ready, then summed over the group. The
    scheduler is an :class:`~commsched.observe.A2AObserver`: register it with the
    :class:`~commsched.observe.A2AEvents` the MoE layers were built with. ``timeout_s``:
    how long :meth:`finish` waits for the allreduce (default: ``COMMSCHED_TIMEOUT_S``, see
    :func:`commsched.config.read_env`).
    """

    def __init__(self, params: Sequence[tuple], cfg: ScheduleConfig, *, timeout_s: float | None = None):
        self.cfg = cfg
        self.timeout_s = timeout_s if timeout_s is not None else read_env().timeout_s
        entries = []
        for e in params:
            p, g = e[0], e[1]
            n = 1 if g is LOCAL else dist.get_world_size(g)
            scale = float(e[2]) if len(e) > 2 else 1.0 / n
            entries.append((p, g if n > 1 else LOCAL, scale))
        # communicated parameters first (in the order given), then the scale-only ones
        entries = [e for e in entries if e[1] is not LOCAL] + [e for e in entries if e[1] is LOCAL]
        self._params = [p for p, _, _ in entries]
        self._groups = [g for _, g, _ in entries]
        self._scale = [s for _, _, s in entries]
        n_comm = sum(1 for g in self._groups if g is not LOCAL)
        ops: list[tuple[CommOp, object]] = []
        # operations never span two groups (nor, for buckets, two dtypes)
        start = 0
        while start < n_comm:
            end = start
            while (end < n_comm and self._groups[end] is self._groups[start]
                   and self._params[end].dtype == self._params[start].dtype):
                end += 1
            numels = [p.numel() for p in self._params[start:end]]
            esize = self._params[start].element_size()
            run = allreduce_ops(numels, esize, cfg)
            for op in run:
                shifted = tuple(type(pc)(pc.tensor + start, pc.offset, pc.numel) for pc in op.pieces)
                ops.append((CommOp(len(ops), shifted, op.nbytes), self._groups[start]))
            start = end
        self.ops = [spec for spec, _ in ops]
        self._op_groups = [g for _, g in ops]
        self._ops_of_param: list[list[int]] = [[] for _ in self._params]
        for spec in self.ops:
            for t in spec.tensors:
                self._ops_of_param[t].append(spec.seq)
        self._policy = make_policy(cfg)
        self._cv = threading.Condition()
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self._params)]
        self._thread_wake = False
        self._closed = False
        self._error: BaseException | None = None
        self._active = False
        self._a2a_key = 0
        self._a2a_blocked_s = 0.0
        self.records: list[OpRecord] = []
        self._rec: dict[tuple[str, int], OpRecord] = {}
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="commsched-gradsched", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ step
    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def begin_step(self) -> None:
        with self._cv:
            if self._active:
                raise RuntimeError("begin_step called twice without finish()")
            self._policy.begin_step(len(self.ops))
            self._state = [_Op(spec, g, len(spec.tensors)) for spec, g in zip(self.ops, self._op_groups)]
            self._param_ready = [False] * len(self._params)
            self.records, self._rec = [], {}
            self._a2a_blocked_s = 0.0
            self._t0 = time.perf_counter()
            self._active = True

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if not self._active:
                return
            with self._cv:
                self._grad_ready(i)
                self._pump()
        return hook

    def _grad_ready(self, i: int) -> None:
        if self._param_ready[i]:
            return
        self._param_ready[i] = True
        p = self._params[i]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if self._scale[i] != 1.0:
            p.grad.mul_(self._scale[i])
        for seq in self._ops_of_param[i]:
            st = self._state[seq]
            st.missing -= 1
            if st.missing == 0:
                self._make_buffer(st)
                self._policy.allreduce_ready(seq, st.spec.nbytes)
                self._rec[("allreduce", seq)] = OpRecord("allreduce", seq, st.spec.nbytes, self._now())

    def _make_buffer(self, st: _Op) -> None:
        views = [self._params[pc.tensor].grad.view(-1)[pc.offset:pc.offset + pc.numel] for pc in st.spec.pieces]
        st.views = views
        st.flat = views[0] if len(views) == 1 else torch.cat(views)

    def _pump(self) -> None:
        """Launch what the policy allows now (caller holds the lock)."""
        for launch in self._policy.next_ops():
            if launch.kind == "a2a":
                rec = self._rec.get(("a2a", launch.key))  # type: ignore[arg-type]
                if rec is not None:
                    rec.start_s = self._now()
                continue
            seq = int(launch.key)  # type: ignore[arg-type]
            st = self._state[seq]
            self._rec[("allreduce", seq)].start_s = self._now()
            try:
                work = dist.all_reduce(st.flat, group=st.group, async_op=True)
            except RuntimeError as e:
                self._error = CommError(f"launching allreduce {seq} failed: {e}")
                self._cv.notify_all()
                continue
            work.get_future().add_done_callback(self._make_done(seq))

    def _make_done(self, seq: int):
        def done(fut) -> None:
            err = None
            try:
                fut.value()
            except BaseException as e:  # handed to finish()
                err = e
            with self._cv:
                if err is not None and self._error is None:
                    self._error = CommError(f"allreduce {seq} failed: {err}")
                rec = self._rec.get(("allreduce", seq))
                if rec is not None:
                    rec.end_s = self._now()
                try:
                    self._policy.allreduce_done(seq)
                except ValueError:
                    pass
                self._thread_wake = True
                self._cv.notify_all()
        return done

    def _loop(self) -> None:
        with self._cv:
            while not self._closed:
                self._cv.wait_for(lambda: self._thread_wake or self._closed)
                self._thread_wake = False
                if self._active and not self._closed:
                    try:
                        self._pump()
                    except BaseException as e:  # handed to finish()
                        self._error = e
                        self._cv.notify_all()

    # ------------------------------------------------------------------ observer (compute thread)
    def a2a_begin(self, nbytes: int) -> object:
        with self._cv:
            key = self._a2a_key
            self._a2a_key += 1
            if self._active:
                self._rec[("a2a", key)] = OpRecord("a2a", key, nbytes, self._now())
            self._policy.a2a_waiting(key, nbytes)
            self._pump()
            return key

    def a2a_end(self, token: object) -> None:
        with self._cv:
            self._policy.a2a_done(token)
            rec = self._rec.get(("a2a", token))  # type: ignore[arg-type]
            if rec is not None:
                rec.end_s = self._now()
            if self._active:
                self._pump()

    def a2a_blocked(self, seconds: float) -> None:
        self._a2a_blocked_s += seconds  # compute thread only

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
        """End the backward pass, wait for every allreduce, return this step's timings."""
        t_end = self._now()
        with self._cv:
            if not self._active:
                raise RuntimeError("finish() without begin_step()")
            for i in range(len(self._params)):
                if not self._param_ready[i]:  # no gradient reached this parameter on this rank
                    self._grad_ready(i)
            self._policy.end_backward()
            self._pump()
            ok = self._cv.wait_for(lambda: self._error is not None or self._policy.finished,
                                   timeout=self.timeout_s)
            self._active = False
            if self._error is not None:
                err, self._error = self._error, None
                raise err if isinstance(err, CommError) else CommError(str(err))
            if not ok:
                raise CommError(f"gradient allreduce did not finish within {self.timeout_s:.0f} s "
                                 f"({self._policy.allreduce_pending} not launched); a peer may be stuck")
            for st in self._state:
                if len(st.views) > 1:
                    off = 0
                    for v in st.views:
                        v.copy_(st.flat[off:off + v.numel()])
                        off += v.numel()
                st.views, st.flat = [], None
            t_done = self._now()
            recs = list(self._rec.values())
        a2a = [(r.ready_s, r.end_s) for r in recs if r.kind == "a2a" and r.end_s >= 0]
        ar_recs = [r for r in recs if r.kind == "allreduce" and r.end_s >= 0]
        ar = [(r.start_s, r.end_s) for r in ar_recs]
        ar_bytes = sum(r.nbytes for r in ar_recs)
        in_bwd = sum(r.nbytes for r in ar_recs if r.end_s <= t_end)
        self.records = sorted(recs, key=lambda r: (r.ready_s, r.kind, r.key))
        return {"a2a_time_s": _union_s(a2a), "a2a_blocked_s": self._a2a_blocked_s,
                "allreduce_time_s": _union_s(ar),
                "allreduce_wait_s": t_done - t_end, "backward_end_s": t_end,
                # share of the allreduce bytes already reduced when the backward pass ended
                "allreduce_in_backward_share": in_bwd / ar_bytes if ar_bytes else 1.0,
                "a2a_count": len(a2a), "allreduce_count": len(ar)}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def __enter__(self) -> "GradScheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["LOCAL", "GradScheduler", "OpRecord"]
