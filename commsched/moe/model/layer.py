"""The MoE feed-forward layer: router, dispatch (local or expert-parallel), experts, combine.

Legend: B batch, S sequence, D model width, T = B*S tokens, E experts.

``MoELayer(d_model, d_hidden, router_cfg)`` holds every expert and dispatches locally
(the reference). Pass ``expert_group=ExpertGroup(E, P, rank, group)`` to hold only this
rank's block of E / P experts and exchange tokens over that process group; ``chunks`` and
``pipeline`` select the pipelined exchange (see :mod:`commsched.moe.model.dispatch`);
``observer`` (an :class:`~commsched.comm.observe.A2AObserver`, given at construction) is told
about its exchanges.

Data parallelism. With an expert group of more than one rank each rank holds different
experts, so they are not data-parallel over all ranks: the layer marks them
(:func:`commsched.priority.ddp.set_grad_group`) as reduced over ``expert_dp_group``, the
ranks that hold the same experts (None: this rank alone, when the expert group spans every
rank), after scaling by 1 / (expert group size x expert_dp_group size).
:class:`commsched.priority.LinaDDP` keeps them out of DDP and reduces them so; inside a
plain ``DistributedDataParallel`` that reduces them (having replaced every rank's experts
with rank 0's when it was built), or that leaves their gradients to nobody, the forward
pass raises a ValueError saying what to use instead.
The forward pass returns ``(y, aux_loss)``; add ``aux_weight * aux_loss`` to the loss.

The layer runs on the device of its input (move it with ``.to(device)``); the pipelined
exchange's lanes are made on that device (CUDA streams on CUDA, a worker thread on the
CPU). Under ``torch.autocast`` the token rows are cast to the autocast dtype before
dispatch, so the experts compute and the all-to-all carries rows in that dtype (bfloat16
rows halve the exchanged bytes); the output is in that dtype too.

Quantized all-to-all (``DispatchConfig(a2a_bits=8)``, ``--a2a-bits 8``): the rows that go
to the experts travel as 8-bit row records of the shared codec (stochastic rounding, a
float32 scale and zero point per row), the rows that come back in bfloat16; ``16``: all
bfloat16; ``32`` (the default): as today, bit for bit (:func:`commsched.moe.model.dispatch.moe_wires`).
Each layer's 8-bit key stream is seeded from ``wire_seed`` and the rank's global rank
(:func:`commsched.quant.rowwire.format_seed`), so ranks and layers never share random bits;
:meth:`MoELayer.key_state` is the stream's position, which a training checkpoint holds so
that a resumed run draws the keys an uninterrupted one draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ...comm.lanes import Lanes
from ...comm.observe import A2AObserver
from ...configurable import Config, option
from ...priority.ddp import check_ddp, set_grad_group
from ...priority.runtime.executor import LOCAL
from .dispatch import A2A_BITS, ExpertGroup, MoEWires, ep_moe, format_seed, local_moe, moe_wires
from .experts import ExpertFFN
from .router import Router, RouterConfig, Routing


@dataclass(frozen=True, kw_only=True)
class DispatchConfig(Config):
    """How tokens reach experts: ``chunks`` of the exchange and whether they are pipelined."""

    chunks: int = option(1, "chunks of the pipelined all-to-all")
    pipeline: bool = option(False, "overlap each chunk's exchange with the expert compute of the others")
    merge: bool = option(False, "pipeline: send the chunks of each exchange as one all-to-all (no overlap; "
                                "the same chunk-by-chunk arithmetic, so the same bits)")
    a2a_bits: int = option(32, "width of the expert all-to-all rows: 32 as computed; 16 bfloat16; 8: tokens "
                               "to the experts (and the gradients of their outputs) as 8-bit rows of the "
                               "shared codec with a per-row scale, the rest bfloat16", choices=A2A_BITS)

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(f"chunks must be a positive integer, got {self.chunks!r}")


class MoELayer(nn.Module):
    def __init__(self, d_model: int, d_hidden: int, router_cfg: RouterConfig, *,
                 expert_group: ExpertGroup | None = None, dispatch: DispatchConfig | None = None,
                 observer: A2AObserver | None = None, expert_dp_group: object | None = None,
                 wire_seed: int = 0):
        super().__init__()
        E = router_cfg.num_experts
        if expert_group is not None and expert_group.num_experts != E:
            raise ValueError(f"expert group is for {expert_group.num_experts} experts, the router for {E}")
        self.router_cfg, self.expert_group = router_cfg, expert_group
        self.dispatch = dispatch or DispatchConfig()
        self.observer = observer
        self.router = Router(d_model, router_cfg)
        if expert_group is None:
            self.experts = ExpertFFN(E, d_model, d_hidden)
        else:
            self.experts = ExpertFFN(E, d_model, d_hidden, expert_group.first, expert_group.num_local)
            if expert_group.size > 1:
                dp = 1 if expert_dp_group is None else dist.get_world_size(expert_dp_group)
                set_grad_group(self.experts.parameters(), LOCAL if expert_dp_group is None else expert_dp_group,
                               expert_group.size * dp)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.wires: MoEWires = moe_wires(self.dispatch.a2a_bits, format_seed(wire_seed, rank))
        self.last_routing: Routing | None = None
        self._lanes: Lanes | None = None  # comm lane of the pipelined exchange, made on first use

    def key_state(self) -> dict | None:
        """The 8-bit wire's key stream position (:meth:`commsched.quant.rowwire.QuantRows.state_dict`);
        None at other widths (nothing random on the wire)."""
        q = self.wires.dispatch.forward if self.wires.bits == 8 else None
        return q.state_dict() if q is not None else None

    def load_key_state(self, st: dict) -> None:
        """Continue the key stream of :meth:`key_state` (ValueError when this layer has no
        8-bit wire, or for a damaged or foreign state)."""
        if self.wires.bits != 8:
            raise ValueError(f"this MoE layer's all-to-all is {self.wires.bits}-bit: it has no key stream to restore")
        self.wires.dispatch.forward.load_state_dict(st)

    def close(self) -> None:
        """Stop the comm lane thread of the pipelined exchange, if one was started."""
        if self._lanes is not None:
            self._lanes.close()
            self._lanes = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        D = x.shape[-1]
        x_TD = x.reshape(-1, D)
        if torch.is_autocast_enabled(x.device.type):
            x_TD = x_TD.to(torch.get_autocast_dtype(x.device.type))  # the wire and expert dtype
        routing = self.router(x_TD)
        self.last_routing = routing
        if self.expert_group is None:
            y_TD = local_moe(x_TD, routing, self.experts)
        else:
            if self.expert_group.size > 1:
                check_ddp(self, self.experts.parameters())  # inside DistributedDataParallel: leaves them to commsched
            merge = self.dispatch.pipeline and self.dispatch.merge
            if self.dispatch.pipeline and not merge and (self._lanes is None or self._lanes.device != x.device):
                self.close()
                self._lanes = Lanes(x.device, names=("compute", "comm"))
            y_TD = ep_moe(x_TD, routing, self.experts, self.expert_group, chunks=self.dispatch.chunks,
                          pipeline=self.dispatch.pipeline, observer=self.observer, lanes=self._lanes,
                          wires=self.wires, merge=merge)
        return y_TD.reshape(x.shape), routing.aux_loss


__all__ = ["DispatchConfig", "MoELayer"]
