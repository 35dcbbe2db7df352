"""Distributed MoE inference with expert placement (Lina's two-phase scheduling).

    torchrun --nproc_per_node 4 -m commsched.moe.infer --placement lina --out DIR
    torchrun --nproc_per_node 4 -m commsched.moe.infer --driver model --checkpoint CKPT \
        --placement oracle --out DIR

Legend: N ranks (= devices), E experts, L MoE layers, k experts per token, S slots (experts
of one layer a device may hold at once), T tokens on a rank, D row width, B sequences.

Every rank serves its own share of each batch. Per MoE layer:

1. gating (the model's router, or the recorded choices of a routing trace);
2. one small exchange of this rank's expert counts, *plus* (lina) its estimate of the
   next layer's expert load from its tokens' paths and a checksum of the previous
   placement: every rank now holds the same global counts and estimates;
3. the placement of the layer: fixed (static, eplb), planned from the actual counts
   (oracle), or (lina) the phase-1 plan made from the estimate exchanged one layer
   earlier -- planned while that layer's device computed, its expert loads prefetched
   by a background thread -- kept, or re-planned when the estimated and actual top-2k
   experts overlap less than ``--threshold``. The planners are deterministic and their
   inputs identical on every rank, so every rank computes the same plan and nothing is
   broadcast (the checksum in the next exchange verifies it);
4. experts the device lacks are loaded from host memory into its S slots (pipelined:
   by the background thread, while the device computes the experts it already holds);
5. :func:`~commsched.moe.placed.placed_moe`: tokens of a replicated expert split evenly
   over its replicas across all ranks, dispatch through the uneven all-to-all with a
   plan derived from the exchanged counts (no count exchange of its own), expert
   compute, combine. Pipelined (``--exchange pipelined``, the default), the rows a rank
   routes to its own device skip both exchanges and are computed while they run.
   ``--exchange sequential`` is the first runtime (ring ``all_gather`` of the counts,
   loads on the critical path, dispatch then compute then combine), kept as a twin.

Two drivers:

* ``--driver trace`` (default) replays a routing trace (``--trace FILE``, or a synthetic
  one from the generator) with synthetic hidden states. Expert compute is either an
  emulated accelerator (``--compute emulated``: the device is busy ``--us-per-row``
  microseconds per row it computes, loading an expert takes ``--load-ms``; the rows
  still travel through the real all-to-all and are transformed by a per-expert affine
  map so that routing errors show) or real FFNs (``--compute real``).
* ``--driver model`` runs a trained MoE language model (``--checkpoint``, written by
  ``python -m commsched.moe.record``) on held-out text, real expert FFNs.

Writes ``DIR/metrics.json`` (rank 0): ``placement``, ``latency_ms`` (p50/p95/p99 of the
batch latency, max over ranks), ``imbalance`` (mean over batches and layers of max/mean
device rows), ``estimation_accuracy`` (top-k overlap of the load the strategy planned
from and the actual load), ``replans`` (per layer: share of batches planned after
gating), ``model_latency_ms`` (sum over layers of the busiest device's rows x per-row
cost: the expert-compute latency on dedicated devices), a time breakdown, and per-layer
heat-map data (``expert_load_share``, ``replicas``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..all2all import A2APlan, all_to_all
from ..config import read_env
from ..dist import check_same_config, comm_guard, init_distributed
from .placed import PlacedTimes, device_rows, placed_moe
from .placement import Placement
from .placement_policy import (
    PLANNERS,
    STRATEGIES,
    LayerDecision,
    PlacementPolicy,
    PolicyConfig,
    default_slots,
    placement_digest,
)
from .popularity import DEFAULT_REPLAN_THRESHOLD, PopularityEstimator, topk_overlap
from .traces import RoutingTrace, SyntheticTraceConfig, load_trace, synthetic_trace

DRIVERS = ("trace", "model")
COMPUTES = ("emulated", "real")
EXCHANGES = ("pipelined", "sequential")


# --------------------------------------------------------------------------- config
@dataclass(frozen=True)
class InferConfig:
    """One inference run. ``slots=None``: ceil(E/N) + 2."""

    placement: str = "lina"
    driver: str = "trace"
    compute: str = "emulated"
    slots: int | None = None
    threshold: float = DEFAULT_REPLAN_THRESHOLD
    path_length: int = 3
    planner: str = "full"
    online_planner: str = "greedy"
    exchange: str = "pipelined"
    batches: int = 30
    warmup: int = 2
    seed: int = 0
    # emulated device
    us_per_row: float = 20.0
    load_ms: float = 0.5
    # trace driver
    trace: str | None = None
    synthetic: SyntheticTraceConfig = field(default_factory=SyntheticTraceConfig)
    profile_fraction: float = 0.5
    tokens_per_batch: int = 2048  # whole batch, all ranks together
    d_model: int = 64
    expert_hidden: int = 256
    # model driver
    checkpoint: str | None = None
    corpus: str | None = None
    batch_size: int = 8  # sequences per rank
    profile_trace: str | None = None
    profile_tokens: int = 16384

    def __post_init__(self) -> None:
        if self.placement not in STRATEGIES:
            raise ValueError(f"--placement must be one of {STRATEGIES}, got {self.placement!r}")
        if self.driver not in DRIVERS:
            raise ValueError(f"--driver must be one of {DRIVERS}, got {self.driver!r}")
        if self.compute not in COMPUTES:
            raise ValueError(f"--compute must be one of {COMPUTES}, got {self.compute!r}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"--exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        if self.driver == "model" and self.compute != "real":
            raise ValueError("--driver model computes the model's real experts: use --compute real")
        if self.batches < 1 or not 0 <= self.warmup < self.batches:
            raise ValueError(f"need batches >= 1 and 0 <= warmup < batches, got {self.batches}, {self.warmup}")
        if not 1 <= self.path_length <= 8:
            raise ValueError(f"--path-length must be in 1..8, got {self.path_length}")
        if self.us_per_row < 0 or self.load_ms < 0:
            raise ValueError("--us-per-row and --load-ms must be >= 0")
        if not 0.0 < self.profile_fraction < 1.0:
            raise ValueError(f"--profile-fraction must lie in (0, 1), got {self.profile_fraction}")
        if self.tokens_per_batch < 1 or self.batch_size < 1 or self.profile_tokens < 1:
            raise ValueError("--tokens-per-batch, --batch-size and --profile-tokens must be >= 1")


# --------------------------------------------------------------------------- expert banks
class FFNBank:
    """Real expert FFNs: every expert's weights in host memory (``w1_LEDH`` etc. per
    layer), and per layer S device slots into which the experts a device holds are
    copied ("loaded") before it computes them."""

    def __init__(self, weights: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                 slots: int):
        self.host = [tuple(w.detach() for w in ws) for ws in weights]  # per layer (w1, b1, w2, b2)
        self.S = slots
        self.slot_w = [tuple(torch.empty((slots, *w.shape[1:]), dtype=w.dtype) for w in ws) for ws in self.host]
        self.slot_of: list[dict[int, int]] = [{} for _ in self.host]
        self.loaded_L = [0] * len(self.host)  # per layer: one thread touches a layer at a time

    @property
    def num_layers(self) -> int:
        return len(self.host)

    def ensure(self, layer: int, held: Sequence[int]) -> int:
        """Make exactly the experts ``held`` resident in ``layer``'s slots (evicting the
        others); returns how many were loaded (copied from host memory)."""
        want = set(int(e) for e in held)
        if len(want) > self.S:
            raise ValueError(f"{len(want)} experts do not fit {self.S} slots")
        cur = self.slot_of[layer]
        for e in [e for e in cur if e not in want]:
            del cur[e]
        free = sorted(set(range(self.S)) - set(cur.values()))
        n = 0
        for e in sorted(want - set(cur)):
            s = free.pop(0)
            for dst, src in zip(self.slot_w[layer], self.host[layer]):
                dst[s].copy_(src[e])
            cur[e] = s
            n += 1
        self.loaded_L[layer] += n
        return n

    def compute(self, layer: int):
        """The device computation of ``layer`` (experts must be resident)."""

        def run(experts: Sequence[int], counts: Sequence[int], x: torch.Tensor) -> torch.Tensor:
            w1, b1, w2, b2 = self.slot_w[layer]
            outs, off = [], 0
            for e, n in zip(experts, counts):
                s = self.slot_of[layer][e]
                h = F.gelu(torch.addmm(b1[s], x[off:off + n], w1[s]))
                outs.append(torch.addmm(b2[s], h, w2[s]))
                off += n
            return torch.cat(outs) if outs else x.new_zeros((0, x.shape[1]))

        return run

    def reference(self, layer: int):
        """Every expert straight from host memory (the single-process twin)."""

        def run(experts: Sequence[int], counts: Sequence[int], x: torch.Tensor) -> torch.Tensor:
            w1, b1, w2, b2 = self.host[layer]
            outs, off = [], 0
            for e, n in zip(experts, counts):
                h = F.gelu(torch.addmm(b1[e], x[off:off + n], w1[e]))
                outs.append(torch.addmm(b2[e], h, w2[e]))
                off += n
            return torch.cat(outs) if outs else x.new_zeros((0, x.shape[1]))

        return run

    def row_cost_s(self, rows: int = 512, reps: int = 7) -> float:
        """Seconds per row of one expert FFN on this process, the fastest of ``reps``
        timings (the least disturbed by other processes), for the model latency."""
        w1, b1, w2, b2 = self.host[0]
        x = torch.randn(rows, w1.shape[1])
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            F.gelu(torch.addmm(b1[0], x, w1[0])) @ w2[0]
            ts.append(time.perf_counter() - t)
        return min(ts) / rows


class EmulatedBank:
    """An emulated accelerator: expert e of a layer maps a row to ``x * scale[e] + shift[e]``
    (cheap, but distinct per expert, so a row sent to the wrong expert shows), and the
    device is busy ``us_per_row`` microseconds per computed row; loading one expert takes
    ``load_ms`` (a sleep of the loading thread).

    The device runs like a GPU stream (:class:`~commsched.moe.placed.AsyncDevice`): a
    computation returns its rows at once and queues its busy time on the device's clock
    (it starts when the device is free, or now); ``wait(token)`` sleeps until the clock
    passes the token, as a host waits for a kernel. A run of back-to-back computations
    therefore costs exactly their rows' time, whatever the host's wake-up delays."""

    def __init__(self, num_layers: int, num_experts: int, d: int, slots: int, us_per_row: float,
                 load_ms: float, seed: int):
        g = torch.Generator().manual_seed(seed + 7919)
        self.scale = [1.0 + 0.1 * torch.randn(num_experts, d, generator=g) for _ in range(num_layers)]
        self.shift = [0.1 * torch.randn(num_experts, d, generator=g) for _ in range(num_layers)]
        self.S, self.us_per_row, self.load_ms = slots, us_per_row, load_ms
        self.resident: list[set[int]] = [set() for _ in range(num_layers)]
        self.loaded_L = [0] * num_layers
        self._free_at = 0.0  # perf_counter time at which the device finishes its queued work

    @property
    def num_layers(self) -> int:
        return len(self.scale)

    def ensure(self, layer: int, held: Sequence[int]) -> int:
        want = set(int(e) for e in held)
        if len(want) > self.S:
            raise ValueError(f"{len(want)} experts do not fit {self.S} slots")
        n = len(want - self.resident[layer])
        self.resident[layer] = self.resident[layer] & want  # evicted at once; the new ones are resident once loaded
        if n and self.load_ms > 0:
            time.sleep(n * self.load_ms / 1e3)
        self.resident[layer] = want
        self.loaded_L[layer] += n
        return n

    def _apply(self, layer: int, experts, counts, x: torch.Tensor) -> torch.Tensor:
        idx = torch.repeat_interleave(torch.tensor(list(experts), dtype=torch.int64),
                                      torch.tensor(list(counts), dtype=torch.int64))
        return x * self.scale[layer][idx] + self.shift[layer][idx]

    def compute(self, layer: int):
        def run(experts, counts, x):
            assert set(experts) <= self.resident[layer], "expert computed before it was loaded"
            self._free_at = max(time.perf_counter(), self._free_at) + sum(counts) * self.us_per_row / 1e6
            return self._apply(layer, experts, counts, x)

        return run

    def issued(self) -> float:
        return self._free_at

    def wait(self, token: float) -> None:
        dt = token - time.perf_counter()
        if dt > 0:
            time.sleep(dt)

    def reference(self, layer: int):
        return lambda experts, counts, x: self._apply(layer, experts, counts, x)

    def row_cost_s(self) -> float:
        return self.us_per_row / 1e6


# --------------------------------------------------------------------------- drivers
def _even_split(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class TraceDriver:
    """Batches of a routing trace, each split over the ranks by whole sequences."""

    def __init__(self, cfg: InferConfig, world: int):
        trace = load_trace(cfg.trace) if cfg.trace else synthetic_trace(cfg.synthetic, cfg.seed)
        self.trace = trace
        self.profile, test = trace.split(cfg.profile_fraction)
        self.batches = test.batches(cfg.tokens_per_batch)
        if len(self.batches) < cfg.batches:
            raise ValueError(f"the held-out part of the trace has {len(self.batches)} batches of "
                             f">= {cfg.tokens_per_batch} tokens, fewer than --batches {cfg.batches}: "
                             "use a longer trace, a smaller --tokens-per-batch or fewer --batches")
        self.batches = self.batches[:cfg.batches]
        self.world, self.cfg = world, cfg
        self.E, self.L, self.k = trace.num_experts, trace.num_layers, trace.k

    def shard(self, b: int, rank: int) -> RoutingTrace:
        tr = self.batches[b]
        bounds = tr._sequence_bounds()
        q = len(bounds) - 1
        sizes = _even_split(q, self.world)
        lo = sum(sizes[:rank])
        return tr.select(slice(int(bounds[lo]), int(bounds[lo + sizes[rank]])))

    def inputs(self, b: int, rank: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_TD, expert_TLK, gate_TK) of this rank's share of batch b."""
        sh = self.shard(b, rank)
        g = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + b) * 1009 + rank)
        x = torch.randn(sh.num_tokens, d, generator=g)
        gate = torch.rand(sh.num_tokens, sh.k, generator=g) + 0.5
        gate = gate / gate.sum(dim=1, keepdim=True)
        return x, torch.from_numpy(sh.experts), gate


