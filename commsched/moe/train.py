"""Distributed MoE language-model training: expert parallelism + data parallelism.

    torchrun --nproc_per_node 4 -m commsched.moe.train --impl commsched --schedule lina --out DIR
    torchrun --nproc_per_node 4 -m commsched.moe.train --impl deepspeed --out DIR

Every rank trains on its own batches (data parallel); the experts of each MoE layer are
spread over an expert-parallel (EP) group of ``--ep-size`` ranks (default: all), tokens
reach them through the uneven all-to-all. Non-expert gradients are averaged over all
ranks, expert gradients over the ranks that hold the same experts (none when the EP
group is the whole world).

``--impl commsched`` uses :class:`~commsched.moe.layer.MoELayer` and the gradient
executor of :mod:`commsched.priority` with ``--schedule lina`` (micro-ops in the gaps of
the all-to-all), ``fifo`` (DDP-style buckets launched as soon as ready) or ``serial``
(allreduce after the backward pass). ``--chunks C --pipeline`` pipeline the all-to-all
with expert compute. ``--impl deepspeed`` uses ``deepspeed.moe.layer.MoE`` and
DeepSpeed's engine (ZeRO stage ``--ds-stage``, gradient reduction overlapping the
backward pass), starting from the same weights.

Writes ``DIR/metrics.json`` (rank 0): ``impl``, ``schedule``, ``world_size``, ``loss``
(mean over ranks, per step), ``step_time_s`` (median over the timed steps of the slowest
rank's step), ``a2a_time_s`` (median per step, mean over ranks, of the time the compute
thread was blocked waiting for expert all-to-alls -- what the step pays for them),
``a2a_inflight_s`` (the same for the time during which an exchange was queued or on the
wire; larger under pipelining, where compute runs meanwhile), ``allreduce_time_s``
(time during which a gradient allreduce was in flight), plus ``a2a_alone_time_s``
(``a2a_time_s`` in extra steps with the allreduce held until after the backward pass),
``allreduce_wait_s`` (time the optimizer waited for allreduce after the backward pass),
``allreduce_in_backward_share`` (commsched only: share of the allreduce bytes already
reduced when the backward pass ended), the configuration and sizes; and
``DIR/timeline.json``: every rank's communication operations of one step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from ..config import read_env
from ..dist import check_same_config, init_distributed
from ..dist import new_group as cs_new_group
from ..priority.executor import LOCAL, GradScheduler, ScheduleConfig
from .data import load_corpus
from .dispatch import ExpertGroup
from .experts import is_expert_param
from .layer import DispatchConfig
from .model import ModelConfig, MoETransformerLM

IMPLS = ("commsched", "deepspeed")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    impl: str = "commsched"
    schedule: str = "lina"
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    sched: ScheduleConfig | None = None  # None: ScheduleConfig(schedule)
    steps: int = 20
    batch_size: int = 8
    lr: float = 1e-3
    seed: int = 0
    ep_size: int | None = None
    warmup: int = 2          # steps left out of the timing medians
    probe_steps: int = 2     # extra steps measuring the all-to-all with no allreduce running
    eval_batches: int = 2
    corpus: str | None = None
    max_corpus_bytes: int = 8 << 20
    timeline_step: int | None = None  # default: the last training step
    ds_stage: int = 2
    # worker threads of the gloo groups carrying the gradient allreduce (every schedule):
    # gloo runs at most this many queued collectives at once (its default is 2)
    allreduce_threads: int | None = 8

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"--impl must be one of {IMPLS}, got {self.impl!r}")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup={self.warmup} must be in 0..steps-1 ({self.steps - 1})")
        if self.allreduce_threads is not None and self.allreduce_threads < 1:
            raise ValueError(f"--allreduce-threads must be >= 1, got {self.allreduce_threads}")
        if self.ds_stage not in (0, 1, 2):
            raise ValueError(f"--ds-stage must be 0, 1 or 2, got {self.ds_stage}")

    @property
    def schedule_config(self) -> ScheduleConfig:
        return self.sched if self.sched is not None else ScheduleConfig(self.schedule)


@dataclass
class Groups:
    ep_group: object
    ep_rank: int
    ep_size: int
    edp_group: object | None  # ranks holding the same experts (None when only this one)
    dp_group: object          # all ranks, separate from the default group and the EP group


def make_groups(ep_size: int, allreduce_threads: int | None = None) -> Groups:
    """EP groups of consecutive ranks, expert-data-parallel groups across them, and one
    all-rank group for the non-expert allreduce (on gloo with ``allreduce_threads`` worker
    threads, see :func:`commsched.dist.new_group`). Every rank creates every group, in order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"--ep-size {ep_size} must divide the world size {world}")
    ep_group = edp_group = None
    for i in range(world // ep_size):
        g = dist.new_group(list(range(i * ep_size, (i + 1) * ep_size)))
        if rank // ep_size == i:
            ep_group = g
    if world // ep_size > 1:
        for j in range(ep_size):
            g = cs_new_group(list(range(j, world, ep_size)), threads=allreduce_threads)
            if rank % ep_size == j:
                edp_group = g
    dp_group = cs_new_group(list(range(world)), threads=allreduce_threads)
    return Groups(ep_group, rank % ep_size, ep_size, edp_group, dp_group)


def _timeline_dicts(records) -> list[dict]:
    return [dataclasses.asdict(r) for r in records]


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="moe-train", unit="step", dynamic_ncols=True)


