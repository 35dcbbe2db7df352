"""Distributed MoE language-model training: expert parallelism + data parallelism (the
library; its command line is :mod:`commsched.moe.train`).

    torchrun --nproc_per_node 4 -m commsched.moe.train --impl commsched --schedule lina --out DIR
    torchrun --nproc_per_node 4 -m commsched.moe.train --impl deepspeed --out DIR

Every rank trains on its own batches (data parallel); the experts of each MoE layer are
spread over an expert-parallel (EP) group of ``--ep-size`` ranks (default: all), tokens
reach them through the uneven all-to-all. Non-expert gradients are averaged over all
ranks, expert gradients over the ranks that hold the same experts (none when the EP
group is the whole world).

``--impl commsched`` (this module: commsched's runtime) uses
:class:`~commsched.moe.model.layer.MoELayer` and the gradient executor of
:mod:`commsched.priority` with ``--schedule lina`` (micro-ops in the gaps of the
all-to-all), ``fifo`` (DDP-style buckets launched as soon as ready), ``serial``
(allreduce after the backward pass) or ``lina-overlap`` (``lina``, with the reduction's tail
running into the next forward pass, one Adam per module stepped as its reduction ends:
:mod:`commsched.priority.runtime.overlap`); the choices are the names of
:data:`commsched.priority.policy.SCHEDULES`, and the schedule's options travel in its own
config (``TrainConfig.schedule``).
``--chunks C --pipeline`` pipeline the all-to-all with expert compute; ``--hier-reduce``
reduces the non-expert gradients hierarchically (inside each host, across hosts under the
schedule's gate, inside again; :mod:`commsched.priority.hier`; hosts from
``Topology.from_env``). ``--impl
deepspeed`` runs the baseline of :mod:`commsched.moe.train.deepspeed_baseline`:
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
``a2a_contention`` (where exchanges of the timeline step ran beside an allreduce for at
least half their time: each one's time on the wire against the same exchange in the last
of those extra steps, the median and largest over every rank, and their count -- the
Lina paper's contention statistic),
``allreduce_wait_s`` (time the optimizer waited for allreduce after the backward pass),
``allreduce_in_backward_share`` (commsched only: share of the allreduce bytes already
reduced when the backward pass ended), the configuration and sizes (DeepSpeed runs add
``deepspeed_comm_ops``); and ``DIR/timeline.json``: every rank's communication operations
of one step.

``--device auto|cpu|cuda`` (default auto: CUDA when every local rank has its own GPU)
places the model and the batches (pinned host batches copied asynchronously) on the
rank's device; NCCL then carries the CUDA tensors and gloo the small host ones.
``--dtype bfloat16`` runs the forward pass under ``torch.autocast`` and sends the expert
all-to-all rows in bfloat16 (half the bytes); parameters and Adam stay float32. The
default float32 is today's arithmetic bit for bit. ``--a2a-bits 16|8`` shortens only the
expert all-to-all (the compute stays in ``--dtype``): 16 sends its rows in bfloat16, 8 the
rows to the experts as 8-bit rows of the shared codec and the rest in bfloat16
(:func:`commsched.moe.model.dispatch.moe_wires`); the scheduler's observer times the shorter
exchanges, so Lina's gaps are the measured ones.

``--compute emulated --device-model NAME|FILE --dilation K`` (:mod:`commsched.moe.train.emulated`)
puts every compute step of the model on an emulated GPU (a device clock: the roofline time
of each kernel at the modelled sizes, times k) while the host sleeps, and keeps every
collective real (the exchanges with rows of the modelled size, the gradient scheduler of
every schedule); ``metrics.json`` then adds ``emulation`` (the device model, k, each rank's
host CPU share and device busy time, the predicted step time on the real cluster: measured
/ k, memory per rank, start-up time).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from ...agree import check_replicas, check_same_config
from ...clock import Clock
from ...comm.observe import A2AEvents, A2AObserver
from ...config import read_env
from ...dist import RunGroups, all_gather_object, barrier, group_device
from ...priority.hier import HierGroups, make_hier
from ...priority.policy import MicroOpConfig, SerialConfig
from ...priority.runtime.executor import LOCAL, GradScheduler
from ...priority.runtime.records import OpRecord, contended_slowdowns
from ...priority.step import make_grad_step
from ...quant.allreduce import CompressedLauncher
from ...quant.rowwire import format_seed
from ...results import OutputError, Progress, tensor_digest, write_json
from ..model.data import Corpus, load_corpus
from ..model.dispatch import ExpertGroup
from ..model.experts import is_expert_param
from ..model.layer import DispatchConfig, MoELayer
from ..model.lm import MoETransformerLM
from . import state as train_state
from .training import (
    TrainConfig,
    TrainMetrics,
    autocast,
    evaluate,
    loss_guard,
    sizes,
    summarize,
    to_device,
)

if TYPE_CHECKING:
    from ...cluster.topology import Topology

SYNTHETIC_SOURCE = "none (--compute emulated: the emulated device reads no text)"


@dataclass
class Groups:
    ep_group: object
    ep_rank: int
    ep_size: int
    edp_group: object | None  # ranks holding the same experts (None when only this one)
    dp_group: object          # all ranks, separate from the default group and the EP group


def make_groups(ep_size: int, allreduce_threads: int | None = None, run: RunGroups | None = None) -> Groups:
    """EP groups of consecutive ranks, expert-data-parallel groups across them, and one
    all-rank group for the non-expert allreduce (on gloo with ``allreduce_threads`` worker
    threads), made in ``run`` (default: a RunGroups of their own). Every rank creates every
    group, in order."""
    cs_new_group = (run or RunGroups()).new
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"--ep-size {ep_size} must divide the world size {world}")
    ep_group = edp_group = None
    for i in range(world // ep_size):
        g = cs_new_group(list(range(i * ep_size, (i + 1) * ep_size)))
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
def build_commsched(cfg: TrainConfig, groups: Groups, observer: A2AObserver | None = None,
                     device: torch.device | str = "cpu"):
    """The expert-parallel model on ``device`` (its MoE layers report to ``observer``) and
    the ``(parameter, group, scale)`` entries of its gradient scheduler. The weights are
    drawn on the host and then moved, so every device starts from the same ones."""
    torch.manual_seed(cfg.seed)
    mcfg = cfg.model
    eg = ExpertGroup(mcfg.num_experts, groups.ep_size, groups.ep_rank, groups.ep_group)
    model = MoETransformerLM(mcfg, expert_group=eg, dispatch=cfg.dispatch, observer=observer, wire_seed=cfg.seed)
    eg.validate(mcfg.d_model, torch.float32 if cfg.dtype == "float32" else getattr(torch, cfg.dtype))
    if torch.device(device).type != "cpu":
        model.to(device)
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


def _comparable(cfg: TrainConfig, resume: bool) -> dict:
    """The configuration every rank must share. The reduction's bind address is each host's
    own (``--reduce-address {caddr1}`` on emulated hosts: one address per host in the link
    class's subnet), so only whether it is set is compared."""
    d = {**dataclasses.asdict(cfg), "resume": bool(resume)}
    sched = d.get("schedule")
    if isinstance(sched, dict) and sched.get("reduce_address"):
        sched["reduce_address"] = "<set: each host's own address>"
    return d


def train(cfg: TrainConfig, out: Path | None = None, *, progress: bool | None = None,
          device: torch.device | str | None = None, resume: bool = False,
          on_step: Callable[[int], None] | None = None,
          topology: Topology | None = None,
          flags: dict[str, Any] | None = None) -> tuple[TrainMetrics, dict[str, torch.Tensor]]:
    """Run training on the initialised default process group; returns the metrics (the same
    on all ranks) and this rank's final ``state_dict`` (on the CPU). Rank 0 writes
    ``out/metrics.json`` and ``out/timeline.json`` when ``out`` is given. ``device``: this
    rank's device (what :func:`commsched.dist.init_distributed` returned); default:
    :func:`commsched.dist.group_device` of ``cfg.device``.

    Checkpoints (``--impl commsched``, :mod:`commsched.moe.train.state`): with
    ``cfg.checkpoint_every`` K > 0 every rank writes ``out/checkpoint-rank{r}.pt`` every K
    steps and after the last; ``resume`` continues from those files, and the run ends
    bitwise equal (parameters, losses) to one that was never interrupted. ``on_step(k)``
    is called after step k (1-based) completed and its checkpoint, if any, was written.
    ``flags``: the command line the rank was started with
    (:func:`commsched.configurable.flag_values`); a configuration that differs between
    ranks names the differing flags first.

    ``topology``: the ranks' hosts for ``cfg.schedule.hier_reduce`` (default:
    ``Topology.from_env()``, collective); with one host or one rank per host the reduction
    is flat (said once), uneven hosts are a ValueError."""
    rank = dist.get_rank()
    t_start = time.perf_counter()
    dev = torch.device(device) if device is not None else group_device(cfg.run_device)
    if cfg.emulated and dev.type != "cpu":
        raise ValueError(f"--compute emulated runs on the CPU (a GPU emulated there), not on {dev}")
    if resume and cfg.emulated:
        raise ValueError("--resume: an emulated run has no weights to resume from (--compute emulated)")
    if resume and cfg.impl != "commsched":  # checkpoint_every: TrainConfig refuses it already
        raise ValueError("--resume is an option of --impl commsched; DeepSpeed's runs are not checkpointed here")
    if (cfg.checkpoint_every or resume) and out is None:
        raise ValueError("--checkpoint-every and --resume need an output folder (out) for the checkpoints")
    check_same_config(_comparable(cfg, resume), what="training configuration", flags=flags)
    ep = cfg.ep_size or dist.get_world_size()
    # the emulated device computes nothing, so it reads no text
    corpus = None if cfg.emulated else load_corpus(cfg.corpus, max_bytes=cfg.max_corpus_bytes)
    show = (read_env().progress if progress is None else progress) and rank == 0
    t_wall = time.perf_counter()
    with Progress(cfg.steps, "moe-train", "step", enabled=show) as bar:
        if cfg.impl == "commsched":
            res = _train_commsched(cfg, corpus, ep, bar, dev, out=out, resume=resume, on_step=on_step,
                                   topology=topology, t_start=t_start)
        else:
            from .deepspeed_baseline import train_deepspeed  # it imports this module's helpers

            res = train_deepspeed(cfg, corpus, ep, bar, dev)
    res["wall_clock_s"] = time.perf_counter() - t_wall
    state = res.pop("state")
    gathered = all_gather_object(res, "gathering the training results")
    metrics = summarize(cfg, gathered, ep, corpus.source if corpus is not None else SYNTHETIC_SOURCE)
    if out is not None and rank == 0:
        timeline = {"step": metrics.timeline_step, "ranks": [g.pop("timeline", []) for g in gathered]}
        write_json(out / "timeline.json", timeline, indent=None)
        metrics.write(out / "metrics.json")
    return metrics, state


def _resume_state(cfg: TrainConfig, out: Path, ep: int, device: torch.device) -> dict:
    """This rank's checkpoint at the newest step every rank holds, checked (collective).

    Each rank looks at its three files: ``checkpoint-rank{r}.pt``, the ``.prev.pt`` kept
    while the ranks rename (``train_state.commit``) and the ``.pt.tmp`` written before the
    renames; a temporary file counts only when whole (its tensor digests verify). A kill
    between the ranks' renames, or between a rank's own two renames, leaves ranks whose
    newest files differ by a step: the ranks ahead step back, those behind take their
    temporary file. A damaged or mismatched ``.pt`` / ``.prev.pt`` on any rank stops every
    rank with the same ValueError; no common step is one line saying what each rank holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    path = train_state.checkpoint_path(out, rank)
    kept, err = None, None
    steps: dict[int, str] = {}  # step -> the file holding it (.pt before .prev.pt before .pt.tmp)
    found: list[str] = []       # what this rank holds, in words
    for f, temp in ((path, False), (train_state.previous_path(path), False), (train_state.temp_path(path), True)):
        if not f.is_file():
            continue
        try:
            st = train_state.read_state(f, device if f == path else "cpu", complete=temp)
            train_state.check_state(st, f, cfg=cfg, rank=rank, world_size=world, ep_size=ep)
        except ValueError as e:
            if not temp:  # a committed file is never partial: damage or a mismatch stops the run
                err = err or str(e)
            found.append(f"{f.name} (not usable)")
            continue
        found.append(f"{f.name} (step {st['step']})")
        steps.setdefault(int(st["step"]), str(f))
        if f == path:
            kept = st
        del st
    got = all_gather_object((err, steps, found), "agreeing on the checkpoint to resume from")
    bad = [(r, e) for r, (e, _, _) in enumerate(got) if e]
    if bad:
        r, e = bad[0]
        raise ValueError(e if r == rank else f"rank {r}: {e}")
    if not any(f for _, _, f in got):
        raise ValueError(f"--resume: no checkpoint in {out} (checkpoint-rank{{r}}.pt; run with --checkpoint-every "
                         "K first, with the same --out and number of ranks)")
    common = set.intersection(*(set(s) for _, s, _ in got))
    if not common:
        held = "; ".join(f"rank {r}: {', '.join(f) or 'nothing'}" for r, (_, _, f) in enumerate(got))
        raise ValueError(f"--resume: the ranks' checkpoints in {out} hold no step in common ({held}); "
                         "they cannot be resumed together")
    chosen = Path(steps[max(common)])
    if chosen != path:  # this rank steps back, or takes its whole temporary file
        kept = train_state.read_state(chosen, device, complete=chosen == train_state.temp_path(path))
    if train_state.DIGESTS not in kept:
        print(f"commsched.moe.train (rank {rank}): --resume: {chosen} was written without tensor digests "
              "(an earlier commsched): loaded unchecked", file=sys.stderr, flush=True)
    return kept


def _check_replicas(model: torch.nn.Module, opt, out: Path, ep_rank: int) -> None:
    """After loading: every rank's replicated (data-parallel) parameters and their Adam
    state must equal its peers' (each file is whole, but files of different runs or steps,
    or one edited and re-signed, would leave replicas apart for good: the allreduce keeps
    them moving together and never brings them back). Expert parameters are compared
    only between ranks holding the same experts (same expert-parallel rank). Collective."""
    names = {id(p): n for n, p in model.named_parameters()}
    inner = getattr(opt, "optimizer", None)
    opts = getattr(inner, "optimizers", None) or ([inner] if isinstance(inner, torch.optim.Optimizer) else [])
    shared: dict[str, int] = {}
    expert: dict[str, int] = {}
    for n, p in model.named_parameters():
        (expert if is_expert_param(p) else shared)[n] = tensor_digest(p)
    for o in opts:
        for p, s in o.state.items():
            for k, v in s.items():
                if id(p) in names and isinstance(v, torch.Tensor):
                    (expert if is_expert_param(p) else shared)[f"{names[id(p)]} (Adam {k})"] = tensor_digest(v)
    what = f"--resume: the checkpoints in {out} do not hold one run's replicas"
    check_replicas(shared, what)
    check_replicas(expert, what, key=ep_rank)


def _save_state(cfg: TrainConfig, out: Path, step: int, ep: int, model, opt, rows: list[dict],
                device: torch.device, grad_keys: dict | None = None, wire_keys: dict | None = None) -> None:
    """Every rank writes its file beside the old one (flushed to the disk), the ranks learn
    whether all could (a full disk on any rank is the same one-line error on every rank,
    nothing renamed), then each renames its file into place keeping the old one, and once
    all have, the old ones go (collective)."""
    rank = dist.get_rank()
    path = train_state.checkpoint_path(out, rank)
    st = train_state.make_state(cfg=cfg, step=step, rank=rank, world_size=dist.get_world_size(), ep_size=ep,
                                model=model, optimizer=opt, rows=rows, device=device,
                                grad_keys=grad_keys, wire_keys=wire_keys)
    tmp, err = None, None
    try:
        tmp = train_state.write_tmp(path, st)
    except OutputError as e:
        err = str(e)
    errs = all_gather_object(err, f"writing the checkpoint of step {step}")
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        r, e = bad[0]
        raise OutputError(e if r == rank else f"rank {r}: {e}")
    train_state.commit(tmp, path)
    barrier(f"barrier after committing the checkpoint of step {step}")
    train_state.drop_previous(path)


def _train_commsched(cfg: TrainConfig, corpus: Corpus | None, ep: int, bar: Progress,
                     device: torch.device | str = "cpu", *, out: Path | None = None, resume: bool = False,
                     on_step: Callable[[int], None] | None = None, topology: Topology | None = None,
                     t_start: float | None = None) -> dict:
    device = torch.device(device)
    # threaded gloo groups carry CPU tensors only: a CUDA run keeps the backend's own groups
    threads = cfg.allreduce_threads if device.type == "cpu" else None
    run = RunGroups()  # every group of the run, destroyed at its end
    groups = make_groups(ep, threads, run)
    hier = None
    if cfg.schedule.hier_reduce:  # its groups once, for every step (None: reduce flat)
        from ...cluster.topology import Topology

        hier = make_hier(topology if topology is not None else Topology.from_env(), threads=threads, run=run)
    events = A2AEvents()  # the MoE layers report here; each scheduler registers for its steps
    emu = None
    if cfg.emulated:  # the model's compute on an emulated GPU (moe/train/emulated.py)
        from .emulated import build_emulated, make_emulation

        emu = make_emulation(cfg, dist.get_rank())
        model, sched_params = build_emulated(cfg, groups, events, emu)
        if t_start is not None:
            emu.t_start = t_start
    else:
        model, sched_params = build_commsched(cfg, groups, events, device)
    try:
        return _train_loop(cfg, corpus, ep, bar, device, model, sched_params, events,
                           out=out, resume=resume, on_step=on_step, hier=hier, run=run, emu=emu)
    finally:
        model.close()
        run.close()


def _fallback_exchange(opt, model: torch.nn.Module, dispatch: DispatchConfig) -> None:
    """``--fallback-exchange`` (the default): the probe's fallback is fifo's exchange as well
    as fifo's launching. In the steps run as the fallback every MoE layer's all-to-all is one
    chunk, not pipelined (as fifo's), in the others as configured; the reduction's fifo
    buckets are ``GradScheduler(fallback_buckets=True)``'s. Where lina cannot help, its 256
    KiB micro-ops' reduction tail and, across hosts, its pipelined exchange's four chunks
    cost more than its launching rule does (docs/results.md). The chunking and the
    buckets change the arithmetic's last bits, so the bits of a run follow a decision taken
    from measured times (``--no-fallback-exchange`` keeps them a function of the
    configuration). The exact middle way, the pipelined exchange's chunks sent as one
    exchange each way (``DispatchConfig.merge``), was measured as the fallback and did not
    pay: on one host the pipelining itself is worth about 4% of a step."""
    plain = dataclasses.replace(dispatch, chunks=1, pipeline=False, merge=False)
    if plain == dispatch:
        return
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]

    def switch(fallback: bool) -> None:
        for layer in layers:
            layer.dispatch = plain if fallback else dispatch

    opt.on_mode(switch)


def _train_loop(cfg: TrainConfig, corpus: Corpus, ep: int, bar: Progress, device: torch.device, model,
                sched_params, events: A2AEvents, *, out: Path | None, resume: bool,
                on_step: Callable[[int], None] | None, hier: HierGroups | None = None,
                run: RunGroups | None = None, emu=None) -> dict:
    # --fallback-exchange: the fallback's reduction in fifo's buckets too
    buckets = {"fallback_buckets": True} if cfg.fallback_exchange else {}
    # --grad-bits: every reduction of the schedule summed in fewer bytes (quant/allreduce.py)
    launcher = None
    if cfg.grad_bits != 32 and emu is not None:  # the codec as device kernels
        from .emulated import EmulatedCompressedLauncher

        launcher = EmulatedCompressedLauncher(emu, cfg.grad_bits, seed=format_seed(cfg.seed, 0x6AD),
                                              batch_bytes=cfg.grad_batch_bytes)
    elif cfg.grad_bits != 32:
        launcher = CompressedLauncher(cfg.grad_bits, seed=format_seed(cfg.seed, 0x6AD),
                                      batch_bytes=cfg.grad_batch_bytes)
    try:
        return _train_steps(cfg, corpus, ep, bar, device, model, sched_params, events, buckets,
                            launcher, out=out, resume=resume, on_step=on_step, hier=hier, run=run, emu=emu)
    finally:
        if launcher is not None:
            launcher.close()


def _train_steps(cfg: TrainConfig, corpus: Corpus, ep: int, bar: Progress, device: torch.device, model,
                 sched_params, events: A2AEvents, buckets: dict, launcher, *, out: Path | None,
                 resume: bool, on_step: Callable[[int], None] | None, hier: HierGroups | None,
                 run: RunGroups | None, emu=None) -> dict:
    """The training steps, then the probe steps and the evaluation. ``emu``: the emulated
    device (``--compute emulated``, :mod:`commsched.moe.train.emulated`): no batches are
    read, the optimizer is the time of Adam's step on the device, marks are the device's,
    every step ends when its device work has (as ``loss.item()`` waits for it)."""
    rank = dist.get_rank()
    # the schedule's optimizer behind one step interface (priority/step.py): one Adam stepped
    # after the whole reduction, or under lina-overlap one Adam per module, stepped as its
    # reduction ends in the next forward pass (priority/runtime/overlap.py)
    if emu is not None:
        from .emulated import DeviceMarks, EmulatedAdam, HostCPU, peak_rss_mib

        def make_opt(ps):
            return EmulatedAdam(ps, emu)
    else:
        def make_opt(ps):
            return torch.optim.Adam(ps, lr=cfg.lr)
    opt = make_grad_step(model, sched_params, cfg.schedule, make_opt,
                         device=device, hier=hier, groups=run, **buckets,
                         **({"launch": launcher} if launcher is not None else {}))
    if cfg.fallback_exchange:
        _fallback_exchange(opt, model, cfg.dispatch)
    B, S = cfg.batch_size, cfg.model.seq_len
    tl_step = cfg.timeline_at
    rows: list[dict] = []
    timeline: list[dict] = []
    start = 0
    if resume:
        st = _resume_state(cfg, out, ep, device)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        _check_replicas(model, opt, out, rank % ep)
        if "probe" in st:  # checkpoints before the probe state: the probe starts again
            opt.load_probe_state(st["probe"])
        if launcher is not None and "grad_keys" in st:  # the rounding keys continue from the interrupted run's
            launcher.load_state_dict(st["grad_keys"])
        if "wire_keys" in st:  # and the 8-bit all-to-all's (--a2a-bits 8)
            model.load_wire_key_state(st["wire_keys"])
        rows = [dict(r) for r in st["rows"]]
        start = int(st["step"])
        train_state.restore_rng(st, device)
        del st
        bar.update(start)
    every = cfg.checkpoint_every if out is not None else 0
    # host clock on the CPU, CUDA events on CUDA, the device's stream on the emulated device
    clock = Clock(device) if emu is None else DeviceMarks(emu.clock)

    def batch(step: int):
        if emu is not None:
            return None, None
        x, y = corpus.batch(B, S, seed=cfg.seed, step=step, rank=rank)
        return to_device(x, device), to_device(y, device)

    def settle() -> None:
        """The emulated step's end: its device work done (what loss.item() waits for)."""
        if emu is not None:
            emu.wait()

    host = None
    t_first = None
    guard = loss_guard(cfg, bar, rank)

    def comm_row(st: dict) -> dict:
        return {"a2a_s": st["a2a_blocked_s"], "a2a_inflight_s": st["a2a_time_s"],
                "allreduce_s": st["allreduce_time_s"], "allreduce_wait_s": st["allreduce_wait_s"],
                "allreduce_in_bwd": st["allreduce_in_backward_share"]}

    with opt, events.register(opt.scheduler):  # opening builds the scheduler (collective)
        for step in range(start, cfg.steps):
            if emu is not None and step == max(cfg.warmup, start):  # the timed steps: host and device shares
                t_first = time.perf_counter()
                host = HostCPU().__enter__()
                emu.clock.reset_stats()
                rows0 = emu.rows_exchanged
                wire0 = getattr(launcher, "wire_bytes_sent", 0)
            x, y = batch(step)
            ckpt = every and ((step + 1) % every == 0 or step + 1 == cfg.steps)
            opt.before_forward()
            t0 = clock.mark()
            with autocast(cfg, device):
                loss, ce = model.loss(x, y)  # lina-overlap: each module waits for its update of the last step
            prev = opt.before_backward()  # lina-overlap: the rest of the previous step (its timings)
            if prev is not None:
                rows[-1].update(comm_row(prev))
                if step - 1 == tl_step:
                    timeline = _timeline_dicts(opt.records)
            t1 = clock.mark()
            loss.backward()
            t2 = clock.mark()
            # this step's timings; None while its reduction runs into the next forward pass
            st = opt.after_backward(sync=bool(ckpt) or step + 1 == cfg.steps)
            settle()
            t3 = clock.mark()
            step_s, fwd_s, bwd_s = clock.seconds(t0, t3), clock.seconds(t0, t1), clock.seconds(t1, t2)
            rows.append({"step_s": step_s, "fwd_s": fwd_s, "bwd_s": bwd_s,
                         "loss": ce.item() if ce is not None else None,
                         **(comm_row(st) if st is not None else {})})
            if step == tl_step and st is not None:
                timeline = _timeline_dicts(opt.records)
            guard(step + 1, rows[-1]["loss"])
            if ckpt:
                _save_state(cfg, out, step + 1, ep, model, opt, rows, device,
                            grad_keys=None if launcher is None else launcher.state_dict(),
                            wire_keys=model.wire_key_state())
            if on_step is not None:
                on_step(step + 1)
            bar.update(1)
            bar.postfix(**({"loss": f"{ce.item():.3f}"} if ce is not None else {}), step_s=f"{step_s:.2f}")
    emulation = None
    if emu is not None and host is not None:
        host.__exit__(None, None, None)
        timed = cfg.steps - max(cfg.warmup, start)
        emulation = {"host_cpu_share": host.share, "device_busy_s_per_step": emu.clock.busy_s / timed,
                     "kernels_per_step": emu.clock.kernels / timed,
                     "rows_exchanged_per_step": (emu.rows_exchanged - rows0) / timed,
                     "startup_s": t_first - emu.t_start, "peak_rss_mib": peak_rss_mib(),
                     **({"grad_wire_bytes_per_step": (launcher.wire_bytes_sent - wire0) / timed}
                        if hasattr(launcher, "wire_bytes_sent") else {})}
    # closed: every update is in (the last step synchronized); lina-overlap's pre-hooks are gone
    # the all-to-all alone: allreduce held until after the backward pass, no optimizer step
    alone, alone_recs = [], []
    s = cfg.schedule
    serial = SerialConfig(launch=s.launch, reduce_address=s.reduce_address,
                          **({"microop_bytes": s.microop_bytes} if isinstance(s, MicroOpConfig) else {}))
    with GradScheduler(sched_params, serial, device=device, groups=run) as probe, events.register(probe):
        for i in range(cfg.probe_steps):
            x, y = batch(cfg.steps + i)
            probe.begin_step()
            with autocast(cfg, device):
                loss = model.loss(x, y)[0]
            loss.backward()
            alone.append(probe.finish()["a2a_blocked_s"])
            alone_recs = probe.records
            settle()
            model.zero_grad(set_to_none=True)
    if emu is not None:  # synthetic weights: nothing to evaluate or return
        val, state = None, {}
    else:
        val = evaluate(model, corpus, cfg, device)
        state = {k: v.detach().cpu().clone() if v.device.type != "cpu" else v.detach().clone()
                 for k, v in model.state_dict().items()}
    # each exchange of the timeline step that ran beside an allreduce, against itself alone
    slowdowns = contended_slowdowns([OpRecord(**r) for r in timeline], alone_recs) if timeline else []
    return {"rows": rows, "timeline": timeline, "a2a_alone_s": alone, "a2a_slowdowns": slowdowns, "val_loss": val,
            "sizes": sizes(model, cfg), "state": state, "resumed_from_step": start if resume else None,
            **({"emulation": emulation} if emulation is not None else {})}
