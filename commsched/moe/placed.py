"""Placed expert dispatch for inference: tokens go to the devices a placement names.

Legend: T tokens on this rank, K experts per token, A = T*K assignments of this rank,
D row width, E experts, N devices (= ranks of the group, also the P source ranks),
M experts held by this device (ascending), R rows received here.

One MoE layer on rank ``me`` with a :class:`~commsched.moe.placement.Placement` ``p``:

1. every rank knows ``counts_PE`` (assignments of every rank to every expert; the
   runtime gathers it once per layer with the next layer's popularity estimate);
2. the i-th assignment (in this rank's token order) to expert e goes to replica
   ``(split_offsets(counts_PE)[me][e] + i) % r_e`` of e (:func:`split_tokens`), so the
   replicas of e share the tokens of *all* ranks evenly (within one token);
3. rows are sent grouped by device, then expert, through the uneven
   ``commsched.all_to_all`` with a plan built locally: the send counts are this rank's,
   the receive counts follow from ``counts_PE`` and ``p`` (:func:`recv_matrix`) -- so no
   count exchange is needed;
4. the device runs its experts on the rows it received, grouped by expert;
5. rows go back through the reverse exchange and are combined with their gates.

:func:`placed_moe` is the distributed path; :func:`placed_moe_local` is its slow twin
with no exchange and no placement (every expert applied where the token is).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ..all2all import A2APlan, all_to_all
from .placement import Placement, split_offsets, split_tokens

# compute(experts_M, counts_M, x_RD) -> y_RD: rows grouped by expert (ascending ids, counts_M
# rows each); the device-side expert computation (real FFNs or an emulated device)
ExpertCompute = Callable[[Sequence[int], Sequence[int], torch.Tensor], torch.Tensor]

__all__ = [
    "ExpertCompute",
    "PlacedTimes",
    "replica_share",
    "recv_matrix",
    "device_rows",
    "send_order",
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
    off = split_offsets(c)
    experts = list(placement.device_experts[device])
    rows = np.zeros((c.shape[0], len(experts)), dtype=np.int64)
    for m, e in enumerate(experts):
        reps = placement.replicas[e]
        rows[:, m] = replica_share(off[:, e], c[:, e], len(reps), reps.index(device))
    return experts, rows


def device_rows(counts_PE: np.ndarray, placement: Placement) -> np.ndarray:
    """[N] rows each device computes for this layer (the device loads after the split)."""
    return np.array([int(recv_matrix(counts_PE, placement, d)[1].sum())
                     for d in range(placement.num_devices)], dtype=np.int64)


def send_order(expert_A: np.ndarray, placement: Placement, offset_E: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """(order_A, send_counts_N): the assignments sorted by (device, expert, position)
    and how many go to each device."""
    dev_A = split_tokens(expert_A, placement, offset_E)
    key = dev_A * placement.num_experts + expert_A
    order = np.argsort(key, kind="stable")
    counts = np.bincount(dev_A, minlength=placement.num_devices)
    return order, counts


def _regroup(rows_PM: np.ndarray) -> torch.Tensor:
    """Permutation taking received rows (source-major, expert within source) to
    expert-major rows (source within expert)."""
    P, M = rows_PM.shape
    flat = rows_PM.reshape(-1)
    starts = np.concatenate([[0], np.cumsum(flat)[:-1]]).reshape(P, M) if flat.size else np.zeros((P, M), int)
    parts = [np.arange(starts[p, m], starts[p, m] + rows_PM[p, m]) for m in range(M) for p in range(P)
             if rows_PM[p, m]]
    perm = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(perm.astype(np.int64))


# --------------------------------------------------------------------------- the exchange
@dataclass
class PlacedTimes:
    """Seconds this rank spent in each part of placed layers (accumulated)."""

    a2a: float = 0.0
    expert: float = 0.0
    other: float = 0.0
    bytes_sent: int = 0
    rows_computed: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.a2a = self.expert = self.other = 0.0
        self.bytes_sent = 0
        self.rows_computed = []


def _flatten(expert_TK: torch.Tensor | np.ndarray, gate_TK: torch.Tensor, keep_TK: torch.Tensor | None):
    ex = torch.as_tensor(expert_TK, dtype=torch.int64)
    T, K = ex.shape
    token = torch.arange(T).unsqueeze(1).expand(T, K).reshape(-1)
    ex_a, gate_a = ex.reshape(-1), gate_TK.reshape(-1)
    if keep_TK is not None:
        keep = keep_TK.reshape(-1)
        token, ex_a, gate_a = token[keep], ex_a[keep], gate_a[keep]
    return token, ex_a, gate_a


def placed_moe(x_TD: torch.Tensor, expert_TK: torch.Tensor, gate_TK: torch.Tensor,
               counts_PE: np.ndarray, placement: Placement, compute: ExpertCompute, *,
               rank: int, group=None, keep_TK: torch.Tensor | None = None,
               times: PlacedTimes | None = None) -> torch.Tensor:
    """One MoE layer through the placement (module docstring); returns y [T, D].

    counts_PE: int [N, E] assignments of every rank to every expert (this rank's row must
    match ``expert_TK``); gate_TK: float [T, K]; keep_TK: bool [T, K] or None (all kept).
    Collective over ``group``: every rank calls it with the same counts and placement."""
    t0 = time.perf_counter()
    E, N = placement.num_experts, placement.num_devices
    token_A, expert_A, gate_A = _flatten(expert_TK, gate_TK, keep_TK)
    ex_np = expert_A.numpy()
    c = np.asarray(counts_PE, dtype=np.int64)
    if c.shape != (N, E):
        raise ValueError(f"counts_PE must be [N, E] = [{N}, {E}], got {c.shape}")
    mine = np.bincount(ex_np, minlength=E)
    if not np.array_equal(mine, c[rank]):
        raise ValueError(f"rank {rank}: counts_PE[{rank}] = {c[rank].tolist()} does not match this rank's "
                         f"routing {mine.tolist()}")
    order, send_N = send_order(ex_np, placement, split_offsets(c)[rank])
    order_t = torch.from_numpy(order)
    experts_M, rows_PM = recv_matrix(c, placement, rank)
    recv_N = rows_PM.sum(axis=1)
    plan = A2APlan(tuple(int(v) for v in send_N), tuple(int(v) for v in recv_N), rank)
    x_send = x_TD[token_A[order_t]]
    t1 = time.perf_counter()
    x_recv = all_to_all(x_send, plan, group=group)
    t2 = time.perf_counter()
    perm = _regroup(rows_PM)
    counts_M = rows_PM.sum(axis=0).tolist()
    y_exp = compute(experts_M, counts_M, x_recv[perm])
    y_recv = torch.empty_like(y_exp)
    y_recv[perm] = y_exp
    t3 = time.perf_counter()
    y_send = all_to_all(y_recv, plan.reversed(), group=group)
    t4 = time.perf_counter()
    w = gate_A[order_t].to(y_send.dtype).unsqueeze(1)
    out = x_TD.new_zeros(x_TD.shape).index_add(0, token_A[order_t], y_send * w)
    t5 = time.perf_counter()
    if times is not None:
        times.a2a += (t2 - t1) + (t4 - t3)
        times.expert += t3 - t2
        times.other += (t1 - t0) + (t5 - t4)
        row = x_TD[0].numel() * x_TD.element_size() if x_TD.shape[0] else 0
        times.bytes_sent += int(plan.total_send - plan.send_counts[rank]) * row * 2
        times.rows_computed.append(int(sum(counts_M)))
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
