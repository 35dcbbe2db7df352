"""Mini-batch training with neighbour sampling (``--mode minibatch``): data-parallel replicas.

Legend: N nodes of the graph, F input features, K classes, B seeds of a batch, S nodes of
a sampled subgraph, P ranks.

What a user with a large graph reaches for first (torch_geometric's ``NeighborLoader``
under DDP): every rank holds the whole graph (a replicated feature store: the features
[N, F], the labels and the in-edges in CSR form), takes its partition's training nodes as
seeds, and each step samples the neighbourhood of one batch of them
(:mod:`commsched.gnn.graph.sample`: ``--fanouts`` per hop, ``--batch-size`` seeds),
runs the model on the subgraph (commsched's own GCN / SAGE layers on a one-part book: no
halo exchange), takes the mean cross-entropy over the seeds, and averages the gradients
over the ranks (the loss divided by P, summed by the run's gradient step
(``--grad-schedule``, ``--grad-bits``) as in the full-graph modes: DDP's average, the
same on every rank), then one Adam step. Every rank runs the same number of steps per
epoch (:func:`~commsched.gnn.graph.sample.num_batches`: the most any rank's seeds fill;
a rank with fewer repeats its batches from the first), or the collectives would hang.

Evaluation is the full-graph modes': the inherited :meth:`Trainer.evaluate` runs the model
over every rank's part with Vanilla's exchange, outside the epoch clock. The epoch clock
covers the sampling, the steps and the reductions. The draws (order of the seeds,
neighbours) come from (seed, rank, epoch), so a resumed run draws what the uninterrupted
one would. Dropout masks are keyed by global node id and step (the epoch of the pass is
the step count), so one rank with one batch and every fan-out -1 trains exactly as
``vanilla`` on one rank.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...agree import check_same_config
from ...comm.all2all import CommStats
from ...dist import all_gather_object
from ..context import ExchangeContext, PassContext
from ..exchange.halo import VanillaExchange
from ..graph.data import Graph, graph_fingerprint
from ..graph.partition import PartData
from ..graph.sample import (
    InNeighbours,
    epoch_batches,
    num_batches,
    sample_neighbours,
    subgraph_book,
)
from ..nn.layers import LocalGraph
from ..nn.models import LAYERS, FastLayer
from ..timing import Breakdown
from .trainer import TrainConfig, Trainer, run_training

_SALT = 0x6D42  # the sampler's stream, apart from other uses of the run's seed


def feature_store_bytes(graph: Graph, adj: InNeighbours) -> int:
    """Bytes every rank holds for the replicated feature store: the features, the labels and
    the in-edge CSR."""
    return int(graph.x_NF.element_size() * graph.x_NF.numel()
               + graph.y_N.element_size() * graph.y_N.numel() + adj.nbytes)


class MiniBatchTrainer(Trainer):
    """One rank's side of a ``--mode minibatch`` run (see the module doc): a
    :class:`Trainer` (model, gradient step, full-graph evaluation, checkpoints) whose epoch
    is mini-batch steps on sampled subgraphs of ``graph``, the whole graph this rank holds
    (the graph ``part`` is a part of)."""

    def __init__(self, cfg: TrainConfig, part: PartData, *, graph: Graph | None, group=None,
                 exchange=None, device: torch.device | str | None = None):
        if not getattr(cfg.exchange, "sampled", False):
            raise ValueError(f"MiniBatchTrainer trains --mode minibatch, not --mode {cfg.mode}")
        if not isinstance(graph, Graph):
            raise ValueError("--mode minibatch keeps the whole graph on every rank (a replicated "
                             "feature store): give the graph (--dataset, --graph or the synthetic "
                             "flags; a --partition-dir alone holds only the parts)")
        if not isinstance(LAYERS[cfg.model], FastLayer):
            raise ValueError(f"--mode minibatch trains commsched's own layers on the sampled "
                             f"subgraphs ({', '.join(k for k, v in LAYERS.items() if isinstance(v, FastLayer))}); "
                             f"--model {cfg.model} is not one of them")
        if cfg.emulated:
            raise ValueError("--mode minibatch computes on the run's device: --compute emulated "
                             "is an option of the full-graph modes")
        self.fanouts = cfg.exchange.fanouts_for(cfg.layers)
        if graph.num_nodes != part.book.num_nodes:
            raise ValueError(f"--mode minibatch: the graph has {graph.num_nodes} nodes, the "
                             f"partition {part.book.num_nodes}: give the graph that was partitioned")
        super().__init__(cfg, part, group=group, exchange=exchange, device=device)
        # the ranks must hold the same graph (a different one would train silently apart)
        check_same_config({"graph": graph_fingerprint(graph)}, group, what="replicated graph")
        self.full = graph
        src, dst = graph.edge_index_2E.numpy()
        self.adj = InNeighbours.from_edges(src, dst, graph.num_nodes)
        self.degree = self.adj.in_degree
        self.seeds = part.book.owned_ids[part.train_mask.numpy().astype(bool)]
        counts = [len(self.seeds)] if self.world == 1 else all_gather_object(
            len(self.seeds), "agreeing on the mini-batches per epoch", group)
        self.batch_size = cfg.exchange.batch_size
        self.steps_per_epoch = num_batches(counts, self.batch_size)
        self.store_bytes = feature_store_bytes(graph, self.adj)
        self._x = graph.x_NF.to(device=self.device, dtype=cfg.param_dtype)
        self._y = graph.y_N.to(self.device)

    def _batch_graph(self, seeds: np.ndarray, rng: np.random.Generator) -> tuple[LocalGraph, torch.Tensor]:
        """The sampled subgraph of ``seeds`` as a one-part :class:`LocalGraph` and its node
        ids [S] on the device (the seeds first)."""
        sample = sample_neighbours(self.adj, seeds, self.fanouts, rng)
        book = subgraph_book(sample, self.degree)
        halo = VanillaExchange(ExchangeContext(book, device=self.device))  # one part: sends nothing
        g = LocalGraph(book, halo, dtype=self.cfg.param_dtype, seed=self.cfg.seed,
                       dropout_rng=self.cfg.dropout_rng, device=self.device)
        return g, torch.from_numpy(sample.node_ids).to(self.device)

    def _step_forward(self, g: LocalGraph, ids_S: torch.Tensor, ctx: PassContext) -> torch.Tensor:
        x = self._x.index_select(0, ids_S)
        if not self.cfg.mixed:
            return self.model(x, g, ctx)
        with torch.autocast(self.device.type, dtype=self.cfg.torch_dtype):
            out = self.model(x, g, ctx)
        return out.float()

    def train_epoch(self) -> float:
        """Run epoch ``self.epoch`` (``steps_per_epoch`` steps); return the training loss:
        the mean over the steps of the ranks' mean seed loss."""
        gs = self.grad_step
        timer = Breakdown(self.clock)
        self.model.train()
        rng = np.random.default_rng([self.cfg.seed, _SALT, self.rank, self.epoch])
        t0 = self.clock.mark()
        batches = epoch_batches(self.seeds, self.batch_size, self.steps_per_epoch, rng)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        last = self.epoch + 1 == self.cfg.epochs
        for i, seeds in enumerate(batches):
            step = self.epoch * self.steps_per_epoch + i
            ctx = PassContext(epoch=step, training=True, timer=timer, stats=CommStats(self.world),
                              events=gs.scheduler)
            g, ids = self._batch_graph(seeds, rng)
            gs.before_forward()
            out = self._step_forward(g, ids, ctx)
            b = len(seeds)
            y = self._y.index_select(0, ids[:b])
            # DDP's average: each rank's mean over its seeds, summed over the ranks / P;
            # the whole output joins the graph so a rank with an empty batch still reduces
            loss = (F.cross_entropy(out[:b], y, reduction="sum") / max(b, 1) + out.sum() * 0.0) / self.world
            self._step_ended(gs.before_backward())
            loss.backward()
            with timer.time("reduce"):
                self._step_ended(gs.after_backward(sync=last and i + 1 == len(batches)))
            total += loss.detach().double()
        with timer.time("reduce"):
            loss_all = self._allreduce_loss(total) / self.steps_per_epoch
        dt = self.clock.seconds(t0, self.clock.mark())
        self.history["loss"].append(loss_all)
        self.history["epoch_time_s"].append(dt)
        self.history["breakdown_s"].append(timer.as_dict())
        self.history["bytes_sent"].append(0)  # no halo rows; the gradient sums are not counted here
        self.history["bytes_sent_P"].append([0] * self.world)
        self.epoch += 1
        return loss_all

    def report(self) -> dict:
        """metrics.json's ``minibatch`` entry: the sampling options and the replicated store."""
        return {"minibatch": {"fanouts": list(self.fanouts), "batch_size": self.batch_size,
                              "steps_per_epoch": self.steps_per_epoch,
                              "seeds_this_rank": int(len(self.seeds)),
                              "feature_store": "replicated",
                              "feature_store_bytes_per_rank": self.store_bytes}}


def run_minibatch(cfg: TrainConfig, part: PartData, *, graph: Graph, **kw: Any
                  ) -> tuple[dict[str, Any], MiniBatchTrainer]:
    """:func:`~commsched.gnn.train.trainer.run_training` of a ``--mode minibatch`` run:
    ``graph`` is the whole graph every rank holds (``part`` one of its parts), ``kw`` the
    other arguments of ``run_training``. Collective."""
    return run_training(cfg, part, trainer=functools.partial(MiniBatchTrainer, graph=graph), **kw)


__all__ = ["MiniBatchTrainer", "feature_store_bytes", "run_minibatch"]
