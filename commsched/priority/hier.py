"""Hierarchical gradient reduction: reduce inside each host, allreduce across hosts, gather
inside the host again -- the three phases of one micro-op (Lina's "cluster shape").

Legend: P ranks, H hosts, L ranks per host (local ranks), N elements of one operation;
``_P`` one entry per rank.

A flat ring allreduce of N elements over P ranks sends 2N(P-1)/P over every ring edge, and
a ring of 2 hosts x 2 ranks crosses each host's NIC once each way: 1.5N per direction. The
hierarchical reduction of one operation (a micro-op or a fused bucket) instead runs:

1. ``intra`` -- a reduction over the host's L ranks after which local rank l holds the
   host's sum of shard l (N / L elements; the operation is padded with zeros to a multiple
   of L): an allreduce inside the host on gloo, whose reduce-scatter has no completion
   future (twice a reduce-scatter's bytes, on the host's fabric only), a reduce-scatter on
   NCCL;
2. ``inter`` -- ``all_reduce`` of shard l over the H ranks with local index l, one per host
   (the *cross* group of l): every local rank reduces its own shard, so the L shards cross
   the NIC side by side and each NIC carries 2N(H-1)/H per direction (N at 2 hosts, against
   1.5N for the ring);
3. ``gather`` -- ``all_gather`` of the shards over the host's ranks: every rank holds the
   sum over all P ranks.

Only phase 2 crosses a NIC, so it is the operation the policy gates (all-to-all first,
credit): on the CPU (gloo) phase 1 starts as soon as the operation's gradients are ready,
the policy is told the operation is ready when phase 1 has finished, and phase 3 starts when
phase 2 has finished. The host-local phases move bytes over the host's fabric, which the
all-to-all's inter-host bytes do not cross, and run beside it. On CUDA (NCCL) a collective
may only be issued at points every rank passes in the same order (the ``program`` launch
rule of :mod:`commsched.priority.policy`), never in reaction to a completion, so there all
three phases are issued together when the policy launches the operation, one after another
on the executor's side stream (each waits for the one before it on the device).

The executor (:class:`~commsched.priority.runtime.executor.GradScheduler`) sends an operation over
all ranks through these phases when it is at least ``ScheduleConfig.hier_min_bytes`` long;
smaller ones stay flat (their NIC bytes save less than two more collectives cost).

Sums. Each element is summed inside its host first (the order of gloo's / NCCL's
reduce-scatter), then across hosts: the same sum as a flat allreduce up to floating-point
reordering, bitwise equal where the order does not matter (values whose partial sums are
exact, such as small integers or dyadic fractions).

Process groups (:class:`HierGroups`, made in a :class:`commsched.dist.RunGroups` under the
configured timeout, collectively): per host one group for phase 1 and a second for phase 3
(each issues its operations in sequence order on every rank, so a reduce-scatter never
meets a gather of another operation), and per local index one cross group. The layout of
ranks on hosts is pure (:class:`HostLayout`) and comes from :class:`commsched.Topology`.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..cluster.topology import Topology
from ..dist import RunGroups
from .runtime.completion import outcome

INTRA, INTER, GATHER = "intra", "inter", "gather"  # the phases of one operation


class HostLayout:
    """The hierarchy's view of a :class:`~commsched.cluster.topology.Topology` (pure): its ranks on
    its hosts, every host holding the same number of them. Built from a topology, or from
    ``hosts_P`` (rank r on host ``hosts_P[r]``: :meth:`Topology.from_hosts
    <commsched.cluster.topology.Topology.from_hosts>`). Hosts are numbered by their first rank; a
    host's ranks keep their order (local rank l is the l-th of them)."""

    def __init__(self, topology: Topology | Sequence[str]):
        if not isinstance(topology, Topology):
            if isinstance(topology, str) or not topology:
                raise ValueError(f"hosts_P must be a non-empty sequence of host names, one per rank, got "
                                 f"{topology!r}")
            topology = Topology.from_hosts(tuple(topology))
        self.topology = topology
        counts = {h: len(topology.ranks_of(h)) for h in self.hosts}
        if len(set(counts.values())) > 1:
            shown = ", ".join(f"{h}: {n}" for h, n in counts.items())
            raise ValueError(f"hierarchical reduction (--hier-reduce) needs the same number of ranks on "
                             f"every host; this layout has {shown} (ranks per host). Start the same "
                             "number of processes on every host, or reduce flat (drop --hier-reduce)")

    @property
    def hosts_P(self) -> tuple[str, ...]:
        return self.topology.hosts_P

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def hosts(self) -> tuple[str, ...]:
        return self.topology.hosts

    @property
    def local_size(self) -> int:
        """L: ranks per host."""
        return self.world_size // len(self.hosts)

    def intra_ranks(self, host: int) -> list[int]:
        """The ranks of host number ``host``, in order."""
        return self.topology.ranks_of(self.hosts[host])

    def cross_ranks(self, local: int) -> list[int]:
        """The rank with local index ``local`` on every host, host 0 first."""
        return [self.intra_ranks(h)[local] for h in range(len(self.hosts))]

    def host_index(self, rank: int) -> int:
        return self.hosts.index(self.hosts_P[rank])

    def local_rank(self, rank: int) -> int:
        return self.intra_ranks(self.host_index(rank)).index(rank)

    @property
    def flat_reason(self) -> str | None:
        """Why the hierarchy would be the flat reduction (None when it is not): one host, or
        one rank per host."""
        if len(self.hosts) == 1:
            return f"all {self.world_size} ranks are on one host"
        if self.local_size == 1:
            return f"every one of the {self.world_size} hosts has one rank"
        return None