# --------------------------------------------------------------------------- commsched impl
def _build_commsched(cfg: TrainConfig, groups: Groups):
    torch.manual_seed(cfg.seed)
    mcfg = cfg.model
    eg = ExpertGroup(mcfg.num_experts, groups.ep_size, groups.ep_rank, groups.ep_group)
    model = MoETransformerLM(mcfg, expert_group=eg, dispatch=cfg.dispatch)
    # The objective is the mean of the ranks' losses. A non-expert gradient is averaged over
    # all ranks. An expert's gradient already sums the contributions of every rank of its
    # EP group (they reached it through the all-to-all); summed over the ranks holding the
    # same expert (the expert-data-parallel group), it holds every rank's share, so it is
    # scaled by 1 / world size -- as DeepSpeed MoE does.
    world = dist.get_world_size()
    sched_params = []
    for p in reversed(list(model.parameters())):  # roughly the order gradients become ready
        if is_expert_param(p):
            sched_params.append((p, groups.edp_group if groups.edp_group is not None else LOCAL, 1.0 / world))
        else:
            sched_params.append((p, groups.dp_group, 1.0 / world))
    return model, sched_params


def _set_observer(model: MoETransformerLM, observer) -> None:
    for layer in model.moe_layers():
        layer.observer = observer


def train(cfg: TrainConfig, out: Path | None = None, *, progress: bool | None = None,
          return_state: bool = False) -> dict:
    """Run training on the initialised default process group; returns the metrics (all ranks).
    Rank 0 writes ``out/metrics.json`` and ``out/timeline.json`` when ``out`` is given.
    ``return_state`` adds this rank's final ``state_dict`` under ``"state"`` (for tests)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_same_config(dataclasses.asdict(cfg), what="training configuration")
    ep = cfg.ep_size or world
    corpus = load_corpus(cfg.corpus, max_bytes=cfg.max_corpus_bytes)
    show = (read_env().progress if progress is None else progress) and rank == 0
    t_wall = time.perf_counter()
    if cfg.impl == "commsched":
        res = _train_commsched(cfg, corpus, ep, show)
    else:
        res = _train_deepspeed(cfg, corpus, ep, show)
    res["wall_clock_s"] = time.perf_counter() - t_wall
    state = res.pop("state", None)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, res)
    metrics = _summarise(cfg, gathered, ep, corpus.source)
    if out is not None and rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        timeline = {"step": metrics["timeline_step"],
                    "ranks": [g.pop("timeline", []) for g in gathered]}
        (out / "timeline.json").write_text(json.dumps(timeline))
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if return_state:
        metrics["state"] = state
    return metrics


def _train_commsched(cfg: TrainConfig, corpus, ep: int, show: bool) -> dict:
    rank = dist.get_rank()
    groups = make_groups(ep, cfg.allreduce_threads)
    model, sched_params = _build_commsched(cfg, groups)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    scfg = cfg.schedule_config
    sched = GradScheduler(sched_params, scfg)
    _set_observer(model, sched)
    B, S = cfg.batch_size, cfg.model.seq_len
    tl_step = cfg.steps - 1 if cfg.timeline_step is None else cfg.timeline_step
    rows: list[dict] = []
    timeline: list[dict] = []
    bar = _progress(cfg.steps, show)
    try:
        for step in range(cfg.steps):
            x, y = corpus.batch(B, S, seed=cfg.seed, step=step, rank=rank)
            sched.begin_step()
            t0 = time.perf_counter()
            loss, ce = model.loss(x, y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            st = sched.finish()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            rows.append({"step_s": t3 - t0, "fwd_s": t1 - t0, "bwd_s": t2 - t1, "loss": ce.item(),
                         "a2a_s": st["a2a_blocked_s"], "a2a_inflight_s": st["a2a_time_s"],
                         "allreduce_s": st["allreduce_time_s"],
                         "allreduce_wait_s": st["allreduce_wait_s"],
                         "allreduce_in_bwd": st["allreduce_in_backward_share"]})
            if step == tl_step:
                timeline = _timeline_dicts(sched.records)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{ce.item():.3f}", step_s=f"{t3 - t0:.2f}")
    finally:
        sched.close()
        if bar is not None:
            bar.close()
    # the all-to-all alone: allreduce held until after the backward pass, no optimizer step
    probe = GradScheduler(sched_params, ScheduleConfig("serial", scfg.microop_bytes))
    _set_observer(model, probe)
    alone = []
    try:
        for i in range(cfg.probe_steps):
            x, y = corpus.batch(B, S, seed=cfg.seed, step=cfg.steps + i, rank=rank)
            probe.begin_step()
            model.loss(x, y)[0].backward()
            alone.append(probe.finish()["a2a_blocked_s"])
            model.zero_grad(set_to_none=True)
    finally:
        probe.close()
    _set_observer(model, None)
    val = _evaluate(model, corpus, cfg, lambda m, xb: m(xb))
    model.close()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"rows": rows, "timeline": timeline, "a2a_alone_s": alone, "val_loss": val,
            "sizes": _sizes(model, cfg), "state": state}

def _sizes(model, cfg: TrainConfig) -> dict:
    expert = sum(p.numel() for p in model.parameters() if is_expert_param(p))
    dense = sum(p.numel() for p in model.parameters() if not is_expert_param(p))
    T = cfg.batch_size * cfg.model.seq_len
    n_moe = sum(1 for i in range(cfg.model.n_layers) if cfg.model.is_moe(i))
    return {"expert_params_here": expert, "non_expert_params": dense,
            "non_expert_grad_bytes": dense * 4,
            "a2a_payload_bytes_per_step": 4 * n_moe * T * cfg.model.k * cfg.model.d_model * 4}


def _evaluate(model, corpus, cfg: TrainConfig, forward) -> float | None:
    if cfg.eval_batches < 1:
        return None
    rank = dist.get_rank()
    losses = []
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            x, y = corpus.batch(cfg.batch_size, cfg.model.seq_len, seed=cfg.seed, step=i, rank=rank, split="val")
            logits, _ = forward(model, x)
            losses.append(float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                  y.reshape(-1))))
    return sum(losses) / len(losses)


# --------------------------------------------------------------------------- deepspeed impl
def _train_deepspeed(cfg: TrainConfig, corpus, ep: int, show: bool) -> dict:
    import deepspeed
    from deepspeed.comm.comm import comms_logger
    from deepspeed.comm.comm import timers as ds_timers
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from .deepspeed_moe import to_deepspeed

    rank = dist.get_rank()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(cfg.seed)
    model = MoETransformerLM(cfg.model)  # every expert here; DeepSpeed keeps its block of them
    to_deepspeed(model, ep)
    B, S = cfg.batch_size, cfg.model.seq_len
    ds_cfg = {
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": cfg.lr, "torch_adam": True, "adam_w_mode": False}},
        "zero_optimization": {"stage": cfg.ds_stage, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": cfg.schedule_config.bucket_bytes // 4,
                              "allgather_bucket_size": cfg.schedule_config.bucket_bytes // 4},
        "comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": False},
        # DeepSpeed clips the global gradient norm to 1.0 unless told otherwise (its default
        # gradient_clipping is 1.0); fifo and lina do not clip, so neither does the baseline.
        "gradient_clipping": 0.0,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_cfg)
    rows: list[dict] = []
    seen: set[str] = set()
    bar = _progress(cfg.steps, show)

    def comm_times() -> tuple[float, float]:
        """Seconds in all-to-all and in other collectives since the last call, from the
        host timers of DeepSpeed's comms logger (its logged latencies are cumulative)."""
        a2a = other = 0.0
        for name in list(comms_logger.comms_dict):
            seen.add(name)
            t = ds_timers(name)
            spent = sum(float(x) for x in t.event_timers)
            t.reset()
            if "all_to_all" in name:
                a2a += spent
            else:
                other += spent
        comms_logger.comms_dict = {}
        return a2a, other

    try:
        for step in range(cfg.steps):
            x, y = corpus.batch(B, S, seed=cfg.seed, step=step, rank=rank)
            comm_times()
            t0 = time.perf_counter()
            logits, aux = engine(x)
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss = ce + cfg.model.aux_weight * aux
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            a2a, other = comm_times()
            rows.append({"step_s": t3 - t0, "fwd_s": t1 - t0, "bwd_s": t2 - t1, "loss": ce.item(),
                         "a2a_s": a2a, "a2a_inflight_s": a2a, "allreduce_s": other,
                         "allreduce_wait_s": t3 - t2})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{ce.item():.3f}", step_s=f"{t3 - t0:.2f}")
    finally:
        if bar is not None:
            bar.close()
    engine.eval()
    val = _evaluate(engine, corpus, cfg, lambda m, xb: m(xb))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dense = sum(p.numel() for p in model.parameters() if getattr(p, "allreduce", True))
    T = B * S
    n_moe = sum(1 for i in range(cfg.model.n_layers) if cfg.model.is_moe(i))
    return {"rows": rows, "timeline": [], "a2a_alone_s": [], "val_loss": val, "state": state,
            "ds_comm_ops": sorted(seen),
            "sizes": {"non_expert_params": dense, "non_expert_grad_bytes": dense * 4,
                      "a2a_payload_bytes_per_step": 4 * n_moe * T * cfg.model.k * cfg.model.d_model * 4}}


