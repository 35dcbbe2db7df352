"""A GNN run's ``metrics.json``: the typed record and how it is computed from histories.

Pure: :func:`summarize` turns the per-rank histories that the trainer gathered into a
:class:`GNNMetrics`, with no process group; it is tested on hand-made histories.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..results import Record, median
from .timing import BREAKDOWN_KEYS


@dataclass(frozen=True)
class GNNMetrics(Record):
    """The documented keys of a GNN run's metrics.json (DESIGN.md "Runs and results",
    docs/gnn.md "Metrics"); ``extra`` holds the rest (graph and partitioning details,
    the exchange's report such as ``adaqp``, ``assign_share_of_wall``)."""

    mode: str
    model: str
    dataset: str
    world_size: int
    epochs: int
    loss: list[float]
    epochs_timed: int
    val_acc: float | None
    test_acc: float | None
    train_acc: float | None
    best_epoch: int | None
    epoch_time_s: float
    breakdown_s: dict[str, float]
    breakdown_other_s: float
    bytes_sent_per_epoch: float
    wall_clock_s: float
    epoch_time_s_per_epoch: list[float]
    val_acc_per_eval: list[float]
    eval_epochs: list[int]
    peak_rss_mib_per_rank: list[float]
    peak_rss_mib_total: float
    partition: list[dict]
    config: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


def _med(xs: Sequence[float]) -> float:
    m = median(xs)
    return 0.0 if m is None else m  # no epoch timed in this invocation (a finished resume)


def summarize(cfg: Any, loss: Sequence[float], evals: Sequence[dict], per_rank: Sequence[dict],
              *, world_size: int, wall_s: float, dataset: str,
              extra: dict | None = None) -> GNNMetrics:
    """The record of a run with config ``cfg`` (a TrainConfig): ``loss`` per epoch and
    ``evals`` (one dict per evaluation: epoch, train/val/test_acc) are global; ``per_rank``
    holds each rank's ``epoch_time_s``, ``breakdown_s`` and ``bytes_sent`` per timed epoch,
    its ``peak_rss_mib`` and its book's ``book`` summary.

    Per epoch, time and every breakdown key take the maximum over ranks and bytes the sum;
    the record holds their medians over epochs. Accuracies are those of the best
    validation epoch (the earliest on ties)."""
    E = len(per_rank[0]["epoch_time_s"])  # epochs timed in this invocation
    epoch_max = [max(r["epoch_time_s"][e] for r in per_rank) for e in range(E)]
    bd_max = [{k: max(r["breakdown_s"][e].get(k, 0.0) for r in per_rank) for k in BREAKDOWN_KEYS}
              for e in range(E)]
    bytes_ep = [sum(r["bytes_sent"][e] for r in per_rank) for e in range(E)]
    best = max(evals, key=lambda r: (r["val_acc"], -r["epoch"])) if evals else None
    rss = [r["peak_rss_mib"] for r in per_rank]
    return GNNMetrics(
        mode=cfg.mode, model=cfg.model, dataset=dataset, world_size=world_size,
        epochs=len(loss), loss=list(loss), epochs_timed=E,
        val_acc=best["val_acc"] if best else None,
        test_acc=best["test_acc"] if best else None,
        train_acc=best["train_acc"] if best else None,
        best_epoch=best["epoch"] if best else None,
        epoch_time_s=_med(epoch_max),
        breakdown_s={k: _med([b[k] for b in bd_max]) for k in BREAKDOWN_KEYS},
        breakdown_other_s=_med([epoch_max[e] - sum(bd_max[e].values()) for e in range(E)]),
        bytes_sent_per_epoch=_med(bytes_ep),
        wall_clock_s=wall_s,
        epoch_time_s_per_epoch=epoch_max,
        val_acc_per_eval=[r["val_acc"] for r in evals],
        eval_epochs=[r["epoch"] for r in evals],
        peak_rss_mib_per_rank=rss,
        peak_rss_mib_total=sum(rss),
        partition=[r["book"] for r in per_rank],
        config=dataclasses.asdict(cfg),
        extra=dict(extra or {}),
    )


__all__ = ["GNNMetrics", "summarize"]
