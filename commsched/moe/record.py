"""Record routing traces from the MoE language model; save and load its checkpoints.

    python -m commsched.moe.record --train-steps 300 --save-checkpoint runs/lm.pt \
        --out runs/lm_trace.npz
    python -m commsched.moe.record --checkpoint runs/lm.pt --tokens 65536 --out trace.npz

Legend: B sequences, S sequence length, T = B*S tokens, L MoE layers, k experts per token.

With ``--train-steps N`` the model is first trained by :func:`commsched.moe.train.train`
in a process group of one (every expert on this process), and the result is written to
``--save-checkpoint``; with ``--checkpoint`` a saved model is loaded. The trace is the
model's routing (``experts[t, l]``: the router's top-k, highest gate first) on
consecutive, non-overlapping ``S``-token windows of the held-out split of the corpus
(``--split val``, the default), one sequence per window; it is written in the trace
format of :mod:`commsched.moe.traces` (version 1) with ``source`` naming the checkpoint,
the corpus and the split.

Checkpoints (:func:`save_checkpoint`, :func:`load_checkpoint`, the file format) live in
:mod:`commsched.moe.checkpoint`; they are re-exported here.

``--device auto|cpu|cuda`` (default auto) is where the model trains; the trace is recorded
on the CPU from the trained weights either way.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..dist import DEVICE_CHOICES
from ..results import read_error
from .checkpoint import CHECKPOINT_FORMAT, load_checkpoint, save_checkpoint
from .model import ModelConfig, MoETransformerLM
from .traces import RoutingTrace, save_trace, trace_stats

__all__ = ["record_trace", "save_checkpoint", "load_checkpoint", "train_model", "CHECKPOINT_FORMAT"]


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
    """Train with :func:`commsched.moe.train.train` on one process (world of one, every
    expert here) on ``device`` (auto, cpu or cuda) and return the model (on the CPU) and
    the training metrics."""
    import torch.distributed as dist

    from ..dist import init_distributed, resolve_device
    from .train import TrainConfig, train

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


def build_parser() -> argparse.ArgumentParser:
    m = ModelConfig()
    p = argparse.ArgumentParser(prog="python -m commsched.moe.record", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None, help="a saved model (else --train-steps trains one)")
    p.add_argument("--train-steps", type=int, default=None)
    p.add_argument("--save-checkpoint", type=Path, default=None)
    p.add_argument("--tokens", type=int, default=65536, help="tokens to record (whole windows)")
    p.add_argument("--split", choices=("val", "train"), default="val")
    p.add_argument("--corpus", default=None, help="text file (default: the Python standard library's sources)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="where --train-steps trains (auto: CUDA when available)")
    g = p.add_argument_group("model to train (with --train-steps)")
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--seq-len", type=int, default=64)
    g.add_argument("--d-model", type=int, default=64)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--layers", type=int, default=6)
    g.add_argument("--moe-every", type=int, default=1)
    g.add_argument("--experts", type=int, default=8)
    g.add_argument("--k", type=int, default=2, choices=(1, 2))
    g.add_argument("--expert-hidden", type=int, default=m.expert_hidden)
    g.add_argument("--d-ff", type=int, default=m.d_ff)
    g.add_argument("--aux-weight", type=float, default=m.aux_weight)
    p.add_argument("--out", type=Path, required=True, help="trace file to write (.npz)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    return p


PROG = "commsched.moe.record"


def _prepare_out_file(path: Path, overwrite: bool) -> None:
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


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from ..dist import CommError, cli_error
    from .data import load_corpus

    torch.set_num_threads(1)
    try:
        if (a.checkpoint is None) == (a.train_steps is None):
            raise ValueError("give exactly one of --checkpoint FILE and --train-steps N")
        _prepare_out_file(a.out, a.overwrite)
        if a.save_checkpoint is not None:
            _prepare_out_file(a.save_checkpoint, True)
        if a.checkpoint is not None:
            model, info = load_checkpoint(a.checkpoint)
            source = str(a.checkpoint)
        else:
            mc = ModelConfig(d_model=a.d_model, n_heads=a.heads, n_layers=a.layers, seq_len=a.seq_len,
                             d_ff=a.d_ff, expert_hidden=a.expert_hidden, num_experts=a.experts, k=a.k,
                             moe_every=a.moe_every, aux_weight=a.aux_weight)
            model, info = train_model(mc, steps=a.train_steps, batch_size=a.batch_size, lr=a.lr, seed=a.seed,
                                      corpus=a.corpus, device=a.device)
            source = str(a.save_checkpoint) if a.save_checkpoint else f"trained {a.train_steps} steps"
            if a.save_checkpoint is not None:
                save_checkpoint(a.save_checkpoint, model, info)
        corpus = load_corpus(a.corpus)
        tr = record_trace(model, corpus, a.tokens, split=a.split, seed=a.seed, source=source)
        save_trace(a.out, tr)
    except (ValueError, CommError) as e:
        return cli_error(PROG, e)
    stats = trace_stats(tr, tokens_per_batch=2048)
    print(json.dumps({"trace": str(a.out), "tokens": tr.num_tokens, "layers": tr.num_layers,
                      "experts": tr.num_experts, "k": tr.k, "info": info, "stats": stats}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
