"""The command line of MoE training: ``python -m commsched.moe.train`` (see
:mod:`commsched.moe.train.trainer`, the library, for what a run does and writes).

    torchrun --nproc_per_node 4 -m commsched.moe.train --impl commsched --schedule lina --out DIR

The flags are generated from the configs (:class:`~commsched.moe.train.training.TrainConfig`, the
config of every schedule of :data:`~commsched.priority.policy.SCHEDULES` (``--schedule``'s
choices), :class:`~commsched.moe.train.training.DeepSpeedConfig`,
:class:`~commsched.moe.model.lm.ModelConfig` and :class:`~commsched.moe.model.layer.DispatchConfig`:
type, default, help and choices), so no default is typed twice; an option of another
schedule or runtime (``--schedule fifo --credit-bytes 1``) exits 2 naming its owner;
only the run's folder and its handling (``--out``, ``--overwrite``, ``--resume``) are the
command line's own. The body runs under :func:`commsched.dist.cli_main`: a ValueError or
CommError is one line (and FAILED in the run folder once there is one), SIGTERM one line,
FAILED, exit status 143.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Sequence

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
from ...dist import barrier, claim_run_folder, cli_main, init_distributed
from ...priority.policy import SCHEDULES, ScheduleConfig
from ...results import dumps_json
from ..model.layer import DispatchConfig
from ..model.lm import ModelConfig
from .trainer import train
from .training import FOREIGN_IMPL, DeepSpeedConfig, TrainConfig

PROG = "commsched.moe.train"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m commsched.moe.train",
                                description="Distributed MoE language-model training: expert parallelism + "
                                            "data parallelism.")
    add_arguments(p, TrainConfig)
    g = p.add_argument_group("gradient schedule (--impl commsched; each option belongs to the schedules whose "
                             "config has it) and DeepSpeed (--impl deepspeed)")
    default = TrainConfig().schedule.policy  # the library's default, typed once
    g.add_argument("--schedule", default=default, choices=SCHEDULES.names, help=f"gradient schedule (default {default})")
    seen: set[str] = set()
    for cls in (*dict.fromkeys(SCHEDULES.values()), DeepSpeedConfig):
        add_arguments(g, cls, skip=tuple(seen), only_given=True)
        seen.update(f.name for f in cli_fields(cls))
    add_arguments(p.add_argument_group("model"), ModelConfig)
    add_arguments(p.add_argument_group("expert dispatch"), DispatchConfig)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in OUT (else a folder holding metrics.json is refused)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/checkpoint-rank{r}.pt (same ranks and configuration; --steps may grow)")
    return p


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    """The run's config from :func:`build_parser`'s flags (``--warmup`` capped at steps - 1); an
    option of another schedule or runtime is a ValueError naming its owner."""
    schedule, deepspeed = _runtime(a)
    return from_arguments(TrainConfig, a, model=from_arguments(ModelConfig, a), schedule=schedule,
                          deepspeed=deepspeed, dispatch=from_arguments(DispatchConfig, a),
                          warmup=min(a.warmup, a.steps - 1))


def _runtime(a: argparse.Namespace) -> tuple[ScheduleConfig, DeepSpeedConfig]:
    """The schedule's config and DeepSpeed's from the options given (the other runtime's refused)."""
    runtimes = {r: {f.name: f for c in cs for f in cli_fields(c)}
                for r, cs in (("commsched", SCHEDULES.values()), ("deepspeed", (DeepSpeedConfig,)))}
    given = {k: getattr(a, k) for fs in runtimes.values() for k in fs if hasattr(a, k)}
    for k in given.keys() - runtimes[a.impl].keys():
        f, other = next((fs[k], r) for r, fs in runtimes.items() if k in fs)
        raise ValueError(FOREIGN_IMPL.format(flag=f.metadata.get("flag") or "--" + k.replace("_", "-"),
                                             owners=other, name=a.impl))
    if a.impl == "deepspeed":
        return SCHEDULES[a.schedule](), DeepSpeedConfig(**given)
    return config_of(SCHEDULES, a.schedule, given, given=True), DeepSpeedConfig()


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = parse_args(p, argv)
    # the run folder once made (a FAILED marker goes there, not before) and rank 0's lock on it
    ready: dict[str, Any] = {}
    try:
        return cli_main(PROG, lambda: _run(a, ready, flag_values(p, a)), out=lambda: ready.get("out"))
    finally:
        if ready.get("lock") is not None:  # the folder is free for the next run
            ready["lock"].release()


def _run(a: argparse.Namespace, ready: dict[str, Any], flags: dict[str, Any] | None = None) -> int:
    cfg = config_from_args(a)
    # ValueError: --device cuda where it cannot run; the emulated device runs on the CPU
    info = init_distributed(device=cfg.run_device)
    # made (or refused) before any work, and held: one run per folder at a time
    ready["lock"] = claim_run_folder(a.out, overwrite=a.overwrite, resume=a.resume)
    ready["out"] = a.out
    if info.device.type == "cpu":
        torch.set_num_threads(1)  # ranks share the host's cores
    m = train(cfg, a.out, device=info.device, resume=a.resume, flags=flags)[0].to_dict()
    if dist.get_rank() == 0:
        line = {k: m[k] for k in ("impl", "schedule", "world_size", "step_time_s", "a2a_time_s",
                                  "allreduce_time_s", "a2a_alone_time_s", "val_loss")}
        if "emulation" in m:
            em = m["emulation"]
            line.update({k: em[k] for k in ("device_model", "dilation", "predicted_step_time_s", "startup_s")},
                        host_cpu_share_max=max(em["host_cpu_share"]), peak_rss_mib_max=max(em["peak_rss_mib"]))
        print(dumps_json(line), flush=True)
    if cfg.impl == "deepspeed":
        # DeepSpeed's CPU backend now and then aborts in its C++ teardown ("terminate called
        # without an active exception") after a run that finished and wrote its results;
        # leave without running those destructors once every rank is done.
        barrier("finishing the DeepSpeed run")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


__all__ = ["PROG", "build_parser", "config_from_args", "main"]
