"""Local search on the maximum device load, in numpy: every move that involves the
busiest device scored at once.

A layout here is a multiplicity matrix ``C_EN`` (int64): ``C[e, d]`` shares of expert e on
device d; expert e's load splits into ``C[e].sum()`` equal shares, so a device holding m of
them carries m of those shares (one copy of e's weights: a slot counts distinct experts).
A :class:`~.types.Placement` lists device d m times in ``replicas[e]``.

Moves, all involving the busiest device d (lowest id among equals) and one expert e held
there, in two tiers (the second is scored only when the first has no improving move):

tier 1
  * ``transfer`` (e, d2): one share of e goes from d to d2 (d2 holds e already or has a
    free slot)
  * ``swap`` (e, f, d2): one share of e on d and one of f on d2 trade places (f's share
    smaller than e's; slots permitting on both)
  * ``add`` (e, d2): e gains a share on d2 (all of e's shares shrink)
  * ``drop`` (e,): e loses its share on d (e keeps at least one)
tier 2
  * ``retarget`` (e, f, d2): one share of f on d2 (f keeps at least one) becomes a share of e

With ``physical=True`` a slot holds one *share* (EPLB's physical expert slots: a device
holding m shares of an expert uses m of its S slots): ``transfer`` and ``add`` need a free
slot on d2, while ``swap``, ``retarget`` and ``drop`` never need one (they keep or lower
every device's share count).

The step applies the best improving move: lowest maximum device load, then lowest sum of
squared loads (each within 1e-12 of the total load, or of its square: sums that differ only
in their last bits tie), then the first in the order above (families in
that order; within a family e ascending, then d2 or the share (f, d2) in C's row-major
order). :meth:`ShareSearch.step` scores a family of every start at once from the top three
device loads (moves that change two devices) or per-row top two (moves that change all of
an expert's devices); the tests hold its slow twin, which applies each candidate to a copy
and recomputes every load.

Legend: E experts, N devices, S slots per device.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from .packing import lpt_shares
from .types import Placement, device_loads, make_placement, matrix_key

FAMILIES = (("transfer", "swap", "add", "drop"), ("retarget",))
# the thorough count search decodes this many neighbours at once (one ShareSearch batch)
COUNT_CHUNK = 32


def counts_matrix(replicas, E: int, N: int) -> np.ndarray:
    """[E, N] int64 shares of each expert on each device of a replica list."""
    lens = np.fromiter((len(r) for r in replicas), dtype=np.int64, count=len(replicas))
    flat = np.fromiter(itertools.chain.from_iterable(replicas), dtype=np.int64, count=int(lens.sum()))
    return np.bincount(np.repeat(np.arange(E), lens) * N + flat, minlength=E * N).reshape(E, N)


def matrix_replicas(C_EN: np.ndarray) -> list[list[int]]:
    """The replica lists of a multiplicity matrix (device d repeated C[e, d] times)."""
    N = C_EN.shape[1]
    ar = np.arange(N)
    return [np.repeat(ar, row).tolist() for row in C_EN]


def _top2(V: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(max, argmax, second largest) along the last axis (-inf when there is one column)."""
    a1 = V.argmax(axis=-1)
    if a1.ndim == 1:
        idx: tuple = (np.arange(a1.shape[0]), a1)
    else:
        idx = tuple(np.arange(n).reshape((-1,) + (1,) * (a1.ndim - 1 - i)) for i, n in enumerate(a1.shape)) + (a1,)
    t1 = V[idx]
    if V.shape[-1] == 1:
        return t1, a1, np.full_like(t1, -np.inf)
    W = V.copy()
    W[idx] = -np.inf
    return t1, a1, W.max(axis=-1)


def _first_least(pool: np.ndarray, ss: np.ndarray, eps2: float) -> np.ndarray:
    """Along the last axis: the first candidate of ``pool`` whose sum of squares is within
    ``eps2`` of the pool's least (the choice rule's tie: equal sums computed by different
    formulas, or summed in another order by another numpy build, may differ in the last bits)."""
    s = np.where(pool, ss, np.inf)
    return np.argmax(pool & (s <= s.min(axis=-1, keepdims=True) + eps2), axis=-1)


