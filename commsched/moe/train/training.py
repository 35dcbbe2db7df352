"""What both MoE training runtimes share (commsched's in :mod:`commsched.moe.train.trainer`,
DeepSpeed's in :mod:`commsched.moe.train.deepspeed_baseline`): the run's configuration, its
``metrics.json`` record, the held-out evaluation and the summary of every rank's results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...cluster.device import load_device_model
from ...configurable import Config, check, option
from ...dist import DEVICE_CHOICES, comm_guard, control_device
from ...priority.policy import LinaConfig, OverlapPolicy, ScheduleConfig
from ...quant.allreduce import DEFAULT_BATCH_BYTES, GRAD_BITS
from ...results import DivergenceGuard, Record, median
from ..model.data import Corpus
from ..model.experts import is_expert_param
from ..model.layer import DispatchConfig
from ..model.lm import ModelConfig

IMPLS = ("commsched", "deepspeed")
COMPUTES = ("real", "emulated")  # --compute (commsched.moe.train.emulated)
DTYPES = ("float32", "bfloat16")  # --dtype: the training compute and the all-to-all rows
# the refusal of a runtime's option given to the other runtime (commsched.moe.train)
FOREIGN_IMPL = "{flag} belongs to --impl {owners}, not to --impl {name}"


@dataclass(frozen=True, kw_only=True)
class DeepSpeedConfig(Config):
    """The DeepSpeed baseline's own options (``--impl deepspeed``,
    :mod:`commsched.moe.train.deepspeed_baseline`)."""

    stage: int = option(2, "DeepSpeed ZeRO stage (0, 1 or 2)", flag="--ds-stage", foreign=FOREIGN_IMPL)
    bucket_bytes: int = option(1 << 20, "DeepSpeed's reduce and allgather buckets", foreign=FOREIGN_IMPL)

    def __post_init__(self) -> None:
        check(self.stage in (0, 1, 2), f"--ds-stage must be 0, 1 or 2, got {self.stage}")
        check(self.bucket_bytes >= 4, f"--bucket-bytes must be at least 4, got {self.bucket_bytes}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(Config):
    """One MoE training run; the flags of ``-m commsched.moe.train`` are generated from these
    fields and those of the nested configs (:mod:`commsched.moe.train`): ``schedule``, the
    gradient schedule of ``--impl commsched`` (a config of
    :data:`~commsched.priority.policy.SCHEDULES`), ``deepspeed``, the options of ``--impl
    deepspeed``."""

    model: ModelConfig = option(default_factory=ModelConfig, cli=False)
    impl: str = option("commsched", "runtime: commsched's or the DeepSpeed baseline", choices=IMPLS)
    schedule: ScheduleConfig = option(default_factory=LinaConfig, cli=False)
    deepspeed: DeepSpeedConfig = option(default_factory=DeepSpeedConfig, cli=False)
    dispatch: DispatchConfig = option(default_factory=DispatchConfig, cli=False)
    steps: int = option(20, "training steps")
    batch_size: int = option(8, "sequences per rank per step")
    lr: float = option(1e-3, "Adam's learning rate")
    seed: int = option(0, "seed of the weights and the batches")
    ep_size: int | None = option(None, "expert-parallel group size (default: world)")
    warmup: int = option(2, "steps left out of the timing medians")
    probe_steps: int = option(2, "extra steps measuring the all-to-all with no allreduce running")
    eval_batches: int = option(2, "held-out batches of the validation loss")
    corpus: str | None = option(None, "text file (default: the Python standard library's sources)")
    max_corpus_bytes: int = option(8 << 20, "bytes of the corpus read (0: the whole file)")
    timeline_step: int | None = option(None, "the step timeline.json holds (default: the last)")
    # gloo runs at most this many queued collectives at once (its default is 2)
    allreduce_threads: int | None = option(8, "gloo worker threads of the gradient-allreduce groups, all "
                                              "schedules (gloo's default: 2)")
    device: str = option("auto", "auto: CUDA when every local rank has its own GPU, else the CPU",
                         choices=DEVICE_CHOICES)
    dtype: str = option("float32", "compute (autocast) and all-to-all row dtype; parameters stay float32",
                        choices=DTYPES)
    checkpoint_every: int = option(0, "--impl commsched: write OUT/checkpoint-rank{r}.pt every K steps and "
                                      "after the last (0: never)")
    fallback_exchange: bool = option(True, "lina, lina-overlap: the probe's fallback steps (and every step "
                                           "once it chose the fallback) run fifo's exchange as well as "
                                           "fifo's launching: the MoE all-to-all in one chunk, not pipelined, "
                                           "the reduction in fifo's buckets; that changes the loss's last "
                                           "bits, so a run's bits follow the measured decision "
                                           "(--no-fallback-exchange: only the launching falls back, and the "
                                           "bits never depend on the decision)")
    grad_bits: int = option(32, "--impl commsched: width of the gradient reduction's messages: 32 exact; "
                                "16 bfloat16; 8/4/2 the shared codec's stochastic row records "
                                "(docs/moe.md, \"Compressed gradient reduction\")", choices=GRAD_BITS)
    compute: str = option("real", "real: compute on this machine; emulated: every compute step of the model on an "
                                  "emulated GPU (--device-model, --dilation), the host asleep, the communication "
                                  "real (docs/moe.md, \"Emulated device\")", choices=COMPUTES)
    device_model: str = option("a100", "--compute emulated: the GPU, a built-in model (a100, h100, h200) or a "
                                       "model file (JSON)")
    dilation: float = option(1.0, "--compute emulated: time dilation k, every device time multiplied by k "
                                  "(the links are slowed by the same k outside; predicted time = measured / k)")
    grad_batch_bytes: int = option(DEFAULT_BATCH_BYTES, "--grad-bits 16/8/4/2: launches the ranks all hold "
                                   "queued are summed together, up to this many bytes, in one pair of "
                                   "collectives (the same bits; 0: one sum per launch)")

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        if self.ep_size is not None and self.ep_size < 1:
            raise ValueError(f"--ep-size must be >= 1, got {self.ep_size}")
        if self.probe_steps < 0 or self.eval_batches < 0:
            raise ValueError(f"--probe-steps and --eval-batches must be >= 0, got {self.probe_steps}, "
                             f"{self.eval_batches}")
        if self.max_corpus_bytes < 0:
            raise ValueError(f"--max-corpus-bytes must be >= 0 (0: the whole file), got {self.max_corpus_bytes}")
        if self.timeline_step is not None and not 0 <= self.timeline_step < self.steps:
            raise ValueError(f"--timeline-step {self.timeline_step} must be in 0..steps-1 ({self.steps - 1})")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup={self.warmup} must be in 0..steps-1 ({self.steps - 1})")
        if self.allreduce_threads is not None and self.allreduce_threads < 1:
            raise ValueError(f"--allreduce-threads must be >= 1, got {self.allreduce_threads}")
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"--device must be one of {DEVICE_CHOICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) \
                or self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be an integer >= 0, got {self.checkpoint_every!r}")
        if self.schedule.hier_reduce and self.impl != "commsched":
            raise ValueError("--hier-reduce is an option of --impl commsched (DeepSpeed reduces its own way)")
        if self.dispatch.a2a_bits != 32 and self.impl != "commsched":
            raise ValueError(f"--a2a-bits {self.dispatch.a2a_bits} is an option of --impl commsched (DeepSpeed's "
                             "MoE layer runs its own all-to-all); use --a2a-bits 32 with --impl deepspeed")
        if self.grad_bits != 32 and self.impl != "commsched":
            raise ValueError(f"--grad-bits {self.grad_bits} is an option of --impl commsched (DeepSpeed "
                             "reduces its own way); use --grad-bits 32 with --impl deepspeed")
        if isinstance(self.grad_batch_bytes, bool) or not isinstance(self.grad_batch_bytes, int) \
                or self.grad_batch_bytes < 0:
            raise ValueError(f"--grad-batch-bytes must be an integer >= 0 (0: one sum per launch), "
                             f"got {self.grad_batch_bytes!r}")
        if self.compute not in COMPUTES:
            raise ValueError(f"--compute must be one of {COMPUTES}, got {self.compute!r}")
        if not (isinstance(self.dilation, (int, float)) and not isinstance(self.dilation, bool)
                and math.isfinite(self.dilation) and self.dilation > 0):
            raise ValueError(f"--dilation must be a finite number > 0, got {self.dilation!r}")
        if self.compute == "emulated":
            if self.impl != "commsched":
                raise ValueError("--compute emulated runs --impl commsched only: DeepSpeed's engine and MoE layer "
                                 "compute on real tensors and cannot be put on the emulated device")
            if self.device == "cuda":
                raise ValueError("--compute emulated is a GPU emulated on the CPU: use --device cpu (or auto)")
            if self.checkpoint_every:
                raise ValueError("--checkpoint-every: an emulated run has no weights to save (--compute emulated)")
            load_device_model(self.device_model)  # an unknown name or a bad file, before any work
        elif self.device_model != "a100" or self.dilation != 1.0:  # not silently ignored
            raise ValueError("--device-model and --dilation are options of --compute emulated")
        if self.checkpoint_every and self.impl != "commsched":
            raise ValueError("--checkpoint-every is an option of --impl commsched; DeepSpeed's runs "
                             "are not checkpointed here")

    @property
    def emulated(self) -> bool:
        return self.compute == "emulated"

    @property
    def run_device(self) -> str:
        """The device choice the ranks run on: the CPU for the emulated device, else ``device``."""
        return "cpu" if self.emulated else self.device

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def timeline_at(self) -> int:
        """The step whose operations ``timeline.json`` holds: ``timeline_step``, else the
        last step -- under ``lina-overlap`` the one before it, whose reduction runs into the
        next step's forward pass (the last step's waits for everything)."""
        if self.timeline_step is not None:
            return self.timeline_step
        overlapped = isinstance(self.schedule.build(), OverlapPolicy)
        return self.steps - 2 if overlapped and self.steps > 1 else self.steps - 1


@dataclass(frozen=True)
class TrainMetrics(Record):
    """``metrics.json`` of an MoE training run (the keys are described in the module
    docstring); ``extra``: ``deepspeed_comm_ops`` of a DeepSpeed run, ``resumed_from_step``
    of a resumed run (the steps before it, their losses and timings, come from the
    checkpoint)."""

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


def a2a_row_bytes(cfg: TrainConfig) -> tuple[int, int, int, int]:
    """Bytes on the wire of one token row in each of an MoE layer's four exchanges: (dispatch,
    combine, combine's backward, dispatch's backward), at ``cfg.dispatch.a2a_bits``: rows of
    D elements of ``cfg.dtype`` at 32; bfloat16 at 16 (or ``cfg.dtype`` if narrower); at 8
    the two towards the experts are row records (D + 8 bytes:
    :func:`commsched.quant.wire.record_bytes`), the others bfloat16."""
    from ...quant.wire import record_bytes

    D = cfg.model.d_model
    esize = torch.empty((), dtype=cfg.torch_dtype).element_size()
    bits = cfg.dispatch.a2a_bits
    if bits == 32:
        return (D * esize,) * 4
    half = D * min(esize, 2)
    if bits == 16:
        return (half,) * 4
    q = record_bytes(D, 8)
    return (q, half, q, half)


def a2a_payload_bytes(cfg: TrainConfig) -> int:
    """Bytes of token rows one rank hands the expert all-to-alls per step: every MoE layer
    exchanges each of its T * k rows four times (dispatch and combine, forward and
    backward), each at its width on the wire (:func:`a2a_row_bytes`)."""
    T = cfg.batch_size * cfg.model.seq_len
    n_moe = sum(1 for i in range(cfg.model.n_layers) if cfg.model.is_moe(i))
    return n_moe * T * cfg.model.k * sum(a2a_row_bytes(cfg))


def autocast(cfg: TrainConfig, device: torch.device):
    """The compute-dtype context of a forward pass: nothing for float32 (today's maths, bit
    for bit), ``torch.autocast`` to ``cfg.dtype`` otherwise."""
    if cfg.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=cfg.torch_dtype)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on ``device``: unchanged on the CPU; on CUDA pinned, then copied
    asynchronously (the copy overlaps whatever the device is still running)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def sizes(model, cfg: TrainConfig) -> dict:
    """Parameter counts and per-step byte figures of one rank's model."""
    expert = sum(p.numel() for p in model.parameters() if is_expert_param(p))
    dense = sum(p.numel() for p in model.parameters() if not is_expert_param(p))
    return {"expert_params_here": expert, "non_expert_params": dense,
            "non_expert_grad_bytes": dense * 4,
            "a2a_payload_bytes_per_step": a2a_payload_bytes(cfg)}


