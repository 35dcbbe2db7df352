"""Cross-layer expert popularity estimation and the two-phase placement rule (Lina).

Legend: T tokens, L MoE layers, k experts per token per layer, E experts, J layers of
history (top-1 expert ids of the layers before the one estimated), U distinct paths.

A token's *path* at layer j, of length m, is its top-1 experts at layers j-m .. j-1.
:class:`PopularityEstimator` counts, from routing batches (a profiling trace, or any
router's [T, L, k] expert ids fed in as they come), for every layer j and every path of
length 1..max_path seen there, how often each expert was chosen at layer j (all k
choices of a token count). It updates incrementally with bounded memory and can forget
old batches (exponential decay of the counts, a cap on the paths kept). To estimate a
batch's load at layer j it gives each token the next-layer distribution of its longest
path that was seen at least ``min_count`` times (decayed counts), backing off to shorter paths and finally to the layer's marginal distribution
(layer 0 has no history and always uses its marginal), and sums over tokens.

Accuracy (:func:`topk_overlap`) is the fraction of the actual top-k experts of a batch
that are also in the estimated top-k.

Phase 2 (:func:`phase2_decision`): after gating, compare the estimated and the actual
top-2k experts; re-plan from the actual load when their overlap falls below a threshold
(the strategies of :mod:`~commsched.moe.infer.policy` apply both phases).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..record.traces import RoutingTrace

__all__ = [
    "PopularityEstimator",
    "topk_experts",
    "topk_overlap",
    "estimation_accuracy",
    "ReplanDecision",
    "phase2_decision",
    "DEFAULT_REPLAN_THRESHOLD",
    "DEFAULT_MAX_PATH_ENTRIES",
]

# phase-2 threshold on the top-2k overlap (Lina does not publish one). Chosen from the
# sweep of ``python -m commsched.bench.moe.placement_report`` (docs/moe_inference.md): on the
# synthetic traces lower thresholds re-plan under 10% of layers and gain under 1% of
# imbalance, while 1.0 (re-plan whenever the top-2k sets differ) halves the gap to the
# oracle for one planner call per re-plan. The runtime should revisit it with measured
# re-plan cost.
DEFAULT_REPLAN_THRESHOLD = 1.0

# paths kept per (layer, path length) table of a streaming estimator (see
# PopularityEstimator): 4096 rows of E + 2 float64 each, 2 MiB per table at E = 64
DEFAULT_MAX_PATH_ENTRIES = 4096


def _path_codes(top1_TM: np.ndarray, E: int) -> np.ndarray:
    """[T] int64 code of each row's path (base-E digits, oldest layer most significant)."""
    code = np.zeros(top1_TM.shape[0], dtype=np.int64)
    for col in range(top1_TM.shape[1]):
        code = code * E + top1_TM[:, col]
    return code


def _positive_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class _Table:
    codes_U: np.ndarray  # sorted path codes
    sum_UE: np.ndarray   # (decayed) assignments to each expert at the next layer
    count_U: np.ndarray  # (decayed) tokens seen with that path; > 0


def _merge(old: _Table | None, new: _Table, decay: float, cap: int | None) -> _Table:
    """``old`` scaled by ``decay`` plus ``new``, then the ``cap`` heaviest paths kept
    (ties: lower code). Both inputs hold distinct codes, so each merged row gets at most
    one contribution from each: a plain indexed add, exact for integer counts."""
    if old is None:
        merged = new
    else:
        uniq, inv = np.unique(np.concatenate([old.codes_U, new.codes_U]), return_inverse=True)
        n_old = old.codes_U.size
        count = np.zeros(uniq.size)
        sums = np.zeros((uniq.size, new.sum_UE.shape[1]))
        if decay == 1.0:
            count[inv[:n_old]] = old.count_U
            sums[inv[:n_old]] = old.sum_UE
        else:
            count[inv[:n_old]] = old.count_U * decay
            sums[inv[:n_old]] = old.sum_UE * decay
        count[inv[n_old:]] += new.count_U
        sums[inv[n_old:]] += new.sum_UE
        merged = _Table(uniq, sums, count)
    if cap is not None and merged.codes_U.size > cap:
        keep = np.sort(np.lexsort((merged.codes_U, -merged.count_U))[:cap])
        merged = _Table(merged.codes_U[keep], merged.sum_UE[keep], merged.count_U[keep])
    return merged


