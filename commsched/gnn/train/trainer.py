"""Full-graph training over partitions: one rank per part, parameters replicated.

Legend: n owned nodes of this rank, F input features, K classes, P ranks.

Each epoch: forward through the distributed model (halo exchanges inside the layers),
loss = sum of cross-entropy over this rank's training nodes / global training count,
backward (gradient exchanges inside the layers), the sum of every parameter gradient over
the ranks, then Adam: one :func:`~commsched.priority.step.make_grad_step` of
``TrainConfig.schedule`` (``--grad-schedule``, a name of
:data:`commsched.priority.policy.SCHEDULES`; default ``flat``, one fused allreduce after
the backward pass), as in MoE training, its scheduler on a process group of its own and
told of every backward halo exchange (under ``lina`` no micro-op is launched while one is
in flight: those are on the critical path, the allreduce is not). With ``grad_bits`` below
32 the sums travel compressed under every schedule
(:class:`commsched.quant.allreduce.CompressedLauncher`), the loss summed exactly beside
them; every replica applies bit-identical sums, so the replicas never drift apart (every
schedule's sums are the flat allreduce's: exact on 2 ranks, on more up to gloo's order of
addition). With one rank (no process group) the same code is the single-process reference.

Each training epoch and each evaluation is one pass with its own
:class:`~commsched.gnn.context.PassContext` (epoch, training flag, a fresh timer, byte
counters for training), handed to the model and the exchange; the trainer sets nothing
on them between passes.

**Device.** Everything a run touches per epoch lives on the run's device
(``TrainConfig.device``, resolved by :func:`commsched.dist.resolve_device`, or the
``device`` given to :class:`Trainer`): the model, features, labels, masks, the adjacency
blocks, the exchange's indices. Epoch times and the breakdown are taken with a
:class:`commsched.clock.Clock` of that device (CUDA events on CUDA, ``perf_counter`` on
the CPU).

**Compute.** ``compute="emulated"`` (``--compute emulated --device-model NAME|FILE
--dilation K``): the layers, the loss, Adam and the exchanges' own kernels are queued on
the rank's :class:`~commsched.cluster.device.DeviceClock` for their roofline time on the
device model (times K) instead of computed (:mod:`commsched.gnn.nn.emulated`); the host
sleeps where a real host waits for its GPU, and every exchange and the gradient
reduction move their real bytes. metrics.json gains ``emulated`` (:func:`emulated_report`).
``compute="real"`` (default) changes nothing.

**dtype.** ``float32`` (default) and ``float64`` are the dtype of everything.
``bfloat16`` is the mixed-precision full-precision baseline (``vanilla``, ``adaqp-p``,
``nocomm``, ``pipegcn``, ``bns`` only): parameters, optimizer, loss and the gradient allreduce stay float32;
the forward runs under ``torch.autocast(dtype=bfloat16)`` (linear layers in bf16); the
sparse aggregation runs in float32 (torch's CPU CSR product has no bf16 kernel); every
exchanged row, forward and backward, crosses the wire in bf16 (half of float32's bytes).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...agree import check_replicas, check_same_config, config_digest
from ...clock import Clock
from ...cluster.device import DeviceClock, HostCPU, load_device_model, peak_rss_mib
from ...comm.all2all import CommStats
from ...configurable import Config, option
from ...dist import DEVICE_CHOICES, RunGroups, all_gather_object, barrier, comm_guard, group_device
from ...priority.policy import SCHEDULES, FlatConfig, ScheduleConfig
from ...priority.runtime.buckets import LOCAL
from ...priority.step import GradStep, make_grad_step
from ...quant.allreduce import GRAD_BITS, CompressedLauncher, check_grad_bits
from ...quant.rowwire import format_seed
from ...results import (
    DIGESTS,
    DivergenceGuard,
    OutputError,
    Progress,
    load_torch_file,
    read_error,
    save_torch,
    tensor_digests,
    with_digests,
)
from ..context import PassContext
from ..exchange.halo import HaloExchange
from ..exchange.modes import MODES, AdaQPConfig, ExchangeConfig, recorded_options, resolve_config
from ..graph.partition import PartData
from ..nn.emulated import EmulatedCompute
from ..nn.layers import DistMessagePassing
from ..nn.models import LAYERS, FastLayer
from ..nn.pyg import DistGraph, _world, allreduce_grads
from ..timing import Breakdown
from .metrics import (
    GNNMetrics,
    auc_from_histograms,
    auc_histograms,
    bytes_by_class,
    emulated_report,
    summarize,
)

COMPUTE = ("real", "emulated")
# fields added after checkpoints were first written, with the value an older record means
_ADDED_FIELDS = {"compute": "real", "device_model": "a100", "dilation": 1.0}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
# dtypes run as mixed precision: float32 parameters, autocast compute, this dtype on the wire
MIXED_DTYPES = ("bfloat16",)
CHECKPOINT = "checkpoint.pt"
# config fields a resumed run may change
_RESUMABLE = ("epochs", "checkpoint_every", "eval_every", "device")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(Config):
    """Everything that shapes a training run (identical on every rank; checked at start).

    Defaults are AdaQP's (3 layers, hidden 256, dropout 0.5, LayerNorm, Adam lr 0.01).
    ``mode`` names the exchange (a key of :data:`commsched.gnn.exchange.modes.MODES`) and
    ``exchange`` holds its config, the mode's options (default: the mode's defaults;
    another mode's config gives the fields the mode has; one the mode lacks that declares
    its refusal, ``--bits``, ``--stale-*``, ``--boundary-rate``, set to other than its
    default is refused: :func:`commsched.gnn.exchange.modes.mode_config`; a config of a mode no
    registry holds trains under the name ``mode``). ``model``: a key of
    :data:`commsched.gnn.nn.models.LAYERS`.
    ``dropout_rng="node"`` draws dropout masks per global node id so N-rank training
    equals single-process training; ``"local"`` is faster but rank-count dependent.
    ``device``: one of :data:`commsched.dist.DEVICE_CHOICES` (``auto``: CUDA when every
    local rank has its own GPU); the library default is the CPU, ``--device`` defaults to
    ``auto``. ``dtype``: see the module doc (``bfloat16``: the mixed-precision baseline of
    the full-precision modes). ``compute``, ``device_model``, ``dilation``: see the module
    doc ("Compute"). The field metadata are the command line's flags
    (:func:`commsched.configurable.add_arguments`).
    """

    model: str = option("gcn", "layer kind", choices=LAYERS)
    mode: str = option("vanilla", "exchange mode (adaqp re-solves its widths every --period epochs, "
                                  f"default {AdaQPConfig.period}, and sends 8 bits until the first: "
                                  f"half of a {2 * AdaQPConfig.period}-epoch run)")
    layers: int = option(3, "layers")
    hidden: int = option(256, "hidden width")
    dropout: float = option(0.5, "dropout probability")
    layer_norm: bool = option(True, "LayerNorm between layers")
    lr: float = option(0.01, "Adam learning rate")
    weight_decay: float = option(0.0, "Adam weight decay")
    epochs: int = option(100, "training epochs")
    seed: int = option(0, "parameter init and dropout seed")
    dtype: str = option("float32", "float32, float64: the dtype of everything; bfloat16 (the "
                        "full-precision modes): float32 parameters and loss, bf16 autocast "
                        "compute, bf16 rows on the wire (docs/gnn.md)", choices=tuple(DTYPES))
    pattern: str = option("direct", "all_to_all pattern of the halo exchange",
                          choices=("direct", "ring"))
    dropout_rng: str = option("node", "node: masks keyed by global node id (N ranks == 1 rank); "
                              "local: faster", choices=("node", "local"))
    eval_every: int = option(1, "epochs between evaluations")
    checkpoint_every: int = option(0, "write OUT/checkpoint.pt every K epochs (0: never)")
    exchange: ExchangeConfig | None = option(None, cli=False)
    schedule: ScheduleConfig = option(default_factory=FlatConfig, cli=False)
    grad_bits: int = option(32, "width of the gradient reduction's messages, every schedule: 32 exact; 16 "
                            "bfloat16; 8/4/2 the codec's stochastic row records (docs/gnn.md, \"Compressed "
                            "gradient allreduce\")", choices=GRAD_BITS)
    device: str = option("cpu", "auto: CUDA when every local rank has its own GPU, else the CPU",
                         choices=DEVICE_CHOICES)
    compute: str = option("real", "real: the ranks compute; emulated: every kernel occupies an emulated "
                          "GPU (--device-model) for its roofline time x --dilation while the host sleeps, "
                          "the communication real (docs/gnn.md, \"Emulated compute\")", choices=COMPUTE)
    device_model: str = option("a100", "--compute emulated: the GPU, a built-in model (a100, h100, h200) "
                               "or a model file (JSON)")
    dilation: float = option(1.0, "--compute emulated: time dilation k (every device time x k; the "
                             "predicted time on the real cluster is the measured time / k)")

    def __post_init__(self) -> None:
        ex = self.exchange
        # a mode no registry holds trains from its config (a test's, an experiment's)
        if self.mode not in MODES and not isinstance(ex, ExchangeConfig):
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if ex is not None and not dataclasses.is_dataclass(ex):
            raise TypeError(f"exchange must be an ExchangeConfig (MODES[{self.mode!r}]), got "
                            f"{type(ex).__name__}")
        object.__setattr__(self, "exchange", resolve_config(self.mode, ex))
        self.exchange.check_run(self.mode, pattern=self.pattern, mixed=self.dtype in MIXED_DTYPES)
        if self.epochs < 1 or self.layers < 1 or self.hidden < 1:
            raise ValueError(f"--epochs, --layers and --hidden must be >= 1, got {self.epochs}, "
                             f"{self.layers}, {self.hidden}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.eval_every < 1 or self.checkpoint_every < 0:
            raise ValueError("eval_every must be >= 1 and checkpoint_every >= 0")
        if not isinstance(self.schedule, ScheduleConfig):
            raise TypeError(f"schedule must be a config of SCHEDULES ({', '.join(SCHEDULES)}), got "
                            f"{type(self.schedule).__name__}")
        check_grad_bits(self.grad_bits, "--grad-bits")
        if self.dropout_rng not in ("node", "local"):
            raise ValueError(f"dropout_rng must be node or local, got {self.dropout_rng!r}")
        self._check_compute()

    def _check_compute(self) -> None:
        if self.compute not in COMPUTE:
            raise ValueError(f"--compute must be one of {', '.join(COMPUTE)}, got {self.compute!r}")
        if self.compute == "real":
            if self.device_model != "a100" or self.dilation != 1.0:
                raise ValueError("--device-model and --dilation are options of --compute emulated")
            return
        load_device_model(self.device_model)  # an unknown name or a bad file names the choices
        if not (self.dilation > 0 and math.isfinite(self.dilation)):
            raise ValueError(f"--dilation must be a finite number > 0, got {self.dilation}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--compute emulated models float32 or bfloat16 compute, not --dtype {self.dtype}")
        if not isinstance(LAYERS[self.model], FastLayer):
            raise ValueError(f"--compute emulated times commsched's own layers ({', '.join(emulated_models())}); "
                             f"--model {self.model} is not one of them")
        if self.device == "cuda":
            raise ValueError("--compute emulated runs on the CPU (the device is emulated): "
                             "use --device cpu or auto")

    @property
    def emulated(self) -> bool:
        """Whether the compute is emulated (``compute == "emulated"``)."""
        return self.compute == "emulated"

    def record(self) -> dict[str, Any]:
        """The config as metrics.json and checkpoints record it: every field (the exchange's
        config nested) and the option groups ``adaqp``, ``pipegcn``, ``bns`` at the top level
        as well (:func:`commsched.gnn.exchange.modes.recorded_options`: readers of records with that
        layout find them)."""
        return {**dataclasses.asdict(self), **recorded_options(self.exchange)}

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype named by ``dtype``."""
        return DTYPES[self.dtype]

    @property
    def mixed(self) -> bool:
        """Mixed precision: float32 parameters, autocast compute, ``torch_dtype`` on the wire."""
        return self.dtype in MIXED_DTYPES

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of parameters, features, blocks and optimizer state."""
        return torch.float32 if self.mixed else DTYPES[self.dtype]

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype exchanged rows cross the wire in, when it is not that of the rows."""
        return DTYPES[self.dtype] if self.mixed else None


