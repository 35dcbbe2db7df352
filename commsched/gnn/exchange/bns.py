"""BNS-GCN's boundary-node sampling (``--mode bns --boundary-rate P``).

Legend: T rows this rank sends per exchange, R remote (halo) rows, c rows one rank sends
one peer, k of them kept, F row width.

BNS-GCN (Wan et al., MLSys 2022) keeps, in every training epoch, a random fraction P of
the boundary nodes each part sends to each peer, and drops the rest (and their edges)
from that epoch's aggregation; only kept rows cross the wire, forward and backward, so a
training epoch sends about P of the halo bytes. The sample is per epoch (the same for
every layer and for the backward pass) and per ordered pair of ranks: of the c rows rank
s sends rank d, k = round(P * c) (half up) rows, a uniform draw without replacement.

**No communication for the sample**: both ends know c (the sender's send count is the
receiver's receive count), and the draw is a pure function of (seed, epoch, s, d, c)
(:func:`boundary_sample`, numpy's PCG64 seeded with those numbers), so sender and
receiver compute the same positions. (BNS-GCN's code draws on the sender and sends the
node ids each epoch.)

**Rescaling**: a kept row is multiplied by c / k before it is sent, as BNS-GCN's code
does (``feat[selected] / ratio``, ratio = k / c), and the edge weights stay those of the
full graph (global degrees). Each boundary row then enters the aggregation with weight
c / k with probability k / c and 0 otherwise, so the marginal aggregation is unbiased
(its expectation is the full-graph one). The backward pass is the exact derivative of that
forward: the kept rows' gradients go back and are multiplied by c / k again.

P = 1 keeps every row (scale 1, identity positions): bit for bit Vanilla (the test twin).
Evaluation passes exchange every row, exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ...comm.all2all import A2APlan
from ..context import ExchangeContext, PassContext
from ..graph.book import PartitionBook
from .halo import Pending, VanillaExchange

DEFAULT_BOUNDARY_RATE = 0.1  # BNS-GCN's recommended rate


def kept_count(count: int, rate: float) -> int:
    """k = round(rate * count), half up: how many of ``count`` boundary rows are kept."""
    return min(int(count), int(math.floor(rate * count + 0.5)))


def boundary_sample(count: int, rate: float, *, seed: int, epoch: int, src: int, dst: int) -> np.ndarray:
    """Sorted positions (int64 [k]) in [0, count) of the rows rank ``src`` keeps of the
    ``count`` it sends rank ``dst`` in ``epoch``: a uniform draw without replacement from
    numpy's PCG64 seeded with (seed, epoch, src, dst). Pure; every rank computes the same."""
    k = kept_count(count, rate)
    if k == count:
        return np.arange(count, dtype=np.int64)
    rng = np.random.default_rng([seed % (1 << 64), epoch, src, dst])
    return np.sort(rng.choice(count, size=k, replace=False)).astype(np.int64)


@dataclass(frozen=True, eq=False)
class BoundarySample:
    """One epoch's sample of one rank. send_pos [T'] and recv_pos [R']: the kept rows among
    the T sent / R received ones (grouped by peer); send_scale [T'] (c / k of the row's
    peer; None when every scale is 1); plan: the exchange of the kept rows."""

    send_pos: torch.Tensor
    recv_pos: torch.Tensor
    send_scale: torch.Tensor | None
    plan: A2APlan


def sample_epoch(book: PartitionBook, rate: float, *, seed: int, epoch: int,
                 device: torch.device | str = "cpu") -> BoundarySample:
    """The :class:`BoundarySample` of ``book``'s rank in ``epoch`` (no communication)."""
    me, P = book.rank, book.num_parts
    send_pos, recv_pos, scale = [], [], []
    send_k, recv_k = [0] * P, [0] * P
    so = ro = 0
    for p in range(P):
        cs, cr = book.send_counts[p], book.recv_counts[p]
        if p != me:
            s = boundary_sample(cs, rate, seed=seed, epoch=epoch, src=me, dst=p)
            r = boundary_sample(cr, rate, seed=seed, epoch=epoch, src=p, dst=me)
            send_pos.append(s + so)
            recv_pos.append(r + ro)
            scale.append(np.full(s.size, cs / s.size if s.size else 1.0))
            send_k[p], recv_k[p] = int(s.size), int(r.size)
        so, ro = so + cs, ro + cr

    def cat(parts: list, dtype) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

    sc = cat(scale, np.float64)
    dev = torch.device(device)
    return BoundarySample(send_pos=torch.from_numpy(cat(send_pos, np.int64)).to(dev),
                          recv_pos=torch.from_numpy(cat(recv_pos, np.int64)).to(dev),
                          send_scale=None if bool((sc == 1.0).all()) else torch.from_numpy(sc).to(dev),
                          plan=A2APlan(send_k, recv_k, me, agreed=True))


class BNSExchange(VanillaExchange):
    """Vanilla rows of a random fraction ``options.rate`` of the boundary nodes in training
    passes (see the module doc); every row in evaluation passes. ``options``: the mode's
    config (:class:`~commsched.gnn.exchange.modes.BNSConfig`); the context's ``seed``: the run's
    (the sample of epoch e is that of (seed, e) on every rank)."""

    name = "bns"

    def __init__(self, ctx: ExchangeContext, options):
        super().__init__(ctx)
        self.options = options
        self.seed = int(self.ctx.seed)
        self._sample: tuple[int, BoundarySample] | None = None

    def sample(self, epoch: int) -> BoundarySample:
        """This rank's sample of ``epoch`` (made once per epoch, on the exchange's device)."""
        if self._sample is None or self._sample[0] != epoch:
            self._sample = (epoch, sample_epoch(self.book, self.options.rate, seed=self.seed,
                                                epoch=epoch, device=self.device))
        return self._sample[1]

    def transfer(self, rows: torch.Tensor, layer: int, direction: str, ctx: PassContext) -> Pending:
        if not ctx.training:
            return super().transfer(rows, layer, direction, ctx)
        s = self.sample(ctx.epoch)
        scale = s.send_scale
        if scale is not None:
            scale = scale.to(rows.dtype).view(-1, *([1] * (rows.dim() - 1)))
        if direction == "forward":
            out = rows.index_select(0, s.send_pos)
            pend = self._wire(out if scale is None else out * scale, s.plan, ctx)
            n, pos, back_scale = self.book.num_remote, s.recv_pos, None
        else:
            pend = self._wire(rows.index_select(0, s.recv_pos), s.plan.reversed(), ctx)
            n, pos, back_scale = int(self.send_idx.numel()), s.send_pos, scale

        def land() -> torch.Tensor:
            got = pend.wait()
            if back_scale is not None:
                got = got * back_scale
            return got.new_zeros((n, *got.shape[1:])).index_copy_(0, pos, got)

        return Pending(land)

    def report(self) -> dict:
        full = sum(self.book.send_counts)
        kept = sum(kept_count(c, self.options.rate) for c in self.book.send_counts)
        return {"bns": {"boundary_rate": self.options.rate,
                        "kept_share": kept / full if full else 1.0}}


__all__ = ["BNSExchange", "BoundarySample", "DEFAULT_BOUNDARY_RATE",
           "boundary_sample", "kept_count", "sample_epoch"]
