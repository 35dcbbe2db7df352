"""A GNN run's ``metrics.json``: the typed record and how it is computed from histories.

Pure: :func:`summarize` turns the per-rank histories that the trainer gathered into a
:class:`GNNMetrics`, with no process group; it is tested on hand-made histories.

ROC AUC (two-class graphs such as Tolokers and Minesweeper, whose usual metric it is:
accuracy there mostly counts the majority class) is computed from score histograms, so
that the ranks combine it with one all-reduce of fixed size whatever the node count:
:func:`auc_histograms` bins each rank's class-1 probabilities per split and class,
:func:`auc_from_histograms` reads the AUC off the summed histograms. Pairs whose scores
fall in the same of the ``AUC_BINS`` bins count one half, as ties do in the exact AUC, so
the result is within ``(share of pairs sharing a bin) / 2`` of the exact one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ...results import Record, median
from ..timing import BREAKDOWN_KEYS

AUC_BINS = 8192  # score bins of the ROC AUC histograms (one all-reduce of 3 x 2 x AUC_BINS)


def auc_histograms(prob_n: torch.Tensor, y_n: torch.Tensor, masks: Sequence[torch.Tensor],
                   bins: int = AUC_BINS) -> torch.Tensor:
    """Counts [S, 2, bins] (float64, on ``prob_n``'s device) of the class-1 probabilities
    ``prob_n`` [n] in [0, 1] of the nodes in each of the S boolean ``masks``, split by the
    label ``y_n`` (0 or 1); bin b holds scores in [b / bins, (b + 1) / bins), 1.0 the last."""
    idx = (prob_n.double() * bins).long().clamp_(0, bins - 1)
    out = torch.zeros(len(masks), 2, bins, dtype=torch.float64, device=prob_n.device)
    for s, m in enumerate(masks):
        for c in (0, 1):
            sel = idx[m & (y_n == c)]
            out[s, c] = torch.bincount(sel, minlength=bins).to(torch.float64)
    return out


def auc_from_histograms(neg_B: Sequence[float] | torch.Tensor, pos_B: Sequence[float] | torch.Tensor) -> float | None:
    """ROC AUC, P(score of a positive > score of a negative) + P(tie) / 2, from the score
    counts of the negatives and the positives per bin (same bins, ascending); a shared bin
    counts as a tie. None when either class is empty."""
    neg = torch.as_tensor(neg_B, dtype=torch.float64)
    pos = torch.as_tensor(pos_B, dtype=torch.float64)
    if neg.shape != pos.shape or neg.dim() != 1:
        raise ValueError(f"auc_from_histograms: histograms of shapes {tuple(neg.shape)} and {tuple(pos.shape)}")
    P, N = float(pos.sum()), float(neg.sum())
    if P == 0 or N == 0:
        return None
    below = torch.cumsum(neg, 0) - neg  # negatives in lower bins
    return float((pos * (below + 0.5 * neg)).sum()) / (P * N)


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
    # two-class graphs only (else None / empty): ROC AUC per evaluation, and val / test AUC
    # at the evaluation of best validation AUC (the earliest on ties)
    val_auc: float | None = None
    test_auc: float | None = None
    val_auc_per_eval: list[float | None] = field(default_factory=list)
    test_auc_per_eval: list[float | None] = field(default_factory=list)


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
    validation epoch (the earliest on ties); None under ``--compute emulated``, whose
    kernels return zeros."""
    E = len(per_rank[0]["epoch_time_s"])  # epochs timed in this invocation
    epoch_max = [max(r["epoch_time_s"][e] for r in per_rank) for e in range(E)]
    bd_max = [{k: max(r["breakdown_s"][e].get(k, 0.0) for r in per_rank) for k in BREAKDOWN_KEYS}
              for e in range(E)]
    bytes_ep = [sum(r["bytes_sent"][e] for r in per_rank) for e in range(E)]
    if getattr(cfg, "compute", "real") == "emulated":
        evals = []  # the emulated device computes zeros: its accuracies measure nothing
    best = max(evals, key=lambda r: (r["val_acc"], -r["epoch"])) if evals else None
    aucs = [r for r in evals if r.get("val_auc") is not None]
    best_auc = max(aucs, key=lambda r: (r["val_auc"], -r["epoch"])) if aucs else None
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
        config=cfg.record() if hasattr(cfg, "record") else dataclasses.asdict(cfg),
        extra=dict(extra or {}),
        val_auc=best_auc["val_auc"] if best_auc else None,
        test_auc=best_auc.get("test_auc") if best_auc else None,
        val_auc_per_eval=[r["val_auc"] for r in evals] if aucs else [],
        test_auc_per_eval=[r.get("test_auc") for r in evals] if aucs else [],
    )


