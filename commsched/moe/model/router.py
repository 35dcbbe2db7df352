"""Top-k softmax gating with a load-balancing loss and optional capacity (token dropping).

Legend: T tokens (rows), D model width, E experts, K choices per token (k = 1 or 2).

The router is plain tensor code with no process group: every rank routes its own tokens.

* Gates: softmax over the E logits (in float32), the top-k probabilities are the gates;
  with k = 2 the two gates are renormalised to sum to 1 (GShard), with k = 1 the gate is
  the probability itself (Switch).
* Load-balancing loss (Switch / GShard): ``E * sum_e f_e * p_e`` with f_e the share of the
  T*K choices that went to expert e and p_e the mean router probability of e. It is 1 for a
  perfectly balanced router and grows as the routing concentrates.
* Capacity (optional): each expert takes at most ``capacity = max(min_capacity,
  ceil(capacity_factor * T * K / E))`` assignments. Seats are given in order of choice
  rank first (all first choices before any second choice), then token order; the
  assignments that find no seat are dropped (their gate becomes 0, the token goes through
  the residual path). ``capacity_factor=None`` is dropless: nothing is ever dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class RouterConfig:
    """How tokens pick experts. ``capacity_factor=None`` is dropless (the default)."""

    num_experts: int
    k: int = 1
    capacity_factor: float | None = None
    min_capacity: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"num_experts must be a positive integer, got {self.num_experts!r}")
        if self.k not in (1, 2):
            raise ValueError(f"k must be 1 or 2 (top-1 or top-2 gating), got {self.k!r}")
        if self.k > self.num_experts:
            raise ValueError(f"k={self.k} needs at least {self.k} experts, got {self.num_experts}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 or None (dropless), got {self.capacity_factor!r}")
        if self.min_capacity < 0:
            raise ValueError(f"min_capacity must be >= 0, got {self.min_capacity}")

    def capacity(self, num_tokens: int) -> int | None:
        """Seats per expert for ``num_tokens`` tokens; None when dropless."""
        if self.capacity_factor is None:
            return None
        need = math.ceil(self.capacity_factor * num_tokens * self.k / self.num_experts)
        return max(self.min_capacity, need)


@dataclass
class Routing:
    """The router's decision for T tokens.

    expert_TK: int64 expert of each choice; gate_TK: float32 weight of each choice (0 when
    dropped; differentiable w.r.t. the logits); keep_TK: bool, False for dropped choices;
    aux_loss: scalar load-balancing loss; probs_TE: the softmax probabilities.

    A router of one's own gives its top-k as ``Routing(expert_TK, gate_TK)``: every choice
    kept, no auxiliary loss or probabilities (what :func:`~commsched.moe.model.dispatch.sort_assignments`
    and the dispatch read are the first three).
    """

    expert_TK: torch.Tensor
    gate_TK: torch.Tensor
    keep_TK: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    probs_TE: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.expert_TK.dim() != 2 or self.gate_TK.shape != self.expert_TK.shape:
            raise ValueError(f"Routing needs expert_TK and gate_TK of one shape [tokens, k], got "
                             f"{list(self.expert_TK.shape)} and {list(self.gate_TK.shape)}")
        if self.expert_TK.dtype != torch.int64:
            raise ValueError(f"expert_TK must hold int64 expert ids, got {self.expert_TK.dtype}")
        if self.keep_TK is None:
            self.keep_TK = torch.ones_like(self.expert_TK, dtype=torch.bool)

    @property
    def num_dropped(self) -> int:
        return int((~self.keep_TK).sum())

    def expert_load(self, num_experts: int) -> torch.Tensor:
        """Kept assignments per expert, int64 [E]."""
        return torch.bincount(self.expert_TK[self.keep_TK], minlength=num_experts)


def load_balancing_loss(probs_TE: torch.Tensor, expert_TK: torch.Tensor) -> torch.Tensor:
    """``E * sum_e f_e * p_e`` (see the module docstring); differentiable through probs."""
    T, E = probs_TE.shape
    if T == 0:
        return probs_TE.sum() * 0.0
    counts_E = torch.bincount(expert_TK.reshape(-1), minlength=E).to(probs_TE.dtype)
    f_E = counts_E / expert_TK.numel()
    p_E = probs_TE.mean(dim=0)
    return E * torch.sum(f_E * p_E)


def capacity_keep(expert_TK: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """bool [T, K]: which choices find a seat (choice rank first, then token order)."""
    if capacity is None:
        return torch.ones_like(expert_TK, dtype=torch.bool)
    T, K = expert_TK.shape
    order_A = expert_TK.t().reshape(-1)  # choice-rank-major: all first choices, then second
    onehot_AE = F.one_hot(order_A, num_experts)
    seat_A = (torch.cumsum(onehot_AE, dim=0) * onehot_AE).sum(dim=1) - 1  # seat within its expert
    keep_A = seat_A < capacity
    return keep_A.reshape(K, T).t().contiguous()


def route_top_k(logits_TE: torch.Tensor, cfg: RouterConfig) -> Routing:
    """Route T tokens given their router logits [T, E] (any float dtype)."""
    if logits_TE.dim() != 2 or logits_TE.shape[1] != cfg.num_experts:
        raise ValueError(f"router logits must be [tokens, {cfg.num_experts}], got {tuple(logits_TE.shape)}")
    probs_TE = torch.softmax(logits_TE.float(), dim=-1)
    gate_TK, expert_TK = torch.topk(probs_TE, cfg.k, dim=-1)
    if cfg.k > 1:
        gate_TK = gate_TK / gate_TK.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(gate_TK.dtype).tiny)
    aux = load_balancing_loss(probs_TE, expert_TK)
    keep_TK = capacity_keep(expert_TK, cfg.num_experts, cfg.capacity(logits_TE.shape[0]))
    gate_TK = gate_TK * keep_TK.to(gate_TK.dtype)
    return Routing(expert_TK=expert_TK, gate_TK=gate_TK, keep_TK=keep_TK, aux_loss=aux, probs_TE=probs_TE)


class Router(nn.Module):
    """A linear gate (no bias) followed by :func:`route_top_k`."""

    def __init__(self, d_model: int, cfg: RouterConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, d_model))
        nn.init.normal_(self.weight, std=d_model ** -0.5)

    def forward(self, x_TD: torch.Tensor) -> Routing:
        return route_top_k(F.linear(x_TD, self.weight), self.cfg)


__all__ = ["Router", "RouterConfig", "Routing", "capacity_keep", "load_balancing_loss", "route_top_k"]