def trace_forward(x_TD: torch.Tensor, expert_TLK: torch.Tensor, gate_TK: torch.Tensor, moe) -> torch.Tensor:
    """The trace driver's stack: x <- layer_norm(x + moe_j(x)) for every layer j, where
    ``moe(j, x, expert_TK, gate_TK, keep_TK)`` is the placed layer or its local twin."""
    D = x_TD.shape[1]
    for j in range(expert_TLK.shape[1]):
        y = moe(j, x_TD, expert_TLK[:, j], gate_TK, None)
        x_TD = F.layer_norm(x_TD + y, (D,))
    return x_TD


def model_forward(model, tokens_BS: torch.Tensor, moe) -> torch.Tensor:
    """``model(tokens)`` with every MoE layer replaced by ``moe(j, h_TD, expert_TK,
    gate_TK, keep_TK)`` (j counts MoE layers); returns logits [B, S, V]. The same
    arithmetic as :class:`~commsched.moe.model.Block` and ``MoELayer``."""
    S = tokens_BS.shape[1]
    x = model.tok(tokens_BS) + model.pos[:S]
    j = 0
    for i, b in enumerate(model.blocks):
        x = x + b.attn(b.ln1(x))
        h = b.ln2(x)
        if model.cfg.is_moe(i):
            h_TD = h.reshape(-1, h.shape[-1])
            r = b.ffn.router(h_TD)
            y = moe(j, h_TD, r.expert_TK, r.gate_TK, r.keep_TK).reshape(h.shape)
            j += 1
        else:
            y, _ = b.ffn(h)
        x = x + y
    return model.head(model.ln_f(x))


