"""Expert feed-forward networks, stored stacked, one slice of the global set per rank.

Legend: R rows, D model width, H expert hidden width, E experts in the layer, L experts
held here (a contiguous block ``first .. first + L - 1`` of the E).

Every rank draws the weights of all E experts from the same random stream and keeps only
its block, so the expert-parallel layer on P ranks holds exactly the experts that the
single-process (local) layer holds, and the random streams of all ranks stay in step.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPERT_ATTR = "_commsched_expert"  # set on expert parameters (not data-parallel over the EP group)


def is_expert_param(p: torch.Tensor) -> bool:
    """True for parameters owned by an expert (reduced over the expert-data-parallel group only)."""
    return bool(getattr(p, EXPERT_ATTR, False))


class ExpertFFN(nn.Module):
    """L experts, each ``gelu(x @ w1 + b1) @ w2 + b2``; w1 [L, D, H], b1 [L, H], w2 [L, H, D], b2 [L, D]."""

    def __init__(self, num_experts: int, d_model: int, d_hidden: int, first: int = 0,
                 num_local: int | None = None):
        super().__init__()
        L = num_experts - first if num_local is None else num_local
        if not (0 <= first and L >= 1 and first + L <= num_experts):
            raise ValueError(f"expert block first={first}, count={L} does not fit in {num_experts} experts")
        self.num_experts, self.first, self.num_local = num_experts, first, L
        self.d_model, self.d_hidden = d_model, d_hidden
        # draw all E experts (same stream on every rank), keep the block [first, first + L)
        w1 = torch.randn(num_experts, d_model, d_hidden) * d_model ** -0.5
        w2 = torch.randn(num_experts, d_hidden, d_model) * d_hidden ** -0.5
        self.w1 = nn.Parameter(w1[first:first + L].clone())
        self.b1 = nn.Parameter(torch.zeros(L, d_hidden))
        self.w2 = nn.Parameter(w2[first:first + L].clone())
        self.b2 = nn.Parameter(torch.zeros(L, d_model))
        for p in self.parameters():
            setattr(p, EXPERT_ATTR, True)

    def params(self) -> tuple[torch.Tensor, ...]:
        return (self.w1, self.b1, self.w2, self.b2)

    def forward(self, x_RD: torch.Tensor, counts_L: Sequence[int]) -> torch.Tensor:
        """Rows grouped by local expert (``counts_L[j]`` rows for expert j, in order)."""
        return expert_apply(x_RD, counts_L, *self.params())


def expert_ffn(x_RD: torch.Tensor, w1_DH: torch.Tensor, b1_H: torch.Tensor, w2_HD: torch.Tensor,
               b2_D: torch.Tensor) -> torch.Tensor:
    """One expert on its rows: ``gelu(x @ w1 + b1) @ w2 + b2``, [R, D] -> [R, D]. The
    expert arithmetic of the package: the layer, the inference banks and their twins all
    call it."""
    return torch.addmm(b2_D, F.gelu(torch.addmm(b1_H, x_RD, w1_DH)), w2_HD)


def expert_apply(x_RD: torch.Tensor, counts_L: Sequence[int], w1_LDH: torch.Tensor, b1_LH: torch.Tensor,
                 w2_LHD: torch.Tensor, b2_LD: torch.Tensor) -> torch.Tensor:
    """Apply expert j to its ``counts_L[j]`` consecutive rows of ``x_RD``; returns [R, D]."""
    if len(counts_L) != w1_LDH.shape[0]:
        raise ValueError(f"{len(counts_L)} row counts for {w1_LDH.shape[0]} experts")
    if sum(counts_L) != x_RD.shape[0]:
        raise ValueError(f"row counts {list(counts_L)} sum to {sum(counts_L)}, input has {x_RD.shape[0]} rows")
    # Every expert runs, even on zero rows: the autograd graph then has the same shape on
    # every rank, so the exchanges inside the backward pass happen on all ranks alike.
    outs, off = [], 0
    for j, n in enumerate(counts_L):
        n = int(n)
        outs.append(expert_ffn(x_RD[off:off + n], w1_LDH[j], b1_LH[j], w2_LHD[j], b2_LD[j]))
        off += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


__all__ = ["EXPERT_ATTR", "ExpertFFN", "expert_apply", "expert_ffn", "is_expert_param"]