def shard_numel(numel: int, local_size: int) -> int:
    """Elements of one local rank's shard of an ``numel``-element operation (pure)."""
    return math.ceil(numel / local_size)


class HierGroups:
    """The process groups of the hierarchical reduction on this rank (see the module
    docstring). Collective: every rank of the job builds it, in the same order, after the
    default group. ``threads``: gloo worker threads of each group (as the allreduce groups'
    ``--allreduce-threads``); ``run``: where they are made (default: a RunGroups of their own)."""


    def __init__(self, layout: HostLayout, *, threads: int | None = None, run: RunGroups | None = None):
        new_group = (run or RunGroups()).new
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("HierGroups builds process groups: call commsched.init_distributed() first")
        if dist.get_world_size() != layout.world_size:
            raise ValueError(f"the host layout has {layout.world_size} ranks, the job {dist.get_world_size()}")
        if layout.flat_reason is not None:
            raise ValueError(f"no hierarchy to reduce over: {layout.flat_reason}")
        self.layout = layout
        rank = dist.get_rank()
        self.rank, self.local_rank = rank, layout.local_rank(rank)
        self.local_size, self.world_size = layout.local_size, layout.world_size
        me = layout.host_index(rank)
        self.intra = self.gather = self.cross = None
        for h in range(len(layout.hosts)):
            ranks = layout.intra_ranks(h)
            a = new_group(ranks, threads=threads)
            b = new_group(ranks, threads=threads)
            if h == me:
                self.intra, self.gather = a, b
        for local in range(layout.local_size):
            g = new_group(layout.cross_ranks(local), threads=threads)
            if local == self.local_rank:
                self.cross = g


def make_hier(hosts_P: Topology | Sequence[str], *, threads: int | None = None,
              say: Callable[[str], None] | None = None, run: RunGroups | None = None) -> HierGroups | None:
    """The groups of the hierarchical reduction over ranks on hosts ``hosts_P`` (a
    :class:`~commsched.cluster.topology.Topology`, or the host of each rank), or None when
    the hierarchy is the flat reduction (one host, or one rank per host): then rank 0 says so
    once (``say``, default: a line on stderr) and the caller reduces flat. Uneven hosts are a
    ValueError. Collective; ``run``: as :class:`HierGroups`'s."""
    layout = HostLayout(hosts_P)
    why = layout.flat_reason
    if why is not None:
        if dist.get_rank() == 0:
            (say or (lambda s: print(s, file=sys.stderr, flush=True)))(
                f"commsched: hierarchical reduction (--hier-reduce) is the flat one here ({why}); "
                "reducing flat")
        return None
    return HierGroups(layout, threads=threads, run=run)