def evaluate(model, corpus: Corpus, cfg: TrainConfig, device: torch.device | None = None) -> float | None:
    """Mean cross-entropy of ``model`` (called as ``model(tokens) -> (logits, aux)``: the
    model or DeepSpeed's engine) on ``cfg.eval_batches`` held-out batches of this rank, on
    ``device`` (default: the CPU) in ``cfg.dtype``; None when ``eval_batches`` is 0."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if cfg.eval_batches < 1:
        return None
    rank = dist.get_rank()
    losses = []
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            x, y = corpus.batch(cfg.batch_size, cfg.model.seq_len, seed=cfg.seed, step=i, rank=rank, split="val")
            x, y = to_device(x, device), to_device(y, device)
            with autocast(cfg, device):
                logits, _ = model(x)
            losses.append(float(torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                                  y.reshape(-1))))
    return sum(losses) / len(losses)


# --------------------------------------------------------------------------- summary
def loss_guard(cfg: TrainConfig, bar: Any, rank: int) -> Callable[[int, float | None], None]:
    """The divergence guard of a training loop, either implementation: call it after step k
    (1-based) with this rank's loss (None: none computed, on every rank). The loss is
    averaged over the ranks (one small all-reduce; non-finite on any rank, non-finite), so a
    diverged run (the loss NaN or infinite) warns once on rank 0 through ``bar`` and stops
    with :class:`commsched.results.DivergedError` on every rank at the same step."""
    guard = DivergenceGuard("step", say=(lambda m: bar.write(f"commsched: {m}")) if rank == 0 else None,
                            hint=f"lower --lr (now {cfg.lr:g})")

    def check_loss(step: int, loss: float | None) -> None:
        if loss is not None:  # the emulated device computes no loss
            t = torch.tensor([loss], dtype=torch.float64, device=control_device())
            with comm_guard(f"allreduce of the loss of step {step}"):
                dist.all_reduce(t)
            loss = float(t.item()) / dist.get_world_size()
        guard.check(step, loss)

    return check_loss


def summarize(cfg: TrainConfig, per_rank: list[dict], ep: int, source: str) -> TrainMetrics:
    """The metrics of a run from every rank's results (in rank order)."""
    world = len(per_rank)
    steps = len(per_rank[0]["rows"])
    timed = range(cfg.warmup, steps)

    def col(key: str, agg) -> list[float]:
        """Per step, ``agg`` over the ranks of ``key`` (None for a rank whose row lacks it: a
        step whose reduction ran into a schedule change has no communication figures)."""
        return [agg([per_rank[r]["rows"][s].get(key) for r in range(world)]) for s in range(steps)]

    def mean(xs):
        """The mean of the numbers (None where a rank did not measure: the DeepSpeed baseline's
        unprofiled CUDA steps); None when none did."""
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    step_max = col("step_s", max)
    keys = ("fwd_s", "bwd_s", "a2a_s", "a2a_inflight_s", "allreduce_s", "allreduce_wait_s", "loss", "allreduce_in_bwd")
    per = {k: col(k, mean) for k in keys if k in per_rank[0]["rows"][0]}
    alone = [mean([per_rank[r]["a2a_alone_s"][i] for r in range(world)])
             for i in range(len(per_rank[0]["a2a_alone_s"]))]
    vals = [p["val_loss"] for p in per_rank if p["val_loss"] is not None]
    step_time = median([step_max[s] for s in timed])
    a2a = median([per["a2a_s"][s] for s in timed])
    comm_from = None
    allreduce = median([per["allreduce_s"][s] for s in timed])
    if a2a is None and allreduce is None and any(per["a2a_s"][s] is not None for s in range(steps)):
        # DeepSpeed on CUDA: its comms logger (which synchronises after every collective) was
        # on for the warm-up steps only; their communication times stand in for the timed ones
        profiled = [s for s in range(steps) if per["a2a_s"][s] is not None]
        a2a = median([per["a2a_s"][s] for s in profiled])
        allreduce = median([per["allreduce_s"][s] for s in profiled])
        comm_from = (f"steps {profiled} (warm-up, DeepSpeed's comms logger on: it synchronises after every "
                     "collective, so the timed steps ran without it)")
    fwd, bwd = median([per["fwd_s"][s] for s in timed]), median([per["bwd_s"][s] for s in timed])
    wait = median([per["allreduce_wait_s"][s] for s in timed])
    breakdown = {"forward": fwd, "backward": bwd, "allreduce_wait": wait,
                 "optimizer_and_other": max(0.0, step_time - fwd - bwd - wait)}
    return TrainMetrics(
        impl=cfg.impl,
        schedule=cfg.schedule.name if cfg.impl == "commsched" else f"deepspeed-zero{cfg.deepspeed.stage}",
        world_size=world,
        ep_size=ep,
        loss=per["loss"],
        val_loss=mean(vals) if vals else None,
        step_time_s=step_time,
        a2a_time_s=a2a,
        a2a_inflight_s=median([per["a2a_inflight_s"][s] for s in timed]),
        allreduce_time_s=allreduce,
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
        timeline_step=cfg.timeline_at,
        sizes=per_rank[0]["sizes"],
        corpus=source,
        wall_clock_s=max(p["wall_clock_s"] for p in per_rank),
        config=json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
        extra={**({"emulation": _emulation_summary(cfg, per_rank, step_time)} if cfg.emulated else {}),
               **_contention(per_rank),
               **({"deepspeed_comm_ops": per_rank[0]["ds_comm_ops"]} if "ds_comm_ops" in per_rank[0] else {}),
               **({"comm_times_from": comm_from} if comm_from is not None else {}),
               **({"resumed_from_step": per_rank[0]["resumed_from_step"]}
                  if per_rank[0].get("resumed_from_step") is not None else {})},
    )


