"""Record routing traces from the MoE language model; save and load its checkpoints (the
library; its command line is :mod:`commsched.moe.record`).

    python -m commsched.moe.record --train-steps 300 --save-checkpoint runs/lm.pt \
        --out runs/lm_trace.npz
    python -m commsched.moe.record --checkpoint runs/lm.pt --tokens 65536 --out trace.npz
    python -m commsched.moe.record --hf-tiny-mixtral --train-steps 300 --out runs/hf_trace.npz

Legend: B sequences, S sequence length, T = B*S tokens, L MoE layers, k experts per token.

With ``--train-steps N`` the model is first trained by :func:`commsched.moe.train.trainer.train`
in a process group of one (every expert on this process), and the result is written to
``--save-checkpoint``; with ``--checkpoint`` a saved model is loaded. The trace is the
model's routing (``experts[t, l]``: the router's top-k, highest gate first) on
consecutive, non-overlapping ``S``-token windows of the held-out split of the corpus
(``--split val``, the default), one sequence per window; it is written in the trace
format of :mod:`commsched.moe.record.traces` (version 1) with ``source`` naming the checkpoint,
the corpus and the split.

With ``--hf-tiny-mixtral --train-steps N`` the model is transformers' ``MixtralForCausalLM`` of
:func:`commsched.moe.hf.tiny_mixtral` (hidden 128, 8 experts, top-2, 4 layers, bytes), drawn
from ``--seed`` and trained in this process for N steps with Adam (:func:`train_hf_model`;
N = 0 keeps the random weights); :func:`record_hf_trace` records any transformers model whose
sparse MoE blocks :mod:`commsched.moe.hf` supports, through forward hooks on their routers.

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

__all__ = ["RecordConfig", "record", "record_trace", "record_hf_trace", "train_hf_model", "save_checkpoint",
           "load_checkpoint", "train_model", "prepare_out_file", "CHECKPOINT_FORMAT"]


def _windows(corpus, seq_len: int, tokens: int, split: str, seed: int) -> torch.Tensor:
    """int64 [Q, S]: the whole ``seq_len`` windows that hold at least ``tokens`` tokens of
    ``corpus``'s ``split``, consecutive from the start of the held-out split, or from a seeded
    offset of the training split."""
    S = seq_len
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
    return data[start:start + n_win * S].long().view(n_win, S)


@torch.no_grad()
def record_trace(model: MoETransformerLM, corpus, tokens: int, *, split: str = "val", seed: int = 0,
                 batch_size: int = 16, source: str = "in-memory model") -> RoutingTrace:
    """The routing of at least ``tokens`` tokens (whole windows of ``seq_len``) of
    ``corpus``'s ``split``: consecutive windows from the start of the held-out split, or
    from a seeded offset of the training split."""
    S = model.cfg.seq_len
    windows = _windows(corpus, S, tokens, split, seed)
    n_win = windows.shape[0]
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


def _hf_gates(model: torch.nn.Module) -> tuple[list[torch.nn.Module], int]:
    """The routers (``gate``) of the transformers ``model``'s sparse MoE blocks in layer order,
    and their number of experts; a ValueError for a model with none, an unsupported block, or
    blocks of different expert counts."""
    from .. import hf

    found, unsupported = hf._blocks(model)
    if unsupported:
        raise ValueError(f"cannot record the routing of {', '.join(unsupported)}; supported blocks: "
                         f"{hf._supported_names()}")
    if not found:
        raise ValueError(f"{type(model).__name__} has no sparse MoE block to record; supported blocks: "
                         f"{hf._supported_names()}")
    gates = [b.gate for _, b, _ in found]
    counts = {int(g.weight.shape[0]) for g in gates}
    if len(counts) != 1:
        raise ValueError(f"the model's MoE blocks have different numbers of experts ({sorted(counts)}); a trace "
                         "holds one")
    return gates, counts.pop()


@torch.no_grad()
def record_hf_trace(model: torch.nn.Module, corpus, tokens: int, *, seq_len: int, split: str = "val",
                    seed: int = 0, batch_size: int = 16, source: str = "transformers model") -> RoutingTrace:
    """:func:`record_trace` for a transformers MoE model (a block of
    :data:`commsched.moe.hf.FAMILIES`: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3): a forward hook on
    every sparse MoE block's router (``gate``, which returns logits, top-k weights [T, k] and
    top-k ids [T, k]) keeps the ids of each window, highest weight first, on windows of
    ``seq_len`` tokens. The model runs in eval mode where its parameters are."""
    gates, E = _hf_gates(model)
    windows = _windows(corpus, seq_len, tokens, split, seed)
    n_win = windows.shape[0]
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and n_win and int(windows.max()) >= vocab:
        raise ValueError(f"the corpus holds byte {int(windows.max())}, beyond the model's vocabulary of {vocab}: "
                         "the recorder feeds bytes as token ids (a model of vocabulary 256)")
    dev = next(model.parameters()).device
    seen: list[list[torch.Tensor]] = [[] for _ in gates]

    def hook(j: int):
        def keep(_mod, _inp, out) -> None:
            if not (isinstance(out, tuple) and len(out) == 3):
                raise ValueError(f"the router of MoE block {j} returned {type(out).__name__}, not "
                                 "(logits, top-k weights, top-k ids)")
            w_TK, ids_TK = out[1].reshape(-1, out[2].shape[-1]), out[2].reshape(-1, out[2].shape[-1])
            order = torch.argsort(-w_TK.float(), dim=-1, stable=True)  # highest gate first
            seen[j].append(ids_TK.gather(-1, order).cpu())
        return keep

    handles = [g.register_forward_hook(hook(j)) for j, g in enumerate(gates)]
    model.eval()
    try:
        for i in range(0, n_win, batch_size):
            model(input_ids=windows[i:i + batch_size].to(dev))
    finally:
        for h in handles:
            h.remove()
    experts = torch.stack([torch.cat(s) for s in seen], dim=1).numpy()  # [T, L, k]
    seq = np.repeat(np.arange(n_win), seq_len)
    src = f"model:{source},corpus:{corpus.source},split:{split}"
    return RoutingTrace(experts, E, src, seq)


def train_hf_model(model: torch.nn.Module, corpus, *, steps: int, batch_size: int, lr: float, seed: int,
                   seq_len: int) -> dict:
    """Train the transformers causal LM ``model`` in place for ``steps`` steps with Adam at ``lr``
    on random ``seq_len`` windows of ``corpus``'s training split (``batch_size`` a step, drawn
    from ``seed`` and the step), on the device its parameters are on; the model's loss (its
    router's auxiliary loss included). Returns the training info."""
    dev = next(model.parameters()).device
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        x, _ = corpus.batch(batch_size, seq_len, seed=seed, step=step, rank=0)
        loss = model(input_ids=x.to(dev), labels=x.to(dev)).loss  # the model shifts its labels
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    val = []
    with torch.no_grad():
        for i in range(4):
            x = corpus.batch(batch_size, seq_len, seed=seed, step=i, rank=0, split="val")[0].to(dev)
            val.append(float(model(input_ids=x, labels=x).loss))
    return {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "corpus": corpus.source,
            "final_loss": losses[-1] if losses else None, "val_loss": sum(val) / len(val)}


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
    tokens of ``split``; with ``hf_tiny_mixtral``, train the tiny transformers Mixtral for
    ``train_steps`` steps (0: none) instead. Its flags are generated from these fields
    (:mod:`commsched.moe.record`)."""

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
    hf_tiny_mixtral: bool = option(False, "record transformers' MixtralForCausalLM instead, hidden 128, 8 experts, "
                                          "top-2, 4 layers, bytes (commsched.moe.hf.tiny_mixtral), trained "
                                          "--train-steps N steps with Adam (0: random weights)")
    # the model trained with --train-steps: ModelConfig with a deeper, every-block-MoE default
    model: ModelConfig = option(default_factory=lambda: ModelConfig(**RECORD_MODEL), cli=False)

    def __post_init__(self) -> None:
        if self.hf_tiny_mixtral:
            check(self.checkpoint is None and self.save_checkpoint is None,
                  "--hf-tiny-mixtral trains its model in-process: --checkpoint and --save-checkpoint are for "
                  "the project's language model")
            check(self.train_steps is not None and self.train_steps >= 0,
                  "--hf-tiny-mixtral needs --train-steps N (N >= 0; 0 records from random weights)")
            check(self.model == ModelConfig(**RECORD_MODEL),
                  "the model flags (--layers, --experts, --k, ...) size the project's language model; "
                  "--hf-tiny-mixtral records a fixed tiny Mixtral (hidden 128, 8 experts, top-2, 4 layers)")
            return
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
    if cfg.hf_tiny_mixtral:
        return _record_hf_tiny_mixtral(cfg, out)
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


def _record_hf_tiny_mixtral(cfg: RecordConfig, out: Path) -> tuple[RoutingTrace, dict]:
    """``--hf-tiny-mixtral``: the tiny Mixtral drawn from ``seed``, trained ``train_steps`` steps on
    ``device`` (none: random weights), its routing recorded on the CPU and written to ``out``."""
    from ...dist import resolve_device
    from .. import hf
    from ..model.data import load_corpus

    corpus = load_corpus(cfg.corpus)
    seq_len = hf.TINY_MIXTRAL["seq_len"]
    model = hf.tiny_mixtral(cfg.seed)
    if cfg.train_steps:
        model.to(resolve_device(cfg.device)[0])
    info = train_hf_model(model, corpus, steps=cfg.train_steps or 0, batch_size=cfg.batch_size, lr=cfg.lr,
                          seed=cfg.seed, seq_len=seq_len)
    model.cpu()
    what = f"trained {cfg.train_steps} steps" if cfg.train_steps else "random weights"
    source = f"hf-tiny-mixtral (MixtralForCausalLM {what} from seed {cfg.seed})"
    tr = record_hf_trace(model, corpus, cfg.tokens, seq_len=seq_len, split=cfg.split, seed=cfg.seed,
                         batch_size=cfg.batch_size, source=source)
    save_trace(out, tr)
    return tr, info