def emulated_models() -> tuple[str, ...]:
    """The ``--model`` names that ``--compute emulated`` times (commsched's own layers)."""
    return tuple(k for k, v in LAYERS.items() if isinstance(v, FastLayer))


def _comparable(cfg: dict) -> dict:
    """The config entries a resumed run must share with its checkpoint: all but
    :data:`_RESUMABLE` and ``compile`` (compiled and uncompiled codecs give the same
    bits)."""
    out = {**_ADDED_FIELDS, **{k: v for k, v in cfg.items() if k not in _RESUMABLE}}
    for key in ("adaqp", "exchange"):
        if isinstance(out.get(key), dict):
            out[key] = {k: v for k, v in out[key].items() if k != "compile"}
    return out


def run_device(cfg: TrainConfig, group=None) -> torch.device:
    """The device of a run with ``cfg`` on ``group``: :func:`commsched.dist.group_device`
    of ``cfg.device`` (``auto`` stays on the CPU on a group without NCCL)."""
    return group_device(cfg.device, group)


class Trainer:
    """One rank's side of a training run on its :class:`PartData`, on ``device`` (default:
    :func:`run_device` of ``cfg``; a given ``exchange`` is moved there).

    The run is one stack: the part as a :class:`~commsched.gnn.nn.pyg.DistGraph`
    (``dgraph``: the mode's exchange, ``halo``; ``graph``: its :class:`LocalGraph`) and the
    model the layer registry builds over it (:data:`commsched.gnn.nn.models.LAYERS`:
    commsched's own fast-path layers or PyG layers through ``distributed``)."""

    def __init__(self, cfg: TrainConfig, part: PartData, *, group=None,
                 exchange: HaloExchange | None = None, device: torch.device | str | None = None):
        self.cfg = cfg
        self.part = part
        self.group = group
        self.rank, self.world = _world(group)
        if part.book.num_parts != self.world or part.book.rank != self.rank:
            raise ValueError(f"rank {self.rank} of {self.world} was given part {part.book.rank} of "
                             f"{part.book.num_parts}")
        if int(part.totals.get("train", 0)) < 1:  # global, so every rank stops here alike
            raise ValueError(f"graph {part.name}: no training nodes (every train mask entry is False); "
                             "give a graph or split with training nodes")
        # the ranks must agree before anything is built from the config: a different lr or
        # dropout would train silently apart, a different hidden/dtype/model fail in gloo
        check_same_config({**cfg.record(),
                           "partition": {"fingerprint": part.fingerprint, "num_parts": part.book.num_parts}},
                          group, what="training configuration")
        self.device = torch.device(device) if device is not None else run_device(cfg, group)
        if cfg.emulated and self.device.type != "cpu":
            raise ValueError(f"--compute emulated runs on the CPU (the device is emulated), not on {self.device}")
        self.clock = Clock(self.device)
        self.setup_s = 0.0  # seconds to build this trainer (run_training measures it)
        dev, dt = self.device, cfg.param_dtype
        # one stack: the part as a DistGraph (its exchange: the mode's config, or the given
        # one), the model from the layer registry over it (own fast-path layers or PyG ones)
        self.dgraph = DistGraph(part, mode=cfg.mode, config=cfg.exchange, group=group, device=dev,
                                dtype=dt, seed=cfg.seed, pattern=cfg.pattern, exchange=exchange,
                                wire_dtype=cfg.wire_dtype, dropout_rng=cfg.dropout_rng)
        self.model = LAYERS[cfg.model].build(self.dgraph, part.num_features, cfg.hidden,
                                             part.num_classes, layers=cfg.layers,
                                             dropout=cfg.dropout, layer_norm=cfg.layer_norm,
                                             seed=cfg.seed, dtype=dt).to(dev)
        # the quantized modes weigh messages by the model's edge normalisation
        self.halo = self.dgraph.halo
        self.graph = self.dgraph.local
        # --compute emulated: the layers and the exchange queue their kernels on one device clock
        self.emulated: EmulatedCompute | None = None
        if cfg.emulated:
            self.emulated = EmulatedCompute(DeviceClock(load_device_model(cfg.device_model), cfg.dilation),
                                            dtype=cfg.torch_dtype)
            self.graph.compute = self.halo.compute = self.emulated
        self._launcher: CompressedLauncher | None = None
        self._groups = RunGroups()
        self.grad_step = self._grad_step()
        self.last_schedule: dict | None = None  # the gradient scheduler's timings of the last epoch
        # the graph's rows on the device (one copy)
        self.x, self.y, self.masks = self.dgraph.x, self.dgraph.y, self.dgraph.masks
        self.totals = {k: max(int(part.totals[k]), 1) for k in ("train", "val", "test")}
        self._train_rows = int(self.masks["train"].sum())
        self.epoch = 0  # epochs completed
        self.history: dict[str, list] = {"loss": [], "epoch_time_s": [], "breakdown_s": [],
                                         "bytes_sent": [], "bytes_sent_P": [], "eval": []}
        if self.emulated is not None:  # per epoch: (host CPU s, wall s, device busy s)
            self.history["emulated"] = []
        # the ranks compared the config above; input width per layer
        self.dgraph.setup(row_numel=part.num_features, check=False,
                          dims=[part.num_features] + [cfg.hidden] * (cfg.layers - 1))
        # build the adjacency blocks now, not inside the first timed epoch
        for conv in self.model.convs:
            if isinstance(conv, DistMessagePassing):
                self.graph.blocks(conv.norm)
        if self.world > 1:
            # set-up (compiling the codec above all) takes different times on different
            # ranks; start the first timed epoch together, or its exchanges time the skew
            barrier("barrier after set-up", self.group)

    # -- one epoch ------------------------------------------------------------------------
    def _forward(self, ctx: PassContext) -> torch.Tensor:
        """Logits [n, K] of the owned nodes (float32 under mixed precision)."""
        if not self.cfg.mixed:
            return self.model(self.x, self.graph, ctx)
        with torch.autocast(self.device.type, dtype=self.cfg.torch_dtype):
            out = self.model(self.x, self.graph, ctx)
        return out.float()

    def _grad_step(self) -> GradStep:
        """The gradient reduction and Adam of ``cfg.schedule`` behind one step interface
        (:func:`~commsched.priority.step.make_grad_step`), open. Collective: its scheduler's
        process group is its own (the halo exchanges keep theirs, so the two never queue on
        one group in different orders on two ranks), made in a
        :class:`~commsched.dist.RunGroups` closed with the step (:meth:`close`); one rank
        reduces nothing."""
        own = LOCAL
        if self.world > 1:
            own = self._groups.new(list(range(self.world)) if self.group is None
                                   else [dist.get_global_rank(self.group, r) for r in range(self.world)],
                                   local=self.group is not None)  # a sub-group's run: its ranks only
            if self.cfg.grad_bits != 32:  # the sums compressed; the keys: the run's seed
                self._launcher = CompressedLauncher(self.cfg.grad_bits, seed=format_seed(self.cfg.seed, 0x64AD))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        # a sum (the loss is divided by the global training count)
        return make_grad_step(self.model, [(p, own, 1.0) for _, p in named], self.cfg.schedule,
                              lambda ps: torch.optim.Adam(ps, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay),
                              device=self.device, names=[n for n, _ in named], groups=self._groups,
                              run_group=self.group,
                              **({"launch": self._launcher} if self._launcher is not None else {})).open()

    def close(self) -> None:
        """Stop the gradient scheduler's thread (and the compressed sums' launcher), destroy
        its group."""
        self.grad_step.close()
        self._groups.close()
        if self._launcher is not None:
            self._launcher.close()
            self._launcher = None

    def train_epoch(self) -> float:
        """Run epoch ``self.epoch``; return the global training loss."""
        gs = self.grad_step
        ctx = PassContext(epoch=self.epoch, training=True, timer=Breakdown(self.clock),
                          stats=CommStats(self.world), events=gs.scheduler)
        self.model.train()
        emu = self.emulated
        cpu = HostCPU().__enter__() if emu is not None else None
        busy0 = emu.clock.busy_s if emu is not None else 0.0
        t0 = self.clock.mark()
        self.halo.begin_epoch(ctx)
        gs.before_forward()
        out = self._forward(ctx)
        m = self.masks["train"]
        if emu is not None:  # the loss kernels on the emulated device (its value: 0)
            loss = emu.loss(out, int(self._train_rows))
        else:
            loss = F.cross_entropy(out[m], self.y[m], reduction="sum") / self.totals["train"]
            # the whole output joins the graph so that every rank runs every backward exchange
            # (a rank without training nodes still forwards its peers' gradients); exact: + 0
            loss = loss + out.sum() * 0.0
        self._step_ended(gs.before_backward())
        loss.backward()
        # the reduction ran during the backward pass; what is left is waited for here
        # (lina-overlap: its tail runs on into the next forward pass, but for the last epoch)
        with ctx.timer.time("reduce"):
            self._step_ended(gs.after_backward(sync=self.epoch + 1 == self.cfg.epochs))
            if emu is not None:
                emu.sync()  # the host reads the loss
            loss_all = self._allreduce_loss(loss.detach())
        if emu is not None:  # Adam on the device, after the sums arrived; the epoch ends with it
            emu.optimizer([p for p in self.model.parameters() if p.requires_grad])
            emu.sync()
        self.halo.end_epoch(ctx)
        dt = self.clock.seconds(t0, self.clock.mark())
        if cpu is not None:
            cpu.__exit__(None, None, None)
            self.history["emulated"].append((cpu.cpu_s, cpu.wall_s, emu.clock.busy_s - busy0))
        self.history["loss"].append(loss_all)
        self.history["epoch_time_s"].append(dt)
        self.history["breakdown_s"].append(ctx.timer.as_dict())
        self.history["bytes_sent"].append(ctx.stats.total_bytes_sent)
        self.history["bytes_sent_P"].append(list(ctx.stats.bytes_sent))
        self.epoch += 1
        return loss_all

    def report(self) -> dict[str, Any]:
        """The trainer's own entries for metrics.json (none here; a subclass adds its own)."""
        return {}

    def _step_ended(self, timings: dict | None) -> None:
        if timings is not None:
            self.last_schedule = timings  # the gradient scheduler's timings of the last step that ended

    def _allreduce_loss(self, loss: torch.Tensor) -> float:
        if self.world == 1:
            return float(loss)
        total = loss.reshape(1).clone()
        with comm_guard("allreduce of the training loss", self.group):
            dist.all_reduce(total, group=self.group)
        return float(total)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Accuracy on the train / val / test nodes, and on a two-class graph their ROC AUC
        (``*_auc``, None for a split without both classes); no dropout, full-precision
        exchanges, untimed and uncounted traffic; collective (every parameter updated first)."""
        self._step_ended(self.grad_step.synchronize())
        ctx = PassContext(epoch=self.epoch - 1, training=False, timer=Breakdown(self.clock))
        self.model.eval()
        t0 = self.clock.mark()
        logits = self._forward(ctx)
        ok = logits.argmax(1) == self.y
        splits = ("train", "val", "test")
        # counted on the device, summed across ranks there, read once
        counts = torch.stack([(ok & self.masks[k]).sum() for k in splits]).double()
        binary = self.part.num_classes == 2
        if binary:  # and the ROC AUC histograms, in the same all-reduce
            hist = auc_histograms(torch.softmax(logits.float(), 1)[:, 1], self.y,
                                  [self.masks[k] for k in splits])
            counts = torch.cat([counts, hist.flatten()])
        if self.world > 1:
            with comm_guard("allreduce of accuracy counts", self.group):
                dist.all_reduce(counts, group=self.group)
        got = counts[:3].tolist()
        res = {f"{k}_acc": got[i] / self.totals[k] for i, k in enumerate(splits)}
        if binary:
            hist = counts[3:].view(len(splits), 2, -1).cpu()
            for i, k in enumerate(splits):
                res[f"{k}_auc"] = auc_from_histograms(hist[i, 0], hist[i, 1])
        res["epoch"] = self.epoch - 1
        res["eval_time_s"] = self.clock.seconds(t0, self.clock.mark())
        return res

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self, exchange: list[dict] | None = None) -> dict[str, Any]:
        """The checkpoint; ``exchange``: every rank's exchange state, in rank order
        (:meth:`exchange_states`; None: this rank's alone, a one-rank run's)."""
        if exchange is None:
            exchange = [self.halo.state_dict()] if self.world == 1 else None
        return {"config": self.cfg.record(), "epoch": self.epoch,
                "world_size": self.world, "fingerprint": self.part.fingerprint,
                "model": self.model.state_dict(), "optimizer": self.grad_step.state_dict(),
                "history": self.history, **({"grad_keys": self._launcher.state_dict()} if self._launcher else {}),
                **({"exchange": exchange} if exchange is not None else {})}

    def exchange_states(self) -> list[dict]:
        """Every rank's exchange state (:meth:`HaloExchange.state_dict`: rounding counters,
        residuals, stale rows, assignments), in rank order, on every rank (collective)."""
        mine = self.halo.state_dict()
        if self.world == 1:
            return [mine]
        return all_gather_object(mine, "gathering the exchanges' state for the checkpoint", self.group)

    def _load_exchange_state(self, states: Any) -> None:
        """Give this rank's exchange its state from the checkpoint; a problem on any rank is
        the same ValueError on every rank (collective)."""
        err = None
        try:
            if not isinstance(states, (list, tuple)) or len(states) != self.world:
                raise ValueError(f"it holds no exchange state for each of the {self.world} ranks")
            self.halo.load_state_dict(states[self.rank])
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            err = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
        errs = all_gather_object(err, "agreeing on the exchange state to resume from", self.group) if self.world > 1 else [err]
        bad = [(r, e) for r, e in enumerate(errs) if e]
        if bad:
            r, e = bad[0]
            raise ValueError(f"--resume: the checkpoint's exchange state does not fit this run "
                             f"(rank {r}: {e}); start without --resume or use the same options")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = _comparable(self.cfg.record())
        theirs = _comparable(state["config"])
        if config_digest(mine) != config_digest(theirs):
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            raise ValueError("--resume: the checkpoint was written by a run with a different "
                             f"configuration ({', '.join(f'{k}: {theirs.get(k)!r} -> {mine.get(k)!r}' for k in diff)})")
        if state["fingerprint"] != self.part.fingerprint or state["world_size"] != self.world:
            raise ValueError("--resume: the checkpoint belongs to another graph or world size")
        self.model.load_state_dict(state["model"])
        self.grad_step.load_state_dict(state["optimizer"])
        if self._launcher is not None:  # the compressed sums' rounding keys go on from the checkpoint's
            self._launcher.load_state_dict(state["grad_keys"])
        if "exchange" in state:  # and the exchange's own (a checkpoint without it: the exchange starts afresh)
            self._load_exchange_state(state["exchange"])
        self.epoch = int(state["epoch"])
        # loss and accuracy are global and carry over; timings cover this invocation only
        self.history["loss"] = list(state["history"]["loss"])
        self.history["eval"] = list(state["history"]["eval"])

    def save_checkpoint(self, path: Path) -> None:
        """Rank 0 writes (atomically, flushed, each tensor's digest: :func:`~commsched.results.with_digests`);
        every rank waits for the file and learns if it could not be written (one line on every rank)."""
        exchange = self.exchange_states()  # every rank's, written by rank 0
        err = None
        if self.rank == 0:
            try:
                save_torch(with_digests(self.state_dict(exchange)), path, what="checkpoint")
            except OutputError as e:
                err = str(e)
        if self.world > 1:
            err = all_gather_object(err, "agreeing that the checkpoint was written", self.group)[0]
        if err is not None:
            raise OutputError(err if self.rank == 0 else f"rank 0: {err}")


# --------------------------------------------------------------------------- a whole run
def run_training(cfg: TrainConfig, part: PartData, *, out_dir: str | os.PathLike | None = None,
                 resume: bool = False, group=None, progress: bool = False,
                 dataset: str | None = None, extra: dict | None = None,
                 on_epoch: Callable[[Trainer], None] | None = None,
                 exchange: HaloExchange | None = None,
                 device: torch.device | str | None = None,
                 hosts_P: Sequence[str] | None = None,
                 trainer: Callable[..., Trainer] | None = None) -> tuple[dict[str, Any], Trainer]:
    """Train ``cfg.epochs`` epochs (continuing from ``out_dir/checkpoint.pt`` when
    ``resume``; with ``cfg.checkpoint_every`` K > 0 it is written every K epochs and after
    the last one, whatever the epoch count); return (metrics, trainer), metrics being :class:`GNNMetrics` as the dict
    metrics.json holds. Rank 0 writes ``out_dir/metrics.json``. Collective: every rank of
    ``group`` calls it. ``device``: where to train (default: :func:`run_device`; the CLI
    passes the device ``init_distributed`` chose). ``hosts_P`` (the host of every rank)
    adds ``bytes_per_epoch_by_class``: the median over epochs of the bytes sent between
    ranks on one host (``intra``) and on different hosts (``inter``), all ranks summed.
    ``trainer``: makes the rank's trainer from (cfg, part, group=, exchange=, device=)
    (default :class:`Trainer`; a mode that samples mini-batches from the whole graph,
    ``cfg.exchange.sampled``, runs through
    :func:`commsched.gnn.train.minibatch.run_minibatch`, which passes its own)."""
    t_start = time.perf_counter()
    if trainer is None:
        if cfg.exchange.sampled:
            raise ValueError(f"--mode {cfg.mode} samples mini-batches from the whole graph, which "
                             "every rank holds: train it with commsched.gnn.train.minibatch."
                             "run_minibatch(cfg, part, graph=GRAPH, ...)")
        trainer = Trainer
    tr = trainer(cfg, part, group=group, exchange=exchange, device=device)
    tr.setup_s = time.perf_counter() - t_start
    try:
        return _run(tr, cfg, part, out_dir, resume, progress, dataset, extra, on_epoch, hosts_P, t_start)
    finally:
        tr.close()


def _run(tr: Trainer, cfg: TrainConfig, part: PartData, out_dir, resume: bool, progress: bool,
         dataset: str | None, extra: dict | None, on_epoch, hosts_P, t_start: float
         ) -> tuple[dict[str, Any], Trainer]:
    out = Path(out_dir) if out_dir is not None else None
    ckpt = out / CHECKPOINT if out is not None else None
    if out is not None and tr.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    if resume:
        if ckpt is None or not ckpt.is_file():
            raise ValueError(f"--resume: no checkpoint at {ckpt} (run with --checkpoint-every K first)")
        # a tensor whose bytes no longer match the digest written with it: a ValueError naming both
        state = load_torch_file(ckpt, "--resume: checkpoint", map_location=tr.device)
        if isinstance(state, dict) and DIGESTS not in state:
            print(f"commsched.gnn.train (rank {tr.rank}): --resume: {ckpt} was written without tensor "
                  "digests (an earlier commsched): loaded unchecked", file=sys.stderr, flush=True)
        try:
            tr.load_state_dict(state)
        except (KeyError, TypeError, RuntimeError, AttributeError) as e:
            raise ValueError(f"--resume: checkpoint {ckpt} does not fit this run (another model or "
                             f"configuration, or a damaged file: {read_error(e)}); start without "
                             "--resume or use the same options") from None
        # every rank holds a replica of the whole state: the ranks' copies must agree
        check_replicas(tensor_digests({"model": tr.model.state_dict(), "optimizer": tr.grad_step.state_dict()}),
                       f"--resume: the ranks' copies of {ckpt} disagree", group=tr.group)
    e0 = tr.epoch  # the first epoch this invocation trains (after a resume: not 0)
    with Progress(cfg.epochs, f"{cfg.mode} {cfg.model}", "epoch", enabled=progress and tr.rank == 0,
                  initial=min(tr.epoch, cfg.epochs)) as bar:
        # the loss is all-reduced: every rank warns (rank 0 aloud) and stops at the same epoch
        guard = DivergenceGuard("epoch", say=(lambda m: bar.write(f"commsched: {m}")) if tr.rank == 0 else None,
                                hint=f"lower --lr (now {cfg.lr:g})")
        while tr.epoch < cfg.epochs:
            loss = tr.train_epoch()
            guard.check(tr.epoch, loss)
            if tr.epoch % cfg.eval_every == 0 or tr.epoch == cfg.epochs:
                tr.history["eval"].append(tr.evaluate())
            # every K epochs, and the final state whatever the epoch count
            if ckpt is not None and cfg.checkpoint_every and (tr.epoch % cfg.checkpoint_every == 0
                                                               or tr.epoch == cfg.epochs):
                tr.save_checkpoint(ckpt)
            if on_epoch is not None:
                on_epoch(tr)
            ev = tr.history["eval"][-1] if tr.history["eval"] else {}
            bar.postfix(loss=f"{loss:.4f}", val=f"{ev.get('val_acc', 0):.3f}",
                        s=f"{tr.history['epoch_time_s'][-1]:.2f}")
            bar.update(1)
    mine = {k: tr.history[k] for k in ("epoch_time_s", "breakdown_s", "bytes_sent", "bytes_sent_P")}
    mine["peak_rss_mib"] = peak_rss_mib()
    mine["load_time_s"] = (extra or {}).get("load_time_s")  # this rank's wait for its part
    mine["book"] = tr.part.book.summary()
    if tr.emulated is not None:
        mine["emulated"] = tr.history["emulated"]
    per_rank = all_gather_object(mine, "gathering per-rank results", tr.group) if tr.world > 1 else [mine]
    # the exchange's entries, with what its work cost over this invocation (rank 0's wall clock)
    run = tr.halo.run_report(wall_s=time.perf_counter() - t_start, first_epoch=e0,
                             epoch_time_s_RE=[r["epoch_time_s"] for r in per_rank])
    extra = {**(extra or {}), **run, **tr.report(), "device": str(tr.device),
             "load_time_s_per_rank": [r.get("load_time_s") for r in per_rank]}
    if tr.emulated is not None:
        extra["emulated"] = emulated_report(cfg, tr.emulated.clock.model.name,
                                            [r["emulated"] for r in per_rank],
                                            [r["epoch_time_s"] for r in per_rank], setup_s=tr.setup_s)
    if hosts_P is not None and tr.world > 1:
        extra["bytes_per_epoch_by_class"] = bytes_by_class(
            [r["bytes_sent_P"] for r in per_rank], hosts_P)
    metrics: GNNMetrics = summarize(cfg, tr.history["loss"], tr.history["eval"], per_rank,
                                    world_size=tr.world, wall_s=time.perf_counter() - t_start,
                                    dataset=dataset or part.name, extra=extra)
    if out is not None and tr.rank == 0:
        metrics.write(out / "metrics.json", indent=1)
    return metrics.to_dict(), tr


__all__ = ["CHECKPOINT", "COMPUTE", "DTYPES", "MIXED_DTYPES", "TrainConfig", "Trainer", "allreduce_grads",
           "bytes_by_class", "emulated_models", "emulated_report", "peak_rss_mib", "run_device", "run_training"]
