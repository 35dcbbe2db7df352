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
   :mod:`~commsched.moe.placement_policy`, chosen by ``--placement``): fixed (static,
   eplb), planned from the actual counts (oracle), or (lina) the phase-1 plan made from
   the estimate exchanged one layer earlier -- planned while that layer's device
   computed, its expert loads prefetched by a background thread -- kept, or re-planned
   when the estimated and actual top-2k experts overlap less than ``--threshold``. The planners are deterministic and their
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

``--device auto|cpu|cuda`` (default auto) chooses where the experts compute: on CUDA the
bank's slots, the rows and the index tensors live on the GPU and loads are asynchronous
copies on a copy stream (docs/moe_inference.md, "Devices"); ``--compute emulated``
always runs on the CPU.

This module is the entry point (the CLI) and re-exports the run's public names from its
rooms: the configuration (:class:`InferConfig` and its nested sub-configs,
:mod:`~commsched.moe.infer_config`), the drivers (:class:`TraceDriver`,
:class:`ModelDriver`) and :func:`build` (:mod:`~commsched.moe.infer_drivers`), the run
loop :func:`run` (:mod:`~commsched.moe.infer_run`) and the metrics (:class:`InferMetrics`,
:func:`summarize`, :mod:`~commsched.moe.infer_metrics`). Steps 2-5 are
:class:`~commsched.moe.runtime.Runtime`; the experts are an
:class:`~commsched.moe.banks.ExpertBank`.

