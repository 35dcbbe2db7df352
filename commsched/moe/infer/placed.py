"""Placed expert dispatch for inference: tokens go to the devices a placement names.

Legend: T tokens on this rank, K experts per token, A = T*K assignments of this rank,
D row width, E experts, N devices (= ranks of the group, also the P source ranks),
M experts held by this device (ascending), R rows received here.

One MoE layer on rank ``me`` with a :class:`~commsched.moe.placement.Placement` ``p``:

1. every rank knows ``counts_PE`` (assignments of every rank to every expert; the
   runtime gathers it once per layer with the next layer's popularity estimate);
2. the i-th assignment (in this rank's token order) to expert e goes to replica
   ``(split_offsets(counts_PE)[me][e] + i) % r_e`` of e (:func:`split_tokens`), so the
   replicas of e share the tokens of *all* ranks evenly (within one token); with a
   host-local placement (``p.device_host`` set) over e's replicas on this rank's host
   when it has any, evenly over the ranks of that host;
3. rows are sent grouped by device, then expert, through the uneven
   ``commsched.all_to_all`` with a plan built locally: the send counts are this rank's,
   the receive counts follow from ``counts_PE`` and ``p`` (:func:`recv_matrix`) -- so no
   count exchange is needed;
4. the device runs its experts on the rows it received, grouped by expert;
5. rows go back through the reverse exchange and are combined with their gates.

Pipelined (the default, ``pipelined=True``): the rows a rank sends to its *own* device
never enter the exchanges, and the device computes them while the exchanges run. The
device first gets part A of its own rows (:func:`own_split`: about half of them, of
experts already resident), then the dispatch of the other ranks' rows starts
asynchronously; the host waits for the remote rows (and for experts still being
loaded), queues them and part B (the rest of its own rows) behind them, and starts the
reverse exchange as soon as the remote rows' results are done, while the device
computes part B. Both exchanges' latency hides behind the device's own compute; the
arithmetic per row is unchanged. ``pipelined=False`` is the plain sequence (dispatch,
compute everything, combine), kept as the twin.

:func:`placed_moe` is the distributed path; :func:`placed_moe_local` is its slow twin
with no exchange and no placement (every expert applied where the token is).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection, Protocol, Sequence

import numpy as np
import torch

from ...clock import Clock, interval_s
from ...comm.all2all import A2APlan, CommStats, all_to_all, all_to_all_async
from ..placement import Placement, split_offsets, split_tokens

# compute(experts_M, counts_M, x_RD) -> y_RD: rows grouped by expert (ascending ids, counts_M
# rows each); the device-side expert computation (real FFNs or an emulated device)
ExpertCompute = Callable[[Sequence[int], Sequence[int], torch.Tensor], torch.Tensor]


class AsyncDevice(Protocol):
    """A device whose computations run asynchronously, like kernels on a GPU stream:
    ``compute`` returns at once (its result is valid, the device is busy a while longer),
    ``issued()`` is a token for "everything issued so far" and ``wait(token)`` blocks
    until the device has finished that work. Without one, ``compute`` is synchronous."""

    def issued(self) -> float: ...

    def wait(self, token: float) -> None: ...

__all__ = [
    "ExpertCompute",
    "AsyncDevice",
    "PlacedTimes",
    "replica_share",
    "recv_matrix",
    "device_rows",
    "send_order",
    "own_split",
    "regroup_order",
    "placed_moe",
    "placed_moe_local",
]


# --------------------------------------------------------------------------- pure counting
def replica_share(offset: np.ndarray | int, count: np.ndarray | int, r: int, i: int) -> np.ndarray:
    """How many of the round-robin positions ``offset .. offset+count-1`` fall on replica
    ``i`` of ``r`` (positions j with j % r == i). Works elementwise on arrays."""
    off = np.asarray(offset, dtype=np.int64)
    cnt = np.asarray(count, dtype=np.int64)

    def upto(n: np.ndarray) -> np.ndarray:  # positions 0..n-1 with j % r == i
        return (n - i + r - 1) // r

    return upto(off + cnt) - upto(off)


def recv_matrix(counts_PE: np.ndarray, placement: Placement, device: int) -> tuple[list[int], np.ndarray]:
    """(experts_M, rows_PM): the experts ``device`` holds and how many rows of each it
    receives from each source rank, given every rank's counts and the placement."""
    c = np.asarray(counts_PE, dtype=np.int64)
    off = split_offsets(c, placement)
    experts = list(placement.device_experts[device])
    rows = np.zeros((c.shape[0], len(experts)), dtype=np.int64)
    for m, e in enumerate(experts):
        if placement.device_host is None:
            reps = placement.replicas[e]  # a device holding several shares: each position counts
            for i in (i for i, x in enumerate(reps) if x == device):
                rows[:, m] += replica_share(off[:, e], c[:, e], len(reps), i)
            continue
        for p in range(c.shape[0]):  # host-local: each source splits over its own candidates
            cand = placement.candidates(e, p)
            for i in (i for i, x in enumerate(cand) if x == device):
                rows[p, m] += replica_share(off[p, e], c[p, e], len(cand), i)
    return experts, rows


