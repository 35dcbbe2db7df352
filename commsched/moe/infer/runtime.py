"""The per-rank inference runtime: one placed MoE layer at a time, and the two drivers'
forward passes around it.

Legend: N ranks (= devices), E experts, L MoE layers, k experts per token, T tokens on a
rank, D row width, B sequences, S sequence length.

:class:`Runtime` is what every MoE layer of a batch calls (``runtime.moe(j, x, ...)``,
steps 2-5 of :mod:`commsched.moe.infer`): the metadata exchange, the layer's placement
from its :class:`~commsched.moe.infer.policy.PlacementStrategy`, the expert loads
into the :class:`~commsched.moe.infer.banks.ExpertBank`, and
:func:`~commsched.moe.infer.placed.placed_moe`. It records per batch what the metrics need.
The forward passes are :func:`trace_forward` (the trace driver's synthetic stack) and
:func:`model_forward` (the language model through its ``moe_call`` seam); the layer
function they take is ``runtime.moe`` or, for the single-process twin, the bank's
``reference`` through :func:`~commsched.moe.infer.placed.placed_moe_local`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import dist as cdist
from ...comm.all2all import A2APlan, CommStats, all_to_all
from ...dist import comm_guard
from ...results import median
from ..placement import Placement
from .banks import ExpertBank
from .placed import PlacedTimes, placed_moe
from .policy import LayerDecision, PlacementStrategy, placement_digest

__all__ = ["trace_forward", "model_forward", "model_weights", "BatchTimes", "Runtime",
           "row_cost"]


# --------------------------------------------------------------------------- forward passes
def trace_forward(x_TD: torch.Tensor, expert_TLK: torch.Tensor, gate_TK: torch.Tensor, moe) -> torch.Tensor:
    """The trace driver's stack: x <- layer_norm(x + moe_j(x)) for every layer j, where
    ``moe(j, x, expert_TK, gate_TK, keep_TK)`` is the placed layer or its local twin."""
    D = x_TD.shape[1]
    for j in range(expert_TLK.shape[1]):
        y = moe(j, x_TD, expert_TLK[:, j], gate_TK, None)
        x_TD = F.layer_norm(x_TD + y, (D,))
    return x_TD


def model_forward(model, tokens_BS: torch.Tensor, moe) -> torch.Tensor:
    """``model(tokens)`` with MoE layer j computed by ``moe(j, h_TD, expert_TK, gate_TK,
    keep_TK)`` on the choices of the layer's own router (the model's ``moe_call`` seam);
    returns logits [B, S, V]."""

    def call(j: int, layer, h_BSD: torch.Tensor) -> torch.Tensor:
        h_TD = h_BSD.reshape(-1, h_BSD.shape[-1])
        r = layer.router(h_TD)
        return moe(j, h_TD, r.expert_TK, r.gate_TK, r.keep_TK).reshape(h_BSD.shape)

    logits, _ = model(tokens_BS, moe_call=call)
    return logits


def model_weights(model) -> list[tuple[torch.Tensor, ...]]:
    """(w1, b1, w2, b2) of every MoE layer of a model that holds all its experts."""
    out = []
    for layer in model.moe_layers():
        ex = layer.experts
        if ex.first != 0 or ex.num_local != ex.num_experts:
            raise ValueError("inference needs a model holding every expert (build it without an expert group)")
        out.append(ex.params())
    return out


def row_cost(bank: ExpertBank, rank: int, world: int, group=None) -> float:
    """Seconds per computed row on a dedicated device: the bank's set figure, or (a bank
    that measures it) the figure timed on each rank in turn while the others wait at a
    barrier, median over ranks (the bank times its own device: CUDA events on a GPU)."""
    if not bank.measures_row_cost:
        return bank.row_cost_s()
    mine = 0.0
    for r in range(world):
        cdist.barrier(f"timing the expert FFN on rank {r}", group)
        if r == rank:
            mine = bank.row_cost_s()
    return float(median(cdist.all_gather_object(mine, "gathering the expert FFN timings", group)))


# --------------------------------------------------------------------------- the runtime
@dataclass
class BatchTimes:
    meta: float = 0.0
    meta_wait: float = 0.0
    phase1: float = 0.0
    phase1_wait: float = 0.0
    plan: float = 0.0
    load: float = 0.0


class Runtime:
    """Per-rank state of one run: strategy, bank, estimator, background loader, records.

    strategy: the run's placement strategy (one that estimates paths estimates the next
    layer's load, :meth:`~commsched.moe.infer.policy.LinaPlacement.path_estimate`);
    pipelined: the pipelined exchange (else the sequential twin); device: the job's
    device, where the metadata rows are exchanged (NCCL carries CUDA tensors only) and the
    layers' tensors live."""

    META_EXTRA = 5  # digest of the previous placement, batch, layer, tokens, wall time sent

    def __init__(self, strategy: PlacementStrategy, bank: ExpertBank, *, pipelined: bool, rank: int, world: int,
                 group=None, device: torch.device | str = "cpu"):
        self.strategy, self.bank, self.pipelined = strategy, bank, pipelined
        self.rank, self.world, self.group = rank, world, group
        self.device = torch.device(device)
        self.E, self.L, self.k = strategy.num_experts, strategy.num_layers, strategy.k
        # one loader thread, first in first out: phase-1 prefetches (path estimates), and
        # (pipelined) the loads of a plan made after gating, which then overlap the exchanges
        loads_in_background = strategy.estimates_paths or (pipelined and strategy.loads_online)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commsched-loader") \
            if loads_in_background else None
        self.placed_times = PlacedTimes(stats=CommStats(world))  # per-peer bytes of the row exchanges
        self.records: list[dict] = []  # one per batch
        self._batch = -1

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    # ---------------------------------------------------------------- phase 1 ahead
    def _phase1_ahead(self, layer: int, est: np.ndarray | None, est_PE: np.ndarray | None = None) -> None:
        """Plan ``layer``'s phase 1 now (main thread: the planner is pure Python, and a
        planner thread contending for the interpreter lock slowed the main thread more
        than planning inline costs) and load its experts in the background thread while
        the current layer's exchange and expert compute run (as a GPU's copy engine
        loads weights during compute)."""
        p, _ = self.strategy.phase1(layer, est, est_PE)
        self._next_p1 = p
        self._future = self.pool.submit(self.bank.ensure, layer, p.device_experts[self.rank])

    def begin_batch(self, b: int, num_tokens: int) -> None:
        self._batch = b
        self._T = num_tokens
        self._hist_T = np.zeros((num_tokens, self.L), dtype=np.int64)
        self._future: Future | None = None
        self._next_p1: Placement | None = None
        self._est_next: np.ndarray | None = None
        self._est_next_PE: np.ndarray | None = None
        self._prev_digest = -1
        self._bt = BatchTimes()
        self._layers: list[dict] = []
        self.placed_times.reset()
        if self.strategy.estimates_paths:  # layer 0's phase 1 (no path yet), loaded between batches
            self._phase1_ahead(0, None)
            self._future.result()

    def _gather_meta(self, layer: int, counts_E: np.ndarray, est_next_E: np.ndarray) -> np.ndarray:
        """[N, 2E + 5] every rank's metadata row (see :meth:`moe`), identical on all ranks.
        Its last entry is the wall-clock time (``time.time()``) the rank sent it at, from
        which :meth:`moe` splits the exchange's time into the wait for the last rank and the
        exchange after it.

        Pipelined: every rank sends its row to every other rank directly (an all-to-all
        of one row per peer: one step, the peers in parallel, so a late rank's row reaches
        every waiting rank at once); sequential: the backend's ``all_gather``, a ring of
        N-1 steps in which every step waits for a process to be scheduled, as the runtime
        first did."""
        E = self.E
        row = np.zeros(2 * E + self.META_EXTRA, dtype=np.float64)
        row[:E], row[E:2 * E] = counts_E, est_next_E
        row[2 * E:2 * E + 4] = (self._prev_digest, self._batch, layer, self._T)
        row[2 * E + 4] = time.time()
        if self.world == 1:
            return row[None, :]
        mine = torch.from_numpy(row)
        if self.device.type != "cpu":  # the backend of the job's device carries it (NCCL: CUDA only)
            mine = mine.to(self.device)
        if self.pipelined:
            plan = A2APlan((1,) * self.world, (1,) * self.world, self.rank, agreed=True)
            with comm_guard(f"exchanging expert counts of MoE layer {layer}", self.group):
                M = all_to_all(mine.unsqueeze(0).expand(self.world, -1), plan, group=self.group).cpu().numpy()
        else:
            got = [torch.empty_like(mine) for _ in range(self.world)]
            with comm_guard(f"gathering expert counts of MoE layer {layer}", self.group):
                dist.all_gather(got, mine, group=self.group)
            M = torch.stack(got).cpu().numpy()
        if not (M[:, 2 * E + 1:2 * E + 3] == M[0, 2 * E + 1:2 * E + 3]).all():
            raise RuntimeError(f"rank {self.rank}: ranks are out of step (batch, layer): "
                               f"{M[:, 2 * E + 1:2 * E + 3].tolist()}")
        if not (M[:, 2 * E] == M[0, 2 * E]).all():
            raise RuntimeError(f"rank {self.rank}: ranks computed different placements for MoE layer "
                               f"{layer - 1} (checksums {M[:, 2 * E].tolist()}); the planners must be "
                               "deterministic")
        return M

    def moe(self, j: int, x_TD: torch.Tensor, expert_TK: torch.Tensor, gate_TK: torch.Tensor,
            keep_TK: torch.Tensor | None) -> torch.Tensor:
        """One placed MoE layer (steps 2-5 of :mod:`commsched.moe.infer`)."""
        E, bt, ahead_planned = self.E, self._bt, self.strategy.estimates_paths
        e_h = expert_TK.cpu()  # one copy to the host for the numpy planning (none on the CPU)
        ex = e_h.numpy() if keep_TK is None else e_h[keep_TK.cpu()].numpy()
        self._hist_T[:, j] = e_h[:, 0].numpy()
        counts = np.bincount(ex.reshape(-1), minlength=E)
        est_local = np.zeros(E)
        if ahead_planned and j + 1 < self.L and self._T:
            est_local = self.strategy.path_estimate(self._hist_T[:, :j + 1], j + 1)
        t0 = time.perf_counter()
        M = self._gather_meta(j, counts, est_local)
        t1 = time.perf_counter()
        # the wait for the last rank to send (clocks of one host agree; across hosts their
        # skew enters, so it is clamped to the call's time), the rest the exchange itself
        sent = M[:, 2 * E + 4]
        wait = min(max(0.0, float(sent.max() - sent[self.rank])), t1 - t0)
        counts_PE = M[:, :E].astype(np.int64)
        actual = counts_PE.sum(axis=0).astype(np.float64)
        est_this = self._est_next  # gathered one layer earlier (None at layer 0)
        self._est_next_PE = M[:, E:2 * E]
        self._est_next = self._est_next_PE.sum(axis=0)
        # phase 1 of this layer: planned one layer ahead, its loads prefetched; or now
        if ahead_planned:
            p1 = self._next_p1
            self._future.result()
            self._future = None
        else:
            p1, _ = self.strategy.phase1(j)
            if p1 is not None:
                self.bank.ensure(j, p1.device_experts[self.rank])
        t2 = time.perf_counter()
        dec: LayerDecision = self.strategy.decide(j, p1, actual, est_this, counts_PE)
        t3 = time.perf_counter()
        loading: tuple[int, ...] = tuple(dec.loads_N[self.rank])
        wait_loaded = None
        if loading:
            held = dec.placement.device_experts[self.rank]
            if self.pipelined:  # loaded while the exchanges and the other experts run
                wait_loaded = self.pool.submit(self.bank.ensure, j, held).result
            else:
                self.bank.ensure(j, held)
                loading = ()
        t4 = time.perf_counter()
        ahead = None
        if ahead_planned and j + 1 < self.L:  # phase 1 of layer j+1 while this one runs
            est_next, est_next_PE = self._est_next, self._est_next_PE

            def ahead() -> None:
                t = time.perf_counter()
                self._phase1_ahead(j + 1, est_next, est_next_PE)
                bt.phase1 += time.perf_counter() - t

        y = placed_moe(x_TD, expert_TK, gate_TK, counts_PE, dec.placement, self.bank.compute(j),
                       rank=self.rank, group=self.group, keep_TK=keep_TK, times=self.placed_times,
                       pipelined=self.pipelined, loading=loading, wait_loaded=wait_loaded,
                       device=self.bank.device, meanwhile=ahead)
        bt.meta += t1 - t0 - wait
        bt.meta_wait += wait
        bt.phase1_wait += t2 - t1
        bt.plan += t3 - t2
        bt.load += t4 - t3
        self._prev_digest = placement_digest(dec.placement)
        # what the summary needs (identical on every rank); derived after the run, off the clock
        self._layers.append({
            "counts": counts_PE, "placement": dec.placement, "replanned": dec.replanned,
            "overlap": dec.overlap, "planned_from": self.strategy.planned_from(j, est_this),
            "loads": sum(len(x) for x in dec.loads_N),
        })
        return y

    def end_batch(self, latency_s: float) -> None:
        pt = self.placed_times.settle()  # CUDA: the layers' event times (the batch has ended)
        if self._future is not None:  # not expected: every phase 1 is consumed by its layer
            self._future.result()
            self._future = None
        self.records.append({
            "latency_s": latency_s,
            "parts_s": {"meta_wait": self._bt.meta_wait, "meta": self._bt.meta, "phase1": self._bt.phase1,
                        "phase1_wait": self._bt.phase1_wait,
                        "plan": self._bt.plan, "load": self._bt.load + pt.load_wait, "a2a": pt.a2a,
                        "expert": pt.expert, "dispatch_other": pt.other,
                        "dense": max(0.0, latency_s - self._bt.meta_wait - self._bt.meta - self._bt.phase1
                                     - self._bt.phase1_wait - self._bt.plan - self._bt.load - pt.load_wait - pt.a2a - pt.expert
                                     - pt.other)},
            "bytes_sent": pt.bytes_sent,
            "peer_bytes": list(pt.stats.bytes_sent),  # sent to each peer by both row exchanges
            "layers": self._layers,
        })
