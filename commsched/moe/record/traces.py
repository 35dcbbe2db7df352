"""Routing traces (which experts each token chose at each MoE layer): file format,
validation, batching, statistics, and a seeded synthetic generator for scale studies.

Legend: T tokens, L MoE layers, k experts chosen per token per layer (top-k), E experts,
C token clusters of the synthetic generator, Q sequences.

Trace file (``.npz``, format version 1)
---------------------------------------
=================  ===============  ==================================================
key                type             meaning
=================  ===============  ==================================================
``experts``        int [T, L, k]    expert ids in 0..E-1; ``experts[t, l, 0]`` is token
                                    t's top-1 choice (highest gate) at layer l, then
                                    the rest of its top-k; the k ids of one (t, l) are
                                    distinct
``num_experts``    int scalar       E
``num_layers``     int scalar       L (must equal ``experts.shape[1]``)
``k``              int scalar       k (must equal ``experts.shape[2]``)
``source``         str scalar       where the trace comes from (model, checkpoint and
                                    text, or ``synthetic:`` and the generator config)
``format_version`` int scalar       1
``seq_ids``        int [T]          optional: the sequence of each token, non-decreasing
                                    (a sequence's tokens are contiguous); batches and
                                    profile/test splits keep sequences whole
=================  ===============  ==================================================

:func:`load_trace` rejects malformed files with one line naming the key at fault.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ...configurable import Config, option
from ...results import read_error

__all__ = [
    "FORMAT_VERSION",
    "RoutingTrace",
    "save_trace",
    "load_trace",
    "trace_stats",
    "SyntheticTraceConfig",
    "synthetic_trace",
]

FORMAT_VERSION = 1


def _fail(where: str, msg: str) -> ValueError:
    return ValueError(f"{where}: {msg}" if where else msg)


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    """Expert choices of T tokens at L layers (see the module docstring for the fields).

    experts: int [T, L, k]; seq_ids: int [T] non-decreasing, or None (each token its own
    sequence for batching purposes)."""

    experts: np.ndarray
    num_experts: int
    source: str = ""
    seq_ids: np.ndarray | None = None

    def __post_init__(self) -> None:
        _validate(self.experts, self.num_experts, self.seq_ids, where="")
        object.__setattr__(self, "experts", np.asarray(self.experts, dtype=np.int64))
        if self.seq_ids is not None:
            object.__setattr__(self, "seq_ids", np.asarray(self.seq_ids, dtype=np.int64))

    # ---------------------------------------------------------------- shape
    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def top1(self) -> np.ndarray:
        """[T, L] each token's top-1 expert per layer (the path the estimator follows)."""
        return self.experts[:, :, 0]

    # ---------------------------------------------------------------- loads and slices
    def loads(self) -> np.ndarray:
        """[L, E] int64 token assignments per layer and expert (all k choices count)."""
        L, E = self.num_layers, self.num_experts
        flat = (np.arange(L)[None, :, None] * E + self.experts).reshape(-1)
        return np.bincount(flat, minlength=L * E).reshape(L, E)

    def select(self, idx: np.ndarray | slice) -> RoutingTrace:
        """The trace of a subset of tokens (an index array or a slice)."""
        seq = None if self.seq_ids is None else self.seq_ids[idx]
        return RoutingTrace(self.experts[idx], self.num_experts, self.source, seq)

    def sequence_bounds(self) -> np.ndarray:
        """[Q+1] token offsets where sequences start (and the end)."""
        T = self.num_tokens
        if self.seq_ids is None:
            return np.arange(T + 1)
        starts = np.flatnonzero(np.diff(self.seq_ids)) + 1
        return np.concatenate([[0], starts, [T]])

    def split(self, fraction: float) -> tuple[RoutingTrace, RoutingTrace]:
        """(first part, rest): the first ``fraction`` of the sequences and the rest, e.g.
        a profiling trace to fit the estimator and a held-out trace to test it."""
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"fraction must lie strictly between 0 and 1, got {fraction}")
        b = self.sequence_bounds()
        q = len(b) - 1
        if q < 2:
            raise ValueError("the trace has fewer than two sequences: nothing to split")
        cut = int(b[min(q - 1, max(1, round(q * fraction)))])
        return self.select(slice(0, cut)), self.select(slice(cut, self.num_tokens))

    def batches(self, tokens_per_batch: int) -> list[RoutingTrace]:
        """Consecutive batches of whole sequences, each with at least ``tokens_per_batch``
        tokens where possible (a trailing remainder of fewer tokens is dropped so that
        every batch is comparable)."""
        if tokens_per_batch < 1:
            raise ValueError(f"tokens_per_batch must be at least 1, got {tokens_per_batch}")
        out: list[RoutingTrace] = []
        start = 0
        for end in self.sequence_bounds()[1:]:
            if end - start >= tokens_per_batch:
                out.append(self.select(slice(start, int(end))))
                start = int(end)
        return out