Writes ``DIR/metrics.json`` (rank 0, an :class:`InferMetrics` record): ``placement``,
``latency_ms`` (p50/p95/p99 of the batch latency, max over ranks), ``imbalance`` (mean over batches and layers of max/mean
device rows), ``estimation_accuracy`` (top-k overlap of the load the strategy planned
from and the actual load), ``replans`` (per layer: share of batches planned after
gating), ``model_latency_ms`` (sum over layers of the busiest device's rows x per-row
cost: the expert-compute latency on dedicated devices), a time breakdown, and per-layer
heat-map data (``expert_load_share``, ``replicas``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from .. import dist as cdist
from ..dist import DEVICE_CHOICES, init_distributed
from ..results import mark_failed, prepare_out
from .infer_config import (
    COMPUTES,
    DRIVER_COMPUTES,
    DRIVERS,
    EXCHANGES,
    EmulationConfig,
    InferConfig,
    ModelDriverConfig,
    PlacementConfig,
    TraceDriverConfig,
    job_device,
)
from .infer_drivers import DRIVER_CLASSES, Driver, ModelDriver, Setup, TraceDriver, build
from .infer_metrics import InferMetrics, summarize
from .infer_run import run, run_inference
from .placement_policy import PLANNERS, STRATEGIES
from .traces import SyntheticTraceConfig

__all__ = ["InferConfig", "PlacementConfig", "EmulationConfig", "TraceDriverConfig", "ModelDriverConfig",
           "InferMetrics", "Setup", "Driver", "TraceDriver", "ModelDriver", "DRIVER_CLASSES", "DRIVERS",
           "COMPUTES", "EXCHANGES", "build", "run", "run_inference", "summarize", "job_device",
           "build_parser", "config_from_args", "main"]


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    d, s = InferConfig(), SyntheticTraceConfig()
    dp, de, dt, dm = d.placement, d.emulation, d.trace, d.model
    p = argparse.ArgumentParser(prog="python -m commsched.moe.infer", description=__doc__.splitlines()[0])
    p.add_argument("--placement", choices=tuple(STRATEGIES), default=dp.strategy)
    p.add_argument("--driver", choices=DRIVERS, default=d.driver)
    p.add_argument("--compute", choices=COMPUTES, default=None,
                   help="expert compute: emulated device or real FFNs (default: emulated for the trace "
                        "driver, real for the model)")
    p.add_argument("--slots", type=int, default=None, help="experts of one layer per device (default ceil(E/N)+2)")
    p.add_argument("--threshold", type=float, default=dp.threshold, help="lina phase-2 re-plan threshold")
    p.add_argument("--path-length", type=int, default=dp.path_length, help="lina: experts of the path (l)")
    p.add_argument("--planner", choices=tuple(PLANNERS), default=dp.planner,
                   help="planner of the layouts fixed before inference (eplb)")
    p.add_argument("--online-planner", choices=tuple(PLANNERS), default=dp.online_planner,
                   help="planner during inference (lina phases 1 and 2, oracle)")
    p.add_argument("--cross-weight", type=float, default=None,
                   help="node-aware strategies (lina-node): weight of a row crossing hosts, in rows of "
                        "device compute (default: from the topology's link classes and the row cost)")
    p.add_argument("--inter-rate", default=None,
                   help="inter-host link rate the default --cross-weight assumes (tc syntax, e.g. 1gbit; "
                        "default: the topology's placeholder inter-host class)")
    p.add_argument("--exchange", choices=EXCHANGES, default=d.exchange,
                   help="pipelined: count exchange in one step, own rows computed while the row exchanges "
                        "run, loads after gating in the background; sequential: the first runtime (ring "
                        "all_gather, dispatch, compute, combine, loads on the critical path)")
    p.add_argument("--device", choices=DEVICE_CHOICES, default=d.device,
                   help="where the experts compute: auto (CUDA when every local rank has its own GPU, "
                        "else the CPU), cpu or cuda; --compute emulated always runs on the CPU")
    p.add_argument("--batches", type=int, default=d.batches)
    p.add_argument("--warmup", type=int, default=d.warmup, help="batches left out of the metrics")
    p.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("emulated device (--compute emulated)")
    g.add_argument("--us-per-row", type=float, default=de.us_per_row, help="expert compute per row, microseconds")
    g.add_argument("--load-ms", type=float, default=de.load_ms, help="time to load one expert into a slot")
    g = p.add_argument_group("trace driver")
    g.add_argument("--trace", default=None, help="routing trace npz (default: a synthetic trace)")
    g.add_argument("--profile-fraction", type=float, default=dt.profile_fraction,
                   help="leading share of the trace's sequences used for profiling (eplb, lina)")
    g.add_argument("--tokens-per-batch", type=int, default=dt.tokens_per_batch, help="tokens per batch, all ranks")
    g.add_argument("--d-model", type=int, default=dt.d_model, help="row width (floats per token)")
    g.add_argument("--expert-hidden", type=int, default=dt.expert_hidden, help="FFN width (--compute real)")
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
    g.add_argument("--batch-size", type=int, default=dm.batch_size, help="sequences per rank per batch")
    g.add_argument("--profile-trace", default=None, help="recorded trace for eplb/lina (default: record one)")
    g.add_argument("--profile-tokens", type=int, default=dm.profile_tokens)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in OUT (else a folder holding metrics.json is refused)")
    return p


def config_from_args(a: argparse.Namespace) -> InferConfig:
    n_tok = a.trace_tokens
    if n_tok is None:  # the held-out part must hold --batches batches of whole sequences
        n_tok = SyntheticTraceConfig().num_tokens
        if 0.0 < a.profile_fraction < 1.0:  # otherwise TraceDriverConfig says what is wrong
            need = (a.batches + 1) * (a.tokens_per_batch + a.seq_len) / (1.0 - a.profile_fraction)
            n_tok = max(n_tok, int(need * 1.05))
    syn = SyntheticTraceConfig(num_experts=a.experts, num_layers=a.layers, k=a.k, num_tokens=n_tok,
                               seq_len=a.seq_len, popularity=a.popularity, zipf_s=a.zipf,
                               lognormal_sigma=a.sigma, stickiness=a.stickiness,
                               cluster_concentration=a.cluster_concentration)
    compute = a.compute or DRIVER_COMPUTES[a.driver][0]
    return InferConfig(
        driver=a.driver, compute=compute, exchange=a.exchange, device=a.device, batches=a.batches,
        warmup=min(a.warmup, a.batches - 1), seed=a.seed,
        placement=PlacementConfig(strategy=a.placement, slots=a.slots, threshold=a.threshold,
                                  path_length=a.path_length, planner=a.planner,
                                  online_planner=a.online_planner, cross_weight=a.cross_weight,
                                  inter_rate=a.inter_rate),
        emulation=EmulationConfig(us_per_row=a.us_per_row, load_ms=a.load_ms),
        trace=TraceDriverConfig(path=a.trace, synthetic=syn, profile_fraction=a.profile_fraction,
                                tokens_per_batch=a.tokens_per_batch, d_model=a.d_model,
                                expert_hidden=a.expert_hidden),
        model=ModelDriverConfig(checkpoint=a.checkpoint, corpus=a.corpus, batch_size=a.batch_size,
                                profile_trace=a.profile_trace, profile_tokens=a.profile_tokens))


PROG = "commsched.moe.infer"


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        return cdist.cli_error(PROG, e)
    torch.set_num_threads(1)
    try:
        info = init_distributed(device=cfg.device_choice)
    except ValueError as e:  # --device cuda without (enough) GPUs
        return cdist.cli_error(PROG, e)
    try:
        prepare_out(a.out, overwrite=a.overwrite)  # made (or refused) before any work
    except ValueError as e:
        dist.destroy_process_group()
        return cdist.cli_error(PROG, e)
    if cfg.device == "auto" and cfg.compute == "emulated" and info.rank == 0 and torch.cuda.is_available():
        print("commsched.moe.infer: --compute emulated runs on the CPU (the emulated accelerator); "
              "--compute real computes on the GPU", file=sys.stderr, flush=True)
    try:
        m = run(cfg, a.out, device=info.device)
        if dist.get_rank() == 0:
            print(json.dumps({k: m[k] for k in ("placement", "world_size", "latency_ms", "model_latency_ms",
                                                 "imbalance", "estimation_accuracy", "replan_rate")}), flush=True)
    except (ValueError, cdist.CommError) as e:
        return cdist.cli_error(PROG, e, a.out)
    except BaseException as e:  # not one of ours: the traceback stays, the folder says it failed
        mark_failed(a.out, f"{PROG} (rank {info.rank}): {type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
