"""The metrics of an inference run (:mod:`commsched.moe.infer`): the ``metrics.json``
record (:class:`InferMetrics`) and :func:`summarize`, which builds it from every rank's
per-batch records (see docs/moe_inference.md, "Metrics").

Legend: N ranks (= devices), E experts, L MoE layers, k experts per token, B batches.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ...results import Record, median
from .config import InferConfig
from .placed import OWN_FIRST_SHARE, device_rows, recv_matrix
from .policy import PlacementStrategy
from .popularity import topk_overlap


@dataclass(frozen=True)
class InferMetrics(Record):
    """``metrics.json`` of an inference run: the documented keys, and in ``extra`` the
    rest (see the module docstring and docs/moe_inference.md, "Metrics")."""

    placement: str
    latency_ms: dict[str, float]           # p50, p95, p99, mean of the batch latency, max over ranks
    imbalance: float                       # mean over batches and layers of max/mean device rows
    estimation_accuracy: float | None      # top-k overlap of the planned-from and actual load
    replans: list[float]                   # per layer: share of batches planned after gating
    extra: dict[str, Any] = field(default_factory=dict)


def _pct(xs: Sequence[float]) -> dict[str, float]:
    a = np.asarray(xs, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def _layer_view(lr: dict, k: int) -> dict:
    """Per-layer figures of one batch from what the runtime recorded."""
    counts, p = lr["counts"], lr["placement"]
    actual = counts.sum(axis=0).astype(np.float64)
    rows = device_rows(counts, p)
    # own rows each device computes while the dispatch runs: the window the next layer's
    # phase-1 plan has on that device before it delays the remote rows (pipelined runtime)
    own_first = [int(np.ceil(OWN_FIRST_SHARE * recv_matrix(counts, p, d)[1][d].sum())) for d in range(p.num_devices)]
    pf = lr["planned_from"]
    ok = pf is not None and actual.sum() > 0
    return {"rows": rows, "load": actual, "replicas": p.share_counts, "replanned": lr["replanned"],
            "overlap": lr["overlap"], "loads": lr["loads"], "own_first": own_first,
            "acc": topk_overlap(pf, actual, k) if ok else None,
            "acc2k": topk_overlap(pf, actual, 2 * k) if ok else None}


def summarize(cfg: InferConfig, strategy: PlacementStrategy, per_rank: list[dict], row_cost_s: float,
              *, wall_clock_s: float, device: str = "cpu", host_P: Sequence[int] | None = None) -> InferMetrics:
    """The run's metrics from every rank's records (rank 0's with per-layer detail).
    ``host_P``: the host of each rank, to count the bytes that crossed hosts (default: one)."""
    N, L, E = strategy.num_devices, strategy.num_layers, strategy.num_experts
    options = dataclasses.asdict(strategy.cfg)  # the strategy's own options (threshold, path_length, ...)
    recs0 = per_rank[0]["records"]
    timed = range(cfg.warmup, len(recs0))
    lat = [1e3 * max(per_rank[r]["records"][b]["latency_s"] for r in range(N)) for b in timed]
    layers = [[_layer_view(recs0[b]["layers"][j], strategy.k) for j in range(L)] for b in timed]
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
    breakdown = {p: median(float(np.mean([per_rank[r]["records"][b]["parts_s"][p] for r in range(N)]))
                           for b in timed) for p in parts}
    loads_per_batch = float(np.mean([sum(lr["loads"] for lr in bl) for bl in layers]))
    window = [1e3 * row_cost_s * min(sum(lr["own_first"][r] for lr in bl[:-1]) for r in range(N)) for bl in layers]
    hosts = tuple(host_P) if host_P is not None else (0,) * N
    cross = np.array([[hosts[q] != hosts[r] for q in range(N)] for r in range(N)])

    def peer_bytes(b: int, inter: bool) -> int:  # both row exchanges, all ranks, as the exchanges counted
        return int(sum(x for r in range(N) for q, x in enumerate(per_rank[r]["records"][b].get("peer_bytes", []))
                       if cross[r, q] == inter))
    return InferMetrics(
        placement=strategy.name,
        latency_ms=_pct(lat),
        imbalance=float(imb.mean()),
        estimation_accuracy=float(np.mean(acc)) if acc else None,
        replans=replans,
        extra={
            "driver": cfg.driver,
            "compute": cfg.compute,
            "device": device,
            "world_size": N,
            "num_experts": E,
            "num_layers": L,
            "k": strategy.k,
            "slots_per_device": strategy.slots,
            "resident_per_device": strategy.resident_cap,
            "load_cost_ms": 1e3 * strategy.load_cost_s,
            "threshold": options.get("threshold"),
            "path_length": options.get("path_length"),
            "batches": len(lat),
            "warmup": cfg.warmup,
            "latency_ms_per_batch": lat,
            "per_batch": {
                "model_latency_ms": model_lat,
                "replanned_layers": [int(sum(lr["replanned"] for lr in bl)) for bl in layers],
                "critical_loads": [int(sum(lr["loads"] for lr in bl)) for bl in layers],
                "parts_ms_max_over_ranks": {p: [1e3 * max(per_rank[r]["records"][b]["parts_s"][p]
                                                          for r in range(N)) for b in timed] for p in parts},
            },
            "model_latency_ms": _pct(model_lat),
            # per batch: the device time of the own rows computed while the dispatches run
            # (layers 0..L-2, the tightest rank), the window the next layers' phase-1 plans
            # have; the host time they take is breakdown_s["phase1"]
            "planning_window_ms": _pct(window),
            "phase1_ms": _pct([1e3 * max(per_rank[r]["records"][b]["parts_s"].get("phase1", 0.0) for r in range(N))
                               for b in timed]),
            "plan_ms": _pct([1e3 * max(per_rank[r]["records"][b]["parts_s"].get("plan", 0.0) for r in range(N))
                             for b in timed]),
            "row_cost_us": row_cost_s * 1e6,
            # the host: each rank's CPU share of the serving loop (low: device- or link-bound),
            # peak memory, set-up time; under a device model, the p95 on the real cluster (/ k)
            "host": {"host_cpu_share": [pr.get("host_cpu_share") for pr in per_rank],
                     "peak_rss_mib": [pr.get("peak_rss_mib") for pr in per_rank],
                     "startup_s": max((pr.get("startup_s") or 0.0) for pr in per_rank)},
            "predicted_latency_ms": ({q: v / cfg.emulation.dilation for q, v in _pct(lat).items()}
                                     if cfg.compute == "emulated" and cfg.emulation.device_model else None),
            "critical_rows": _pct(crit_rows),
            "imbalance_p95": float(np.percentile(imb, 95)),
            "imbalance_per_layer": imb.mean(axis=0).tolist(),
            "estimation_accuracy_top2k": float(np.mean(acc2)) if acc2 else None,
            "estimation_accuracy_per_layer": acc_layer,
            "phase2_overlap": float(np.mean(overl)) if overl else None,
            "replan_rate": float(np.mean(replans)),
            "expert_loads_per_batch": loads_per_batch,
            "expert_loads_total": int(sum(p["loaded"] for p in per_rank)),
            "breakdown_s": breakdown,
            "bytes_sent_per_batch": float(np.mean([sum(per_rank[r]["records"][b]["bytes_sent"] for r in range(N))
                                                   for b in timed])),
            "host_of_rank": list(hosts),
            "hosts": len(set(hosts)),
            "cross_weight": strategy.cross_weight,
            "inter_host_bytes_per_batch": float(np.mean([peer_bytes(b, True) for b in timed])),
            "intra_host_bytes_per_batch": float(np.mean([peer_bytes(b, False) for b in timed])),
            "expert_load_share": share.tolist(),
            "replicas": reps.tolist(),
            "device_rows_share": dev_share.tolist(),
            "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
            "wall_clock_s": wall_clock_s,
        },
    )


__all__ = ["InferMetrics", "summarize"]