def device_rows(counts_PE: np.ndarray, placement: Placement) -> np.ndarray:
    """[N] rows each device computes for this layer (the device loads after the split)."""
    return np.array([int(recv_matrix(counts_PE, placement, d)[1].sum())
                     for d in range(placement.num_devices)], dtype=np.int64)


def send_order(expert_A: np.ndarray, placement: Placement, offset_E: np.ndarray, source: int | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """(order_A, send_counts_N): the assignments of rank ``source`` (needed by a host-local
    placement) sorted by (device, expert, position) and how many go to each device."""
    dev_A = split_tokens(expert_A, placement, offset_E, source)
    key = dev_A * placement.num_experts + expert_A
    order = np.argsort(key, kind="stable")
    counts = np.bincount(dev_A, minlength=placement.num_devices)
    return order, counts


def regroup_order(rows_PM: np.ndarray) -> np.ndarray:
    """int64 [R] permutation taking received rows (source-major, expert within source;
    ``rows_PM[p, m]`` rows of source p for expert m) to expert-major rows (source within
    expert): ``received[perm]`` is grouped by expert."""
    rows = np.asarray(rows_PM, dtype=np.int64)
    P, M = rows.shape
    key = np.repeat((np.arange(M)[None, :] * P + np.arange(P)[:, None]).reshape(-1), rows.reshape(-1))
    return np.argsort(key, kind="stable").astype(np.int64)


def _on(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host-planned int64 array as a tensor on ``device`` (one copy; none on the CPU)."""
    t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.to(device)


def _regroup(rows_PM: np.ndarray, device: torch.device) -> torch.Tensor:
    return _on(regroup_order(rows_PM), device)


OWN_FIRST_SHARE = 0.5  # share of a device's own rows computed while the dispatch runs


def own_split(experts_M: Sequence[int], own_M: Sequence[int], loading: Collection[int] = (),
              share: float = OWN_FIRST_SHARE) -> tuple[np.ndarray, np.ndarray]:
    """(first_M, last_M): how many of this device's own rows of each expert (``own_M``,
    rows it sends itself, grouped by expert in the order ``experts_M``) to compute while
    the dispatch exchange runs (first) and while the combine exchange runs (last).

    First takes rows in expert order up to ceil(share * total), skipping experts in
    ``loading`` (not resident yet: they can only be computed after their load); first of
    an expert is a prefix of its own rows, last the rest."""
    own = np.asarray(own_M, dtype=np.int64)
    if own.shape != (len(experts_M),) or (own < 0).any():
        raise ValueError(f"own_M must hold one count >= 0 per expert of {list(experts_M)}, got {own.tolist()}")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must lie in [0, 1], got {share}")
    budget = int(np.ceil(share * own.sum()))
    first = np.zeros_like(own)
    for m, e in enumerate(experts_M):
        if budget <= 0:
            break
        if e in loading:
            continue
        first[m] = min(own[m], budget)
        budget -= first[m]
    return first, own - first


# --------------------------------------------------------------------------- the exchange
@dataclass
class PlacedTimes:
    """Seconds this rank spent in each part of placed layers (accumulated).

    The parts are timed with :class:`commsched.clock.Clock` on the rows' device: host
    seconds on the CPU, added at once; CUDA events on CUDA (the host clock would measure
    enqueue times there), kept as marks and added by :meth:`settle`, so a layer never
    waits for its own timing. Read the numbers after :meth:`settle`."""

    a2a: float = 0.0
    expert: float = 0.0
    other: float = 0.0
    load_wait: float = 0.0  # waiting in ``wait_loaded`` for experts still loading
    bytes_sent: int = 0
    rows_computed: list[int] = field(default_factory=list)
    stats: CommStats | None = None  # when set, the row exchanges' own per-peer byte counts
    # CUDA layers not yet added: (start, end, {part: [(start, end), ...]}) marks
    _pending: list = field(default_factory=list, repr=False)

    def reset(self) -> None:
        self.a2a = self.expert = self.other = self.load_wait = 0.0
        self.bytes_sent = 0
        self.rows_computed = []
        self._pending = []
        if self.stats is not None:
            self.stats.reset()

    def add_layer(self, t0, t5, parts: dict) -> None:
        """One layer from mark ``t0`` to ``t5`` with its parts' intervals (``a2a``, ``expert``,
        ``load_wait``, ``meanwhile``; ``other`` is the rest but ``meanwhile``)."""
        if isinstance(t0, float):
            self._add(t0, t5, parts)
        else:
            self._pending.append((t0, t5, parts))

    def _add(self, t0, t5, parts: dict) -> None:
        sec = {k: sum(interval_s(a, b) for a, b in v) for k, v in parts.items()}
        self.a2a += sec.get("a2a", 0.0)
        self.expert += sec.get("expert", 0.0)
        self.load_wait += sec.get("load_wait", 0.0)
        self.other += interval_s(t0, t5) - sum(sec.values())

    def settle(self) -> "PlacedTimes":
        """Add the CUDA layers recorded so far (waits for their last event); a no-op on the CPU."""
        for t0, t5, parts in self._pending:
            self._add(t0, t5, parts)
        self._pending = []
        return self


def _flatten(expert_TK: torch.Tensor | np.ndarray, gate_TK: torch.Tensor, keep_TK: torch.Tensor | None):
    ex = torch.as_tensor(expert_TK, dtype=torch.int64, device=gate_TK.device)
    T, K = ex.shape
    token = torch.arange(T, device=ex.device).unsqueeze(1).expand(T, K).reshape(-1)
    ex_a, gate_a = ex.reshape(-1), gate_TK.reshape(-1)
    if keep_TK is not None:
        keep = keep_TK.reshape(-1)
        token, ex_a, gate_a = token[keep], ex_a[keep], gate_a[keep]
    return token, ex_a, gate_a


def _blocks(counts_M: np.ndarray, take_M: np.ndarray, skip_M: np.ndarray) -> np.ndarray:
    """Row indices, into rows grouped by expert (``counts_M`` each), of rows
    ``skip_M[m] .. skip_M[m] + take_M[m] - 1`` of every expert m."""
    starts = np.concatenate([[0], np.cumsum(counts_M)[:-1]]) + skip_M
    parts = [np.arange(a, a + n) for a, n in zip(starts.tolist(), take_M.tolist()) if n]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def _run(compute: ExpertCompute, experts_M: Sequence[int], counts_M: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """``compute`` on the experts that have rows (an expert without rows here may not be
    resident, e.g. still loading)."""
    keep = [m for m, n in enumerate(counts_M.tolist()) if n]
    return compute([experts_M[m] for m in keep], [int(counts_M[m]) for m in keep], x)


def placed_moe(x_TD: torch.Tensor, expert_TK: torch.Tensor, gate_TK: torch.Tensor,
               counts_PE: np.ndarray, placement: Placement, compute: ExpertCompute, *,
               rank: int, group=None, keep_TK: torch.Tensor | None = None,
               times: PlacedTimes | None = None, pipelined: bool = True,
               loading: Collection[int] = (), wait_loaded: Callable[[], None] | None = None,
               device: AsyncDevice | None = None, meanwhile: Callable[[], None] | None = None) -> torch.Tensor:
    """One MoE layer through the placement (module docstring); returns y [T, D].

    counts_PE: int [N, E] assignments of every rank to every expert (this rank's row must
    match ``expert_TK``); gate_TK: float [T, K]; keep_TK: bool [T, K] or None (all kept).
    ``loading``: experts of this device still being loaded, ``wait_loaded()`` blocks
    until they are resident (called before the first computation that needs them).
    ``device``: set when ``compute`` is asynchronous (:class:`AsyncDevice`); results are
    waited for before they are sent or combined. ``meanwhile()``: host work with no
    part in this layer (the next layer's phase-1 plan), run while the device computes
    (pipelined) or before the dispatch (sequential). Collective over ``group``: every
    rank calls it with the same counts and placement. The tensors are on one device (the
    job's: the rows, routing and index tensors stay there); the send order and the
    permutations are planned with numpy on the host and moved there in one copy each."""
    dev = x_TD.device  # index tensors live there; the planning below is numpy on the host
    clock = Clock(dev)  # the parts' times: CUDA events on CUDA (PlacedTimes)
    t0 = clock.mark()
    E, N = placement.num_experts, placement.num_devices  # index tensors live there; the planning below is numpy on the host
    token_A, expert_A, gate_A = _flatten(expert_TK, gate_TK, keep_TK)
    ex_np = expert_A.cpu().numpy()
    c = np.asarray(counts_PE, dtype=np.int64)
    if c.shape != (N, E):
        raise ValueError(f"counts_PE must be [N, E] = [{N}, {E}], got {c.shape}")
    mine = np.bincount(ex_np, minlength=E)
    if not np.array_equal(mine, c[rank]):
        raise ValueError(f"rank {rank}: counts_PE[{rank}] = {c[rank].tolist()} does not match this rank's "
                         f"routing {mine.tolist()}")
    order, send_N = send_order(ex_np, placement, split_offsets(c, placement)[rank], rank)
    order_t = _on(order, dev)
    experts_M, rows_PM = recv_matrix(c, placement, rank)
    x_send = x_TD.index_select(0, token_A[order_t])
    tm: dict[str, list] = {"a2a": [], "expert": [], "load_wait": [], "meanwhile": []}
    stats = times.stats if times is not None else None

    def timed(part: str, fn, *a, **kw):
        t = clock.mark()
        out = fn(*a, **kw)
        tm[part].append((t, clock.mark()))
        return out

    def device_done(token: float | None = None) -> None:
        if device is not None:
            timed("expert", device.wait, device.issued() if token is None else token)

    if not pipelined:
        if meanwhile is not None:
            timed("meanwhile", meanwhile)
        recv_N = rows_PM.sum(axis=1)
        plan = A2APlan(tuple(int(v) for v in send_N), tuple(int(v) for v in recv_N), rank, agreed=True)
        x_recv = timed("a2a", all_to_all, x_send, plan, group=group, stats=stats)
        if wait_loaded is not None:
            timed("load_wait", wait_loaded)
        perm = _regroup(rows_PM, dev)
        y_exp = timed("expert", _run, compute, experts_M, rows_PM.sum(axis=0), x_recv[perm])
        device_done()
        y_recv = torch.empty_like(y_exp)
        y_recv[perm] = y_exp
        y_send = timed("a2a", all_to_all, y_recv, plan.reversed(), group=group, stats=stats)
        sent_rows = int(plan.total_send - plan.send_counts[rank])
    else:
        # own rows (this rank -> this device) stay here; the exchanges carry the others'
        so = np.concatenate([[0], np.cumsum(send_N)])
        own_x = x_send[so[rank]:so[rank + 1]]
        own_M = rows_PM[rank].copy()
        rem_PM = rows_PM.copy()
        rem_PM[rank] = 0
        send_r, recv_r = send_N.copy(), rem_PM.sum(axis=1)
        send_r[rank] = 0
        plan = A2APlan(tuple(int(v) for v in send_r), tuple(int(v) for v in recv_r), rank, agreed=True)
        first_M, last_M = own_split(experts_M, own_M, loading)
        zero = np.zeros_like(own_M)
        idx_f = _on(_blocks(own_M, first_M, zero), dev)
        idx_l = _on(_blocks(own_M, last_M, first_M), dev)
        y_own = torch.empty_like(own_x)
        if len(idx_f):  # queued first: the device starts at once, the dispatch right after
            y_own[idx_f] = timed("expert", _run, compute, experts_M, first_M, own_x.index_select(0, idx_f))
        x_rem = torch.cat([x_send[:so[rank]], x_send[so[rank + 1]:]])
        h = timed("a2a", all_to_all_async, x_rem, plan, group=group, stats=stats)
        if meanwhile is not None:
            timed("meanwhile", meanwhile)
        x_recv = timed("a2a", h.wait)
        if wait_loaded is not None:
            timed("load_wait", wait_loaded)
        perm = _regroup(rem_PM, dev)
        y_exp = timed("expert", _run, compute, experts_M, rem_PM.sum(axis=0), x_recv.index_select(0, perm))
        remote_done = device.issued() if device is not None else None
        if len(idx_l):  # queued behind the remote rows: the device never idles between them
            y_own[idx_l] = timed("expert", _run, compute, experts_M, last_M, own_x.index_select(0, idx_l))
        device_done(remote_done)
        y_recv = torch.empty_like(y_exp)
        y_recv[perm] = y_exp
        h2 = timed("a2a", all_to_all_async, y_recv, plan.reversed(), group=group,
                   stats=stats)
        device_done()
        y_back = timed("a2a", h2.wait)
        y_send = torch.cat([y_back[:so[rank]], y_own, y_back[so[rank]:]])
        sent_rows = int(plan.total_send)
    w = gate_A[order_t].to(y_send.dtype).unsqueeze(1)
    out = x_TD.new_zeros(x_TD.shape).index_add(0, token_A[order_t], y_send * w)
    if times is not None:
        times.add_layer(t0, clock.mark(), tm)
        row = x_TD[0].numel() * x_TD.element_size() if x_TD.shape[0] else 0
        times.bytes_sent += sent_rows * row * 2
        times.rows_computed.append(int(rows_PM.sum()))
    return out


def placed_moe_local(x_TD: torch.Tensor, expert_TK: torch.Tensor, gate_TK: torch.Tensor,
                     compute: ExpertCompute, keep_TK: torch.Tensor | None = None) -> torch.Tensor:
    """The slow twin: every expert applied here to its rows (in token order), no
    placement, no exchange; ``compute`` gets the experts that have rows, ascending."""
    token_A, expert_A, gate_A = _flatten(expert_TK, gate_TK, keep_TK)
    order = torch.sort(expert_A, stable=True).indices
    ex_sorted = expert_A[order]
    experts = torch.unique(ex_sorted).tolist()
    counts = [int((ex_sorted == e).sum()) for e in experts]
    y = compute(experts, counts, x_TD[token_A[order]])
    w = gate_A[order].to(y.dtype).unsqueeze(1)
    return x_TD.new_zeros(x_TD.shape).index_add(0, token_A[order], y * w)
