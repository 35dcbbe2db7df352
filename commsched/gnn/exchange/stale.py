"""PipeGCN's stale exchange (``--mode pipegcn``): last epoch's halo rows and gradients.

Legend: R remote (halo) rows of this rank, T rows it sends per exchange, F row width.

PipeGCN (Wan et al., ICLR 2022) pipelines the halo exchange with the computation: in
training epoch t a layer aggregates the remote rows its peers sent in epoch t-1, and the
owned rows receive the boundary gradients computed in epoch t-1; the rows and gradients
of epoch t are sent in the background while epoch t computes, and are used in epoch t+1.
So every exchange of epoch t (one per layer and direction) overlaps the rest of that
epoch's forward, its backward, the gradient allreduce and the optimizer step, and is
waited for once, at the end of the epoch (:meth:`PipeGCNExchange.end_epoch`, the blocked
time counted as "comm").

- **The first epoch is exact**: with nothing from a previous epoch, the first training
  epoch of the exchange (epoch 0) waits for its own rows and gradients, like ``adaqp-p``;
  what it received is then the stale value of the next epoch. The stale rows are the
  exchange's state (``state_dict``): a checkpoint holds them, so the first epoch after
  ``--resume`` uses the rows an uninterrupted run uses.
- ``delay=0`` uses every epoch's own rows (the same background exchanges, waited at once):
  it trains exactly like ``vanilla`` (the twin the tests compare with).
- ``smoothing=gamma`` (PipeGCN-GF): the value used in epoch t+1 is the moving average
  ``s_t = gamma * s_{t-1} + (1 - gamma) * r_t`` of the rows (and gradients) received,
  ``s`` starting at the first epoch's exact rows; 0 (default) is plain PipeGCN.
- Evaluation passes exchange exact rows, blocking, and leave the stale rows alone.

The exchanges of one epoch are all in flight together, and the gradient allreduce runs
while they are: that needs the direct pattern (one posted all-to-all per exchange); the
ring runs its rounds on a thread that no other collective may overlap, so ``pattern="ring"``
is refused.
"""

from __future__ import annotations

import torch

from ..context import ExchangeContext, PassContext
from .halo import Pending, VanillaExchange, cpu, keyed_dict, keyed_items


def check_pattern(pattern: str, mode: str = "pipegcn") -> None:
    """The rule, stated once: a stale exchange keeps every exchange of an epoch in flight
    across the gradient allreduce, which only the direct pattern allows (a ValueError)."""
    if pattern != "direct":
        raise ValueError(f"--mode {mode} keeps every exchange of an epoch in flight across the "
                         f"gradient allreduce, which needs --pattern direct (got {pattern!r})")


class PipeGCNExchange(VanillaExchange):
    """Full-precision rows in the background; training passes use the rows and gradients of
    the previous epoch (see the module doc). ``options``: the mode's config
    (:class:`~commsched.gnn.exchange.modes.PipeGCNConfig`: ``delay``, ``smoothing``); the context's
    ``wire_dtype`` as in :class:`VanillaExchange`."""

    name = "pipegcn"

    def __init__(self, ctx: ExchangeContext, options):
        super().__init__(ctx, asynchronous=True)
        check_pattern(self.pattern)  # also a config check (PipeGCNConfig.check_run), for direct use
        self.options = options
        self._stale: dict[tuple[int, str], torch.Tensor] = {}    # what the next epoch uses
        self._inflight: dict[tuple[int, str], Pending] = {}     # this epoch's exchanges

    def transfer(self, rows: torch.Tensor, layer: int, direction: str, ctx: PassContext) -> Pending:
        fresh = super().transfer(rows, layer, direction, ctx)  # this epoch's rows, in the background
        if not ctx.training:
            return fresh  # evaluation: exact
        key = (layer, direction)
        if key in self._inflight:
            raise RuntimeError(f"pipegcn: a second {direction} exchange of layer {layer} in one epoch "
                               "(end_epoch was not called after the last training pass)")
        self._inflight[key] = fresh
        stale = self._stale.get(key)
        if self.options.delay == 0 or stale is None:
            return fresh  # exact: the first epoch, or no delay
        # a new alias each pass: the pass's autograd marks the tensor it is given, not the kept one
        return Pending.ready(stale.detach())

    def end_epoch(self, ctx: PassContext) -> None:
        """Wait for this epoch's exchanges (blocked time: "comm") and keep what arrived (or its
        moving average) for the next epoch."""
        if not self._inflight:
            return
        if self.options.delay == 0:  # every exchange was waited for in its pass: nothing to keep
            self._inflight.clear()
            return
        gamma = self.options.smoothing
        t = ctx.timer.mark()
        with torch.no_grad():  # kept values join no graph: one epoch's graph never holds the next
            for key, pend in self._inflight.items():
                got = pend.wait().detach()
                old = self._stale.get(key)
                self._stale[key] = got if old is None or gamma == 0.0 else old * gamma + got * (1.0 - gamma)
        self._inflight.clear()
        ctx.timer.add_span("comm", t, ctx.timer.mark())

    def state_dict(self) -> dict:
        """The rows and gradients the next epoch uses (received, or their moving average)."""
        return {"stale": keyed_items(self._stale, cpu)}

    def load_state_dict(self, state: dict) -> None:
        st = self._state_keys(state, ("stale",))
        self._stale = keyed_dict(st["stale"], lambda t: t.to(self.device))

    def report(self) -> dict:
        return {"pipegcn": {"delay": self.options.delay, "smoothing": self.options.smoothing}}


__all__ = ["PipeGCNExchange", "check_pattern"]