def bytes_by_class(sent_RES: Sequence[Sequence[Sequence[int]]], hosts_P: Sequence[str]) -> dict[str, float]:
    """{"intra": bytes, "inter": bytes}: the median over epochs of the bytes all ranks sent
    to peers on their own host / on another host. ``sent_RES[r][e][p]``: bytes rank r sent
    to rank p in epoch e; ``hosts_P[r]``: the host of rank r. Only the classes of the
    layout appear (intra when a host has 2+ ranks, inter when there are 2+ hosts)."""
    P = len(hosts_P)
    if len(sent_RES) != P:
        raise ValueError(f"bytes_by_class: {len(sent_RES)} ranks' bytes for {P} hosts_P entries")
    E = min((len(r) for r in sent_RES), default=0)
    out: dict[str, float] = {}
    for cls, same in (("intra", True), ("inter", False)):
        pairs = [(a, b) for a in range(P) for b in range(P)
                 if a != b and (hosts_P[a] == hosts_P[b]) == same]
        if pairs:
            out[cls] = float(median([sum(sent_RES[a][e][b] for a, b in pairs) for e in range(E)])) if E else 0.0
    return out


def emulated_report(cfg: Any, model_name: str, epochs_RE: Sequence[Sequence[Sequence[float]]],
                    epoch_time_s_RE: Sequence[Sequence[float]], *, setup_s: float) -> dict[str, Any]:
    """metrics.json's ``emulated`` entry of a ``--compute emulated`` run: the device model,
    the dilation k, each rank's host CPU share over its timed epochs (CPU seconds / wall
    seconds, :class:`~commsched.cluster.device.HostCPU`), its median device busy time per
    epoch, and the epoch time (the median over epochs of the slowest rank) with its
    prediction on the real cluster (measured / k); ``host_cpu_share_per_epoch``: each
    epoch's largest share over the ranks. ``epochs_RE[r][e]``: rank r's (host CPU s, wall
    s, device busy s) of epoch e."""
    k = cfg.dilation
    share = [sum(e[0] for e in r) / max(sum(e[1] for e in r), 1e-12) for r in epochs_RE]
    busy = [float(median([e[2] for e in r]) or 0.0) for r in epochs_RE]
    E = min((len(r) for r in epoch_time_s_RE), default=0)
    epoch = float(median([max(r[e] for r in epoch_time_s_RE) for e in range(E)]) or 0.0) if E else 0.0
    per_epoch = [max(r[e][0] / max(r[e][1], 1e-12) for r in epochs_RE) for e in range(E)] if epochs_RE else []
    return {"device_model": model_name, "dilation": k, "host_cpu_share_per_rank": share,
            "host_cpu_share_max": max(share, default=0.0), "host_cpu_share_per_epoch": per_epoch,
            "device_busy_s_per_epoch_per_rank": busy,
            "device_busy_share_max": max(busy, default=0.0) / epoch if epoch > 0 else 0.0,
            "epoch_time_s": epoch, "predicted_epoch_time_s": epoch / k,
            "setup_s": setup_s}


__all__ = ["AUC_BINS", "GNNMetrics", "auc_from_histograms", "auc_histograms", "bytes_by_class",
           "emulated_report", "summarize"]