class _Entry:
    """One operation's buffers. ``buf``: the operation padded to L shards (``flat`` itself
    when no padding is needed); ``shard``: this rank's shard, a view of ``buf`` after an
    allreduce inside the host (gloo) or its own tensor after a reduce-scatter (chained);
    ``out``: where the gather lands (gloo: a tensor of its own, never aliasing the shard)."""

    __slots__ = ("seq", "flat", "buf", "shard", "out", "nbytes", "works")

    def __init__(self, seq: int, flat: torch.Tensor, local_rank: int, local_size: int, nbytes: int,
                 chained: bool):
        self.seq, self.flat, self.nbytes = seq, flat, nbytes
        n, k = flat.numel(), shard_numel(flat.numel(), local_size)
        if n == k * local_size and flat.is_contiguous():
            self.buf = flat  # no padding needed: reduce in place
        else:
            self.buf = torch.zeros(k * local_size, dtype=flat.dtype, device=flat.device)
            self.buf[:n].copy_(flat)
        if chained:
            self.shard, self.out = torch.empty(k, dtype=flat.dtype, device=flat.device), self.buf
        else:
            self.shard = self.buf[local_rank * k:(local_rank + 1) * k]
            self.out = torch.empty_like(self.buf)
        self.works: list[Any] = []


