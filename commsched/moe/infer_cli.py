"""The command line of MoE inference: ``python -m commsched.moe.infer`` (see
:mod:`commsched.moe.infer` for what a run does and writes).

    torchrun --nproc_per_node 4 -m commsched.moe.infer --placement lina --out DIR

The flags are generated from the configs of :mod:`commsched.moe.infer_config` and the
synthetic trace's :class:`~commsched.moe.traces.SyntheticTraceConfig` (type, default, help
and choices; ``--placement``, ``--planner`` and ``--online-planner`` from the strategy and
planner registries); the command line's own are ``--out`` and ``--overwrite``, and two
defaults that depend on other flags (``--compute``: the driver's; ``--trace-tokens``: enough
for ``--batches``). The body runs under :func:`commsched.dist.cli_main`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from ..configurable import add_arguments, from_arguments
from ..dist import CommError, Stopped, cli_main, init_distributed
from ..results import mark_failed, prepare_out
from .infer_config import (
    DRIVER_COMPUTES,
    EmulationConfig,
    InferConfig,
    ModelDriverConfig,
    PlacementConfig,
    TraceDriverConfig,
)
from .infer_run import run
from .traces import SyntheticTraceConfig

PROG = "commsched.moe.infer"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m commsched.moe.infer",
                                description="Distributed MoE inference with expert placement (Lina's "
                                            "two-phase scheduling).")
    add_arguments(p, PlacementConfig)
    add_arguments(p, InferConfig, defaults={"compute": None})
    add_arguments(p.add_argument_group("emulated device (--compute emulated)"), EmulationConfig)
    g = p.add_argument_group("trace driver")
    add_arguments(g, TraceDriverConfig)
    add_arguments(g, SyntheticTraceConfig, defaults={"num_tokens": None})
    add_arguments(p.add_argument_group("model driver"), ModelDriverConfig)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in OUT (else a folder holding metrics.json is refused)")
    return p


def trace_tokens(batches: int, tokens_per_batch: int, seq_len: int, profile_fraction: float) -> int:
    """``--trace-tokens``' default: the held-out part must hold ``batches`` batches of whole sequences."""
    n_tok = SyntheticTraceConfig().num_tokens
    if 0.0 < profile_fraction < 1.0:  # otherwise TraceDriverConfig says what is wrong
        n_tok = max(n_tok, int((batches + 1) * (tokens_per_batch + seq_len) / (1.0 - profile_fraction) * 1.05))
    return n_tok


def config_from_args(a: argparse.Namespace) -> InferConfig:
    """The run's config from :func:`build_parser`'s flags: ``--compute`` defaults to the
    driver's, ``--trace-tokens`` to enough for ``--batches`` after profiling, ``--warmup`` is
    capped at batches - 1."""
    n_tok = a.num_tokens if a.num_tokens is not None else trace_tokens(a.batches, a.tokens_per_batch, a.seq_len,
                                                                       a.profile_fraction)
    syn = from_arguments(SyntheticTraceConfig, a, num_tokens=n_tok)
    return from_arguments(
        InferConfig, a, compute=a.compute or DRIVER_COMPUTES[a.driver][0], warmup=min(a.warmup, a.batches - 1),
        placement=from_arguments(PlacementConfig, a), emulation=from_arguments(EmulationConfig, a),
        trace=from_arguments(TraceDriverConfig, a, synthetic=syn), model=from_arguments(ModelDriverConfig, a))


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    ready: dict[str, Path] = {}  # the run folder, once made (a FAILED marker goes there, not before)
    try:
        return cli_main(PROG, lambda: _run(a, ready), out=lambda: ready.get("out"))
    finally:  # after cli_main's line, which names the rank from the group
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(a: argparse.Namespace, ready: dict[str, Path]) -> int:
    cfg = config_from_args(a)
    torch.set_num_threads(1)
    info = init_distributed(device=cfg.device_choice)  # ValueError: --device cuda without (enough) GPUs
    try:
        prepare_out(a.out, overwrite=a.overwrite)  # made (or refused) before any work
        ready["out"] = a.out
        if cfg.device == "auto" and cfg.compute == "emulated" and info.rank == 0 and torch.cuda.is_available():
            print("commsched.moe.infer: --compute emulated runs on the CPU (the emulated accelerator); "
                  "--compute real computes on the GPU", file=sys.stderr, flush=True)
        m = run(cfg, a.out, device=info.device)
        if dist.get_rank() == 0:
            print(json.dumps({k: m[k] for k in ("placement", "world_size", "latency_ms", "model_latency_ms",
                                                 "imbalance", "estimation_accuracy", "replan_rate")}), flush=True)
    except (ValueError, CommError, Stopped):
        raise  # cli_main: one line, and FAILED in the run folder once there is one
    except BaseException as e:  # not one of ours: the traceback stays, the folder says it failed
        if "out" in ready:
            mark_failed(a.out, f"{PROG} (rank {info.rank}): {type(e).__name__}: {e}")
        raise
    return 0


__all__ = ["PROG", "build_parser", "config_from_args", "main"]
