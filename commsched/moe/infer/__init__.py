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
3. the placement of the layer, from the run's placement strategy (a class of
   :mod:`~commsched.moe.infer.policy`, chosen by ``--placement``): fixed (static,
   eplb), planned from the actual counts (oracle), or (lina) the phase-1 plan made from
   the estimate exchanged one layer earlier -- planned while that layer's device
   computed, its expert loads prefetched by a background thread -- kept, or re-planned
   when the estimated and actual top-2k experts overlap less than ``--threshold``. The planners are deterministic and their
   inputs identical on every rank, so every rank computes the same plan and nothing is
   broadcast (the checksum in the next exchange verifies it);
4. experts the device lacks are loaded from host memory into its S slots (pipelined:
   by the background thread, while the device computes the experts it already holds);
5. :func:`~commsched.moe.infer.placed.placed_moe`: tokens of a replicated expert split evenly
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

``--device auto|cpu|cuda`` (default auto) chooses where the experts compute: on CUDA the
bank's slots, the rows and the index tensors live on the GPU and loads are asynchronous
copies on a copy stream (docs/moe_inference.md, "Devices"); ``--compute emulated``
always runs on the CPU.

This module is the entry point (``-m``: a shim onto :mod:`~commsched.moe.infer.cli`, the
command line, whose flags are generated from the configs) and re-exports the run's public names from its
rooms: the configuration (:class:`InferConfig` and its nested sub-configs,
:mod:`~commsched.moe.infer.config`), the drivers (:class:`TraceDriver`,
:class:`ModelDriver`) and :func:`build` (:mod:`~commsched.moe.infer.drivers`), the run
loop :func:`run` (:mod:`~commsched.moe.infer.loop`) and the metrics (:class:`InferMetrics`,
:func:`summarize`, :mod:`~commsched.moe.infer.metrics`). Steps 2-5 are
:class:`~commsched.moe.infer.runtime.Runtime`; the experts are an
:class:`~commsched.moe.infer.banks.ExpertBank`.

Writes ``DIR/metrics.json`` (rank 0, an :class:`InferMetrics` record): ``placement``,
``latency_ms`` (p50/p95/p99 of the batch latency, max over ranks), ``imbalance`` (mean over batches and layers of max/mean
device rows), ``estimation_accuracy`` (top-k overlap of the load the strategy planned
from and the actual load), ``replans`` (per layer: share of batches planned after
gating), ``model_latency_ms`` (sum over layers of the busiest device's rows x per-row
cost: the expert-compute latency on dedicated devices), a time breakdown, and per-layer
heat-map data (``expert_load_share``, ``replicas``).
"""

from __future__ import annotations

from ..._lazy import lazy_getattr

_EXPORTS: dict[str, str] = {
    "COMPUTES": "config",
    "DRIVERS": "config",
    "EXCHANGES": "config",
    "EmulationConfig": "config",
    "InferConfig": "config",
    "ModelDriverConfig": "config",
    "TraceDriverConfig": "config",
    "job_device": "config",
    "DRIVER_CLASSES": "drivers",
    "Driver": "drivers",
    "ModelDriver": "drivers",
    "Setup": "drivers",
    "TraceDriver": "drivers",
    "build": "drivers",
    "InferMetrics": "metrics",
    "summarize": "metrics",
    "run": "loop",
    "run_inference": "loop",
    "main": "cli",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