def apply_move(C: np.ndarray, kind: str, a, d: int) -> None:
    """Apply move (kind, *a) of the busiest device d to the share matrix C in place."""
    if kind == "transfer":
        C[a[0], d] -= 1
        C[a[0], a[1]] += 1
    elif kind == "swap":
        C[a[0], d] -= 1
        C[a[1], a[2]] -= 1
        C[a[0], a[2]] += 1
        C[a[1], d] += 1
    elif kind == "add":
        C[a[0], a[1]] += 1
    elif kind == "drop":
        C[a[0], d] -= 1
    elif kind == "retarget":
        C[a[1], a[2]] -= 1
        C[a[0], a[2]] += 1
    else:  # pragma: no cover - internal
        raise AssertionError(kind)


class ShareSearch:
    """Local search on B layouts ``C`` [B, E, N] in lockstep (see the module docstring), one
    numpy call per formula for all of them (on small instances the per-call overhead, not
    the arithmetic, is the step's cost); one layout is a batch of one. A start at its local
    optimum stops, the others go on. The retarget tier holds a [R, S, E, N] array (R the
    starts without a tier-1 move). Legend adds B starts, A the starts still moving, P the
    shares off a start's busiest device (padded to the most of any start)."""

    def __init__(self, Cs_BEN: Sequence[np.ndarray], load_E: np.ndarray, slots_per_device: int,
                 physical: bool = False) -> None:
        self.C = np.array(np.stack(Cs_BEN), dtype=np.int64)
        self.load = np.asarray(load_E, dtype=np.float64)
        self.B, self.E, self.N = self.C.shape
        self.S = int(slots_per_device)
        self.physical = bool(physical)  # a slot holds one share, not one expert (module docstring)
        scale = max(1.0, float(self.load.sum()))
        self.eps = 1e-12 * scale
        self.eps2 = 1e-12 * scale * scale
        self.steps = np.zeros(self.B, dtype=np.int64)

    def run(self, max_steps: int) -> np.ndarray:
        """Up to ``max_steps`` moves per start; returns [B] the moves each made."""
        active = np.arange(self.B)
        for _ in range(max_steps):
            if active.size == 0:
                break
            moved = np.array([m is not None for m in self.step(active)], dtype=bool)
            self.steps[active[moved]] += 1
            active = active[moved]
        return self.steps

    def step(self, act: np.ndarray | None = None) -> list[tuple | None]:
        """Apply the best improving move (module docstring) to each start in ``act``
        (default all); returns per start the move as (family, *args), None at a local
        optimum."""
        act = np.arange(self.B) if act is None else act
        load, N, S = self.load, self.N, self.S
        C = self.C[act]                                       # [A, E, N]
        A = act.size
        ai = np.arange(A)
        ac = ai[:, None]
        cnt = C.sum(axis=2)                                   # [A, E]
        per = load[None, :] / cnt
        dl = np.stack([per[i] @ C[i] for i in range(A)])      # [A, N], per start (the same sums alone or batched)
        order = np.argsort(-dl, axis=1, kind="stable")
        pos = C > 0
        held = C.sum(axis=1) if self.physical else pos.sum(axis=1)  # [A, N] slots in use
        cur_m = dl.max(axis=1)
        cur_ss = np.array([float(dl[i] @ dl[i]) for i in range(A)])
        d = order[:, 0]
        if N > 1:
            t1 = order[:, 1]
            u1 = dl[ai, t1]
        else:
            t1, u1 = np.full(A, -1), np.full(A, -np.inf)
        u2 = dl[ai, order[:, 2]] if N > 2 else np.full(A, -np.inf)
        ss0 = cur_ss[:, None, None]
        dd = dl[ai, d]                                        # [A] busiest load
        # the experts on the busiest device, ascending, padded to S (the padding masked)
        on = pos[ai, :, d]                                    # [A, E]
        K = min(S, self.E)                                    # experts a device can hold
        es = np.argsort(~on, axis=1, kind="stable")[:, :K]    # [A, K] (S written for K below)
        ev = on[ac, es]               # [A, S] valid
        G = C[ai[:, None], es, :]                             # [A, S, N]
        pe = per[ac, es]              # [A, S]
        ar = np.arange(N)
        # the shares (f, d2) off the busiest device in C's row-major order, padded to P
        off = pos & (ar[None, None, :] != d[:, None, None])
        rows, cols = np.nonzero(off.reshape(A, -1))
        P_A = np.bincount(rows, minlength=A)
        P = int(P_A.max()) if rows.size else 0
        slot = np.arange(rows.size) - np.repeat(np.cumsum(P_A) - P_A, P_A)
        flat = np.zeros((A, P), dtype=np.int64)
        flat[rows, slot] = cols
        pv = np.zeros((A, P), dtype=bool)
        pv[rows, slot] = True
        fs, ds = np.divmod(flat, N)                           # [A, P]
        G_ds = G[ai[:, None, None], np.arange(K)[None, :, None], ds[:, None, :]]  # C[e, d2]
        C_fd2 = C[ai[:, None], fs, ds]                        # [A, P]
        held_d2 = held[ac, ds]
        slot_ok_d2 = held_d2[:, None, :] + (G_ds == 0) - (C_fd2 == 1)[:, None, :] <= S  # [A, S, P]
        if self.physical:  # a share for a share: d2's slots in use do not change
            slot_ok_d2 = np.ones_like(slot_ok_d2)
        p_add = load[None, :] / (cnt + 1)
        base = dl[:, None, :] + (p_add - per)[ac, es][:, :, None] * G  # [A, S, N]
        inf = np.inf
        ddc = dd[:, None]

        # tier 1: transfer, swap, add, drop
        room = (held < S)[:, None, :]
        pair_ok = ev[:, :, None] & (ar[None, :] != d[:, None])[:, None, :] & (room if self.physical else (G > 0) | room)
        x = ddc - pe                                          # [A, S]
        y = dl[:, None, :] + pe[:, :, None]
        rest = np.where(ar[None, :] == t1[:, None], u2[:, None], u1[:, None])  # [A, N]
        m_t = np.where(pair_ok, np.maximum(np.maximum(x[:, :, None], y), rest[:, None, :]), inf)
        ss_t = ss0 + (x * x)[:, :, None] - (dd ** 2)[:, None, None] + y * y - (dl * dl)[:, None, :]
        per_f = per[ac, fs]           # [A, P]
        C_fd = C[ai[:, None], fs, d[:, None]]                 # [A, P]
        C_ed = C[ai[:, None], es, d[:, None]]                 # [A, S]
        held_d = held[ai, d]
        ok = (ev[:, :, None] & pv[:, None, :] & (fs[:, None, :] != es[:, :, None])
              & (per_f[:, None, :] < pe[:, :, None]) & slot_ok_d2
              & (self.physical | (held_d[:, None, None] + (C_fd == 0)[:, None, :] - (C_ed == 1)[:, :, None] <= S)))
        delta = pe[:, :, None] - per_f[:, None, :]
        dl_ds = dl[ac, ds]            # [A, P]
        xs, ys = ddc[:, :, None] - delta, dl_ds[:, None, :] + delta
        rest_s = np.where(ds == t1[:, None], u2[:, None], u1[:, None])
        m_s = np.where(ok, np.maximum(np.maximum(xs, ys), rest_s[:, None, :]), inf)
        ss_s = ss0 + xs * xs - (dd ** 2)[:, None, None] + ys * ys - (dl_ds ** 2)[:, None, :]
        top, arg, sec = _top2(base)                           # [A, S]
        w = base + p_add[ac, es][:, :, None]
        m_a = np.where(pair_ok, np.maximum(np.where(arg[:, :, None] == ar, sec[:, :, None], top[:, :, None]), w), inf)
        bb = base * base
        ss_a = bb.sum(axis=2)[:, :, None] + w * w - bb
        cnt_e = cnt[ac, es]
        two = ev & (cnt_e >= 2)
        p_drop_e = load[es] / np.maximum(cnt_e - 1, 1)        # [A, S]
        V = dl[:, None, :] + (p_drop_e - pe)[:, :, None] * G
        V[ai[:, None], np.arange(K)[None, :], d[:, None]] -= p_drop_e
        m_d = np.where(two, V.max(axis=2), inf)
        ss_d = (V * V).sum(axis=2)
        fams = [("transfer", m_t, ss_t), ("swap", m_s, ss_s), ("add", m_a, ss_a), ("drop", m_d, ss_d)]
        m = np.concatenate([f[1].reshape(A, -1) for f in fams], axis=1)
        ss = np.concatenate([f[2].reshape(A, -1) for f in fams], axis=1)
        cm = cur_m[:, None]
        better = (m < cm - self.eps) | ((m <= cm + self.eps) & (ss < cur_ss[:, None] - self.eps2))
        has = better.any(axis=1)
        m0 = np.where(better, m, inf).min(axis=1)
        pool = better & (m <= m0[:, None] + self.eps)
        jj = _first_least(pool, ss, self.eps2)
        sizes = [f[1][0].size for f in fams]
        moves: list[tuple | None] = [None] * A
        for i in np.flatnonzero(has).tolist():
            j = int(jj[i])
            for (kind, mk, _), k in zip(fams, sizes):
                if j < k:
                    idx = np.unravel_index(j, mk.shape[1:])
                    e = int(es[i, idx[0]])
                    if kind == "drop":
                        a = (e,)
                    elif kind == "swap":
                        a = (e, int(fs[i, idx[1]]), int(ds[i, idx[1]]))
                    else:
                        a = (e, int(idx[1]))
                    apply_move(self.C[act[i]], kind, a, int(d[i]))
                    moves[i] = (kind, *a)
                    break
                j -= k
        r = np.flatnonzero(~has)
        if r.size == 0 or P == 0:  # P == 0: no share off the busiest device to retarget
            return moves
        # tier 2 (retarget) for the starts without a tier-1 move: [R, S, E, N] at once
        ri = np.arange(r.size)
        rc = ri[:, None]
        Cr, cnt_r, per_r, es_r, fs_r, ds_r = C[r], cnt[r], per[r], es[r], fs[r], ds[r]
        ok = (ev[r][:, :, None] & pv[r][:, None, :] & (fs_r[:, None, :] != es_r[:, :, None])
              & (cnt_r[rc, fs_r] >= 2)[:, None, :] & slot_ok_d2[r])
        p_drop = load[None, :] / np.maximum(cnt_r - 1, 1)
        g = p_drop - per_r                                    # [R, E]
        base_r = base[r]
        v = (base_r[ri[:, None, None], np.arange(K)[None, :, None], ds_r[:, None, :]]
             + (g[rc, fs_r] * Cr[ri[:, None], fs_r, ds_r])[:, None, :])  # [R, S, P]
        w = v + p_add[r][rc, es_r][:, :, None] - p_drop[rc, fs_r][:, None, :]
        V = base_r[:, :, None, :] + g[:, None, :, None] * Cr[:, None, :, :]   # [R, S, E, N]
        top, arg, sec = _top2(V)                              # [R, S, E]
        sq = (V * V).sum(axis=3)
        si = np.arange(K)[None, :, None]
        rr = ri[:, None, None]
        fsb = fs_r[:, None, :]
        m_r = np.where(ok, np.maximum(np.where(arg[rr, si, fsb] == ds_r[:, None, :], sec[rr, si, fsb],
                                               top[rr, si, fsb]), w), inf).reshape(r.size, -1)
        ss_r = (sq[rr, si, fsb] + w * w - v * v).reshape(r.size, -1)
        cm = cur_m[r][:, None]
        better = (m_r < cm - self.eps) | ((m_r <= cm + self.eps) & (ss_r < cur_ss[r][:, None] - self.eps2))
        has2 = better.any(axis=1)
        m0 = np.where(better, m_r, inf).min(axis=1)
        pool = better & (m_r <= m0[:, None] + self.eps)
        jj = _first_least(pool, ss_r, self.eps2)
        for q in np.flatnonzero(has2).tolist():
            i = int(r[q])
            s_, p_ = divmod(int(jj[q]), P)
            a = (int(es[i, s_]), int(fs[i, p_]), int(ds[i, p_]))
            apply_move(self.C[act[i]], "retarget", a, int(d[i]))
            moves[i] = ("retarget", *a)
        return moves