def model_weights(model) -> list[tuple[torch.Tensor, ...]]:
    """(w1, b1, w2, b2) of every MoE layer of a model that holds all its experts."""
    out = []
    for layer in model.moe_layers():
        ex = layer.experts
        if ex.first != 0 or ex.num_local != ex.num_experts:
            raise ValueError("inference needs a model holding every expert (build it without an expert group)")
        out.append(ex.params())
    return out


# --------------------------------------------------------------------------- the runtime
@dataclass
class BatchTimes:
    meta: float = 0.0
    phase1: float = 0.0
    phase1_wait: float = 0.0
    plan: float = 0.0
    load: float = 0.0
    dense: float = 0.0


class Runtime:
    """Per-rank state of one run: policy, bank, estimator, background planner, records."""

    META_EXTRA = 4  # digest of the previous placement, batch, layer, tokens

    def __init__(self, cfg: InferConfig, pcfg: PolicyConfig, bank, estimator: PopularityEstimator | None,
                 historical_LE: np.ndarray | None, rank: int, world: int, group=None):
        self.cfg, self.pcfg, self.bank, self.est = cfg, pcfg, bank, estimator
        self.policy = PlacementPolicy(pcfg, historical_LE)
        self.hist = historical_LE
        self.rank, self.world, self.group = rank, world, group
        self.E, self.L, self.k = pcfg.num_experts, pcfg.num_layers, pcfg.k
        self.pipelined = cfg.exchange == "pipelined"
        # one loader thread, first in first out: lina's phase-1 prefetches, and (pipelined)
        # the loads of a plan made after gating, which then overlap the exchanges
        loads_online = pcfg.strategy == "lina" or (self.pipelined and pcfg.strategy == "oracle")
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="commsched-loader") \
            if loads_online else None
        self.placed_times = PlacedTimes()
        self.records: list[dict] = []  # one per batch
        self._batch = -1

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    # ---------------------------------------------------------------- phase 1 (lina)
    def _phase1_ahead(self, layer: int, est: np.ndarray | None) -> None:
        """Plan ``layer``'s phase 1 now (main thread: the planner is pure Python, and a
        planner thread contending for the interpreter lock slowed the main thread more
        than planning inline costs) and load its experts in the background thread while
        the current layer's exchange and expert compute run (as a GPU's copy engine
        loads weights during compute)."""
        p, _ = self.policy.phase1(layer, est)
        self._next_p1 = p
        self._future = self.pool.submit(self.bank.ensure, layer, p.device_experts[self.rank])

    def begin_batch(self, b: int, num_tokens: int) -> None:
        self._batch = b
        self._T = num_tokens
        self._hist_T = np.zeros((num_tokens, self.L), dtype=np.int64)
        self._future: Future | None = None
        self._next_p1: Placement | None = None
        self._est_next: np.ndarray | None = None
        self._prev_digest = -1
        self._bt = BatchTimes()
        self._layers: list[dict] = []
        self.placed_times.reset()
        if self.pcfg.strategy == "lina":  # layer 0's phase 1 is the historical plan, loaded between batches
            self._phase1_ahead(0, None)
            self._future.result()

    def _gather_meta(self, layer: int, counts_E: np.ndarray, est_next_E: np.ndarray) -> np.ndarray:
        """[N, 2E + 4] every rank's metadata row (see :meth:`moe`), identical on all ranks.

        Pipelined: every rank sends its row to every other rank directly (an all-to-all
        of one row per peer: one step, the peers in parallel, so a late rank's row reaches
        every waiting rank at once); sequential: the backend's ``all_gather``, a ring of
        N-1 steps in which every step waits for a process to be scheduled, as the runtime
        first did."""
        E = self.E
        row = np.zeros(2 * E + self.META_EXTRA, dtype=np.float64)
        row[:E], row[E:2 * E] = counts_E, est_next_E
        row[2 * E:] = (self._prev_digest, self._batch, layer, self._T)
        mine = torch.from_numpy(row)
        if self.world == 1:
            return row[None, :]
        if self.pipelined:
            plan = A2APlan((1,) * self.world, (1,) * self.world, self.rank)
            with comm_guard(f"exchanging expert counts of MoE layer {layer}", self.group):
                M = all_to_all(mine.unsqueeze(0).expand(self.world, -1), plan, group=self.group).numpy()
        else:
            got = [torch.empty_like(mine) for _ in range(self.world)]
            with comm_guard(f"gathering expert counts of MoE layer {layer}", self.group):
                dist.all_gather(got, mine, group=self.group)
            M = torch.stack(got).numpy()
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
        """One placed MoE layer (module docstring, steps 2-5)."""
        E, bt = self.E, self._bt
        ex = expert_TK.numpy() if keep_TK is None else expert_TK[keep_TK].numpy()
        self._hist_T[:, j] = expert_TK[:, 0].numpy()
        counts = np.bincount(ex.reshape(-1), minlength=E)
        est_local = np.zeros(E)
        if self.pcfg.strategy == "lina" and j + 1 < self.L and self._T:
            est_local = self.est.estimate_load(self._hist_T[:, :j + 1], j + 1, self.cfg.path_length)
        t0 = time.perf_counter()
        M = self._gather_meta(j, counts, est_local)
        t1 = time.perf_counter()
        counts_PE = M[:, :E].astype(np.int64)
        actual = counts_PE.sum(axis=0).astype(np.float64)
        est_this = self._est_next  # gathered one layer earlier (None at layer 0)
        self._est_next = M[:, E:2 * E].sum(axis=0)
        # phase 1 of this layer: planned one layer ahead, its loads prefetched (lina); or fixed
        if self.pcfg.strategy == "lina":
            p1 = self._next_p1
            self._future.result()
            self._future = None
        else:
            p1, _ = self.policy.phase1(j)
            if p1 is not None:
                self.bank.ensure(j, p1.device_experts[self.rank])
        t2 = time.perf_counter()
        dec: LayerDecision = self.policy.decide(j, p1, actual, est_this)
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
        if self.pcfg.strategy == "lina" and j + 1 < self.L:  # phase 1 of layer j+1 while this one runs
            est_next = self._est_next

            def ahead() -> None:
                t = time.perf_counter()
                self._phase1_ahead(j + 1, est_next)
                bt.phase1 += time.perf_counter() - t

        y = placed_moe(x_TD, expert_TK, gate_TK, counts_PE, dec.placement, self.bank.compute(j),
                       rank=self.rank, group=self.group, keep_TK=keep_TK, times=self.placed_times,
                       pipelined=self.pipelined, loading=loading, wait_loaded=wait_loaded,
                       device=self.bank if isinstance(self.bank, EmulatedBank) else None, meanwhile=ahead)
        bt.meta += t1 - t0
        bt.phase1_wait += t2 - t1
        bt.plan += t3 - t2
        bt.load += t4 - t3
        self._prev_digest = placement_digest(dec.placement)
        # what the summary needs (identical on every rank); derived after the run, off the clock
        planned_from = None
        if self.pcfg.strategy == "lina":
            planned_from = est_this if est_this is not None else self.hist[j]
        elif self.pcfg.strategy == "eplb":
            planned_from = self.hist[j]
        self._layers.append({
            "counts": counts_PE, "placement": dec.placement, "replanned": dec.replanned,
            "overlap": dec.overlap, "planned_from": planned_from,
            "loads": sum(len(x) for x in dec.loads_N),
        })
        return y

    def end_batch(self, latency_s: float) -> None:
        pt = self.placed_times
        if self._future is not None:  # not expected: every phase 1 is consumed by its layer
            self._future.result()
            self._future = None
        self.records.append({
            "latency_s": latency_s,
            "parts_s": {"meta": self._bt.meta, "phase1": self._bt.phase1, "phase1_wait": self._bt.phase1_wait,
                        "plan": self._bt.plan, "load": self._bt.load + pt.load_wait, "a2a": pt.a2a,
                        "expert": pt.expert, "dispatch_other": pt.other,
                        "dense": max(0.0, latency_s - self._bt.meta - self._bt.phase1 - self._bt.phase1_wait
                                     - self._bt.plan - self._bt.load - pt.load_wait - pt.a2a - pt.expert
                                     - pt.other)},
            "bytes_sent": pt.bytes_sent,
            "layers": self._layers,
        })