class PopularityEstimator:
    """Per-layer path tables counted from routing batches (see the module docstring).

    Build one empty and feed it with :meth:`update` (streaming), or in one call with
    :meth:`fit` (a whole profiling trace). ``max_path`` is the longest path kept (Lina's
    l; default 3); every estimate may ask for any ``path_length`` up to it.

    Forgetting and memory. Before each update every count held so far is multiplied by
    ``decay`` (1.0, the default, forgets nothing; ``0.5 ** (1 / h)`` halves a batch's
    weight after h more updates), so an old routing pattern fades and a new one takes
    over. Each (layer, path length) table keeps at most ``max_entries`` paths, the ones
    with the largest (decayed) token count (ties: lower path code); a token whose path
    was dropped backs off to a shorter path as an unseen path does. Memory is therefore
    bounded by (L - 1) * max_path * max_entries * (E + 2) * 8 bytes for the tables plus
    the [L, E] marginal, whatever the number of tokens seen. ``max_entries=None`` keeps
    every path (the table grows with the distinct paths seen; :meth:`fit`'s default).
    With ``decay=1`` and no path dropped, updates with batches A then B equal one update
    (or :meth:`fit`) with A and B concatenated, exactly: counts are sums of integers.
    """

    def __init__(self, num_experts: int, num_layers: int, k: int, *, max_path: int = 3,
                 min_count: float = 1, decay: float = 1.0,
                 max_entries: int | None = DEFAULT_MAX_PATH_ENTRIES) -> None:
        self.num_experts = _positive_int("num_experts", num_experts)
        self.num_layers = _positive_int("num_layers", num_layers)
        self.k = _positive_int("k", k)
        self.max_path = _positive_int("max_path", max_path)
        if self.k > self.num_experts:
            raise ValueError(f"k={k} experts per token exceeds num_experts={num_experts}")
        if isinstance(min_count, bool) or not isinstance(min_count, numbers.Real) or not min_count > 0:
            raise ValueError(f"min_count must be a positive number (tokens a path needs), "
                             f"got {min_count!r}")
        self.min_count = min_count
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not 0.0 < decay <= 1.0:
            raise ValueError(f"decay is the weight old counts keep at each update, in (0, 1] "
                             f"(1.0 forgets nothing); got {decay!r}")
        self.decay = float(decay)
        if max_entries is not None:
            max_entries = _positive_int("max_entries", max_entries)
        self.max_entries = max_entries
        if self.max_path * np.log2(max(self.num_experts, 2)) >= 62:
            raise ValueError(f"paths of {max_path} layers over {num_experts} experts do not fit "
                             "a 64-bit code: use a shorter max_path")
        self.num_tokens = 0.0  # (decayed) tokens seen
        self._counts_LE = np.zeros((self.num_layers, self.num_experts))
        self._tables: dict[tuple[int, int], _Table] = {}

    @classmethod
    def fit(cls, trace: RoutingTrace, max_path: int = 3, min_count: float = 1,
            max_entries: int | None = None) -> PopularityEstimator:
        """An estimator counted from the whole of ``trace`` (one :meth:`update`; every path
        kept unless ``max_entries`` is given)."""
        if not isinstance(trace, RoutingTrace):
            raise TypeError(f"trace must be a RoutingTrace, got {type(trace).__name__}")
        est = cls(trace.num_experts, trace.num_layers, trace.k, max_path=max_path,
                  min_count=min_count, max_entries=max_entries)
        return est.update(trace)

    def _as_trace(self, batch) -> RoutingTrace:
        if isinstance(batch, RoutingTrace):
            tr = batch
        else:
            if hasattr(batch, "detach"):  # a torch tensor, on any device
                batch = batch.detach().cpu().numpy()
            tr = RoutingTrace(np.asarray(batch), self.num_experts, "update")
        if tr.num_experts != self.num_experts or tr.num_layers != self.num_layers or tr.k != self.k:
            raise ValueError(f"the batch has E={tr.num_experts}, L={tr.num_layers}, k={tr.k}; "
                             f"the estimator was built for E={self.num_experts}, "
                             f"L={self.num_layers}, k={self.k}")
        return tr

    def update(self, batch) -> PopularityEstimator:
        """Count one batch: a :class:`RoutingTrace`, or a plain int [T, L, k] array or
        tensor of expert ids (``batch[t, l, 0]`` the top-1 of token t at layer l, the k
        ids of one (t, l) distinct). Old counts are first scaled by ``decay``; tables are
        cut to ``max_entries`` paths. Returns ``self``."""
        tr = self._as_trace(batch)
        T, E, L = tr.num_tokens, self.num_experts, self.num_layers
        if T == 0:
            raise ValueError("cannot count an empty trace or batch (no tokens) into a "
                             "popularity estimator")
        d = self.decay
        self.num_tokens = self.num_tokens * d + T
        self._counts_LE = (self._counts_LE * d if d != 1.0 else self._counts_LE) + tr.loads()
        top1 = tr.top1
        for j in range(1, L):
            nxt = tr.experts[:, j, :]  # [T, k]
            for m in range(1, min(self.max_path, j) + 1):
                codes = _path_codes(top1[:, j - m:j], E)
                uniq, inv = np.unique(codes, return_inverse=True)
                U = uniq.size
                counts = np.bincount(inv, minlength=U).astype(np.float64)
                flat = (inv[:, None] * E + nxt).reshape(-1)
                sums = np.bincount(flat, minlength=U * E).reshape(U, E).astype(np.float64)
                self._tables[(j, m)] = _merge(self._tables.get((j, m)), _Table(uniq, sums, counts),
                                              d, self.max_entries)
        return self

    @property
    def marginal_LE(self) -> np.ndarray:
        """[L, E] expected assignments per token at each layer (rows sum to k)."""
        if self.num_tokens == 0:
            raise ValueError("the popularity estimator has seen no tokens yet: call update() "
                             "with a batch first")
        return self._counts_LE / self.num_tokens

    def num_paths(self) -> dict[tuple[int, int], int]:
        """(layer, path length) -> paths held in that table (at most ``max_entries``)."""
        return {key: int(t.codes_U.size) for key, t in sorted(self._tables.items())}

    def _check_history(self, history, layer: int) -> np.ndarray:
        if hasattr(history, "detach"):  # a torch tensor, on any device
            history = history.detach().cpu().numpy()
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
            out[rows] = tab.sum_UE[pos_c[hit]] / tab.count_U[pos_c[hit], None]
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
    if est.size == 0:
        raise ValueError("topk_overlap: the load vectors are empty; give one load per expert "
                         "(at least one expert)")
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


def phase2_decision(estimated_E, actual_E, k: int,
                    threshold: float = DEFAULT_REPLAN_THRESHOLD) -> ReplanDecision:
    """Lina's phase-2 test after gating: re-plan when the estimated and actual top-2k
    experts overlap by less than ``threshold`` (0 never re-plans; 1 re-plans unless the
    sets are identical)."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold is a fraction of the top-2k experts, in [0, 1]; got {threshold}")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k (experts per token) must be a positive int, got {k!r}")
    ov = topk_overlap(estimated_E, actual_E, 2 * k)
    return ReplanDecision(ov, ov < threshold)
