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

The step applies the best improving move: lowest maximum device load, then (within 1e-12
of the total) lowest sum of squared loads, then the first in the order above (families in
that order; within a family e ascending, then d2 or the share (f, d2) in C's row-major
order). :meth:`ShareSearch.step` scores a family in O(candidates) with the top three device
loads (moves that change two devices) or per-row top two (moves that change all of an
expert's devices); :meth:`ShareSearch.step_reference` applies each candidate to a copy
and recomputes every load: its slow twin.

Legend: E experts, N devices, S slots per device, K candidates of a family, F experts.
"""

from __future__ import annotations

import itertools

import numpy as np

from .packing import lpt_shares
from .types import Placement, device_loads, make_placement, placement_key

FAMILIES = (("transfer", "swap", "add", "drop"), ("retarget",))


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
    t1 = np.take_along_axis(V, a1[..., None], axis=-1)[..., 0]
    if V.shape[-1] == 1:
        return t1, a1, np.full_like(t1, -np.inf)
    W = V.copy()
    np.put_along_axis(W, a1[..., None], -np.inf, axis=-1)
    return t1, a1, W.max(axis=-1)


class ShareSearch:
    """Mutable layout ``C`` [E, N] under local search (see the module docstring)."""

    def __init__(self, C_EN: np.ndarray, load_E: np.ndarray, slots_per_device: int) -> None:
        self.C = np.array(C_EN, dtype=np.int64)
        self.load = np.asarray(load_E, dtype=np.float64)
        self.E, self.N = self.C.shape
        self.S = int(slots_per_device)
        scale = max(1.0, float(self.load.sum()))
        self.eps = 1e-12 * scale
        self.eps2 = 1e-12 * scale * scale
        assert (self.C.sum(axis=1) >= 1).all() and ((self.C > 0).sum(axis=0) <= self.S).all()

    # ------------------------------------------------------------------ state
    def loads(self, C: np.ndarray | None = None) -> np.ndarray:
        C = self.C if C is None else C
        return (self.load / C.sum(axis=1)) @ C

    def _state(self):
        C = self.C
        cnt = C.sum(axis=1)
        per = self.load / cnt
        dl = per @ C
        order = np.argsort(-dl, kind="stable")
        return C, cnt, per, dl, order, (C > 0).sum(axis=0)

    # ------------------------------------------------------------------ candidates
    def candidates(self, tier: int, state=None) -> dict[str, np.ndarray]:
        """The feasible moves of ``tier`` (0 or 1), family -> [K, args] int64, in the order
        of the module docstring."""
        C, cnt, per, dl, order, held = self._state() if state is None else state
        d, N, S = int(order[0]), self.N, self.S
        es = np.flatnonzero(C[:, d])
        ar = np.arange(N)
        fs, ds = np.nonzero(C)
        keep = ds != d
        fs, ds = fs[keep], ds[keep]
        out: dict[str, np.ndarray] = {}
        if tier == 0:
            E2, D2 = np.meshgrid(es, ar, indexing="ij")
            ok = (D2 != d) & ((C[E2, D2] > 0) | (held[D2] < S))
            pair = np.stack([E2[ok], D2[ok]], axis=1)
            out["transfer"] = pair
            Ei = np.repeat(es, fs.size)
            Fi, Di = np.tile(fs, es.size), np.tile(ds, es.size)
            ok = ((Fi != Ei) & (per[Fi] < per[Ei])
                  & (held[Di] + (C[Ei, Di] == 0) - (C[Fi, Di] == 1) <= S)
                  & (held[d] + (C[Fi, d] == 0) - (C[Ei, d] == 1) <= S))
            out["swap"] = np.stack([Ei[ok], Fi[ok], Di[ok]], axis=1)
            out["add"] = pair
            out["drop"] = es[cnt[es] >= 2][:, None]
        else:
            Ei = np.repeat(es, fs.size)
            Fi, Di = np.tile(fs, es.size), np.tile(ds, es.size)
            ok = (Fi != Ei) & (cnt[Fi] >= 2) & (held[Di] + (C[Ei, Di] == 0) - (C[Fi, Di] == 1) <= S)
            out["retarget"] = np.stack([Ei[ok], Fi[ok], Di[ok]], axis=1)
        return out

    def _apply_to(self, C: np.ndarray, kind: str, a: np.ndarray, d: int) -> None:
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

    # ------------------------------------------------------------------ scoring
    def _score(self, kind: str, a: np.ndarray, state):
        """([K] maximum load, [K] sum of squares) of each candidate, from the top loads."""
        C, cnt, per, dl, order, _ = state
        d = int(order[0])
        ss0 = float(dl @ dl)
        N = self.N
        t1 = int(order[1]) if N > 1 else -1
        u1 = dl[t1] if N > 1 else -np.inf
        u2 = dl[order[2]] if N > 2 else -np.inf
        if kind in ("transfer", "swap"):
            e, d2 = a[:, 0], a[:, -1]
            delta = per[e] if kind == "transfer" else per[e] - per[a[:, 1]]
            x, y = dl[d] - delta, dl[d2] + delta
            rest = np.where(d2 == t1, u2, u1)  # busiest device outside {d, d2}
            m = np.maximum(np.maximum(x, y), rest)
            return m, ss0 + x * x - dl[d] ** 2 + y * y - dl[d2] ** 2
        e = a[:, 0]
        p_add = self.load / (cnt + 1)
        if kind == "drop":
            p_drop = self.load[e] / (cnt[e] - 1)
            V = dl[None, :] + (p_drop - per[e])[:, None] * C[e]
            V[:, d] -= p_drop
            return V.max(axis=1), (V * V).sum(axis=1)
        ue, inv = np.unique(e, return_inverse=True)
        base = dl[None, :] + ((p_add - per)[ue])[:, None] * C[ue]  # [U, N] e's shares shrink
        if kind == "add":
            d2 = a[:, 1]
            top, arg, sec = _top2(base)
            v = base[inv, d2]
            w = v + p_add[e]
            m = np.maximum(np.where(arg[inv] == d2, sec[inv], top[inv]), w)
            return m, (base * base).sum(axis=1)[inv] + w * w - v * v
        # retarget: base of e plus f's shares growing, then d2 trades f's share for e's
        f, d2 = a[:, 1], a[:, 2]
        uf, finv = np.unique(f, return_inverse=True)
        p_drop = self.load / np.maximum(cnt - 1, 1)
        V = base[:, None, :] + ((p_drop - per)[uf])[None, :, None] * C[uf][None, :, :]  # [U, F, N]
        top, arg, sec = _top2(V)
        sq = (V * V).sum(axis=2)
        v = V[inv, finv, d2]
        w = v + p_add[e] - p_drop[f]
        m = np.maximum(np.where(arg[inv, finv] == d2, sec[inv, finv], top[inv, finv]), w)
        return m, sq[inv, finv] + w * w - v * v

    def _score_reference(self, kind: str, a: np.ndarray, state):
        d = int(state[4][0])
        m, ss = np.empty(len(a)), np.empty(len(a))
        for i, row in enumerate(a):
            C = self.C.copy()
            self._apply_to(C, kind, row, d)
            assert C.min() >= 0 and (C.sum(axis=1) >= 1).all() and ((C > 0).sum(axis=0) <= self.S).all()
            v = self.loads(C)
            m[i], ss[i] = v.max(), v @ v
        return m, ss

    # ------------------------------------------------------------------ step
    def _step(self, score) -> tuple | None:
        state = self._state()
        dl = state[3]
        cur_m, cur_ss = float(dl.max()), float(dl @ dl)
        d = int(state[4][0])
        for tier in range(len(FAMILIES)):
            cands = self.candidates(tier, state)
            ms, sss, who = [], [], []
            for kind in FAMILIES[tier]:
                a = cands[kind]
                if len(a) == 0:
                    continue
                m, ss = score(kind, a, state)
                ms.append(m)
                sss.append(ss)
                who.append((kind, len(a)))
            if not ms:
                continue
            m, ss = np.concatenate(ms), np.concatenate(sss)
            better = (m < cur_m - self.eps) | ((m <= cur_m + self.eps) & (ss < cur_ss - self.eps2))
            if not better.any():
                continue
            m0 = m[better].min()
            pool = better & (m <= m0 + self.eps)
            j = int(np.argmin(np.where(pool, ss, np.inf)))
            for kind, k in who:
                if j < k:
                    move = (kind, *(int(x) for x in cands[kind][j]))
                    self._apply_to(self.C, kind, np.asarray(move[1:]), d)
                    return move
                j -= k
        return None

    def step(self) -> tuple | None:
        """Apply the best improving move (module docstring) and return it as (family,
        *args); None at a local optimum."""
        return self._step(self._score)

    def step_reference(self) -> tuple | None:
        """Slow twin of :meth:`step`: each candidate applied to a copy, loads recomputed."""
        return self._step(self._score_reference)

    def run(self, max_steps: int) -> int:
        for i in range(max_steps):
            if self.step() is None:
                return i
        return max_steps

    def result(self) -> Placement:
        return make_placement(matrix_replicas(self.C), self.load, self.N, self.S)


def improve(p: Placement, load: np.ndarray, max_steps: int) -> Placement:
    """``p`` improved by :class:`ShareSearch` (at most ``max_steps`` moves)."""
    s = ShareSearch(counts_matrix(p.replicas, p.num_experts, p.num_devices), load, p.slots_per_device)
    s.run(max_steps)
    return s.result()


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
    counts = list(p.replica_counts)
    best, best_key = p, placement_key(p)
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

    while evals < max_evals:
        for change in neighbours():
            if evals >= max_evals:
                break
            evals += 1
            trial = list(counts)
            for x, dx in change:
                trial[x] += dx
            reps = lpt_shares(lo, trial, N, S)
            if thorough:
                q: Placement | None = improve(make_placement(reps, load, N, S), load, 20 * N * S)
                k = placement_key(q)
            else:  # scored without building the Placement (the same sums as make_placement's), built if taken
                q = None
                dl = device_loads(reps, load, N).tolist()
                k = (max(dl), float(sum(x * x for x in dl)))
            if k[0] < best_key[0] - tol or (k[0] <= best_key[0] + tol and k[1] < best_key[1] - tol * tol):
                best = q if q is not None else make_placement(reps, load, N, S)
                best_key, counts = k, list(best.replica_counts)
                break
        else:
            break  # no neighbour is better: a local optimum
    return best


__all__ = ["FAMILIES", "ShareSearch", "counts_matrix", "matrix_replicas", "improve", "count_search"]
