"""Distributed MoE language-model training: expert parallelism + data parallelism.

    torchrun --nproc_per_node 4 -m commsched.moe.train --impl commsched --schedule lina --out DIR
    torchrun --nproc_per_node 4 -m commsched.moe.train --impl deepspeed --out DIR

Every rank trains on its own batches (data parallel); the experts of each MoE layer are
spread over an expert-parallel (EP) group of ``--ep-size`` ranks (default: all), tokens
reach them through the uneven all-to-all. Non-expert gradients are averaged over all
ranks, expert gradients over the ranks that hold the same experts (none when the EP
group is the whole world).

``--impl commsched`` (this module: commsched's runtime) uses
:class:`~commsched.moe.layer.MoELayer` and the gradient executor of
:mod:`commsched.priority` with ``--schedule lina`` (micro-ops in the gaps of the
all-to-all), ``fifo`` (DDP-style buckets launched as soon as ready) or ``serial``
(allreduce after the backward pass); the choices are the names of
:data:`commsched.priority.policy.POLICIES`, and the schedule's knobs travel in one
:class:`~commsched.priority.policy.ScheduleConfig` (``TrainConfig.schedule``).
``--chunks C --pipeline`` pipeline the all-to-all with expert compute. ``--impl
deepspeed`` runs the baseline of :mod:`commsched.moe.deepspeed_baseline`:
``deepspeed.moe.layer.MoE`` and DeepSpeed's engine (ZeRO stage ``--ds-stage``, gradient
reduction overlapping the backward pass), starting from the same weights.

Writes ``DIR/metrics.json`` (rank 0, a :class:`TrainMetrics`): ``impl``, ``schedule``, ``world_size``, ``loss``
(mean over ranks, per step), ``step_time_s`` (median over the timed steps of the slowest
rank's step), ``a2a_time_s`` (median per step, mean over ranks, of the time the compute
thread was blocked waiting for expert all-to-alls -- what the step pays for them),
``a2a_inflight_s`` (the same for the time during which an exchange was queued or on the
wire; larger under pipelining, where compute runs meanwhile), ``allreduce_time_s``
(time during which a gradient allreduce was in flight), plus ``a2a_alone_time_s``
(``a2a_time_s`` in extra steps with the allreduce held until after the backward pass),
``allreduce_wait_s`` (time the optimizer waited for allreduce after the backward pass),
``allreduce_in_backward_share`` (commsched only: share of the allreduce bytes already
reduced when the backward pass ended), the configuration and sizes (DeepSpeed runs add
``deepspeed_comm_ops``); and ``DIR/timeline.json``: every rank's communication operations
of one step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..config import read_env
from ..dist import all_gather_object, barrier, check_same_config, init_distributed
from ..dist import new_group as cs_new_group
from ..observe import A2AEvents, A2AObserver
from ..priority.executor import LOCAL, GradScheduler
from ..priority.policy import DEFAULT_CREDIT_MICROOPS, POLICIES, ScheduleConfig
from ..results import Progress, Record, median, write_json
from .data import Corpus, load_corpus
from .dispatch import ExpertGroup
from .experts import is_expert_param
from .layer import DispatchConfig
from .model import ModelConfig, MoETransformerLM

IMPLS = ("commsched", "deepspeed")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    impl: str = "commsched"
    # the gradient schedule (commsched) with its knobs; DeepSpeed reuses its bucket_bytes
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
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


@dataclass(frozen=True)
class TrainMetrics(Record):
    """``metrics.json`` of an MoE training run (the keys are described in the module
    docstring); ``extra``: ``deepspeed_comm_ops`` of a DeepSpeed run."""

    impl: str
    schedule: str
    world_size: int
    loss: list[float]
    step_time_s: float | None
    a2a_time_s: float | None
    allreduce_time_s: float | None
    ep_size: int
    val_loss: float | None
    a2a_inflight_s: float | None
    allreduce_wait_s: float | None
    allreduce_in_backward_share: float | None
    a2a_alone_time_s: float | None
    a2a_share_of_step: float | None
    fwd_time_s: float | None
    bwd_time_s: float | None
    breakdown_s: dict[str, float | None]
    step_times_s: list[float]
    steps: int
    warmup: int
    timeline_step: int
    sizes: dict[str, int]
    corpus: str
    wall_clock_s: float
    config: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


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


# --------------------------------------------------------------------------- commsched impl
def _build_commsched(cfg: TrainConfig, groups: Groups, observer: A2AObserver | None = None):
    """The expert-parallel model (its MoE layers report to ``observer``) and the
    ``(parameter, group, scale)`` entries of its gradient scheduler."""
    torch.manual_seed(cfg.seed)
    mcfg = cfg.model
    eg = ExpertGroup(mcfg.num_experts, groups.ep_size, groups.ep_rank, groups.ep_group)
    model = MoETransformerLM(mcfg, expert_group=eg, dispatch=cfg.dispatch, observer=observer)
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


def train(cfg: TrainConfig, out: Path | None = None, *,
          progress: bool | None = None) -> tuple[TrainMetrics, dict[str, torch.Tensor]]:
    """Run training on the initialised default process group; returns the metrics (the same
    on all ranks) and this rank's final ``state_dict``. Rank 0 writes ``out/metrics.json``
    and ``out/timeline.json`` when ``out`` is given."""
    rank = dist.get_rank()
    check_same_config(dataclasses.asdict(cfg), what="training configuration")
    ep = cfg.ep_size or dist.get_world_size()
    corpus = load_corpus(cfg.corpus, max_bytes=cfg.max_corpus_bytes)
    show = (read_env().progress if progress is None else progress) and rank == 0
    t_wall = time.perf_counter()
    with Progress(cfg.steps, "moe-train", "step", enabled=show) as bar:
        if cfg.impl == "commsched":
            res = _train_commsched(cfg, corpus, ep, bar)
        else:
            from .deepspeed_baseline import train_deepspeed  # it imports this module's helpers

            res = train_deepspeed(cfg, corpus, ep, bar)
    res["wall_clock_s"] = time.perf_counter() - t_wall
    state = res.pop("state")
    gathered = all_gather_object(res, "gathering the training results")
    metrics = summarise(cfg, gathered, ep, corpus.source)
    if out is not None and rank == 0:
        timeline = {"step": metrics.timeline_step, "ranks": [g.pop("timeline", []) for g in gathered]}
        write_json(out / "timeline.json", timeline, indent=None)
        metrics.write(out / "metrics.json")
    return metrics, state


def _train_commsched(cfg: TrainConfig, corpus: Corpus, ep: int, bar: Progress) -> dict:
    rank = dist.get_rank()
    groups = make_groups(ep, cfg.allreduce_threads)
    events = A2AEvents()  # the MoE layers report here; each scheduler registers for its steps
    model, sched_params = _build_commsched(cfg, groups, events)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    B, S = cfg.batch_size, cfg.model.seq_len
    tl_step = cfg.steps - 1 if cfg.timeline_step is None else cfg.timeline_step
    rows: list[dict] = []
    timeline: list[dict] = []
    with GradScheduler(sched_params, cfg.schedule) as sched, events.register(sched):
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
            bar.update(1)
            bar.postfix(loss=f"{ce.item():.3f}", step_s=f"{t3 - t0:.2f}")
    # the all-to-all alone: allreduce held until after the backward pass, no optimizer step
    alone = []
    serial = dataclasses.replace(cfg.schedule, policy="serial")
    with GradScheduler(sched_params, serial) as probe, events.register(probe):
        for i in range(cfg.probe_steps):
            x, y = corpus.batch(B, S, seed=cfg.seed, step=cfg.steps + i, rank=rank)
            probe.begin_step()
            model.loss(x, y)[0].backward()
            alone.append(probe.finish()["a2a_blocked_s"])
            model.zero_grad(set_to_none=True)
    val = evaluate(model, corpus, cfg)
    model.close()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"rows": rows, "timeline": timeline, "a2a_alone_s": alone, "val_loss": val,
            "sizes": _sizes(model, cfg), "state": state}


def a2a_payload_bytes(cfg: TrainConfig) -> int:
    """Bytes of token rows one rank hands the expert all-to-alls per step: every MoE layer
    exchanges each of its T * k rows of D float32 four times (dispatch and combine, forward
    and backward)."""
    T = cfg.batch_size * cfg.model.seq_len
    n_moe = sum(1 for i in range(cfg.model.n_layers) if cfg.model.is_moe(i))
    return 4 * n_moe * T * cfg.model.k * cfg.model.d_model * 4


def _sizes(model, cfg: TrainConfig) -> dict:
    expert = sum(p.numel() for p in model.parameters() if is_expert_param(p))
    dense = sum(p.numel() for p in model.parameters() if not is_expert_param(p))
    return {"expert_params_here": expert, "non_expert_params": dense,
            "non_expert_grad_bytes": dense * 4,
            "a2a_payload_bytes_per_step": a2a_payload_bytes(cfg)}


def evaluate(model, corpus: Corpus, cfg: TrainConfig) -> float | None:
    """Mean cross-entropy of ``model`` (called as ``model(tokens) -> (logits, aux)``: the
    model or DeepSpeed's engine) on ``cfg.eval_batches`` held-out batches of this rank;
    None when ``eval_batches`` is 0."""
    if cfg.eval_batches < 1:
        return None
    rank = dist.get_rank()
    losses = []
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            x, y = corpus.batch(cfg.batch_size, cfg.model.seq_len, seed=cfg.seed, step=i, rank=rank, split="val")
            logits, _ = model(x)
            losses.append(float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                  y.reshape(-1))))
    return sum(losses) / len(losses)


# --------------------------------------------------------------------------- summary
def summarise(cfg: TrainConfig, per_rank: list[dict], ep: int, source: str) -> TrainMetrics:
    """The metrics of a run from every rank's results (in rank order)."""
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
    step_time = median([step_max[s] for s in timed])
    a2a = median([per["a2a_s"][s] for s in timed])
    fwd, bwd = median([per["fwd_s"][s] for s in timed]), median([per["bwd_s"][s] for s in timed])
    wait = median([per["allreduce_wait_s"][s] for s in timed])
    breakdown = {"forward": fwd, "backward": bwd, "allreduce_wait": wait,
                 "optimizer_and_other": max(0.0, step_time - fwd - bwd - wait)}
    return TrainMetrics(
        impl=cfg.impl,
        schedule=cfg.schedule.policy if cfg.impl == "commsched" else f"deepspeed-zero{cfg.ds_stage}",
        world_size=world,
        ep_size=ep,
        loss=per["loss"],
        val_loss=mean(vals) if vals else None,
        step_time_s=step_time,
        a2a_time_s=a2a,
        a2a_inflight_s=median([per["a2a_inflight_s"][s] for s in timed]),
        allreduce_time_s=median([per["allreduce_s"][s] for s in timed]),
        allreduce_wait_s=median([per["allreduce_wait_s"][s] for s in timed]),
        allreduce_in_backward_share=(median([per["allreduce_in_bwd"][s] for s in timed])
                                     if "allreduce_in_bwd" in per else None),
        a2a_alone_time_s=median(alone),
        a2a_share_of_step=(a2a / step_time) if a2a is not None and step_time else None,
        fwd_time_s=fwd,
        bwd_time_s=bwd,
        breakdown_s=breakdown,
        step_times_s=step_max,
        steps=steps,
        warmup=cfg.warmup,
        timeline_step=cfg.steps - 1 if cfg.timeline_step is None else cfg.timeline_step,
        sizes=per_rank[0]["sizes"],
        corpus=source,
        wall_clock_s=max(p["wall_clock_s"] for p in per_rank),
        config=json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
        extra={"deepspeed_comm_ops": per_rank[0]["ds_comm_ops"]} if "ds_comm_ops" in per_rank[0] else {},
    )


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    d, m, sc = TrainConfig(), ModelConfig(), ScheduleConfig()
    p = argparse.ArgumentParser(prog="python -m commsched.moe.train", description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=IMPLS, default=d.impl)
    p.add_argument("--schedule", choices=tuple(POLICIES), default=d.schedule.policy)
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
    p.add_argument("--microop-bytes", type=int, default=sc.microop_bytes)
    p.add_argument("--credit-bytes", type=int, default=sc.credit_bytes,
                   help=f"lina: allreduce bytes in flight (default: {DEFAULT_CREDIT_MICROOPS} micro-ops)")
    p.add_argument("--hold-in-block", action=argparse.BooleanOptionalAction, default=sc.hold_in_block,
                   help="lina: also hold allreduce during the expert compute of a backward expert block")
    p.add_argument("--allreduce-threads", type=int, default=d.allreduce_threads,
                   help="gloo worker threads of the gradient-allreduce groups, all schedules (gloo's default: 2)")
    p.add_argument("--bucket-bytes", type=int, default=sc.bucket_bytes,
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
    return TrainConfig(model=model, impl=a.impl,
                       schedule=ScheduleConfig(a.schedule, a.microop_bytes, a.credit_bytes, a.bucket_bytes,
                                               a.hold_in_block),
                       dispatch=DispatchConfig(a.chunks, a.pipeline),
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
        m = train(cfg, a.out)[0].to_dict()
        if dist.get_rank() == 0:
            print(json.dumps({k: m[k] for k in ("impl", "schedule", "world_size", "step_time_s", "a2a_time_s",
                                                 "allreduce_time_s", "a2a_alone_time_s", "val_loss")}), flush=True)
        if cfg.impl == "deepspeed":
            # DeepSpeed's CPU backend now and then aborts in its C++ teardown ("terminate called
            # without an active exception") after a run that finished and wrote its results;
            # leave without running those destructors once every rank is done.
            barrier("finishing the DeepSpeed run")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