# --------------------------------------------------------------------------- summary
def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _summarise(cfg: TrainConfig, per_rank: list[dict], ep: int, source: str) -> dict:
    world = len(per_rank)
    steps = len(per_rank[0]["rows"])
    timed = range(cfg.warmup, steps)

    def col(key: str, agg) -> list[float]:
        return [agg([per_rank[r]["rows"][s][key] for r in range(world)]) for s in range(steps)]

    def mean(xs):
        return sum(xs) / len(xs)

    step_max = col("step_s", max)
    keys = ("fwd_s", "bwd_s", "a2a_s", "a2a_inflight_s", "allreduce_s", "allreduce_wait_s", "loss", "allreduce_in_bwd")
    per = {k: col(k, mean) for k in keys if k in per_rank[0]["rows"][0]}
    alone = [mean([per_rank[r]["a2a_alone_s"][i] for r in range(world)])
             for i in range(len(per_rank[0]["a2a_alone_s"]))]
    vals = [p["val_loss"] for p in per_rank if p["val_loss"] is not None]
    step_time = _median([step_max[s] for s in timed])
    a2a = _median([per["a2a_s"][s] for s in timed])
    fwd, bwd = _median([per["fwd_s"][s] for s in timed]), _median([per["bwd_s"][s] for s in timed])
    wait = _median([per["allreduce_wait_s"][s] for s in timed])
    breakdown = {"forward": fwd, "backward": bwd, "allreduce_wait": wait,
                 "optimizer_and_other": max(0.0, step_time - fwd - bwd - wait)}
    return {
        "impl": cfg.impl,
        "schedule": cfg.schedule if cfg.impl == "commsched" else f"deepspeed-zero{cfg.ds_stage}",
        "world_size": world,
        "ep_size": ep,
        "loss": per["loss"],
        "val_loss": mean(vals) if vals else None,
        "step_time_s": step_time,
        "a2a_time_s": a2a,
        "a2a_inflight_s": _median([per["a2a_inflight_s"][s] for s in timed]),
        "allreduce_time_s": _median([per["allreduce_s"][s] for s in timed]),
        "allreduce_wait_s": _median([per["allreduce_wait_s"][s] for s in timed]),
        "allreduce_in_backward_share": (_median([per["allreduce_in_bwd"][s] for s in timed])
                                        if "allreduce_in_bwd" in per else None),
        "a2a_alone_time_s": _median(alone),
        "a2a_share_of_step": (a2a / step_time) if a2a is not None and step_time else None,
        "fwd_time_s": fwd,
        "bwd_time_s": bwd,
        "breakdown_s": breakdown,
        "step_times_s": step_max,
        "steps": steps,
        "warmup": cfg.warmup,
        "timeline_step": cfg.steps - 1 if cfg.timeline_step is None else cfg.timeline_step,
        "sizes": per_rank[0]["sizes"],
        **({"deepspeed_comm_ops": per_rank[0]["ds_comm_ops"]} if "ds_comm_ops" in per_rank[0] else {}),
        "corpus": source,
        "wall_clock_s": max(p["wall_clock_s"] for p in per_rank),
        "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
    }


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    d, m = TrainConfig(), ModelConfig()
    p = argparse.ArgumentParser(prog="python -m commsched.moe.train", description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=IMPLS, default=d.impl)
    p.add_argument("--schedule", choices=("lina", "fifo", "serial"), default=d.schedule)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=m.seq_len)
    p.add_argument("--d-model", type=int, default=m.d_model)
    p.add_argument("--heads", type=int, default=m.n_heads)
    p.add_argument("--layers", type=int, default=m.n_layers)
    p.add_argument("--d-ff", type=int, default=m.d_ff, help="hidden width of the dense FFNs")
    p.add_argument("--expert-hidden", type=int, default=m.expert_hidden)
    p.add_argument("--experts", type=int, default=m.num_experts)
    p.add_argument("--k", type=int, default=m.k, choices=(1, 2))
    p.add_argument("--capacity-factor", type=float, default=None, help="default: dropless")
    p.add_argument("--moe-every", type=int, default=m.moe_every)
    p.add_argument("--aux-weight", type=float, default=m.aux_weight)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--ep-size", type=int, default=None, help="expert-parallel group size (default: world)")
    p.add_argument("--chunks", type=int, default=1, help="chunks of the pipelined all-to-all")
    p.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=False,
                   help="overlap each chunk's exchange with the expert compute of the others")
    p.add_argument("--microop-bytes", type=int, default=ScheduleConfig().microop_bytes)
    p.add_argument("--credit-bytes", type=int, default=None, help="lina: allreduce bytes in flight (default: 8 micro-ops)")
    p.add_argument("--hold-in-block", action=argparse.BooleanOptionalAction, default=ScheduleConfig().hold_in_block,
                   help="lina: also hold allreduce during the expert compute of a backward expert block")
    p.add_argument("--allreduce-threads", type=int, default=d.allreduce_threads,
                   help="gloo worker threads of the gradient-allreduce groups, all schedules (gloo's default: 2)")
    p.add_argument("--bucket-bytes", type=int, default=ScheduleConfig().bucket_bytes,
                   help="fifo buckets; also DeepSpeed's reduce bucket")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--probe-steps", type=int, default=d.probe_steps)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--corpus", default=None, help="text file (default: the Python standard library's sources)")
    p.add_argument("--max-corpus-bytes", type=int, default=d.max_corpus_bytes)
    p.add_argument("--timeline-step", type=int, default=None)
    p.add_argument("--ds-stage", type=int, default=d.ds_stage, help="DeepSpeed ZeRO stage (0, 1 or 2)")
    p.add_argument("--out", type=Path, required=True)
    return p


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    model = ModelConfig(d_model=a.d_model, n_heads=a.heads, n_layers=a.layers, seq_len=a.seq_len, d_ff=a.d_ff,
                        expert_hidden=a.expert_hidden, num_experts=a.experts, k=a.k,
                        capacity_factor=a.capacity_factor, moe_every=a.moe_every, aux_weight=a.aux_weight)
    return TrainConfig(model=model, impl=a.impl, schedule=a.schedule,
                       dispatch=DispatchConfig(a.chunks, a.pipeline),
                       sched=ScheduleConfig(a.schedule, a.microop_bytes, a.credit_bytes, a.bucket_bytes,
                                                      a.hold_in_block),
                       steps=a.steps, batch_size=a.batch_size, lr=a.lr, seed=a.seed, ep_size=a.ep_size,
                       warmup=min(a.warmup, a.steps - 1), probe_steps=a.probe_steps, eval_batches=a.eval_batches,
                       corpus=a.corpus, max_corpus_bytes=a.max_corpus_bytes, timeline_step=a.timeline_step,
                       ds_stage=a.ds_stage, allreduce_threads=a.allreduce_threads)


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(a)
    except ValueError as e:
        raise SystemExit(f"commsched.moe.train: {e}") from None
    torch.set_num_threads(1)
    init_distributed()
    try:
        m = train(cfg, a.out)
        if dist.get_rank() == 0:
            print(json.dumps({k: m[k] for k in ("impl", "schedule", "world_size", "step_time_s", "a2a_time_s",
                                                 "allreduce_time_s", "a2a_alone_time_s", "val_loss")}), flush=True)
        if cfg.impl == "deepspeed":
            # DeepSpeed's CPU backend now and then aborts in its C++ teardown ("terminate called
            # without an active exception") after a run that finished and wrote its results;
            # leave without running those destructors once every rank is done.
            dist.barrier()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