@contextlib.contextmanager
def _on_side(stream: Any, tensors: Sequence[torch.Tensor]):
    """Run the block on ``stream`` after the current stream's work so far, with ``tensors``
    recorded on it (CUDA); a plain block for ``stream`` None."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(tensors[0].device))
    for t in tensors:
        t.record_stream(stream)
    with torch.cuda.stream(stream):
        yield


class HierStep:
    """One step's hierarchical operations on this rank (the executor holds its lock around
    every call). ``on_done(phase, seq, error)`` is called when phase ``intra`` or ``gather``
    of operation ``seq`` has finished (from the backend's completion thread); phase
    ``inter`` is the executor's own launch. ``chained``: issue all three phases at the
    launch (CUDA, see the module docstring)."""

    def __init__(self, groups: HierGroups, on_done: Callable[[str, int, BaseException | None], None],
                 *, chained: bool = False):
        self.g, self.on_done, self.chained = groups, on_done, chained
        self._ops: dict[int, _Entry] = {}
        self._order: list[int] = []       # the hierarchical operations' sequence numbers, in order
        self._intra_next = 0              # index into _order: the next phase 1 to issue
        self._gather_next = 0             # index into _order: the next phase 3 to issue
        self._ready: set[int] = set()     # buffers ready for phase 1
        self._inter_done: set[int] = set()
        self._done: set[int] = set()

    def expect(self, seqs: Sequence[int]) -> None:
        """The sequence numbers of this step's hierarchical operations (every rank the same)."""
        self._order = sorted(seqs)

    # ------------------------------------------------------------------ phases
    def ready(self, seq: int, flat: torch.Tensor, nbytes: int) -> bool:
        """Operation ``seq``'s gradients are ready in ``flat``. Returns whether the policy may
        be told it is ready now (chained: yes; else after phase 1, through ``on_done``)."""
        self._ops[seq] = _Entry(seq, flat, self.g.local_rank, self.g.local_size, nbytes, self.chained)
        self._ready.add(seq)
        return self.chained

    def pump(self) -> None:
        """Issue what may go now, in sequence order: phase 1 of ready operations, phase 3 of
        those whose phase 2 has finished (not chained)."""
        if self.chained:
            return
        while self._intra_next < len(self._order) and self._order[self._intra_next] in self._ready:
            e = self._ops[self._order[self._intra_next]]
            self._intra_next += 1
            self._issue(e, INTRA)
        while self._gather_next < len(self._order) and self._order[self._gather_next] in self._inter_done:
            e = self._ops[self._order[self._gather_next]]
            self._gather_next += 1
            self._issue(e, GATHER)

    def _issue(self, e: _Entry, phase: str) -> None:
        try:
            w = self._start(e, phase)
        except RuntimeError as err:
            self.on_done(phase, e.seq, err)
            return
        e.works.append(w)
        w.get_future().add_done_callback(lambda fut: self.on_done(phase, e.seq, outcome(fut)))

    def _start(self, e: _Entry, phase: str) -> Any:
        # gloo's reduce-scatter has no completion future: phase 1 is an allreduce inside the
        # host, of which this rank keeps its shard (twice a reduce-scatter's bytes on the
        # host's fabric, none more on the NIC)
        if phase == INTRA:
            return dist.all_reduce(e.buf, group=self.g.intra, async_op=True)
        if phase == GATHER:
            return dist.all_gather_into_tensor(e.out, e.shard, group=self.g.gather, async_op=True)
        raise AssertionError(phase)

    def inter_tensor(self, seq: int) -> torch.Tensor:
        """What phase 2 reduces over the cross group: this rank's shard."""
        return self._ops[seq].shard

    @property
    def cross(self) -> Any:
        return self.g.cross

    def launch_chained(self, seq: int, launch: Callable[[torch.Tensor, Any], Any], stream: Any) -> Any:
        """CUDA: issue the three phases of ``seq`` on ``stream``, each after the one before it;
        returns the last one's Work (its completion is the operation's). ``stream`` first
        waits for the caller's current stream (which produced, scaled and padded the
        gradient: NCCL orders after ``stream`` only), and the buffers are recorded on it so
        the allocator does not reuse them while it runs. ``stream`` None (the CPU, tests of
        NCCL's semantics): the same three phases, each ``wait()`` blocking the host."""
        e = self._ops[seq]
        with _on_side(stream, (e.buf, e.shard, e.out)):
            w1 = dist.reduce_scatter_tensor(e.shard, e.buf, group=self.g.intra, async_op=True)
            w1.wait()  # the stream waits for it (NCCL: no host wait)
            w2 = launch(e.shard, self.g.cross)
            if hasattr(w2, "stream_wait") and stream is not None:
                w2.stream_wait(stream)  # its event, recorded at enqueue: no host wait (CompressedLauncher)
            else:
                w2.wait()
            w3 = dist.all_gather_into_tensor(e.out, e.shard, group=self.g.gather, async_op=True)
        e.works += [w1, w2, w3]
        return w3

    def inter_done(self, seq: int) -> None:
        """Phase 2 of ``seq`` has finished (chained: the whole operation has)."""
        if self.chained:
            self._done.add(seq)
        else:
            self._inter_done.add(seq)

    def gathered(self, seq: int) -> None:
        """Phase 3 of ``seq`` has finished: the operation is done."""
        self._done.add(seq)

    # ------------------------------------------------------------------ end of step
    @property
    def pending(self) -> int:
        """Operations whose last phase has not finished."""
        return len(self._order) - len(self._done)

    def wait_all(self) -> None:
        """Wait for every issued phase (a failure is raised: the caller reports it)."""
        for e in self._ops.values():
            for w in e.works:
                w.wait()
            e.works = []

    def wait_quietly(self) -> None:
        """Let every issued phase end, ignoring failures (before an error leaves)."""
        for e in self._ops.values():
            for w in e.works:
                try:
                    w.wait()
                except RuntimeError:
                    pass
            e.works = []

    def copy_back(self) -> None:
        """Write every operation's sum back into its ``flat``."""
        for e in self._ops.values():
            if e.out is not e.flat:
                e.flat.copy_(e.out[:e.flat.numel()])
        self._ops = {}


__all__ = ["GATHER", "INTER", "INTRA", "HierGroups", "HierStep", "HostLayout", "make_hier", "shard_numel"]
