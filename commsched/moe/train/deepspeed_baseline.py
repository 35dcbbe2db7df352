"""The DeepSpeed baseline: the same language model with ``deepspeed.moe.layer.MoE`` layers,
trained by DeepSpeed's engine (``python -m commsched.moe.train --impl deepspeed``).

Legend: D model width, H expert hidden width, E experts, L experts per rank, B batch,
S sequence.

:func:`to_deepspeed` replaces every MoE feed-forward layer of a model built with all
experts held locally by DeepSpeed's real MoE layer, copying the router and the experts
this rank hosts, so both implementations start from the same weights and compute the
same function (top-k softmax gating, the same load-balancing loss, no second-expert
sampling noise). Dropless routing maps to DeepSpeed's ``drop_tokens=False`` (every
expert padded to the largest load in the group); a capacity factor maps to
``drop_tokens=True`` with that factor.

:func:`train_deepspeed` is the training loop of the baseline: the engine with ZeRO stage
``--ds-stage``, gradient reduction overlapping the backward pass, the same Adam, tokens and
seed as commsched's runtime (:mod:`commsched.moe.train.trainer`, which calls it and summarizes
both alike). DeepSpeed is imported only when called. It runs on the rank's device with the
backend that follows it (gloo on the CPU, NCCL on CUDA); ``--dtype bfloat16`` turns on
DeepSpeed's own bf16 mode (bf16 weights and all-to-all, float32 master weights).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..._lazy import require
from ...clock import Clock
from ...results import Progress
from ..model.data import Corpus
from ..model.layer import MoELayer
from ..model.lm import MoETransformerLM
from .training import TrainConfig, a2a_payload_bytes, evaluate, loss_guard, to_device


class DeepSpeedMoEFFN(nn.Module):
    """Wraps ``deepspeed.moe.layer.MoE`` to return ``(y, aux)`` like :class:`MoELayer`."""

    def __init__(self, src: MoELayer, ep_size: int):
        super().__init__()
        from deepspeed.moe.layer import MoE

        rc = src.router_cfg
        ex = src.experts
        if ex.num_local != rc.num_experts:
            raise ValueError("to_deepspeed needs a model whose MoE layers hold every expert (no expert_group)")
        D, H = ex.d_model, ex.d_hidden
        expert = nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D))
        dropless = rc.capacity_factor is None
        self.moe = MoE(D, expert, num_experts=rc.num_experts, ep_size=ep_size, k=rc.k,
                       capacity_factor=1.0 if dropless else rc.capacity_factor,
                       eval_capacity_factor=1.0 if dropless else rc.capacity_factor,
                       min_capacity=rc.min_capacity, drop_tokens=not dropless, use_rts=False,
                       top2_2nd_expert_sampling=False)
        self._src = src  # weights are copied by load_weights() once the EP rank is known
        self.ep_size = ep_size

    def load_weights(self, ep_rank: int) -> None:
        src, moe = self._src, self.moe
        L = moe.num_local_experts
        with torch.no_grad():
            moe.deepspeed_moe.gate.wg.weight.copy_(src.router.weight)
            for j, seq in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                e = ep_rank * L + j
                seq[0].weight.copy_(src.experts.w1[e].t())
                seq[0].bias.copy_(src.experts.b1[e])
                seq[2].weight.copy_(src.experts.w2[e].t())
                seq[2].bias.copy_(src.experts.b2[e])
        del self._src

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, aux, _ = self.moe(x)
        return y, aux


def to_deepspeed(model: MoETransformerLM, ep_size: int) -> MoETransformerLM:
    """Swap the MoE layers for DeepSpeed's (in place; returns the model). Needs
    ``deepspeed.init_distributed`` first: it creates DeepSpeed's expert-parallel groups."""
    from deepspeed.utils import groups

    for i, b in enumerate(model.blocks):
        if model.cfg.is_moe(i):
            ds = DeepSpeedMoEFFN(b.ffn, ep_size)
            name = ds.moe.expert_group_name
            if name not in groups._get_expert_parallel_group_dict():
                # the groups DeepSpeed's engine would create; made now to learn this rank's experts
                groups._create_expert_and_data_parallel(ep_size)
            ds.load_weights(groups._get_expert_parallel_rank(name))
            b.ffn = ds
    return model


def _groups_under_timeout() -> None:
    """Make the groups DeepSpeed creates (expert-parallel, expert-data-parallel) through
    :func:`commsched.dist.new_group`, so that they run under ``COMMSCHED_TIMEOUT_S`` like
    every other group of a run: DeepSpeed's backend calls ``torch.distributed.new_group(ranks)``,
    whose default timeout is 30 minutes whatever the default group's is. Idempotent; it
    touches only DeepSpeed's communication backend object of this process."""
    from deepspeed.comm import comm as ds_comm

    from ...dist import new_group

    cdb = ds_comm.cdb
    if cdb is not None and not getattr(cdb, "_commsched_timeout", False):
        cdb.new_group = lambda ranks: new_group(list(ranks))
        cdb._commsched_timeout = True


def comm_latency_s(comms_dict: dict) -> tuple[float, float]:
    """Seconds in all-to-all and in other collectives from DeepSpeed's comms logger
    dictionary (``comms_logger.comms_dict``: ``{op name: {message bytes: [count, [latency
    ms, ...], [algbw], [busbw]]}}``). Each logged latency is the op's timer total since the
    timer was last reset (DeepSpeed reads it with ``elapsed(reset=False)``), so an op's time
    is its largest entry. Pure: floats in, floats out, the same on the CPU and on CUDA
    (where the timers themselves hold CUDA events, never summed here)."""
    a2a = other = 0.0
    for name, by_size in comms_dict.items():
        lat = [float(v) for rec in by_size.values() for v in rec[1]]
        spent = max(lat) / 1e3 if lat else 0.0
        if "all_to_all" in name:
            a2a += spent
        else:
            other += spent
    return a2a, other


