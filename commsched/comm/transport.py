"""How the messages of an all-to-all travel: the transports, the ring's rounds, the reverse group.

:mod:`commsched.comm.all2all` calls these with its ``plan`` (an :class:`~commsched.comm.all2all.A2APlan`)
and ``stats`` (a :class:`~commsched.comm.all2all.CommStats` or None).

Transports (:data:`TRANSPORTS`; why two: docs/design.md, "Transport"): ``"duplex"`` (gloo, CPU
rows; what ``"auto"`` picks there) sends lower to higher rank on the group itself and higher
to lower on the group's *reverse*, a second gloo group of the same ranks; ``"single"`` (the
only one on NCCL) uses the group alone: direct, one ``all_to_all_single``; ring, each round's
send and receive in one ``batch_isend_irecv``, never a lone ``isend``/``irecv``, which
deadlocks NCCL at 3+ ranks. The reverse group is made at the first duplex exchange on a
group, by the caller's thread (never the ring's background thread): that is collective over
the group's members only. It connects through the group's store under a fixed prefix, with
the group's timeout, and stays in a small per-process table until the group is destroyed
(the one piece of module state here: open connections, like torch's own table of groups).
"""

from __future__ import annotations

import atexit
import threading
from typing import Sequence

import torch
import torch.distributed as dist

from ..clock import Clock
from ..dist import comm_guard, gloo_devices

TRANSPORTS = ("auto", "single", "duplex")  # module docstring


