"""Slow twins of the placement's fast paths, kept as executable specifications: plain
loops that the tests in ``test_placement.py`` compare the package's numpy paths with.

Legend: E experts, N devices, S slots per device, H hosts, K candidates of a family.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from commsched.moe.placement import Placement
from commsched.moe.placement.checks import check_load
from commsched.moe.placement.search import FAMILIES, _first_least, apply_move
from commsched.moe.placement.split import _check_split_inputs
from commsched.moe.placement.types import even_origin


# --------------------------------------------------------------------------- local search
def candidates(C: np.ndarray, load: np.ndarray, S: int, tier: int, physical: bool = False
               ) -> tuple[int, dict[str, np.ndarray]]:
    """(busiest device d, family -> [K, args] int64): the feasible moves of ``tier`` (0 or
    1) of layout C [E, N], in the order of :mod:`commsched.moe.placement.search`;
    ``physical``: a slot holds one share (only transfer and add need a free one)."""
    N = C.shape[1]
    cnt = C.sum(axis=1)
    per = load / cnt
    dl = per @ C
    held = C.sum(axis=0) if physical else (C > 0).sum(axis=0)
    d = int(np.argsort(-dl, kind="stable")[0])
    es = np.flatnonzero(C[:, d])
    ar = np.arange(N)
    fs, ds = np.nonzero(C)
    keep = ds != d
    fs, ds = fs[keep], ds[keep]
    Ei = np.repeat(es, fs.size)
    Fi, Di = np.tile(fs, es.size), np.tile(ds, es.size)
    out: dict[str, np.ndarray] = {}
    if tier == 0:
        E2, D2 = np.meshgrid(es, ar, indexing="ij")
        ok = (D2 != d) & (held[D2] < S) if physical else (D2 != d) & ((C[E2, D2] > 0) | (held[D2] < S))
        pair = np.stack([E2[ok], D2[ok]], axis=1)
        out["transfer"] = pair
        ok = (Fi != Ei) & (per[Fi] < per[Ei])
        if not physical:
            ok &= ((held[Di] + (C[Ei, Di] == 0) - (C[Fi, Di] == 1) <= S)
                   & (held[d] + (C[Fi, d] == 0) - (C[Ei, d] == 1) <= S))
        out["swap"] = np.stack([Ei[ok], Fi[ok], Di[ok]], axis=1)
        out["add"] = pair
        out["drop"] = es[cnt[es] >= 2][:, None]
    else:
        ok = (Fi != Ei) & (cnt[Fi] >= 2)
        if not physical:
            ok &= held[Di] + (C[Ei, Di] == 0) - (C[Fi, Di] == 1) <= S
        out["retarget"] = np.stack([Ei[ok], Fi[ok], Di[ok]], axis=1)
    return d, out


def reference_step(C: np.ndarray, load_E: np.ndarray, S: int, physical: bool = False) -> tuple | None:
    """Slow twin of one move of :class:`~commsched.moe.placement.search.ShareSearch`: every
    feasible candidate applied to a copy of C [E, N] and every load recomputed; the best
    improving move is applied to C in place and returned as (family, *args); None at a
    local optimum."""
    load = np.asarray(load_E, dtype=np.float64)
    scale = max(1.0, float(load.sum()))
    eps, eps2 = 1e-12 * scale, 1e-12 * scale * scale
    dl = (load / C.sum(axis=1)) @ C
    cur_m, cur_ss = float(dl.max()), float(dl @ dl)
    for tier in range(len(FAMILIES)):
        d, cands = candidates(C, load, S, tier, physical)
        moves = [(kind, row) for kind in FAMILIES[tier] for row in cands[kind]]
        if not moves:
            continue
        m, ss = np.empty(len(moves)), np.empty(len(moves))
        for i, (kind, row) in enumerate(moves):
            T = C.copy()
            apply_move(T, kind, row, d)
            used = T.sum(axis=0) if physical else (T > 0).sum(axis=0)
            assert T.min() >= 0 and (T.sum(axis=1) >= 1).all() and (used <= S).all()
            v = (load / T.sum(axis=1)) @ T
            m[i], ss[i] = v.max(), v @ v
        better = (m < cur_m - eps) | ((m <= cur_m + eps) & (ss < cur_ss - eps2))
        if not better.any():
            continue
        pool = better & (m <= m[better].min() + eps)
        kind, row = moves[int(_first_least(pool, ss, eps2))]
        apply_move(C, kind, row, d)
        return (kind, *(int(x) for x in row))
    return None


# --------------------------------------------------------------------------- token split
def split_tokens_reference(expert_T: np.ndarray | Sequence[int], placement: Placement,
                           offset_E: np.ndarray | Sequence[int] | None = None,
                           source: int | None = None) -> np.ndarray:
    """Slow twin of :func:`~commsched.moe.placement.split_tokens`: a plain loop with one
    counter per expert."""
    ex, off = _check_split_inputs(expert_T, placement, offset_E, source)
    seen = [int(x) for x in off]
    out = []
    for e in ex.reshape(-1).tolist():
        devs = placement.candidates(e, source) if placement.device_host is not None else placement.replicas[e]
        out.append(devs[seen[e] % len(devs)])
        seen[e] += 1
    return np.asarray(out, dtype=np.int64).reshape(ex.shape)


# --------------------------------------------------------------------------- hosts
def host_local_loads_reference(replicas: Sequence[Sequence[int]], origin_HE: np.ndarray,
                               device_host: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slow twin of :func:`~commsched.moe.placement.host_local_loads`: one host's tokens of
    one expert at a time."""
    o = np.asarray(origin_HE, dtype=np.float64)
    host = list(device_host)
    N, H = len(host), o.shape[0]
    dl = np.zeros(N)
    out_H, in_H = np.zeros(H), np.zeros(H)
    for e, devs in enumerate(replicas):
        for h in range(H):
            t = float(o[h, e])
            if t == 0.0:
                continue
            local = [d for d in devs if host[d] == h]
            cand = local or list(devs)
            share = t / len(cand)
            for d in cand:
                dl[d] += share
            if not local:
                out_H[h] += t
                for d in cand:
                    in_H[host[d]] += share
    return dl, out_H, in_H


def cross_rows_reference(p: Placement, load_E: Sequence[float] | np.ndarray, device_host: Sequence[int],
                         origin_HE: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Slow twin of :func:`~commsched.moe.placement.cross_rows` for a flat placement: one
    host's tokens of one expert on one replica at a time."""
    hosts = list(device_host)
    load = check_load(load_E)
    o = even_origin(load, hosts) if origin_HE is None else np.asarray(origin_HE, dtype=np.float64)
    H = max(hosts) + 1
    out_H, in_H = np.zeros(H), np.zeros(H)
    for e, devs in enumerate(p.replicas):
        for h in range(H):
            for d in devs:
                if hosts[d] != h:
                    x = o[h, e] / len(devs)
                    out_H[h] += x
                    in_H[hosts[d]] += x
    return out_H, in_H
