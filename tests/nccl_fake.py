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

Blocking collectives (``async_op=False``) go straight to gloo. ``fake.calls`` counts what
went through, by name, so a test can show a path ran.

* **Order.** NCCL requires every member of a communicator to issue its collectives in the
  same sequence, and collectives on *different* communicators to be issued in the same
  relative order on every rank they share (else the kernels that spin waiting for peers
  can deadlock the device). Every collective of the block -- blocking or async, list-form
  ``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
  ``all_to_all_single``, ``barrier``, ``broadcast``, P2P batches, the object collectives --
  is logged as an :class:`Entry` (group by member ranks, op, numel, dtype, thread name,
  index). At the block's exit (``check=True``, the default) or at ``fake.check()`` the ranks
  gather their logs over a private gloo group and every rank raises the same
  :class:`OrderViolation` when (a) a group's members issued different op sequences, (b) two
  groups sharing two or more ranks interleave differently on two of those ranks, or (c) a
  group was used by a thread while another thread's Work on it was outstanding (pure:
  :func:`order_violations`). Point-to-point ops are logged but not compared (only the
  peers take part). Calls made off the thread that entered the block first sleep a random
  0..``jitter_s`` seconds, so a race between threads shows in CI rather than by chance.
"""

from __future__ import annotations

import datetime
import random
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_P2P = ("isend", "irecv", "send", "recv")
_COLLECTIVES = ("all_reduce", "all_to_all_single", "reduce_scatter_tensor",
                "all_gather_into_tensor", "broadcast")
# collectives logged and passed through as they are (the first argument(s) named in the
# table, for numel and dtype; group found by keyword or position)
_PASSED = {"all_gather": (1, 2), "barrier": (None, 0), "all_to_all": (1, 2), "reduce": (0, 3),
           "gather": (0, 3), "scatter": (0, 3), "reduce_scatter": (0, 3),
           "all_gather_object": (None, 2), "broadcast_object_list": (None, 2),
           "gather_object": (None, 3), "scatter_object_list": (None, 3)}
# ops whose numel must agree between the members (the rest legitimately differ per rank)
_SAME_NUMEL = {"all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "broadcast",
               "reduce", "barrier"}
_P2P_OPS = {"isend", "irecv", "send", "recv", "batch_isend_irecv"}


@dataclass(frozen=True)
class Entry:
    """One logged collective: the group by its members' global ranks, the op, numel and
    dtype of its (first) tensor, the calling thread's name and its index in this rank's log."""

    group: tuple
    op: str
    numel: int
    dtype: str
    thread: str
    index: int

    def signature(self) -> tuple:
        return (self.op, self.dtype, self.numel if self.op in _SAME_NUMEL else None)

    def __str__(self) -> str:
        return f"#{self.index} {self.op}(numel={self.numel}, {self.dtype}) on group {self.group} from thread {self.thread!r}"


class OrderViolation(AssertionError):
    """The ranks' logs break NCCL's ordering rules (module docstring, "Order")."""


def order_violations(logs: Sequence[Sequence[Entry]], notes: Sequence[Sequence[str]] = ()) -> list[str]:
    """What breaks NCCL's ordering rules in the per-rank logs ``logs[rank]`` (pure; empty:
    none): (a) per group the same op sequence on every member; (b) for every pair of groups
    sharing two or more ranks the same interleaving of their ops on each shared rank; plus
    ``notes[rank]``: what a rank itself saw (a group used by two threads at once)."""
    out: list[str] = []
    world = len(logs)
    per: list[dict[tuple, list[Entry]]] = []
    for log in logs:
        d: dict[tuple, list[Entry]] = {}
        for e in log:
            if e.op not in _P2P_OPS:
                d.setdefault(e.group, []).append(e)
        per.append(d)
    groups = sorted({g for d in per for g in d})
    bad_groups = set()
    for g in groups:  # (a)
        members = [r for r in g if r < world]
        seqs = {r: per[r].get(g, []) for r in members}
        ref = members[0]
        for r in members[1:]:
            a, b = seqs[ref], seqs[r]
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x.signature() != y.signature()), None)
            if k is None and len(a) == len(b):
                continue
            bad_groups.add(g)
            if k is None:
                k = min(len(a), len(b))
            show = lambda s, k=k: str(s[k]) if k < len(s) else f"nothing (it issued {len(s)} ops)"  # noqa: E731
            out.append(f"group {g}: op {k} differs between its members: rank {ref} issued {show(a)}, "
                       f"rank {r} issued {show(b)}")
            break
    for i, g1 in enumerate(groups):  # (b)
        for g2 in groups[i + 1:]:
            shared = sorted(set(g1) & set(g2))
            if len(shared) < 2 or g1 in bad_groups or g2 in bad_groups:
                continue
            orders = {}
            for r in shared:
                if r >= world:
                    continue
                merged = sorted(per[r].get(g1, []) + per[r].get(g2, []), key=lambda e: e.index)
                cnt = {g1: 0, g2: 0}
                seq = []
                for e in merged:
                    seq.append((e.group, cnt[e.group], e))
                    cnt[e.group] += 1
                orders[r] = seq
            ranks = list(orders)
            for r in ranks[1:]:
                a, b = orders[ranks[0]], orders[r]
                k = next((j for j, (x, y) in enumerate(zip(a, b)) if x[:2] != y[:2]), None)
                if k is None:
                    continue
                out.append(f"groups {g1} and {g2} (sharing ranks {shared}) are interleaved differently: "
                           f"rank {ranks[0]}'s op {k} on the two is {a[k][2]} (op {a[k][1]} of its group), "
                           f"rank {r}'s is {b[k][2]} (op {b[k][1]} of its group); NCCL needs collectives "
                           "on different communicators issued in the same order on every rank")
                break
    return out + [f"rank {r}: {n}" for r, ns in enumerate(notes) for n in ns]


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

    def __init__(self, delay_s: float, jitter_s: float = 0.005, seed: int | None = None):
        self.delay_s, self.jitter_s = delay_s, jitter_s
        self.calls: Counter[str] = Counter()
        self._tls = threading.local()
        self.orig = {n: getattr(c10d, n) for n in (*_P2P, *_COLLECTIVES, *_PASSED, "batch_isend_irecv")}
        self.log: list[Entry] = []  # this rank's collectives in issue order
        self.notes: list[str] = []  # what this rank saw itself (a group used by two threads at once)
        self._log_lock = threading.Lock()
        self._main = threading.current_thread()
        self._rng = random.Random(seed)
        # per communicator (members, object id): [(thread name, Work, or None while in a blocking call)]
        self._open: dict[tuple, list] = {}
        self._pg = None  # the private gloo group of check()

    # ------------------------------------------------------------------ order log
    def _group_key(self, group) -> tuple | None:
        try:
            g = group if group is not None else c10d._get_default_group()
            return tuple(dist.get_process_group_ranks(g))
        except (RuntimeError, ValueError, AttributeError):
            return None

    def _nested(self) -> bool:
        return getattr(self._tls, "depth", 0) > 0

    def _note(self, op: str, group, t: Any = None) -> tuple | None:
        """Log a collective (not one issued inside another logged one); jitter off the main thread."""
        if self._nested():
            return None
        if isinstance(t, (list, tuple)):
            t = t[0] if t else None
        numel = int(t.numel()) if isinstance(t, torch.Tensor) else 0
        dtype = str(t.dtype).replace("torch.", "") if isinstance(t, torch.Tensor) else "-"
        me = threading.current_thread()
        if me is not self._main and self.jitter_s > 0:
            time.sleep(self._rng.uniform(0.0, self.jitter_s))
        key = self._group_key(group)
        if key is None:
            return None
        comm = (key, id(group if group is not None else c10d._get_default_group()))  # this communicator
        with self._log_lock:
            opened = self._open.setdefault(comm, [])
            opened[:] = [(n, w) for n, w in opened if w is not None and not w.is_completed()
                         ] + [(n, w) for n, w in opened if w is None]
            others = sorted({n for n, _ in opened if n != me.name})
            if others and op not in _P2P_OPS:
                self.notes.append(f"group {key} used by thread {me.name!r} ({op}) while thread(s) {others} "
                                  "had a collective on it outstanding: two threads on one communicator")
            self.log.append(Entry(key, op, numel, dtype, me.name, len(self.log)))
        return comm

    @contextmanager
    def _call(self, op: str, group, t: Any = None) -> Iterator[None]:
        """Log ``op`` and mark the group busy with this thread for the blocking call."""
        key = self._note(op, group, t)
        mark = (threading.current_thread().name, None)
        if key is not None:
            with self._log_lock:
                self._open[key].append(mark)
        self._tls.depth = getattr(self._tls, "depth", 0) + 1
        try:
            yield
        finally:
            self._tls.depth -= 1
            if key is not None:
                with self._log_lock:
                    try:
                        self._open[key].remove(mark)
                    except ValueError:
                        pass

    def _outstanding(self, key: tuple | None, work: Any) -> Any:
        if key is not None and isinstance(work, DeferredWork):
            with self._log_lock:
                self._open[key].append((threading.current_thread().name, work))
        return work

    def check(self, timeout_s: float = 60.0) -> None:
        """Gather every rank's log over a private gloo group and raise :class:`OrderViolation`
        (on every rank alike) when they break NCCL's ordering rules. Collective."""
        if not (dist.is_available() and dist.is_initialized()):
            v = order_violations([self.log], [self.notes])
        else:
            if self._pg is None:
                self._pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            got: list = [None] * dist.get_world_size()
            self._tls.depth = getattr(self._tls, "depth", 0) + 1
            try:
                self.orig["all_gather_object"](got, (list(self.log), list(self.notes)), group=self._pg)
            finally:
                self._tls.depth -= 1
            v = order_violations([g[0] for g in got], [g[1] for g in got])
        if v:
            raise OrderViolation("nccl_fake: the collectives break NCCL's ordering rules:\n  " + "\n  ".join(v[:8])
                                 + (f"\n  ... and {len(v) - 8} more" if len(v) > 8 else ""))

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
        with self._call("isend", group, tensor):
            real = self.orig["isend"](tensor, dst, group, tag, group_dst=group_dst)
        return DeferredWork(real, None, self.delay_s)

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        self.calls["irecv"] += 1
        self._check_lone("irecv", group)
        with self._call("irecv", group, tensor):
            return self._defer(tensor, lambda t: self.orig["irecv"](t, src, group, tag, group_src=group_src))

    def send(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        self.calls["send"] += 1
        self._check_lone("send", group)
        with self._call("send", group, tensor):
            return self.orig["send"](tensor, dst, group, tag, group_dst=group_dst)

    def recv(self, tensor, src=None, group=None, tag=0, group_src=None):
        self.calls["recv"] += 1
        self._check_lone("recv", group)
        with self._call("recv", group, tensor):
            return self.orig["recv"](tensor, src, group, tag, group_src=group_src)

    def batch_isend_irecv(self, p2p_op_list):
        self.calls["batch_isend_irecv"] += 1
        self._tls.batch = getattr(self._tls, "batch", 0) + 1
        try:
            group = p2p_op_list[0].group if p2p_op_list else None
            with self._call("batch_isend_irecv", group, p2p_op_list[0].tensor if p2p_op_list else None):
                works = self.orig["batch_isend_irecv"](p2p_op_list)
        finally:
            self._tls.batch -= 1
        return [w if isinstance(w, DeferredWork) else DeferredWork(w, None, self.delay_s) for w in works]

    # ------------------------------------------------------------------ collectives
    def _async(self, op: str, group, t, out, run) -> Any:
        """An async collective: logged, deferred to ``wait()``, outstanding on its group until then."""
        key = self._note(op, group, t)
        self._tls.depth = getattr(self._tls, "depth", 0) + 1
        try:
            work = self._defer(out, run)
        finally:
            self._tls.depth -= 1
        return self._outstanding(key, work)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.calls["all_reduce"] += 1
        if not async_op:
            with self._call("all_reduce", group, tensor):
                return self.orig["all_reduce"](tensor, op, group, async_op)
        return self._async("all_reduce", group, tensor, tensor,
                           lambda t: self.orig["all_reduce"](t, op, group, True))

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        self.calls["all_to_all_single"] += 1
        f = self.orig["all_to_all_single"]
        name = "all_to_all_single" if output_split_sizes is None and input_split_sizes is None \
            else "all_to_all_single(splits)"
        if not async_op:
            with self._call(name, group, input):
                return f(output, input, output_split_sizes, input_split_sizes, group, async_op)
        return self._async(name, group, input, output,
                           lambda t: f(t, input, output_split_sizes, input_split_sizes, group, True))

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.calls["reduce_scatter_tensor"] += 1
        f = self.orig["reduce_scatter_tensor"]
        if not async_op:
            with self._call("reduce_scatter_tensor", group, input):
                return f(output, input, op, group, async_op)
        return self._async("reduce_scatter_tensor", group, input, output, lambda t: f(t, input, op, group, True))

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        self.calls["all_gather_into_tensor"] += 1
        f = self.orig["all_gather_into_tensor"]
        if not async_op:
            with self._call("all_gather_into_tensor", group, input_tensor):
                return f(output_tensor, input_tensor, group, async_op)
        return self._async("all_gather_into_tensor", group, input_tensor, output_tensor,
                           lambda t: f(t, input_tensor, group, True))

    def broadcast(self, tensor, src=None, group=None, async_op=False, group_src=None):
        self.calls["broadcast"] += 1
        f = self.orig["broadcast"]
        if not async_op:
            with self._call("broadcast", group, tensor):
                return f(tensor, src, group, async_op, group_src=group_src)
        return self._async("broadcast", group, tensor, tensor,
                           lambda t: f(t, src, group, True, group_src=group_src))

    def _passed(self, name: str):
        """A collective logged and passed through (``_PASSED``)."""
        t_pos, g_pos = _PASSED[name]
        fn = self.orig[name]

        def call(*args, **kw):
            self.calls[name] += 1
            t = args[t_pos] if t_pos is not None and len(args) > t_pos else None
            group = kw.get("group", args[g_pos] if len(args) > g_pos else None)
            with self._call(name, group, t):
                return fn(*args, **kw)
        call.__name__ = name
        return call


@contextmanager
def nccl_semantics(delay_s: float = 0.005, *, check: bool = True, jitter_s: float = 0.005,
                   seed: int | None = None) -> Iterator[NcclFake]:
    """Patch ``torch.distributed`` (and ``distributed_c10d``, whose ``P2POp`` checks its ops
    against the module's ``isend``/``irecv``) with NCCL's semantics for the block. With
    ``check`` a block left without an exception ends with :meth:`NcclFake.check` (collective:
    every rank must leave it normally); ``jitter_s``: the largest random sleep before a call
    made off the entering thread (0: none)."""
    fake = NcclFake(delay_s, jitter_s, seed)
    names = (*_P2P, *_COLLECTIVES, "batch_isend_irecv")
    saved = {n: (getattr(dist, n), getattr(c10d, n)) for n in (*names, *_PASSED)}
    for n in names:
        fn = getattr(fake, n)  # one bound method object: batch_isend_irecv tests ``op.op is isend``
        setattr(dist, n, fn)
        setattr(c10d, n, fn)
    for n in _PASSED:
        fn = fake._passed(n)
        setattr(dist, n, fn)
        setattr(c10d, n, fn)
    ok = False
    try:
        yield fake
        ok = True
    finally:
        for n, (a, b) in saved.items():
            setattr(dist, n, a)
            setattr(c10d, n, b)
    if ok and check:
        fake.check()


__all__ = ["DeferredWork", "Entry", "LonePointToPoint", "NcclFake", "OrderViolation", "nccl_semantics",
           "order_violations"]
