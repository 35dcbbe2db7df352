"""Record routing traces from the MoE language model; save and load its checkpoints (the
library; its command line is :mod:`commsched.moe.record`).

    python -m commsched.moe.record --train-steps 300 --save-checkpoint runs/lm.pt \
        --out runs/lm_trace.npz
    python -m commsched.moe.record --checkpoint runs/lm.pt --tokens 65536 --out trace.npz

Legend: B sequences, S sequence length, T = B*S tokens, L MoE layers, k experts per token.

With ``--train-steps N`` the model is first trained by :func:`commsched.moe.train.trainer.train`
in a process group of one (every expert on this process), and the result is written to
``--save-checkpoint``; with ``--checkpoint`` a saved model is loaded. The trace is the
model's routing (``experts[t, l]``: the router's top-k, highest gate first) on
consecutive, non-overlapping ``S``-token windows of the held-out split of the corpus
(``--split val``, the default), one sequence per window; it is written in the trace
format of :mod:`commsched.moe.record.traces` (version 1) with ``source`` naming the checkpoint,
the corpus and the split.

Checkpoints (:func:`save_checkpoint`, :func:`load_checkpoint`, the file format) live in
:mod:`commsched.moe.model.checkpoint`; they are re-exported here.

``--device auto|cpu|cuda`` (default auto) is where the model trains; the trace is recorded
on the CPU from the trained weights either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...configurable import Config, check, option
from ...dist import DEVICE_CHOICES
from ...results import read_error
from ..model.checkpoint import CHECKPOINT_FORMAT, load_checkpoint, save_checkpoint
from ..model.lm import ModelConfig, MoETransformerLM
from .traces import RoutingTrace, save_trace

__all__ = ["RecordConfig", "record", "record_trace", "save_checkpoint", "load_checkpoint", "train_model",
           "prepare_out_file", "CHECKPOINT_FORMAT"]


@torch.no_grad()
def record_trace(model: MoETransformerLM, corpus, tokens: int, *, split: str = "val", seed: int = 0,
                 batch_size: int = 16, source: str = "in-memory model") -> RoutingTrace:
    """The routing of at least ``tokens`` tokens (whole windows of ``seq_len``) of
    ``corpus``'s ``split``: consecutive windows from the start of the held-out split, or
    from a seeded offset of the training split."""
    S = model.cfg.seq_len
    data = corpus.val if split == "val" else corpus.train
    n_win = -(-tokens // S)
    if data.numel() < S:
        raise ValueError(f"the {split} split has {data.numel()} bytes, fewer than one window of {S}")
    start = 0
    if split != "val":
        g = torch.Generator().manual_seed(seed)
        span = max(1, data.numel() - n_win * S)
        start = int(torch.randint(0, span, (1,), generator=g))
    avail = (data.numel() - start) // S
    if avail < n_win:
        raise ValueError(f"the {split} split holds {avail} windows of {S} bytes, fewer than the {n_win} "
                         f"needed for {tokens} tokens: ask for fewer tokens or use a larger corpus")
    windows = data[start:start + n_win * S].long().view(n_win, S)
    dev = next(model.parameters()).device
    if dev.type != "cpu":
        windows = windows.to(dev)
    moe = model.eval().moe_layers()
    parts = []
    for i in range(0, n_win, batch_size):
        model(windows[i:i + batch_size])
        parts.append(torch.stack([m.last_routing.expert_TK for m in moe], dim=1))  # [T, L, k]
    experts = torch.cat(parts).cpu().numpy()
    seq = np.repeat(np.arange(n_win), S)
    src = f"model:{source},corpus:{corpus.source},split:{split}"
    return RoutingTrace(experts, model.cfg.num_experts, src, seq)


def train_model(model_cfg: ModelConfig, *, steps: int, batch_size: int, lr: float, seed: int,
                corpus: str | None, progress: bool = False,
                device: str = "auto") -> tuple[MoETransformerLM, dict]:
    """Train with :func:`commsched.moe.train.trainer.train` on one process (world of one, every
    expert here) on ``device`` (auto, cpu or cuda) and return the model (on the CPU) and
    the training metrics."""
    import torch.distributed as dist

    from ...dist import init_distributed, resolve_device
    from ..train.trainer import TrainConfig, train

    cfg = TrainConfig(model=model_cfg, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                      warmup=min(2, steps - 1), probe_steps=0, eval_batches=4, corpus=corpus, device=device)
    created = not dist.is_initialized()
    dev = resolve_device(device)[0]
    info = init_distributed(backend="gloo" if dev.type == "cpu" else None, device=dev)
    try:
        m, state = train(cfg, None, progress=progress, device=info.device)
    finally:
        if created:
            dist.destroy_process_group()
    model = MoETransformerLM(model_cfg)
    model.load_state_dict(state)
    info = {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "corpus": m.corpus,
            "final_loss": m.loss[-1] if m.loss else None, "val_loss": m.val_loss}
    return model.eval(), info


@dataclass(frozen=True, kw_only=True)
class RecordConfig(Config):
    """What ``-m commsched.moe.record`` does: load ``checkpoint`` or train a model of
    ``model`` for ``train_steps`` steps (exactly one of the two), then record ``tokens``
    tokens of ``split``. Its flags are generated from these fields (:mod:`commsched.moe.record`)."""

    checkpoint: str | None = option(None, "a saved model (else --train-steps trains one)")
    train_steps: int | None = option(None, "train a model for this many steps first")
    save_checkpoint: str | None = option(None, "write the trained model here")
    tokens: int = option(65536, "tokens to record (whole windows)")
    split: str = option("val", "the corpus split recorded", choices=("val", "train"))
    corpus: str | None = option(None, "text file (default: the Python standard library's sources)")
    seed: int = option(0, "seed of the training and of a train-split offset")
    device: str = option("auto", "where --train-steps trains (auto: CUDA when available)", choices=DEVICE_CHOICES)
    batch_size: int = option(16, "--train-steps: sequences per step")
    lr: float = option(3e-3, "--train-steps: Adam's learning rate")
    # the model trained with --train-steps: ModelConfig with a deeper, every-block-MoE default
    model: ModelConfig = option(default_factory=lambda: ModelConfig(**RECORD_MODEL), cli=False)

    def __post_init__(self) -> None:
        check((self.checkpoint is None) != (self.train_steps is None),
              "give exactly one of --checkpoint FILE and --train-steps N")


# ModelConfig fields whose default the recorder's model changes (--layers 6 --moe-every 1 --experts 8 --k 2)
RECORD_MODEL = {"n_layers": 6, "moe_every": 1, "num_experts": 8, "k": 2}


def prepare_out_file(path: Path, overwrite: bool) -> None:
    """The trace file's folder is made, and an existing trace refused, before any work."""
    if path.is_dir():
        raise ValueError(f"--out {path}: is a folder; give the trace file to write (.npz)")
    if path.exists() and not overwrite:
        raise ValueError(f"--out {path} already exists; pass --overwrite to replace it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot create its folder {path.parent} ({read_error(e)})") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path}: its folder {path.parent} is not writable")


def record(cfg: RecordConfig, out: Path, *, overwrite: bool = False) -> tuple[RoutingTrace, dict]:
    """What ``-m commsched.moe.record`` runs: the out file (and ``save_checkpoint``'s) checked
    before any work, the model loaded or trained, its routing recorded and written to
    ``out``; returns the trace and the model's info."""
    from ..model.data import load_corpus

    prepare_out_file(out, overwrite)
    save = Path(cfg.save_checkpoint) if cfg.save_checkpoint is not None else None
    if save is not None:
        prepare_out_file(save, True)
    if cfg.checkpoint is not None:
        model, info = load_checkpoint(cfg.checkpoint)
        source = str(cfg.checkpoint)
    else:
        model, info = train_model(cfg.model, steps=cfg.train_steps, batch_size=cfg.batch_size, lr=cfg.lr,
                                  seed=cfg.seed, corpus=cfg.corpus, device=cfg.device)
        source = str(save) if save else f"trained {cfg.train_steps} steps"
        if save is not None:
            save_checkpoint(save, model, info)
    corpus = load_corpus(cfg.corpus)
    tr = record_trace(model, corpus, cfg.tokens, split=cfg.split, seed=cfg.seed, source=source)
    save_trace(out, tr)
    return tr, info