def _contention(per_rank: list[dict]) -> dict:
    """``a2a_contention`` of ``metrics.json``: the timeline step's exchanges that ran beside an
    allreduce for at least half their time, each against the same exchange with no allreduce
    running (:func:`~commsched.priority.runtime.records.contended_slowdowns`), over every
    rank: the median and the largest slowdown and how many exchanges; absent when none did."""
    xs = sorted(x for p in per_rank for x in p.get("a2a_slowdowns") or ())
    if not xs:
        return {}
    return {"a2a_contention": {"median": median(xs), "max": xs[-1], "exchanges": len(xs)}}


def _emulation_summary(cfg: TrainConfig, per_rank: list[dict], step_time_s: float | None) -> dict:
    """The ``emulation`` entry of ``metrics.json`` (``--compute emulated``) from every rank's
    ``emulation`` result (:mod:`commsched.moe.train.emulated`)."""
    em = [p["emulation"] for p in per_rank]
    k = cfg.dilation
    return {
        "device_model": load_device_model(cfg.device_model).name,
        "device_model_source": cfg.device_model,
        "dilation": k,
        "host_cpu_share": [e["host_cpu_share"] for e in em],
        "device_busy_s_per_step": [e["device_busy_s_per_step"] for e in em],
        "device_busy_share": [e["device_busy_s_per_step"] / step_time_s if step_time_s else None for e in em],
        "predicted_step_time_s": step_time_s / k if step_time_s is not None else None,
        "rows_exchanged_per_step": [e["rows_exchanged_per_step"] for e in em],
        "peak_rss_mib": [e["peak_rss_mib"] for e in em],
        "startup_s": max(e["startup_s"] for e in em),
        "kernels_per_step": [e["kernels_per_step"] for e in em],
        "host_cpu_share_total": sum(e["host_cpu_share"] for e in em),
        **({"grad_wire_bytes_per_step": [e["grad_wire_bytes_per_step"] for e in em]}
           if "grad_wire_bytes_per_step" in em[0] else {}),
    }


__all__ = ["COMPUTES", "DTYPES", "DeepSpeedConfig", "FOREIGN_IMPL", "IMPLS", "TrainConfig", "TrainMetrics", "a2a_payload_bytes", "a2a_row_bytes", "autocast", "loss_guard",
           "evaluate", "sizes", "summarize", "to_device"]