def count_search(p: Placement, load: np.ndarray, max_evals: int, thorough: bool) -> Placement:
    """Search over replica counts with :func:`pack_lpt` as the decoder, from ``p``'s
    counts: try, in order, one more replica of an expert on the busiest device (any
    expert when ``thorough``), taken from a free slot or from any expert with two or
    more replicas, then one fewer replica of any expert; pack each by LPT (then improve
    it by local search when ``thorough``) and move to the first that lowers (maximum
    load, then sum of squares). Stops at a local optimum or after ``max_evals`` packings.

    Local search on a layout moves one replica at a time and each move must help; a
    count change re-packs everything, which finds layouts such as a mid-sized expert cut
    into many small shares that fill the devices of the big ones (tight slots)."""
    N, S, E = p.num_devices, p.slots_per_device, p.num_experts
    lo = [float(x) for x in load]
    counts = list(p.share_counts)
    best, best_key = p, p.key
    tol = 1e-12 * max(1.0, float(load.sum()))
    evals = 0

    def neighbours():
        busiest = max(range(N), key=lambda i: (best.device_load[i], -i))
        free = sum(counts) < N * S
        for x in (range(E) if thorough else best.device_experts[busiest]):
            if counts[x] >= N:
                continue
            if free:
                yield ((x, 1),)
            for y in range(E):
                if y != x and counts[y] > 1:
                    yield ((x, 1), (y, -1))
        for y in range(E):
            if counts[y] > 1:
                yield ((y, -1),)

    def better(k) -> bool:
        return k[0] < best_key[0] - tol or (k[0] <= best_key[0] + tol and k[1] < best_key[1] - tol * tol)

    while evals < max_evals:
        changes = list(neighbours())  # (the generator reads best and counts, which change only on a move)
        i, moved = 0, False
        while i < len(changes) and evals < max_evals:
            part = changes[i:i + min(COUNT_CHUNK if thorough else 1, max_evals - evals)]
            trials = []
            for change in part:
                trial = list(counts)
                for x, dx in change:
                    trial[x] += dx
                trials.append(trial)
            reps = [lpt_shares(lo, t, N, S) for t in trials]
            if thorough:  # each improved by local search, all of the chunk in lockstep; keyed on the share matrix
                srch = ShareSearch([counts_matrix(r, E, N) for r in reps], load, S)
                srch.run(20 * N * S)
                keys = [matrix_key(C, load) for C in srch.C]
            else:  # scored without building the Placement (the same sums as make_placement's), built if taken
                keys = []
                for r in reps:
                    dl = device_loads(r, load, N).tolist()
                    keys.append((max(dl), float(sum(x * x for x in dl))))
            for j, k in enumerate(keys):
                if better(k):  # the first improving neighbour in order, as one at a time would take
                    evals += j + 1
                    best = (make_placement(matrix_replicas(srch.C[j]), load, N, S) if thorough
                            else make_placement(reps[j], load, N, S))
                    best_key, counts = k, list(best.share_counts)
                    moved = True
                    break
            if moved:
                break
            evals += len(part)
            i += len(part)
        if not moved:
            break  # no neighbour is better (a local optimum), or max_evals reached
    return best


__all__ = ["FAMILIES", "ShareSearch", "apply_move", "counts_matrix", "matrix_replicas", "count_search"]