# --------------------------------------------------------------------------- setup
def _load_model(cfg: InferConfig):
    from .record import load_checkpoint

    if cfg.checkpoint is None:
        raise ValueError("--driver model needs --checkpoint (write one with python -m commsched.moe.record "
                         "--train-steps N --save-checkpoint FILE)")
    model, _ = load_checkpoint(cfg.checkpoint)
    return model


def build(cfg: InferConfig, rank: int, world: int):
    """Everything a rank needs, built identically on every rank: (driver data, bank,
    estimator, historical load, policy config)."""
    if cfg.driver == "trace":
        drv = TraceDriver(cfg, world)
        E, L, k = drv.E, drv.L, drv.k
        profile = drv.profile
        S = cfg.slots or default_slots(E, world)
        if cfg.compute == "emulated":
            bank = EmulatedBank(L, E, cfg.d_model, S, cfg.us_per_row, cfg.load_ms, cfg.seed)
        else:
            g = torch.Generator().manual_seed(cfg.seed + 104729)
            D, H = cfg.d_model, cfg.expert_hidden
            weights = [(torch.randn(E, D, H, generator=g) * D ** -0.5, torch.zeros(E, H),
                        torch.randn(E, H, D, generator=g) * H ** -0.5, torch.zeros(E, D)) for _ in range(L)]
            bank = FFNBank(weights, S)
        model = None
    else:
        from .data import load_corpus
        from .record import record_trace

        model = _load_model(cfg).eval()
        mc = model.cfg
        E, k = mc.num_experts, mc.k
        L = len(model.moe_layers())
        S = cfg.slots or default_slots(E, world)
        bank = FFNBank(model_weights(model), S)
        corpus = load_corpus(cfg.corpus)
        if cfg.profile_trace:
            profile = load_trace(cfg.profile_trace)
        elif cfg.placement in ("eplb", "lina"):
            profile = record_trace(model, corpus, cfg.profile_tokens, split="train", seed=cfg.seed + 1)
        else:
            profile = None
        if profile is not None and (profile.num_experts, profile.num_layers, profile.k) != (E, L, k):
            raise ValueError(f"the profile trace has E={profile.num_experts}, L={profile.num_layers}, "
                             f"k={profile.k}; the model E={E}, L={L}, k={k}")
        drv = corpus
    pcfg = PolicyConfig(cfg.placement, E, world, L, k, S, cfg.threshold, cfg.planner, cfg.online_planner)
    est = hist = None
    if profile is not None:
        hist = profile.loads().astype(np.float64) / max(1, profile.num_tokens)
        if cfg.placement == "lina":
            est = PopularityEstimator.fit(profile, max_path=cfg.path_length)
    return drv, model, bank, est, hist, pcfg


