"""MoE language-model checkpoints: save and load a :class:`~commsched.moe.model.lm.MoETransformerLM`.

Checkpoint file (``torch.save``; load with :func:`load_checkpoint`): a dict with
``format`` = ``"commsched-moe-lm"``, ``version`` = 1, ``model_config`` (the fields of
:class:`~commsched.moe.model.lm.ModelConfig`), ``state_dict`` (every expert included) and
``info`` (how it was trained). Written by ``python -m commsched.moe.record
--save-checkpoint`` and read by ``python -m commsched.moe.infer --driver model``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ...results import load_torch_file, read_error, save_torch
from .lm import ModelConfig, MoETransformerLM

CHECKPOINT_FORMAT = "commsched-moe-lm"
CHECKPOINT_VERSION = 1

__all__ = ["save_checkpoint", "load_checkpoint", "CHECKPOINT_FORMAT", "CHECKPOINT_VERSION"]


def save_checkpoint(path: str | Path, model: MoETransformerLM, info: dict | None = None) -> None:
    """Write ``model`` (every expert) and ``info`` (how it was trained, JSON-able) to ``path``."""
    save_torch({"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
                "model_config": dataclasses.asdict(model.cfg),
                "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "info": json.loads(json.dumps(info or {}, default=str))}, path, what="checkpoint")


def load_checkpoint(path: str | Path) -> tuple[MoETransformerLM, dict]:
    """(model holding every expert, info). Raises ValueError for a file that is not one."""
    p = Path(path)
    ck = load_torch_file(p, "checkpoint")
    if not isinstance(ck, dict) or ck.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint {p}: not a commsched MoE LM checkpoint (format {CHECKPOINT_FORMAT!r})")
    if ck.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"checkpoint {p}: version {ck.get('version')} is not supported "
                         f"(this code reads {CHECKPOINT_VERSION})")
    try:
        model = MoETransformerLM(ModelConfig(**ck["model_config"]))
        model.load_state_dict(ck["state_dict"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"checkpoint {p}: damaged: its model configuration or weights do not fit "
                         f"({read_error(e)})") from None
    return model.eval(), ck.get("info", {})
