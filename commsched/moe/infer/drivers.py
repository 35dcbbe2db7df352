"""The drivers of an inference run (:mod:`commsched.moe.infer`): what feeds the batches to
the runtime, and what a rank builds before inference (:func:`build`).

Legend: N ranks (= devices), E experts, L MoE layers, k experts per token, S slots, T tokens
on a rank, D row width, B sequences.

A driver (a :class:`Driver` subclass, by name in :data:`DRIVER_CLASSES`) knows the run's
sizes (``E``, ``L``, ``k``), the profile the placement strategy plans from (``profile``),
the experts' bank (:meth:`Driver.make_bank`), and per batch this rank's inputs
(:meth:`Driver.batch`) and the forward pass over them (:meth:`Driver.forward`):

* :class:`TraceDriver` (``--driver trace``) replays a routing trace with synthetic hidden
  states through :func:`~commsched.moe.infer.runtime.trace_forward`; its experts are an emulated
  device or real FFNs (``--compute``).
* :class:`ModelDriver` (``--driver model``) runs a trained MoE language model on held-out
  text through :func:`~commsched.moe.infer.runtime.model_forward`, with the model's own experts.

A new driver is one subclass and one entry in :data:`DRIVER_CLASSES` (and its computes in
:data:`~commsched.moe.infer.config.DRIVER_COMPUTES`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..record.traces import RoutingTrace, load_trace, synthetic_trace
from .banks import EmulatedBank, ExpertBank, FFNBank
from .config import DEFAULT_LOAD_MS, InferConfig, ModelDriverConfig, TraceDriverConfig
from .policy import default_slots
from .runtime import model_forward, model_weights, trace_forward


class Driver(ABC):
    """What the runtime needs of a driver: the sizes ``E``, ``L``, ``k``; the ``profile``
    (a routing trace of past traffic, or None when the strategy needs none and the driver
    has none); ``model`` (the language model, or None); ``row_width`` D (floats per row on
    the wire); the experts' bank; and per batch this rank's inputs and their forward pass."""

    name: ClassVar[str]
    E: int
    L: int
    k: int
    profile: RoutingTrace | None
    model: Any = None

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: InferConfig, world: int, needs_profile: bool,
                    device: torch.device) -> Driver:
        """The driver of run ``cfg`` in a world of ``world`` ranks; ``needs_profile``: the
        strategy plans from a historical load; ``device``: where this rank computes."""

    @property
    @abstractmethod
    def row_width(self) -> int:
        """D: the floats of one row on the wire (float32 rows of the model width)."""

    @abstractmethod
    def make_bank(self, cfg: InferConfig, slots: int, device: torch.device) -> ExpertBank:
        """The experts, S = ``slots`` of each layer resident on ``device`` at a time."""

    @abstractmethod
    def batch(self, b: int, rank: int, device: torch.device) -> tuple[tuple[torch.Tensor, ...], int]:
        """(inputs, T): this rank's inputs of batch b on ``device``, and its tokens."""

    @abstractmethod
    def forward(self, inputs: tuple[torch.Tensor, ...], moe) -> torch.Tensor:
        """The forward pass over :meth:`batch`'s inputs, MoE layer j computed by
        ``moe(j, h_TD, expert_TK, gate_TK, keep_TK)``."""


