"""The DeepSpeed baseline: the same language model with ``deepspeed.moe.layer.MoE`` layers.

Legend: D model width, H expert hidden width, E experts, L experts per rank.

:func:`to_deepspeed` replaces every MoE feed-forward layer of a model built with all
experts held locally by DeepSpeed's real MoE layer, copying the router and the experts
this rank hosts, so both implementations start from the same weights and compute the
same function (top-k softmax gating, the same load-balancing loss, no second-expert
sampling noise). Dropless routing maps to DeepSpeed's ``drop_tokens=False`` (every
expert padded to the largest load in the group); a capacity factor maps to
``drop_tokens=True`` with that factor. DeepSpeed is imported only when called.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .layer import MoELayer
from .model import MoETransformerLM


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


__all__ = ["DeepSpeedMoEFFN", "to_deepspeed"]