def _global(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


_REVERSE_PREFIX = "commsched-a2a-reverse/"  # store prefix of a group's reverse connections
_reverse_lock = threading.Lock()
_reverse_groups: dict = {}  # group -> its reverse gloo backend (module docstring)


def _gloo_backend(group, device: torch.device):
    """The group's gloo backend for ``device``, or None (another backend, or none)."""
    from torch.distributed import ProcessGroupGloo

    if not dist.is_initialized():  # no process group: a one-rank exchange, no transport
        return None
    pg = group if group is not None else dist.group.WORLD
    try:
        be = pg._get_backend(device)
    except (RuntimeError, ValueError):  # the group has no backend for this device
        return None
    return be if isinstance(be, ProcessGroupGloo) else None


def _backend_name(group) -> str:
    return f"a {dist.get_backend(group)} group" if dist.is_initialized() else "no process group"


def resolve_transport(transport: str, group, device: torch.device) -> str:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    duplex_ok = device.type == "cpu" and _gloo_backend(group, device) is not None
    if transport == "duplex" and not duplex_ok:
        raise ValueError("transport='duplex' needs a gloo group and CPU rows (got rows on "
                         f"{device} and {_backend_name(group)}); use 'auto' or 'single'")
    if transport == "auto":
        return "duplex" if duplex_ok else "single"
    return transport


def reverse_group(group):
    """The gloo backend that carries the group's higher-to-lower-rank sends, made at the first
    call on each member (collective over the group's members only; module docstring)."""
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed import PrefixStore, ProcessGroupGloo

    pg = group if group is not None else dist.group.WORLD
    with _reverse_lock:
        rev = _reverse_groups.get(pg)
        if rev is not None:
            return rev
        for old in [g for g in _reverse_groups if g not in c10d._world.pg_map]:
            del _reverse_groups[old]  # groups destroyed since: drop their connections
    opts = ProcessGroupGloo._Options()
    opts._devices = gloo_devices()
    opts._timeout = _gloo_backend(pg, torch.device("cpu")).options._timeout
    store = PrefixStore(_REVERSE_PREFIX, c10d._get_process_group_store(pg))
    # connected outside the lock: another thread's first exchange on another group must not
    # wait for this one's peers (two threads on one group at once is not allowed anyway)
    with comm_guard("connecting the all_to_all reverse group (every rank of the group "
                    "must reach its first exchange)", group):
        rev = ProcessGroupGloo(store, dist.get_rank(pg), dist.get_world_size(pg), opts)
    with _reverse_lock:
        if not _reverse_groups:
            atexit.register(close_reverse_groups)  # idempotent: registered when the table fills
        return _reverse_groups.setdefault(pg, rev)


def close_reverse_groups() -> None:
    """Shut down every reverse connection group the duplex transport made and forget them.

    They are not in torch's group registry, so ``destroy_process_group`` does not reach
    them; left to the interpreter's final clean-up, a gloo backend's worker threads can be
    destroyed while still joinable, which aborts the process at exit ("terminate called
    without an active exception") after the job's work is done. This runs at exit
    (``atexit``) and may be called after ``destroy_process_group``; a later duplex exchange
    connects afresh.
    """
    with _reverse_lock:
        revs = list(_reverse_groups.values())
        _reverse_groups.clear()
    for rev in revs:
        try:
            rev.shutdown()
        except Exception:  # already closed, or a backend without shutdown: dropping it is enough
            pass
    del revs


def _post_pair(x_out, peer: int, send: bool, plan, group, reverse):
    """Post one message to / from ``peer`` (a rank of ``group``): on the group itself when it
    goes from a lower to a higher rank, else on ``reverse``; with ``reverse`` None, on the
    group (the single transport)."""
    me = plan.rank
    lower_to_higher = me < peer if send else peer < me
    if reverse is None or lower_to_higher:
        op = dist.isend if send else dist.irecv
        return op(x_out, _global(group, peer), group=group)
    return reverse.send([x_out], peer, 0) if send else reverse.recv([x_out], peer, 0)


def p2p_direct(x: torch.Tensor, out: torch.Tensor, plan, group, reverse) -> list:
    """Post every peer's send and receive at once (the duplex direct pattern); returns the
    works. The rows this rank keeps are copied here."""
    so, ro, me = plan.send_offsets, plan.recv_offsets, plan.rank
    out[ro[me]:ro[me + 1]].copy_(x[so[me]:so[me + 1]])
    works = []
    with comm_guard("all_to_all (direct, duplex)", group):
        for dst, src in plan.ring_rounds():
            if plan.send_counts[dst] > 0:
                works.append(_post_pair(x[so[dst]:so[dst + 1]], dst, True, plan, group, reverse))
            if plan.recv_counts[src] > 0:
                works.append(_post_pair(out[ro[src]:ro[src + 1]], src, False, plan, group, reverse))
    return works


def _round_ops(x: torch.Tensor, out: torch.Tensor, plan, group, dst: int, src: int) -> list:
    """The P2P ops of one ring round on the single transport (send to ``dst``, receive from
    ``src``; none for an empty message), to post together with ``dist.batch_isend_irecv``."""
    so, ro = plan.send_offsets, plan.recv_offsets
    ops = []
    if plan.send_counts[dst] > 0:
        ops.append(dist.P2POp(dist.isend, x[so[dst]:so[dst + 1]], _global(group, dst), group))
    if plan.recv_counts[src] > 0:
        ops.append(dist.P2POp(dist.irecv, out[ro[src]:ro[src + 1]], _global(group, src), group))
    return ops


def ring(x: torch.Tensor, out: torch.Tensor, plan, group, stats,
          reverse=None) -> None:
    """The ring pattern, round after round (each round waited for before the next). On the
    single transport each round's send and receive are posted together in one
    ``dist.batch_isend_irecv``: NCCL gives a lone ``isend``/``irecv`` a lazy two-rank
    communicator, and with 3+ ranks each rank's first one waits for the next rank's in a
    cycle (a deadlock). On the duplex transport (gloo only, two groups) they go one by one."""
    so, ro, me = plan.send_offsets, plan.recv_offsets, plan.rank
    clock = Clock(x.device)
    t0 = clock.mark()
    out[ro[me]:ro[me + 1]].copy_(x[so[me]:so[me + 1]])
    if stats is not None:
        stats.add_time(0, t0, clock.mark())
    for i, (dst, src) in enumerate(plan.ring_rounds(), start=1):
        t = clock.mark()
        with comm_guard(f"all_to_all ring round {i} (send to rank {dst}, receive from rank {src})", group):
            if reverse is None:
                ops = _round_ops(x, out, plan, group, dst, src)
                reqs = dist.batch_isend_irecv(ops) if ops else []
            else:
                reqs = []
                if plan.send_counts[dst] > 0:
                    reqs.append(_post_pair(x[so[dst]:so[dst + 1]], dst, True, plan, group, reverse))
                if plan.recv_counts[src] > 0:
                    reqs.append(_post_pair(out[ro[src]:ro[src + 1]], src, False, plan, group, reverse))
            for r in reqs:
                r.wait()
        if stats is not None:
            stats.add_time(i, t, clock.mark())


def ring_post_all(x: torch.Tensor, out: torch.Tensor, plan, group) -> list:
    """The ring pattern on a device backend (NCCL), posted at once from the caller's thread:
    one ``batch_isend_irecv`` per round, in round order; the backend runs a communicator's
    operations in the order they were posted, so the rounds stay in sequence with no host
    wait. Returns the works. The rows this rank keeps are copied here."""
    so, ro, me = plan.send_offsets, plan.recv_offsets, plan.rank
    out[ro[me]:ro[me + 1]].copy_(x[so[me]:so[me + 1]])
    works: list = []
    with comm_guard("all_to_all (ring)", group):
        for dst, src in plan.ring_rounds():
            ops = _round_ops(x, out, plan, group, dst, src)
            if ops:
                works.extend(dist.batch_isend_irecv(ops))
    return works


def check_ring_device(pattern: str, device: torch.device, group) -> None:
    """A ValueError for the ring pattern with device (CUDA) rows on a gloo group: gloo's
    send/recv would be handed raw device pointers."""
    if pattern == "ring" and device.type != "cpu" and _gloo_backend(group, device) is not None:
        raise ValueError(f"all_to_all: the ring pattern cannot carry rows on {device} over gloo "
                         "(gloo's send/recv take host memory, not device pointers); use "
                         "pattern='direct', CPU rows, or a NCCL group (init_distributed(device='cuda'))")


class _RawHandle:
    """An exchange in flight; ``_finish`` blocks until the received tensor is complete."""

    def __init__(self, out: torch.Tensor, plan, stats, t0,
                 works: Sequence = (), thread: threading.Thread | None = None,
                 err: list | None = None, what: str = "all_to_all", stream=None):
        self.out, self.plan, self.stats, self.t0 = out, plan, stats, t0
        self._works, self._thread, self._err, self._what = list(works), thread, err, what
        self._stream = stream  # CUDA: the side stream the exchange was posted on, or None
        self._done = False

    def _finish(self) -> torch.Tensor:
        if not self._done:
            if self._works:
                with comm_guard(self._what):
                    for w in self._works:
                        w.wait()
            if self._stream is not None:  # the local rows' copy ran there too
                torch.cuda.current_stream(self.out.device).wait_stream(self._stream)
            if self._thread is not None:
                self._thread.join()
                if self._err:
                    raise self._err[0]
            if self.stats is not None:
                end = Clock(self.out.device).mark()
                self.stats.add_time(None, self.t0, end)
                if self._works:
                    self.stats.add_time(0, self.t0, end)
            self._done = True
        return self.out

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._works:
            return all(bool(w.is_completed()) for w in self._works)
        return self._thread is None or not self._thread.is_alive()