def _even_split(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class TraceDriver(Driver):
    """``batches`` batches of a routing trace (after its profiling part), each split over
    the ranks by whole sequences."""

    name = "trace"

    def __init__(self, cfg: TraceDriverConfig, batches: int, seed: int, world: int):
        self.cfg = cfg
        trace = load_trace(cfg.path) if cfg.path else synthetic_trace(cfg.synthetic, seed)
        self.trace = trace
        self.profile, test = trace.split(cfg.profile_fraction)
        self.batches = test.batches(cfg.tokens_per_batch)
        if len(self.batches) < batches:
            raise ValueError(f"the held-out part of the trace has {len(self.batches)} batches of "
                             f">= {cfg.tokens_per_batch} tokens, fewer than --batches {batches}: "
                             "use a longer trace, a smaller --tokens-per-batch or fewer --batches")
        self.batches = self.batches[:batches]
        self.world, self.seed = world, seed
        self.E, self.L, self.k = trace.num_experts, trace.num_layers, trace.k

    @classmethod
    def from_config(cls, cfg: InferConfig, world: int, needs_profile: bool,
                    device: torch.device) -> TraceDriver:
        return cls(cfg.trace, cfg.batches, cfg.seed, world)

    @property
    def row_width(self) -> int:
        return self.cfg.d_model

    def make_bank(self, cfg: InferConfig, slots: int, device: torch.device) -> ExpertBank:
        """The emulated device (``--compute emulated``), or real FFNs of seeded random weights."""
        E, L, tc = self.E, self.L, self.cfg
        if cfg.compute == "emulated":
            em = cfg.emulation
            gpu = em.gpu()
            load_ms = em.load_ms if em.load_ms is not None or gpu is not None else DEFAULT_LOAD_MS
            return EmulatedBank(L, E, tc.d_model, slots, em.us_per_row, load_ms, cfg.seed, device=device,
                                device_model=gpu, dilation=em.dilation, hidden=tc.expert_hidden)
        g = torch.Generator().manual_seed(cfg.seed + 104729)
        D, H = tc.d_model, tc.expert_hidden
        weights = [(torch.randn(E, D, H, generator=g) * D ** -0.5, torch.zeros(E, H),
                    torch.randn(E, H, D, generator=g) * H ** -0.5, torch.zeros(E, D)) for _ in range(L)]
        return FFNBank(weights, slots, device=device)

    def shard(self, b: int, rank: int) -> RoutingTrace:
        tr = self.batches[b]
        bounds = tr.sequence_bounds()
        q = len(bounds) - 1
        sizes = _even_split(q, self.world)
        lo = sum(sizes[:rank])
        return tr.select(slice(int(bounds[lo]), int(bounds[lo + sizes[rank]])))

    def inputs(self, b: int, rank: int, d: int, device: torch.device | str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_TD, expert_TLK, gate_TK) of this rank's share of batch b, on ``device``
        (default: the CPU). Drawn from a seeded CPU generator and moved in one copy each,
        so every device serves the same numbers."""
        sh = self.shard(b, rank)
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + b) * 1009 + rank)
        x = torch.randn(sh.num_tokens, d, generator=g)
        gate = torch.rand(sh.num_tokens, sh.k, generator=g) + 0.5
        gate = gate / gate.sum(dim=1, keepdim=True)
        ex = torch.from_numpy(sh.experts)
        if device is not None and torch.device(device).type != "cpu":
            x, ex, gate = (t.to(device) for t in (x, ex, gate))
        return x, ex, gate

    def batch(self, b: int, rank: int, device: torch.device) -> tuple[tuple[torch.Tensor, ...], int]:
        x, ex, gate = self.inputs(b, rank, self.cfg.d_model, device)
        return (x, ex, gate), x.shape[0]

    def forward(self, inputs: tuple[torch.Tensor, ...], moe) -> torch.Tensor:
        x, ex, gate = inputs
        return trace_forward(x, ex, gate, moe)


class ModelDriver(Driver):
    """A trained MoE language model (``--checkpoint``) on the held-out split of the corpus:
    ``batch_size`` sequences per rank per batch; the profile a recorded trace
    (``profile_trace``), else (a strategy that needs one) ``profile_tokens`` tokens of the
    training split recorded at start-up, on the CPU. The bank holds the model's own experts
    (its host copies: the CPU model's weights); the model then moves to ``device``."""

    name = "model"

    def __init__(self, cfg: ModelDriverConfig, seed: int, needs_profile: bool,
                 device: torch.device | str = "cpu"):
        from ..model.checkpoint import load_checkpoint
        from ..model.data import load_corpus
        from ..record.recorder import record_trace

        if cfg.checkpoint is None:
            raise ValueError("--driver model needs --checkpoint (write one with python -m commsched.moe.record "
                             "--train-steps N --save-checkpoint FILE)")
        device = torch.device(device)
        model, _ = load_checkpoint(cfg.checkpoint)
        model = model.eval()
        self.cfg, self.seed = cfg, seed
        self.E, self.k = model.cfg.num_experts, model.cfg.k
        self.L = len(model.moe_layers())
        self._host_weights = model_weights(model)  # before the model moves: the bank's host copies
        self.corpus = load_corpus(cfg.corpus)
        E, L, k = self.E, self.L, self.k
        if cfg.profile_trace:
            profile = load_trace(cfg.profile_trace)
        elif needs_profile:
            profile = record_trace(model, self.corpus, cfg.profile_tokens, split="train", seed=seed + 1)
        else:
            profile = None
        if profile is not None and (profile.num_experts, profile.num_layers, profile.k) != (E, L, k):
            raise ValueError(f"the profile trace has E={profile.num_experts}, L={profile.num_layers}, "
                             f"k={profile.k}; the model E={E}, L={L}, k={k}")
        self.profile = profile
        if device.type != "cpu":  # after the profile (recorded on the CPU, where the corpus is)
            model = model.to(device)
        self.model = model

    @classmethod
    def from_config(cls, cfg: InferConfig, world: int, needs_profile: bool,
                    device: torch.device) -> ModelDriver:
        return cls(cfg.model, cfg.seed, needs_profile, device)

    @property
    def row_width(self) -> int:
        return self.model.cfg.d_model

    def make_bank(self, cfg: InferConfig, slots: int, device: torch.device) -> ExpertBank:
        return FFNBank(self._host_weights, slots, device=device)

    def batch(self, b: int, rank: int, device: torch.device) -> tuple[tuple[torch.Tensor, ...], int]:
        tokens, _ = self.corpus.batch(self.cfg.batch_size, self.model.cfg.seq_len, seed=self.seed,
                                      step=b, rank=rank, split="val")
        tokens = tokens.to(device) if device.type != "cpu" else tokens
        return (tokens,), tokens.numel()

    def forward(self, inputs: tuple[torch.Tensor, ...], moe) -> torch.Tensor:
        (tokens,) = inputs
        return model_forward(self.model, tokens, moe)


# name (``--driver``) -> driver class
DRIVER_CLASSES: dict[str, type[Driver]] = {c.name: c for c in (TraceDriver, ModelDriver)}


@dataclass(frozen=True)
class Setup:
    """What a rank builds before inference, identically on every rank.

    driver: the run's :class:`Driver`; model: the language model (model driver, else
    None); bank: the experts, ``slots`` S of each layer per device in a placement and
    ``resident`` of each layer kept in a device's memory (the bank's slots). The placement
    strategy is built after them, from the row cost the bank measures
    (:func:`~commsched.moe.infer.loop.run`)."""

    driver: Driver
    model: Any
    bank: ExpertBank
    slots: int
    resident: int


def build(cfg: InferConfig, rank: int, world: int, device: torch.device | str = "cpu") -> Setup:
    """Everything a rank needs before the placement strategy (see :class:`Setup`), built
    identically on every rank; the bank's slots and the model on ``device`` (the expert
    weights' master copies stay in host memory)."""
    device = torch.device(device)
    drv = DRIVER_CLASSES[cfg.driver].from_config(cfg, world, cfg.strategy.strategy.needs_profile, device)
    S = cfg.slots or default_slots(drv.E, world)
    if cfg.resident is not None and cfg.resident < S:
        raise ValueError(f"--resident ({cfg.resident}) must be at least the slots per device ({S})")
    R = S if cfg.resident is None else max(S, min(cfg.resident, drv.E))  # more than E holds nothing more
    bank = drv.make_bank(cfg, R, device)
    if R >= drv.E:  # every expert fits: all loaded at start-up, as the strategy assumes
        for j in range(drv.L):
            bank.preload(j)
    return Setup(drv, drv.model, bank, S, R)


__all__ = ["Driver", "TraceDriver", "ModelDriver", "DRIVER_CLASSES", "Setup", "build"]