def profiled_step(step: int, warmup: int, cuda: bool) -> bool:
    """Whether DeepSpeed's comms logger is on for ``step``. It synchronises the device after
    every logged collective, which serialises DeepSpeed's overlap on CUDA: there it is on for
    the warm-up steps only (untimed), and the timed steps run as DeepSpeed runs unobserved.
    On the CPU the synchronisation is free, so every step is profiled."""
    return not cuda or step < warmup


def train_deepspeed(cfg: TrainConfig, corpus: Corpus, ep: int, bar: Progress,
                    device: torch.device | str = "cpu") -> dict:
    """Train ``cfg`` under DeepSpeed's engine on the initialised default process group (gloo
    on the CPU, NCCL on CUDA) with expert-parallel groups of ``ep`` ranks, on ``device``;
    returns this rank's results in the form
    :func:`commsched.moe.train.training.summarize` reads (per-step ``rows``, ``val_loss``, ``sizes``,
    ``state``, and ``ds_comm_ops``: the collectives DeepSpeed's comms logger saw). A step
    without the logger (:func:`profiled_step`) has ``a2a_s`` / ``allreduce_s`` None."""
    deepspeed = require("deepspeed", "the DeepSpeed-MoE baseline (--impl deepspeed)")
    import torch.distributed as dist
    from deepspeed.comm.comm import comms_logger
    from deepspeed.comm.comm import timers as ds_timers
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    rank = dist.get_rank()
    device = torch.device(device)
    cuda = device.type == "cuda"
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    _groups_under_timeout()
    torch.manual_seed(cfg.seed)
    model = MoETransformerLM(cfg.model)  # every expert here; DeepSpeed keeps its block of them
    to_deepspeed(model, ep)
    if cuda:
        model.to(device)
    B, S = cfg.batch_size, cfg.model.seq_len
    ds_cfg = {
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": cfg.lr, "torch_adam": True, "adam_w_mode": False}},
        "zero_optimization": {"stage": cfg.deepspeed.stage, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": cfg.deepspeed.bucket_bytes // 4,
                              "allgather_bucket_size": cfg.deepspeed.bucket_bytes // 4},
        "comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": False},
        # DeepSpeed clips the global gradient norm to 1.0 unless told otherwise (its default
        # gradient_clipping is 1.0); fifo and lina do not clip, so neither does the baseline.
        "gradient_clipping": 0.0,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if cfg.dtype == "bfloat16":
        ds_cfg["bf16"] = {"enabled": True}
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_cfg)
    rows: list[dict] = []
    seen: set[str] = set()
    clock = Clock(device)  # host clock on the CPU, CUDA events on CUDA
    guard = loss_guard(cfg, bar, rank)  # a diverged run warns once and stops, as commsched's runtime does

    def comm_times() -> tuple[float, float]:
        """Seconds in all-to-all and in other collectives since the last call, from the
        comms logger's dictionary (:func:`comm_latency_s`); its timers are reset."""
        a2a, other = comm_latency_s(comms_logger.comms_dict)
        for name in list(comms_logger.comms_dict):
            seen.add(name)
            ds_timers(name).reset()
        comms_logger.comms_dict = {}
        return a2a, other

    for step in range(cfg.steps):
        x, y = corpus.batch(B, S, seed=cfg.seed, step=step, rank=rank)
        x, y = to_device(x, device), to_device(y, device)
        comm_times()
        profiled = profiled_step(step, cfg.warmup, cuda)
        comms_logger.enabled = profiled
        t0 = clock.mark()
        logits, aux = engine(x)
        ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss = ce + cfg.model.aux_weight * aux
        t1 = clock.mark()
        engine.backward(loss)
        t2 = clock.mark()
        engine.step()
        t3 = clock.mark()
        a2a, other = comm_times() if profiled else (None, None)
        sec = clock.seconds
        rows.append({"step_s": sec(t0, t3), "fwd_s": sec(t0, t1), "bwd_s": sec(t1, t2), "loss": ce.item(),
                     "a2a_s": a2a, "a2a_inflight_s": a2a, "allreduce_s": other,
                     "allreduce_wait_s": sec(t2, t3)})
        guard(step + 1, rows[-1]["loss"])
        bar.update(1)
        bar.postfix(loss=f"{ce.item():.3f}", step_s=f"{sec(t0, t3):.2f}")
    engine.eval()
    val = evaluate(engine, corpus, cfg, device)
    state = {k: v.detach().cpu().clone() if cuda else v.detach().clone() for k, v in model.state_dict().items()}
    dense = sum(p.numel() for p in model.parameters() if getattr(p, "allreduce", True))
    return {"rows": rows, "timeline": [], "a2a_alone_s": [], "val_loss": val, "state": state,
            "ds_comm_ops": sorted(seen),
            "sizes": {"non_expert_params": dense, "non_expert_grad_bytes": dense * 4,
                      "a2a_payload_bytes_per_step": a2a_payload_bytes(cfg)}}


__all__ = ["DeepSpeedMoEFFN", "to_deepspeed", "train_deepspeed"]