def _validate(experts: Any, num_experts: Any, seq_ids: Any, where: str) -> None:
    ex = np.asarray(experts)
    if ex.ndim != 3:
        raise _fail(where, f"'experts' must be a [T, L, k] array (tokens x layers x top-k), "
                           f"got shape {tuple(ex.shape)}")
    if ex.size and not np.issubdtype(ex.dtype, np.integer):
        raise _fail(where, f"'experts' must hold integer expert ids, got dtype {ex.dtype}")
    if ex.shape[1] < 1 or ex.shape[2] < 1:
        raise _fail(where, f"'experts' needs at least one layer and k >= 1, got shape "
                           f"{tuple(ex.shape)}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)):
        raise _fail(where, f"'num_experts' must be an int, got {num_experts!r}")
    if num_experts < ex.shape[2]:
        raise _fail(where, f"'num_experts' is {num_experts}, fewer than k={ex.shape[2]}")
    if ex.size:
        lo, hi = int(ex.min()), int(ex.max())
        if lo < 0 or hi >= num_experts:
            raise _fail(where, f"'experts' holds ids {lo}..{hi}, outside 0..{num_experts - 1}")
        if ex.shape[2] > 1:
            s = np.sort(ex, axis=2)
            dup = (s[:, :, 1:] == s[:, :, :-1]).any(axis=2)
            if dup.any():
                t, l = (int(x) for x in np.argwhere(dup)[0])
                raise _fail(where, f"'experts' repeats an expert in the top-k of token {t} "
                                   f"at layer {l}: {ex[t, l].tolist()} (top-k ids are distinct)")
    if seq_ids is not None:
        sq = np.asarray(seq_ids)
        if sq.shape != (ex.shape[0],):
            raise _fail(where, f"'seq_ids' must have shape [T] = ({ex.shape[0]},), "
                               f"got {tuple(sq.shape)}")
        if sq.size and not np.issubdtype(sq.dtype, np.integer):
            raise _fail(where, f"'seq_ids' must be integers, got dtype {sq.dtype}")
        if sq.size > 1 and (np.diff(sq) < 0).any():
            raise _fail(where, "'seq_ids' must be non-decreasing (keep each sequence's "
                               "tokens contiguous)")


# --------------------------------------------------------------------------- files
def save_trace(path: str | os.PathLike, trace: RoutingTrace) -> None:
    """Write ``trace`` as a version-1 trace npz (compressed)."""
    arrays: dict[str, Any] = {
        "experts": trace.experts.astype(np.int16 if trace.num_experts <= 32767 else np.int32),
        "num_experts": np.int64(trace.num_experts),
        "num_layers": np.int64(trace.num_layers),
        "k": np.int64(trace.k),
        "source": np.str_(trace.source),
        "format_version": np.int64(FORMAT_VERSION),
    }
    if trace.seq_ids is not None:
        arrays["seq_ids"] = trace.seq_ids
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def _scalar_int(z: Any, key: str, where: str) -> int:
    v = z[key]
    if v.shape != () or not np.issubdtype(v.dtype, np.integer):
        raise _fail(where, f"'{key}' must be an integer scalar, got {v.dtype} of shape "
                           f"{tuple(v.shape)}")
    return int(v)


def load_trace(path: str | os.PathLike) -> RoutingTrace:
    """Read a trace npz (format above). Malformed files raise ValueError naming the key."""
    where = f"trace file {os.fspath(path)}"
    try:
        z = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: not a readable npz file ({read_error(e)})") from None
    except Exception as e:  # noqa: BLE001 - zipfile.BadZipFile and kin for a damaged archive
        raise ValueError(f"{where}: not a readable npz file, corrupt or truncated ({read_error(e)})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise _fail(where, "holds a single array, not a routing trace archive (.npz)")
    try:
        return _read_trace(z, where)
    except ValueError as e:
        if str(e).startswith(where):
            raise
        raise ValueError(f"{where}: unreadable array ({read_error(e)})") from None
    except Exception as e:  # noqa: BLE001 - a bad CRC or truncated member surfaces on first read
        raise ValueError(f"{where}: unreadable, the file is corrupt or truncated ({read_error(e)})") from None
    finally:
        z.close()


def _read_trace(z: Any, where: str) -> RoutingTrace:
    for key in ("experts", "num_experts", "num_layers", "k", "format_version"):
        if key not in z.files:
            raise _fail(where, f"missing key '{key}' (a routing trace needs experts, "
                               "num_experts, num_layers, k, format_version)")
    version = _scalar_int(z, "format_version", where)
    if version != FORMAT_VERSION:
        raise _fail(where, f"format_version {version} is not supported (this code reads "
                           f"version {FORMAT_VERSION})")
    experts = z["experts"]
    E = _scalar_int(z, "num_experts", where)
    seq = z["seq_ids"] if "seq_ids" in z.files else None
    _validate(experts, E, seq, where)
    for key, axis in (("num_layers", 1), ("k", 2)):
        if _scalar_int(z, key, where) != experts.shape[axis]:
            raise _fail(where, f"'{key}' is {int(z[key])} but 'experts' has "
                               f"{experts.shape[axis]} along axis {axis}")
    source = str(z["source"]) if "source" in z.files else ""
    return RoutingTrace(experts, E, source, seq)


# --------------------------------------------------------------------------- statistics
def trace_stats(trace: RoutingTrace, tokens_per_batch: int | None = None) -> dict[str, float]:
    """Skew and stickiness of a trace.

    * ``max_over_mean`` / ``max_over_min``: busiest expert's load over the mean (resp.
      the least loaded expert's) per layer over the whole trace, averaged over layers
      (``max_over_min`` is inf when an expert gets no token).
    * ``batch_max_over_mean``: the same per batch of ``tokens_per_batch``, averaged over
      batches and layers (when given).
    * ``stickiness``: fraction of (token, layer l >= 1) whose top-1 expert equals its
      top-1 at layer l-1.
    """
    loads = trace.loads().astype(np.float64)
    mean = loads.mean(axis=1)
    out: dict[str, float] = {
        "tokens": float(trace.num_tokens),
        "max_over_mean": float(np.mean(loads.max(axis=1) / np.maximum(mean, 1e-300))),
        "max_over_min": float(np.mean(loads.max(axis=1) / loads.min(axis=1)))
        if (loads.min(axis=1) > 0).all() else math.inf,
    }
    if trace.num_layers > 1 and trace.num_tokens:
        t1 = trace.top1
        out["stickiness"] = float((t1[:, 1:] == t1[:, :-1]).mean())
    if tokens_per_batch:
        ratios = []
        for b in trace.batches(tokens_per_batch):
            bl = b.loads().astype(np.float64)
            ratios.append(bl.max(axis=1) / bl.mean(axis=1))
        if ratios:
            out["batch_max_over_mean"] = float(np.mean(ratios))
    return out


# --------------------------------------------------------------------------- generator
POPULARITY = ("zipf", "lognormal")
RELATED = ("same", "permuted")


@dataclass(frozen=True, kw_only=True)
class SyntheticTraceConfig(Config):
    """Parameters of :func:`synthetic_trace`.

    Model: each layer l has a skewed base popularity b_l over experts (Zipf with exponent
    ``zipf_s`` or log-normal weights with ``lognormal_sigma``, in a random expert order
    per layer, so the popular experts differ between layers). There are C token
    clusters; cluster c prefers experts by q_{c,l} ~ Dirichlet(cluster_concentration * E
    * b_l), whose mean is b_l (small concentration: peaky preferences, so a token's path
    reveals its cluster). Each sequence draws a mixture over clusters ~
    Dirichlet(sequence_concentration) (small: a sequence is about a few clusters, so
    batches differ in which experts are popular), and each of its tokens a cluster from it.
    At layer 0 a token samples its top-k from q_{c,0}; at each later layer, with
    probability ``stickiness`` its top-1 is the *related* expert of its previous top-1
    (``related="same"``: the same expert id; ``"permuted"``: a fixed random permutation
    per layer), otherwise it samples from q_{c,l}; the other k-1 choices are sampled
    from q_{c,l} without replacement.

    The defaults (16 experts, top-2, Zipf 1.2, stickiness 0.39) give a busiest expert
    about 4.2x the mean load and about 42% top-1 same-expert stickiness, in the range
    Lina reports (docs/moe_inference.md has the measured values and a milder preset).
    """

    num_experts: int = option(16, "synthetic trace: E", flag="--experts")
    num_layers: int = option(12, "synthetic trace: L", flag="--layers")
    k: int = option(2, "synthetic trace: experts per token")
    num_tokens: int = option(65536, "synthetic trace: tokens", flag="--trace-tokens")
    seq_len: int = option(64, "synthetic trace: tokens per sequence")
    popularity: str = option("zipf", "synthetic trace: base popularity", choices=("zipf", "lognormal"))
    zipf_s: float = option(1.2, "synthetic trace: Zipf exponent", flag="--zipf")
    lognormal_sigma: float = option(1.0, "synthetic trace: lognormal sigma", flag="--sigma")
    stickiness: float = option(0.39, "synthetic trace: probability that a token's top-1 follows its previous top-1")
    related: str = option("same", cli=False)
    num_clusters: int = option(32, cli=False)
    cluster_concentration: float = option(0.05, "synthetic trace: concentration of the clusters' preferences")
    sequence_concentration: float = option(0.1, cli=False)

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_layers", "k", "num_tokens", "seq_len", "num_clusters"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.k > self.num_experts:
            raise ValueError(f"k={self.k} exceeds num_experts={self.num_experts}")
        if self.related not in RELATED:
            raise ValueError(f"related must be one of {RELATED}, got {self.related!r}")
        if not 0.0 <= self.stickiness <= 1.0:
            raise ValueError(f"stickiness is a probability in [0, 1], got {self.stickiness}")
        for name in ("zipf_s", "lognormal_sigma"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("cluster_concentration", "sequence_concentration"):
            if not getattr(self, name) > 0.0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def _base_popularity(cfg: SyntheticTraceConfig, rng: np.random.Generator) -> np.ndarray:
    """[L, E] per-layer base popularity (rows sum to 1), experts shuffled per layer."""
    E, L = cfg.num_experts, cfg.num_layers
    out = np.empty((L, E))
    for l in range(L):
        if cfg.popularity == "zipf":
            w = np.arange(1, E + 1, dtype=np.float64) ** -cfg.zipf_s
        else:
            w = np.exp(cfg.lognormal_sigma * rng.standard_normal(E))
        out[l] = w[rng.permutation(E)] / w.sum()
    return out


def synthetic_trace(cfg: SyntheticTraceConfig | None = None, seed: int = 0) -> RoutingTrace:
    """A seeded synthetic routing trace (model in :class:`SyntheticTraceConfig`).

    Same config and seed give the same trace. Tokens come in sequences of ``seq_len``
    (the last one may be shorter); ``seq_ids`` is set."""
    cfg = cfg or SyntheticTraceConfig()
    rng = np.random.default_rng(seed)
    E, L, k, T, C = cfg.num_experts, cfg.num_layers, cfg.k, cfg.num_tokens, cfg.num_clusters
    base_LE = _base_popularity(cfg, rng)
    # q[c, l] ~ Dirichlet(alpha * E * base_l); floored so log() stays finite
    q_CLE = np.empty((C, L, E))
    for l in range(L):
        q_CLE[:, l] = rng.dirichlet(cfg.cluster_concentration * E * base_LE[l], size=C)
    logq_CLE = np.log(np.maximum(q_CLE, 1e-12))
    related_LE = np.tile(np.arange(E), (L, 1))
    if cfg.related == "permuted":
        for l in range(1, L):
            related_LE[l] = rng.permutation(E)
    seq_T = np.arange(T) // cfg.seq_len
    Q = int(seq_T[-1]) + 1
    mix_QC = rng.dirichlet(np.full(C, cfg.sequence_concentration), size=Q)
    cum_QC = np.cumsum(mix_QC, axis=1)
    u = rng.random(T)
    cluster_T = np.minimum((cum_QC[seq_T] < u[:, None]).sum(axis=1), C - 1)

    experts = np.empty((T, L, k), dtype=np.int64)
    rows = np.arange(T)
    for l in range(L):
        # Gumbel-top-k: the k largest of log q + Gumbel noise are a sample without
        # replacement from q, in order of selection
        score_TE = logq_CLE[cluster_T, l] + rng.gumbel(size=(T, E))
        if l > 0:
            stick = rng.random(T) < cfg.stickiness
            kept = related_LE[l][experts[:, l - 1, 0]]
            score_TE[rows[stick], kept[stick]] = np.inf
        experts[:, l] = np.argsort(-score_TE, axis=1, kind="stable")[:, :k]
    src = "synthetic:" + ",".join(f"{k_}={v}" for k_, v in asdict(cfg).items()) + f",seed={seed}"
    return RoutingTrace(experts, E, src, seq_T)
