"""The command line of MoE inference: ``python -m commsched.moe.infer`` (see
:mod:`commsched.moe.infer` for what a run does and writes).

    torchrun --nproc_per_node 4 -m commsched.moe.infer --placement lina --out DIR

The flags are generated from the configs of :mod:`commsched.moe.infer.config`, the
placement strategies' configs (:data:`~commsched.moe.infer.policy.STRATEGIES`: each
option belongs to the strategies whose config has it, and one given to another strategy
exits with status 2 naming them, as ``--placement static --threshold 0.1`` does) and the
synthetic trace's :class:`~commsched.moe.record.traces.SyntheticTraceConfig` (type, default, help
and choices; ``--placement``, ``--planner`` and ``--online-planner`` from the strategy and
planner registries); the command line's own are ``--out`` and ``--overwrite``, and two
defaults that depend on other flags (``--compute``: the driver's; ``--trace-tokens``: enough
for ``--batches``). The body runs under :func:`commsched.dist.cli_main`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from ...configurable import (
    add_arguments,
    cli_fields,
    config_of,
    flag_values,
    from_arguments,
    parse_args,
)
from ...dist import cli_main, init_distributed
from ...results import dumps_json, prepare_out
from ..record.traces import SyntheticTraceConfig
from .config import (
    DRIVER_COMPUTES,
    EmulationConfig,
    InferConfig,
    ModelDriverConfig,
    TraceDriverConfig,
)
from .loop import run
from .policy import STRATEGIES

PROG = "commsched.moe.infer"


CLI_DEFAULTS = {"compute": None}  # the flags' defaults that are not the config's (None: the driver's)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m commsched.moe.infer",
                                description="Distributed MoE inference with expert placement (Lina's "
                                            "two-phase scheduling).")
    add_arguments(p, InferConfig, defaults=CLI_DEFAULTS)
    g = p.add_argument_group("placement strategy options (each belongs to the strategies whose config has it)")
    seen: set[str] = set()
    for cls in STRATEGIES.values():
        add_arguments(g, cls, skip=tuple(seen), only_given=True)
        seen.update(f.name for f in cli_fields(cls))
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
    capped at batches - 1; a strategy option given to a strategy whose config lacks it is a
    ValueError naming the strategies that take it."""
    n_tok = a.num_tokens
    if n_tok is None:  # the held-out part must hold --batches batches of whole sequences
        n_tok = SyntheticTraceConfig().num_tokens
        if 0.0 < a.profile_fraction < 1.0:  # otherwise TraceDriverConfig says what is wrong
            need = (a.batches + 1) * (a.tokens_per_batch + a.seq_len) / (1.0 - a.profile_fraction)
            n_tok = max(n_tok, int(need * 1.05))
    syn = from_arguments(SyntheticTraceConfig, a, num_tokens=n_tok)
    options = {f.name: getattr(a, f.name) for cls in STRATEGIES.values() for f in cli_fields(cls)
               if hasattr(a, f.name)}  # only the flags given: one of another strategy is refused
    return from_arguments(
        InferConfig, a, compute=a.compute or DRIVER_COMPUTES[a.driver][0], warmup=min(a.warmup, a.batches - 1),
        strategy=config_of(STRATEGIES, a.placement, options, given=True), emulation=from_arguments(EmulationConfig, a),
        trace=from_arguments(TraceDriverConfig, a, synthetic=syn), model=from_arguments(ModelDriverConfig, a))


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = parse_args(p, argv)
    ready: dict[str, Path] = {}  # the run folder, once made (a FAILED marker goes there, not before)
    return cli_main(PROG, lambda: _run(a, ready, flag_values(p, a)), out=lambda: ready.get("out"))


def _run(a: argparse.Namespace, ready: dict[str, Path], flags: dict | None = None) -> int:
    cfg = config_from_args(a)
    torch.set_num_threads(1)
    info = init_distributed(device=cfg.device_choice)  # ValueError: --device cuda without (enough) GPUs
    prepare_out(a.out, overwrite=a.overwrite)  # made (or refused) before any work
    ready["out"] = a.out
    if cfg.device == "auto" and cfg.compute == "emulated" and info.rank == 0 and torch.cuda.is_available():
        print("commsched.moe.infer: --compute emulated runs on the CPU (the emulated accelerator); "
              "--compute real computes on the GPU", file=sys.stderr, flush=True)
    m = run(cfg, a.out, device=info.device, flags=flags)
    if dist.get_rank() == 0:
        print(dumps_json({k: m[k] for k in ("placement", "world_size", "latency_ms", "model_latency_ms",
                                             "imbalance", "estimation_accuracy", "replan_rate")}), flush=True)
    return 0


__all__ = ["PROG", "build_parser", "config_from_args", "main"]
