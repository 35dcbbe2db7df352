"""A CPU fake of the NCCL semantics that gloo hides, for the multi-process tests.

``nccl_semantics()`` (a context manager, per process: enter it inside each rank of a
:func:`tests.mp.run_ranks` job) wraps ``torch.distributed``'s functions on the gloo group
so that they behave as NCCL's do where code written on gloo can go wrong on a GPU:

* **Deferred completion.** An ``async_op=True`` collective (``all_reduce``,
  ``all_to_all_single``, ``reduce_scatter_tensor``, ``all_gather_into_tensor``,
  ``broadcast``), an ``isend``/``irecv`` and every op of a ``batch_isend_irecv`` returns a
  :class:`DeferredWork`: the result lands in the caller's output tensor only at ``wait()``
  (on NCCL the caller's stream sees it only after ``wait()``), and ``is_completed()`` stays
  False until ``wait()`` or ``delay_s`` after the launch with the transfer done.
* **Futures fire at enqueue.** ``work.get_future()`` is already complete when the call
  returns (NCCL's future completes when the collective is *enqueued*), so a done-callback
  is no proof the data arrived.
* **No lone point-to-point on 3+ ranks.** NCCL builds a lazy two-rank communicator for a
  single ``isend``/``irecv``/``send``/``recv`` outside ``batch_isend_irecv``; ranks that
  each post one to the next rank then wait for each other in a cycle (the ring pattern's
  deadlock). On a group of 3 or more ranks such a call raises :class:`LonePointToPoint`
  here; inside ``batch_isend_irecv`` (one group-wide communicator) it is allowed.

Blocking collectives (``async_op=False``) and the rest of ``torch.distributed`` are left
alone. ``fake.calls`` counts what went through, by name, so a test can show a path ran.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_P2P = ("isend", "irecv", "send", "recv")
_COLLECTIVES = ("all_reduce", "all_to_all_single", "reduce_scatter_tensor",
                "all_gather_into_tensor", "broadcast")


class LonePointToPoint(RuntimeError):
    """A single P2P op outside ``batch_isend_irecv`` on a group of 3+ ranks (see the module)."""


class DeferredWork:
    """A Work whose result lands in the output at ``wait()`` (module docstring)."""

    def __init__(self, real: Any, land: Callable[[], None] | None, delay_s: float, result: Any = None):
        self._real, self._land, self._delay_s = real, land, delay_s
        self._t0 = time.monotonic()
        self._done = False
        self._lock = threading.Lock()
        self._fut = torch.futures.Future()
        self._fut.set_result(result)  # NCCL: complete at enqueue, not when the bytes are there

    def _complete(self) -> None:
        with self._lock:
            if self._done:
                return
            if self._real is not None:
                self._real.wait()
            if self._land is not None:
                self._land()
            self._done = True

    def wait(self, timeout=None) -> bool:
        self._complete()
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if time.monotonic() - self._t0 < self._delay_s:
            return False
        if self._real is not None and not self._real.is_completed():
            return False
        self._complete()
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def result(self):
        self._complete()
        return []


class NcclFake:
    """The patched functions of one :func:`nccl_semantics` block."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.calls: Counter[str] = Counter()
        self._tls = threading.local()
        self.orig = {n: getattr(c10d, n) for n in (*_P2P, *_COLLECTIVES, "batch_isend_irecv")}

    # ------------------------------------------------------------------ helpers
    def _in_batch(self) -> bool:
        return getattr(self._tls, "batch", 0) > 0

    def _check_lone(self, name: str, group) -> None:
        size = dist.get_world_size(group)
        if not self._in_batch() and size >= 3:
            raise LonePointToPoint(
                f"nccl_fake: a lone dist.{name} outside batch_isend_irecv on a group of {size} ranks: "
                "NCCL builds a two-rank communicator for it, and ranks that each post one to the next "
                "rank wait for each other in a cycle; post each round's sends and receives together "
                "with dist.batch_isend_irecv([dist.P2POp(dist.isend, ...), dist.P2POp(dist.irecv, ...)])")

    def _defer(self, out: torch.Tensor, run: Callable[[torch.Tensor], Any]) -> DeferredWork:
        """Run ``run(staging)`` into a copy of ``out``; copy it into ``out`` at ``wait()``."""
        stage = out.detach().clone()
        real = run(stage)

        def land() -> None:
            out.copy_(stage)
        return DeferredWork(real, land, self.delay_s, result=[out])

    # ------------------------------------------------------------------ point to point
    def isend(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        self.calls["isend"] += 1
        self._check_lone("isend", group)
        real = self.orig["isend"](tensor, dst, group, tag, group_dst=group_dst)
        return DeferredWork(real, None, self.delay_s)

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        self.calls["irecv"] += 1
        self._check_lone("irecv", group)
        return self._defer(tensor, lambda t: self.orig["irecv"](t, src, group, tag, group_src=group_src))

    def send(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        self.calls["send"] += 1
        self._check_lone("send", group)
        return self.orig["send"](tensor, dst, group, tag, group_dst=group_dst)

    def recv(self, tensor, src=None, group=None, tag=0, group_src=None):
        self.calls["recv"] += 1
        self._check_lone("recv", group)
        return self.orig["recv"](tensor, src, group, tag, group_src=group_src)

    def batch_isend_irecv(self, p2p_op_list):
        self.calls["batch_isend_irecv"] += 1
        self._tls.batch = getattr(self._tls, "batch", 0) + 1
        try:
            works = self.orig["batch_isend_irecv"](p2p_op_list)
        finally:
            self._tls.batch -= 1
        return [w if isinstance(w, DeferredWork) else DeferredWork(w, None, self.delay_s) for w in works]

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.calls["all_reduce"] += 1
        if not async_op:
            return self.orig["all_reduce"](tensor, op, group, async_op)
        return self._defer(tensor, lambda t: self.orig["all_reduce"](t, op, group, True))

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        self.calls["all_to_all_single"] += 1
        f = self.orig["all_to_all_single"]
        if not async_op:
            return f(output, input, output_split_sizes, input_split_sizes, group, async_op)
        return self._defer(output, lambda t: f(t, input, output_split_sizes, input_split_sizes, group, True))

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.calls["reduce_scatter_tensor"] += 1
        f = self.orig["reduce_scatter_tensor"]
        if not async_op:
            return f(output, input, op, group, async_op)
        return self._defer(output, lambda t: f(t, input, op, group, True))

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        self.calls["all_gather_into_tensor"] += 1
        f = self.orig["all_gather_into_tensor"]
        if not async_op:
            return f(output_tensor, input_tensor, group, async_op)
        return self._defer(output_tensor, lambda t: f(t, input_tensor, group, True))

    def broadcast(self, tensor, src=None, group=None, async_op=False, group_src=None):
        self.calls["broadcast"] += 1
        f = self.orig["broadcast"]
        if not async_op:
            return f(tensor, src, group, async_op, group_src=group_src)
        return self._defer(tensor, lambda t: f(t, src, group, True, group_src=group_src))


@contextmanager
def nccl_semantics(delay_s: float = 0.005) -> Iterator[NcclFake]:
    """Patch ``torch.distributed`` (and ``distributed_c10d``, whose ``P2POp`` checks its ops
    against the module's ``isend``/``irecv``) with NCCL's semantics for the block."""
    fake = NcclFake(delay_s)
    names = (*_P2P, *_COLLECTIVES, "batch_isend_irecv")
    saved = {n: (getattr(dist, n), getattr(c10d, n)) for n in names}
    for n in names:
        fn = getattr(fake, n)  # one bound method object: batch_isend_irecv tests ``op.op is isend``
        setattr(dist, n, fn)
        setattr(c10d, n, fn)
    try:
        yield fake
    finally:
        for n, (a, b) in saved.items():
            setattr(dist, n, a)
            setattr(c10d, n, b)


__all__ = ["DeferredWork", "LonePointToPoint", "NcclFake", "nccl_semantics"]