def run(cfg: InferConfig, out: Path | None = None, *, group=None, return_outputs: bool = False) -> dict:
    """Run inference on the initialised process group; every rank returns the metrics.
    ``return_outputs`` adds this rank's final outputs per batch (tests compare them with
    the single-process model)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    check_same_config(dataclasses.asdict(cfg), group, what="inference configuration")
    t_wall = time.perf_counter()
    drv, model, bank, est, hist, pcfg = build(cfg, rank, world)
    row_cost = _row_cost(bank, rank, world, group)
    rt = Runtime(cfg, pcfg, bank, est, hist, rank, world, group)
    outputs = []
    show = read_env().progress and rank == 0 and out is not None
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=cfg.batches, desc=f"moe-infer {cfg.placement}", unit="batch", dynamic_ncols=True)
    # no garbage collection inside a timed batch: a collection pass on one rank stalls
    # every rank at the next exchange; collect between batches instead
    gc.collect()
    gc.freeze()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.inference_mode():
            for b in range(cfg.batches):
                gc.collect()
                if cfg.driver == "trace":
                    x, ex, gate = drv.inputs(b, rank, cfg.d_model)
                    T = x.shape[0]
                else:
                    tokens, _ = drv.batch(cfg.batch_size, model.cfg.seq_len, seed=cfg.seed, step=b,
                                          rank=rank, split="val")
                    T = tokens.numel()
                rt.begin_batch(b, T)
                with comm_guard("aligning ranks before a batch", group):
                    dist.barrier(group=group)
                t0 = time.perf_counter()
                if cfg.driver == "trace":
                    y = trace_forward(x, ex, gate, rt.moe)
                else:
                    y = model_forward(model, tokens, rt.moe)
                rt.end_batch(time.perf_counter() - t0)
                if return_outputs:
                    outputs.append(y.clone())
                if bar is not None:
                    bar.update(1)
    finally:
        if gc_was_enabled:
            gc.enable()
        gc.unfreeze()
        rt.close()
        if bar is not None:
            bar.close()
    gathered: list = [None] * world
    mine = rt.records if rank == 0 else [{k: v for k, v in r.items() if k != "layers"} for r in rt.records]
    dist.all_gather_object(gathered, {"records": mine, "loaded": sum(bank.loaded_L)}, group=group)
    metrics = summarise(cfg, pcfg, gathered, row_cost)
    metrics["wall_clock_s"] = time.perf_counter() - t_wall
    if out is not None and rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if return_outputs:
        metrics["outputs"] = outputs
    return metrics


def _row_cost(bank, rank: int, world: int, group) -> float:
    """Seconds per computed row on a dedicated device: the emulated figure, or the real
    FFN timed on each rank in turn (the others wait at a barrier), median over ranks."""
    if isinstance(bank, EmulatedBank):
        return bank.row_cost_s()
    mine = 0.0
    for r in range(world):
        dist.barrier(group=group)
        if r == rank:
            mine = bank.row_cost_s()
    got: list = [None] * world
    dist.all_gather_object(got, mine, group=group)
    return float(statistics.median(got))


# --------------------------------------------------------------------------- metrics
def _pct(xs: Sequence[float]) -> dict[str, float]:
    a = np.asarray(xs, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def _layer_view(lr: dict, k: int) -> dict:
    """Per-layer figures of one batch from what the runtime recorded."""
    counts, p = lr["counts"], lr["placement"]
    actual = counts.sum(axis=0).astype(np.float64)
    rows = device_rows(counts, p)
    pf = lr["planned_from"]
    ok = pf is not None and actual.sum() > 0
    return {"rows": rows, "load": actual, "replicas": p.replica_counts, "replanned": lr["replanned"],
            "overlap": lr["overlap"], "loads": lr["loads"],
            "acc": topk_overlap(pf, actual, k) if ok else None,
            "acc2k": topk_overlap(pf, actual, 2 * k) if ok else None}


def summarise(cfg: InferConfig, pcfg: PolicyConfig, per_rank: list[dict], row_cost_s: float) -> dict:
    N, L, E = pcfg.num_devices, pcfg.num_layers, pcfg.num_experts
    recs0 = per_rank[0]["records"]
    timed = range(cfg.warmup, len(recs0))
    lat = [1e3 * max(per_rank[r]["records"][b]["latency_s"] for r in range(N)) for b in timed]
    layers = [[_layer_view(recs0[b]["layers"][j], pcfg.k) for j in range(L)] for b in timed]
    imb = np.array([[max(lr["rows"]) / (sum(lr["rows"]) / N) if sum(lr["rows"]) else 1.0 for lr in bl]
                    for bl in layers])  # [batches, L]
    crit_rows = [int(sum(max(lr["rows"]) for lr in bl)) for bl in layers]
    model_lat = [1e3 * r * row_cost_s for r in crit_rows]
    replans = [float(np.mean([bl[j]["replanned"] for bl in layers])) for j in range(L)]
    acc = [lr["acc"] for bl in layers for lr in bl if lr["acc"] is not None]
    acc2 = [lr["acc2k"] for bl in layers for lr in bl if lr["acc2k"] is not None]
    acc_layer = [(float(np.mean([bl[j]["acc"] for bl in layers])) if layers[0][j]["acc"] is not None else None)
                 for j in range(L)]
    overl = [lr["overlap"] for bl in layers for lr in bl if lr["overlap"] is not None]
    load = np.array([[lr["load"] for lr in bl] for bl in layers], dtype=np.float64)  # [B, L, E]
    share = (load / np.maximum(load.sum(axis=2, keepdims=True), 1e-300)).mean(axis=0)
    reps = np.array([[lr["replicas"] for lr in bl] for bl in layers], dtype=np.float64).mean(axis=0)
    dev_rows = np.array([[lr["rows"] for lr in bl] for bl in layers], dtype=np.float64)  # [B, L, N]
    dev_share = (dev_rows / np.maximum(dev_rows.sum(axis=2, keepdims=True), 1e-300)).mean(axis=0)
    parts = list(recs0[0]["parts_s"])
    breakdown = {p: float(np.median([np.mean([per_rank[r]["records"][b]["parts_s"][p] for r in range(N)])
                                     for b in timed])) for p in parts}
    loads_per_batch = float(np.mean([sum(lr["loads"] for lr in bl) for bl in layers]))
    return {
        "placement": cfg.placement,
        "driver": cfg.driver,
        "compute": cfg.compute,
        "world_size": N,
        "num_experts": E,
        "num_layers": L,
        "k": pcfg.k,
        "slots_per_device": pcfg.slots,
        "threshold": pcfg.threshold if cfg.placement == "lina" else None,
        "path_length": cfg.path_length if cfg.placement == "lina" else None,
        "batches": len(lat),
        "warmup": cfg.warmup,
        "latency_ms": _pct(lat),
        "latency_ms_per_batch": lat,
        "per_batch": {
            "model_latency_ms": model_lat,
            "replanned_layers": [int(sum(lr["replanned"] for lr in bl)) for bl in layers],
            "critical_loads": [int(sum(lr["loads"] for lr in bl)) for bl in layers],
            "parts_ms_max_over_ranks": {p: [1e3 * max(per_rank[r]["records"][b]["parts_s"][p] for r in range(N))
                                            for b in timed] for p in recs0[0]["parts_s"]},
        },
        "model_latency_ms": _pct(model_lat),
        "row_cost_us": row_cost_s * 1e6,
        "critical_rows": _pct(crit_rows),
        "imbalance": float(imb.mean()),
        "imbalance_p95": float(np.percentile(imb, 95)),
        "imbalance_per_layer": imb.mean(axis=0).tolist(),
        "estimation_accuracy": float(np.mean(acc)) if acc else None,
        "estimation_accuracy_top2k": float(np.mean(acc2)) if acc2 else None,
        "estimation_accuracy_per_layer": acc_layer,
        "phase2_overlap": float(np.mean(overl)) if overl else None,
        "replans": replans,
        "replan_rate": float(np.mean(replans)),
        "expert_loads_per_batch": loads_per_batch,
        "expert_loads_total": int(sum(p["loaded"] for p in per_rank)),
        "breakdown_s": breakdown,
        "bytes_sent_per_batch": float(np.mean([sum(per_rank[r]["records"][b]["bytes_sent"] for r in range(N))
                                               for b in timed])),
        "expert_load_share": share.tolist(),
        "replicas": reps.tolist(),
        "device_rows_share": dev_share.tolist(),
        "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
    }


run_inference = run  # the name exported by commsched.moe

__all__ = ["InferConfig", "FFNBank", "EmulatedBank", "TraceDriver", "Runtime", "build", "run", "run_inference",
           "trace_forward", "model_forward", "model_weights", "summarise"]


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    d, s = InferConfig(), SyntheticTraceConfig()
    p = argparse.ArgumentParser(prog="python -m commsched.moe.infer", description=__doc__.splitlines()[0])
    p.add_argument("--placement", choices=STRATEGIES, default=d.placement)
    p.add_argument("--driver", choices=DRIVERS, default=d.driver)
    p.add_argument("--compute", choices=COMPUTES, default=None,
                   help="expert compute: emulated device or real FFNs (default: emulated for the trace "
                        "driver, real for the model)")
    p.add_argument("--slots", type=int, default=None, help="experts of one layer per device (default ceil(E/N)+2)")
    p.add_argument("--threshold", type=float, default=d.threshold, help="lina phase-2 re-plan threshold")
    p.add_argument("--path-length", type=int, default=d.path_length, help="lina: experts of the path (l)")
    p.add_argument("--planner", choices=tuple(PLANNERS), default=d.planner,
                   help="planner of the layouts fixed before inference (eplb)")
    p.add_argument("--online-planner", choices=tuple(PLANNERS), default=d.online_planner,
                   help="planner during inference (lina phases 1 and 2, oracle)")
    p.add_argument("--exchange", choices=EXCHANGES, default=d.exchange,
                   help="pipelined: count exchange in one step, own rows computed while the row exchanges "
                        "run, loads after gating in the background; sequential: the first runtime (ring "
                        "all_gather, dispatch, compute, combine, loads on the critical path)")
    p.add_argument("--batches", type=int, default=d.batches)
    p.add_argument("--warmup", type=int, default=d.warmup, help="batches left out of the metrics")
    p.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("emulated device (--compute emulated)")
    g.add_argument("--us-per-row", type=float, default=d.us_per_row, help="expert compute per row, microseconds")
    g.add_argument("--load-ms", type=float, default=d.load_ms, help="time to load one expert into a slot")
    g = p.add_argument_group("trace driver")
    g.add_argument("--trace", default=None, help="routing trace npz (default: a synthetic trace)")
    g.add_argument("--profile-fraction", type=float, default=d.profile_fraction,
                   help="leading share of the trace's sequences used for profiling (eplb, lina)")
    g.add_argument("--tokens-per-batch", type=int, default=d.tokens_per_batch, help="tokens per batch, all ranks")
    g.add_argument("--d-model", type=int, default=d.d_model, help="row width (floats per token)")
    g.add_argument("--expert-hidden", type=int, default=d.expert_hidden, help="FFN width (--compute real)")
    g.add_argument("--experts", type=int, default=s.num_experts, help="synthetic trace: E")
    g.add_argument("--layers", type=int, default=s.num_layers, help="synthetic trace: L")
    g.add_argument("--k", type=int, default=s.k, help="synthetic trace: experts per token")
    g.add_argument("--trace-tokens", type=int, default=None,
                   help="synthetic trace: tokens (default: enough for --batches after profiling)")
    g.add_argument("--seq-len", type=int, default=s.seq_len, help="synthetic trace: tokens per sequence")
    g.add_argument("--popularity", choices=("zipf", "lognormal"), default=s.popularity)
    g.add_argument("--zipf", type=float, default=s.zipf_s)
    g.add_argument("--sigma", type=float, default=s.lognormal_sigma)
    g.add_argument("--stickiness", type=float, default=s.stickiness)
    g.add_argument("--cluster-concentration", type=float, default=s.cluster_concentration)
    g = p.add_argument_group("model driver")
    g.add_argument("--checkpoint", default=None, help="model checkpoint (python -m commsched.moe.record)")
    g.add_argument("--corpus", default=None, help="text file (default: the Python standard library's sources)")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank per batch")
    g.add_argument("--profile-trace", default=None, help="recorded trace for eplb/lina (default: record one)")
    g.add_argument("--profile-tokens", type=int, default=d.profile_tokens)
    p.add_argument("--out", type=Path, required=True)
    return p


def config_from_args(a: argparse.Namespace) -> InferConfig:
    n_tok = a.trace_tokens
    if n_tok is None:  # the held-out part must hold --batches batches of whole sequences
        need = (a.batches + 1) * (a.tokens_per_batch + a.seq_len) / (1.0 - a.profile_fraction)
        n_tok = max(SyntheticTraceConfig().num_tokens, int(need * 1.05))
    syn = SyntheticTraceConfig(num_experts=a.experts, num_layers=a.layers, k=a.k, num_tokens=n_tok,
                               seq_len=a.seq_len, popularity=a.popularity, zipf_s=a.zipf,
                               lognormal_sigma=a.sigma, stickiness=a.stickiness,
                               cluster_concentration=a.cluster_concentration)
    compute = a.compute or ("emulated" if a.driver == "trace" else "real")
    return InferConfig(placement=a.placement, driver=a.driver, compute=compute, slots=a.slots,
                       threshold=a.threshold, path_length=a.path_length, planner=a.planner,
                       online_planner=a.online_planner, exchange=a.exchange, batches=a.batches, warmup=min(a.warmup, a.batches - 1),
                       seed=a.seed, us_per_row=a.us_per_row, load_ms=a.load_ms, trace=a.trace, synthetic=syn,
                       profile_fraction=a.profile_fraction, tokens_per_batch=a.tokens_per_batch,
                       d_model=a.d_model, expert_hidden=a.expert_hidden, checkpoint=a.checkpoint,
                       corpus=a.corpus, batch_size=a.batch_size, profile_trace=a.profile_trace,
                       profile_tokens=a.profile_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        raise SystemExit(f"commsched.moe.infer: {e}") from None
    torch.set_num_threads(1)
    init_distributed()
    try:
        m = run(cfg, a.out)
        if dist.get_rank() == 0:
            print(json.dumps({k: m[k] for k in ("placement", "world_size", "latency_ms", "model_latency_ms",
                                                 "imbalance", "estimation_accuracy", "replan_rate")}), flush=True)
    except ValueError as e:
        raise SystemExit(f"commsched.moe.infer: {e}") from None
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
