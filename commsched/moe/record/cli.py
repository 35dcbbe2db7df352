"""The command line of the trace recorder: ``python -m commsched.moe.record`` (see
:mod:`commsched.moe.record.recorder`, the library).

    python -m commsched.moe.record --train-steps 300 --save-checkpoint runs/lm.pt --out runs/lm_trace.npz
    python -m commsched.moe.record --hf-tiny-mixtral --train-steps 300 --out runs/hf_trace.npz

The flags are generated from :class:`~commsched.moe.record.recorder.RecordConfig` and the model's
:class:`~commsched.moe.model.lm.ModelConfig` (the recorder's model defaults,
:data:`~commsched.moe.record.recorder.RECORD_MODEL`); ``--out`` and ``--overwrite`` are the command
line's own. The body runs under :func:`commsched.dist.cli_main` (an error is one line; the
trace file is a file, so no FAILED marker).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

import torch

from ...configurable import add_arguments, from_arguments
from ...dist import cli_main
from ..model.lm import ModelConfig
from .recorder import RECORD_MODEL, RecordConfig, record
from .traces import trace_stats

PROG = "commsched.moe.record"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m commsched.moe.record",
                                description="Record routing traces from the MoE language model (or a tiny "
                                            "transformers Mixtral); save and load its checkpoints.")
    add_arguments(p, RecordConfig)
    add_arguments(p.add_argument_group("model to train (with --train-steps; not --hf-tiny-mixtral)"), ModelConfig,
                  skip=("capacity_factor",), defaults=RECORD_MODEL)
    p.add_argument("--out", type=Path, required=True, help="trace file to write (.npz)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    return p


def config_from_args(a: argparse.Namespace) -> RecordConfig:
    return from_arguments(RecordConfig, a, model=from_arguments(ModelConfig, a))


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return cli_main(PROG, lambda: _run(a))


def _run(a: argparse.Namespace) -> int:
    cfg = config_from_args(a)
    torch.set_num_threads(1)
    tr, info = record(cfg, a.out, overwrite=a.overwrite)
    stats = trace_stats(tr, tokens_per_batch=2048)
    print(json.dumps({"trace": str(a.out), "tokens": tr.num_tokens, "layers": tr.num_layers,
                      "experts": tr.num_experts, "k": tr.k, "info": info, "stats": stats}), flush=True)
    return 0


__all__ = ["PROG", "build_parser", "config_from_args", "main"]
