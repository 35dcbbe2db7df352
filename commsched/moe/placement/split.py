"""The token split: which replica of its expert each token goes to (round robin, equal
shares within one token), flat or host-local.

Legend: E experts, T tokens (or token assignments), P source ranks.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np

from .types import Placement


def split_offsets(counts_PE: Sequence[Sequence[int]] | np.ndarray,
                  placement: Placement | None = None) -> np.ndarray:
    """[P, E] exclusive prefix over source ranks of per-rank expert token counts.

    Passing ``offset_E=split_offsets(counts)[p]`` to :func:`split_tokens` on rank p makes
    the round robin continue where rank p-1 stopped, so each replica of an expert gets
    an equal share (within one token) of the tokens of *all* ranks together. With a
    host-local ``placement`` (``device_host`` set; ranks are its devices) the prefix runs
    over the ranks that split over the same replicas (:meth:`Placement.candidates`): the
    ranks of one host where it holds the expert, else every rank of a host that does not."""
    c = np.asarray(counts_PE, dtype=np.int64)
    if c.ndim != 2 or (c < 0).any():
        raise ValueError("counts_PE must be a [P, E] array of non-negative token counts")
    if placement is None or placement.device_host is None:
        return np.cumsum(c, axis=0) - c
    P, E = c.shape
    if (P, E) != (placement.num_devices, placement.num_experts):
        raise ValueError(f"counts_PE must be [N, E] = [{placement.num_devices}, {placement.num_experts}] "
                         f"for a host-local placement, got {c.shape}")
    host = placement.device_host
    off = np.zeros_like(c)
    for e, devs in enumerate(placement.replicas):
        held = {host[d] for d in devs}
        seen: dict[int, int] = {}
        for p in range(P):
            key = host[p] if host[p] in held else -1  # -1: hosts without a replica share all of them
            off[p, e] = seen.get(key, 0)
            seen[key] = off[p, e] + c[p, e]
    return off


def _check_split_inputs(expert_T, placement: Placement, offset_E, source) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a Placement, got {type(placement).__name__}")
    ex = np.asarray(expert_T)
    if ex.size and not np.issubdtype(ex.dtype, np.integer):
        raise TypeError(f"expert ids must be integers, got dtype {ex.dtype}")
    ex = ex.astype(np.int64, copy=False)
    E = placement.num_experts
    if ex.size and (ex.min() < 0 or ex.max() >= E):
        raise ValueError(f"expert ids must lie in 0..{E - 1}, got {int(ex.min())}..{int(ex.max())}")
    off = np.zeros(E, dtype=np.int64) if offset_E is None else np.asarray(offset_E, np.int64)
    if off.shape != (E,):
        raise ValueError(f"offset_E must have one entry per expert ({E}), got shape {off.shape}")
    if placement.device_host is not None and not (isinstance(source, numbers.Integral)
                                                  and 0 <= source < placement.num_devices):
        raise ValueError(f"a host-local placement splits by the tokens' host: pass source, the rank "
                         f"(0..{placement.num_devices - 1}) whose tokens these are; got {source!r}")
    return ex, off


def _cands(placement: Placement, source: int | None) -> list[tuple[int, ...]]:
    if placement.device_host is None:
        return list(placement.replicas)
    return [placement.candidates(e, int(source)) for e in range(placement.num_experts)]


def split_tokens(expert_T: np.ndarray | Sequence[int], placement: Placement,
                 offset_E: np.ndarray | Sequence[int] | None = None, source: int | None = None) -> np.ndarray:
    """Device of each token: the i-th token (in flattened order) routed to expert e goes
    to ``placement.replicas[e][(offset_E[e] + i) % len(replicas[e])]`` -- with a
    host-local placement, to the i-th (from ``offset_E[e]``) of
    ``placement.candidates(e, source)``.

    expert_T: int array of any shape (e.g. [T] or [T, k]) of expert ids.
    offset_E: [E] starting position of each expert's round robin (default zeros; see
    :func:`split_offsets` to balance across source ranks).
    source: the rank whose tokens these are (required for a host-local placement).
    Returns an int64 array of the same shape. The tests hold its one-token-at-a-time twin
    (a plain loop with one counter per expert)."""
    ex, off = _check_split_inputs(expert_T, placement, offset_E, source)
    flat = ex.reshape(-1)
    E = placement.num_experts
    cands = _cands(placement, source)
    rmax = max(len(c) for c in cands)
    table = np.zeros((E, rmax), dtype=np.int64)
    for e, devs in enumerate(cands):
        table[e, :len(devs)] = devs
    r = np.asarray([len(c) for c in cands], dtype=np.int64)
    order = np.argsort(flat, kind="stable")
    sorted_ex = flat[order]
    starts = np.searchsorted(sorted_ex, np.arange(E))
    pos = np.empty_like(flat)
    pos[order] = np.arange(flat.size) - starts[sorted_ex]
    slot = (off[flat] + pos) % r[flat]
    return table[flat, slot].reshape(ex.shape)


__all__ = ["split_offsets", "split_tokens"]
