"""Cross-layer expert popularity estimation and the two-phase placement rule (Lina).

Legend: T tokens, L MoE layers, k experts per token per layer, E experts, J layers of
history (top-1 expert ids of the layers before the one estimated), U distinct paths.

A token's *path* at layer j, of length m, is its top-1 experts at layers j-m .. j-1.
:class:`PopularityEstimator` counts, from a profiling trace, for every layer j and every
path of length 1..max_path seen there, how often each expert was chosen at layer j (all
k choices of a token count). To estimate a batch's load at layer j it gives each token
the next-layer distribution of its longest path that was seen at least ``min_count``
times, backing off to shorter paths and finally to the layer's marginal distribution
(layer 0 has no history and always uses its marginal), and sums over tokens.

Accuracy (:func:`topk_overlap`) is the fraction of the actual top-k experts of a batch
that are also in the estimated top-k.

Phase 2 (:func:`phase2_decision`): after gating, compare the estimated and the actual
top-2k experts; re-plan from the actual load when their overlap falls below a threshold.
:func:`two_phase_placement` applies both phases to one layer.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .placement import Placement, plan_placement
from .traces import RoutingTrace

__all__ = [
    "PopularityEstimator",
    "topk_experts",
    "topk_overlap",
    "estimation_accuracy",
    "ReplanDecision",
    "phase2_decision",
    "two_phase_placement",
    "DEFAULT_REPLAN_THRESHOLD",
]

# phase-2 threshold on the top-2k overlap (Lina does not publish one). Chosen from the
# sweep of ``python -m commsched.bench.placement_report`` (docs/moe_inference.md): on the
# synthetic traces lower thresholds re-plan under 10% of layers and gain under 1% of
# imbalance, while 1.0 (re-plan whenever the top-2k sets differ) halves the gap to the
# oracle for one planner call per re-plan. The runtime should revisit it with measured
# re-plan cost.
DEFAULT_REPLAN_THRESHOLD = 1.0


def _path_codes(top1_TM: np.ndarray, E: int) -> np.ndarray:
    """[T] int64 code of each row's path (base-E digits, oldest layer most significant)."""
    code = np.zeros(top1_TM.shape[0], dtype=np.int64)
    for col in range(top1_TM.shape[1]):
        code = code * E + top1_TM[:, col]
    return code


@dataclass(frozen=True)
class _Table:
    codes_U: np.ndarray  # sorted path codes
    dist_UE: np.ndarray  # expected assignments per token of the path at the next layer
    count_U: np.ndarray  # tokens seen with that path


class PopularityEstimator:
    """Per-layer path tables fitted from a routing trace (see the module docstring).

    Build with :meth:`fit`. ``max_path`` is the longest path kept (Lina's l; default 3);
    every estimate may ask for any ``path_length`` up to it.
    """

    def __init__(self, num_experts: int, k: int, marginal_LE: np.ndarray,
                 tables: dict[tuple[int, int], _Table], max_path: int, min_count: int) -> None:
        self.num_experts = num_experts
        self.k = k
        self.num_layers = marginal_LE.shape[0]
        self.marginal_LE = marginal_LE  # expected assignments per token, rows sum to k
        self._tables = tables
        self.max_path = max_path
        self.min_count = min_count

    @classmethod
    def fit(cls, trace: RoutingTrace, max_path: int = 3, min_count: int = 1) -> PopularityEstimator:
        """Count next-layer experts per (layer, path) for paths of length 1..max_path."""
        if not isinstance(trace, RoutingTrace):
            raise TypeError(f"trace must be a RoutingTrace, got {type(trace).__name__}")
        for name, v in (("max_path", max_path), ("min_count", min_count)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        E, L, T = trace.num_experts, trace.num_layers, trace.num_tokens
        if T == 0:
            raise ValueError("cannot fit a popularity estimator on an empty trace")
        if max_path * np.log2(E) >= 62:
            raise ValueError(f"paths of {max_path} layers over {E} experts do not fit a 64-bit "
                             "code: use a shorter max_path")
        loads = trace.loads().astype(np.float64)
        marginal = loads / T
        top1 = trace.top1
        tables: dict[tuple[int, int], _Table] = {}
        for j in range(1, L):
            nxt = trace.experts[:, j, :]  # [T, k]
            for m in range(1, min(max_path, j) + 1):
                codes = _path_codes(top1[:, j - m:j], E)
                uniq, inv = np.unique(codes, return_inverse=True)
                U = uniq.size
                counts = np.bincount(inv, minlength=U)
                flat = (inv[:, None] * E + nxt).reshape(-1)
                dist = np.bincount(flat, minlength=U * E).reshape(U, E).astype(np.float64)
                tables[(j, m)] = _Table(uniq, dist / counts[:, None], counts)
        return cls(E, trace.k, marginal, tables, max_path, min_count)

    def _check_history(self, history, layer: int) -> np.ndarray:
        h = np.asarray(history)
        if h.ndim == 3:
            h = h[:, :, 0]
        if h.ndim != 2:
            raise ValueError(f"history must be [T, J] top-1 experts (or [T, J, k]), got shape "
                             f"{tuple(h.shape)}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must lie in 0..{self.num_layers - 1}, got {layer}")
        if h.shape[1] < layer:
            raise ValueError(f"history has {h.shape[1]} layers; estimating layer {layer} needs "
                             f"the top-1 experts of layers 0..{layer - 1}")
        if h.size and (h.min() < 0 or h.max() >= self.num_experts):
            raise ValueError(f"history holds expert ids outside 0..{self.num_experts - 1}")
        return h.astype(np.int64, copy=False)

    def token_distribution(self, history, layer: int, path_length: int | None = None,
                           return_used: bool = False):
        """[T, E] expected assignments of each token at ``layer`` (rows sum to k).

        history: [T, J] top-1 experts at layers 0..J-1 (J >= layer; a [T, J, k] trace
        slice is accepted and its top-1 column used). With ``return_used`` also returns
        [T] the path length used per token (0: the layer's marginal)."""
        l_path = self.max_path if path_length is None else path_length
        if isinstance(l_path, bool) or not isinstance(l_path, numbers.Integral) or not 1 <= l_path <= self.max_path:
            raise ValueError(f"path_length must lie in 1..{self.max_path} (the fitted max_path), "
                             f"got {path_length!r}")
        h = self._check_history(history, layer)
        T, E = h.shape[0], self.num_experts
        out = np.tile(self.marginal_LE[layer], (T, 1))
        used = np.zeros(T, dtype=np.int64)
        pending = np.ones(T, dtype=bool)
        for m in range(min(l_path, layer), 0, -1):
            if not pending.any():
                break
            tab = self._tables[(layer, m)]
            idx = np.flatnonzero(pending)
            codes = _path_codes(h[idx, layer - m:layer], E)
            pos = np.searchsorted(tab.codes_U, codes)
            pos_c = np.minimum(pos, tab.codes_U.size - 1)
            hit = (tab.codes_U[pos_c] == codes) & (tab.count_U[pos_c] >= self.min_count)
            rows = idx[hit]
            out[rows] = tab.dist_UE[pos_c[hit]]
            used[rows] = m
            pending[rows] = False
        return (out, used) if return_used else out

    def estimate_load(self, history, layer: int, path_length: int | None = None) -> np.ndarray:
        """[E] expected token assignments of a batch at ``layer`` (sums to T*k)."""
        return self.token_distribution(history, layer, path_length).sum(axis=0)


# --------------------------------------------------------------------------- accuracy
def topk_experts(load_E: Sequence[float] | np.ndarray, k: int) -> np.ndarray:
    """[min(k, E)] the k most loaded experts, ties broken by lower expert id."""
    load = np.asarray(load_E, dtype=np.float64)
    if load.ndim != 1:
        raise ValueError(f"load_E must be one-dimensional, got shape {tuple(load.shape)}")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    return np.lexsort((np.arange(load.size), -load))[:k]


def topk_overlap(estimated_E, actual_E, k: int) -> float:
    """|top-k(estimated) & top-k(actual)| / min(k, E): 1.0 when the sets agree."""
    est, act = np.asarray(estimated_E), np.asarray(actual_E)
    if est.shape != act.shape:
        raise ValueError(f"estimated and actual loads differ in shape: {est.shape} vs {act.shape}")
    a, b = topk_experts(est, k), topk_experts(act, k)
    return len(set(a.tolist()) & set(b.tolist())) / a.size


def estimation_accuracy(estimator: PopularityEstimator, batches: Sequence[RoutingTrace],
                        path_lengths: Sequence[int], top: int,
                        layers: Sequence[int] | None = None) -> dict[int, float]:
    """Mean top-``top`` overlap of estimated vs actual load over batches and ``layers``
    (default 1..L-1: layer 0 has no path and is left out), for each path length."""
    out: dict[int, float] = {}
    for m in path_lengths:
        scores = []
        for b in batches:
            actual = b.loads()
            for j in (range(1, b.num_layers) if layers is None else layers):
                est = estimator.estimate_load(b.top1, j, m)
                scores.append(topk_overlap(est, actual[j], top))
        out[int(m)] = float(np.mean(scores)) if scores else float("nan")
    return out


# --------------------------------------------------------------------------- phase 2
@dataclass(frozen=True)
class ReplanDecision:
    overlap: float  # |top-2k(estimated) & top-2k(actual)| / 2k
    replan: bool    # overlap < threshold


def phase2_decision(estimated_E, actual_E, k: int, threshold: float) -> ReplanDecision:
    """Lina's phase-2 test after gating: re-plan when the estimated and actual top-2k
    experts overlap by less than ``threshold`` (0 never re-plans; 1 re-plans unless the
    sets are identical)."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold is a fraction of the top-2k experts, in [0, 1]; got {threshold}")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k (experts per token) must be a positive int, got {k!r}")
    ov = topk_overlap(estimated_E, actual_E, 2 * k)
    return ReplanDecision(ov, ov < threshold)


def two_phase_placement(estimated_E, actual_E, num_devices: int, slots_per_device: int,
                        k: int, threshold: float,
                        planner: Callable[..., Placement] = plan_placement,
                        phase1: Placement | None = None) -> tuple[Placement, ReplanDecision]:
    """Both phases for one layer: plan from the estimate (or take ``phase1``, already
    planned before gating), then keep it or re-plan from the actual load by
    :func:`phase2_decision`. Returns the placement used, with device loads of the
    *actual* load, and the decision."""
    p1 = phase1 if phase1 is not None else planner(estimated_E, num_devices, slots_per_device)
    d = phase2_decision(estimated_E, actual_E, k, threshold)
    if d.replan:
        return planner(actual_E, num_devices, slots_per_device), d
    return p1.with_load(actual_E), d
