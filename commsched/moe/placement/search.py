"""Local search on the maximum device load (moves, swaps, adds, drops and re-targets of
replicas on the busiest device) and the search over replica counts with LPT as decoder.

Legend: E experts, N devices, S slots per device.
"""

from __future__ import annotations

import math

import numpy as np

from .packing import lpt_replicas
from .types import Placement, device_loads, make_placement, placement_key


class _Expert:
    """What :meth:`LocalSearch.step` needs of expert x in one step: its devices (``devs``,
    and ``order``: descending load), its share ``per`` now, the change ``grow`` of each
    replica's share when x gains a replica and ``shrink`` when it loses one, and the
    resulting changes of the sum of squared device loads, over all of x's devices."""

    __slots__ = ("devs", "order", "per", "per_add", "grow", "shrink", "grow_ss", "shrink_ss")

    def __init__(self, s: LocalSearch, x: int) -> None:
        dl = s.dl
        self.devs = s.devs[x]
        self.order = sorted(self.devs, key=lambda i: -dl[i])
        r = len(self.devs)
        self.per = s.load[x] / r
        self.per_add = s.load[x] / (r + 1)
        self.grow = self.per_add - self.per
        self.shrink = s.load[x] / (r - 1) - self.per if r >= 2 else 0.0
        g, h = self.grow, self.shrink
        self.grow_ss = sum(g * (2.0 * dl[i] + g) for i in self.devs)
        self.shrink_ss = sum(h * (2.0 * dl[i] + h) for i in self.devs)


class LocalSearch:
    """Mutable layout for local search on the maximum device load (plain Python floats:
    N and S are small, and list copies beat NumPy calls at this size)."""

    def __init__(self, p: Placement, load: np.ndarray) -> None:
        self.load = [float(x) for x in load]
        self.N, self.S = p.num_devices, p.slots_per_device
        self.devs: list[set[int]] = [set(r) for r in p.replicas]  # expert -> devices
        self.held: list[set[int]] = [set(x) for x in p.device_experts]  # device -> experts
        self.dl = [float(x) for x in p.device_load]
        scale = max(1.0, float(load.sum()))
        self.eps = 1e-12 * scale
        self.eps2 = 1e-12 * scale * scale

    def per(self, e: int, extra: int = 0) -> float:
        return self.load[e] / (len(self.devs[e]) + extra)

    def step(self) -> tuple | None:
        """Apply the best improving move that involves the busiest device and return it;
        None if there is none.

        Moves and their order are those of :meth:`step_reference`; a candidate is scored
        in O(1) amortised instead of O(devices it touches). Per expert x (once per step):
        its devices in descending load, its share now / with one replica more / one less,
        and the change of the sum of squares when all its replicas grow or shrink by that
        share (``_Expert``). A move's maximum is then the largest of: the first entry of
        those descending lists not otherwise changed, the one or two single devices it
        changes, and the busiest device it leaves alone (the first of the global order
        outside the changed sets); its sum of squares the current one plus the
        precomputed changes (with the cross term of devices both experts share)."""
        dl, N, S = self.dl, self.N, self.S
        d = max(range(N), key=lambda i: (dl[i], -i))
        order = sorted(range(N), key=lambda i: -dl[i])
        cur_ss = sum(x * x for x in dl)
        best, best_move = (dl[d], cur_ss), None
        eps, eps2 = self.eps, self.eps2
        cache: dict[int, _Expert] = {}

        def info(x: int) -> _Expert:
            got = cache.get(x)
            if got is None:
                got = cache[x] = _Expert(self, x)
            return got

        def untouched(a: set[int], b: set[int] | None = None, c: int = -1) -> float:
            for dd in order:
                if dd not in a and (b is None or dd not in b) and dd != c:
                    return dl[dd]
            return -math.inf

        def consider(m: float, ss: float, move: tuple) -> None:
            nonlocal best, best_move
            if m < best[0] - eps or (m <= best[0] + eps and ss < best[1] - eps2):
                best, best_move = (m, ss), move

        def sq(x: int, delta: float) -> float:  # change of x's square when it moves by delta
            return delta * (2.0 * dl[x] + delta)

        for e in sorted(self.held[d]):
            ie = info(e)
            de, pe, pe_add, g = ie.devs, ie.per, ie.per_add, ie.grow
            top_e = dl[ie.order[0]] + g  # e's busiest replica after e gains a replica
            if len(de) >= 2:  # drop the replica of e on d; its share goes to e's other replicas
                sh = ie.shrink
                m = max(dl[d] - pe, untouched(de))
                for dd in ie.order:
                    if dd != d:
                        m = max(m, dl[dd] + sh)
                        break
                consider(m, cur_ss + ie.shrink_ss - sq(d, sh) + sq(d, -pe), ("drop", e, d))
            for d2 in range(N):
                if d2 == d or e in self.held[d2]:
                    continue
                if len(self.held[d2]) < S:
                    m = max(dl[d] - pe, dl[d2] + pe, untouched({d, d2}))
                    consider(m, cur_ss + sq(d, -pe) + sq(d2, pe), ("move", e, d, d2))
                    m = max(top_e, dl[d2] + pe_add, untouched(de, None, d2))
                    consider(m, cur_ss + ie.grow_ss + sq(d2, pe_add), ("add", e, d2))
                for f in sorted(self.held[d2]):
                    jf = info(f)
                    pf = jf.per
                    if pf < pe and f not in self.held[d]:
                        m = max(dl[d] + pf - pe, dl[d2] + pe - pf, untouched({d, d2}))
                        consider(m, cur_ss + sq(d, pf - pe) + sq(d2, pe - pf), ("swap", e, d, f, d2))
                    if len(jf.devs) >= 2:  # re-target f's replica on d2 to e
                        df, sh = jf.devs, jf.shrink
                        m = dl[d2] + pe_add - pf
                        for dd in jf.order:  # f's other replicas gain sh (and lose g on e's)
                            if dd == d2:
                                continue
                            if dd in de:
                                m = max(m, dl[dd] + sh + g)
                            else:
                                m = max(m, dl[dd] + sh)
                                break
                        for dd in ie.order:  # e's replicas that f does not share
                            if dd not in df:
                                m = max(m, dl[dd] + g)
                                break
                        m = max(m, untouched(de, df))
                        both = len(de & df)
                        ss = (cur_ss + ie.grow_ss + jf.shrink_ss - sq(d2, sh)
                              + sq(d2, pe_add - pf) + 2.0 * g * sh * both)
                        consider(m, ss, ("retarget", e, f, d2))
        if best_move is not None:
            self.apply(best_move)
        return best_move

    def step_reference(self) -> tuple | None:
        """Slow twin of :meth:`step`: every candidate's changed loads in a dict.

        A move changes the loads of a few devices (``delta``: device -> change); its
        maximum is the largest changed load or the largest unchanged one (the first device
        of the descending order not in ``delta``), its sum of squares the current one
        plus the changes."""
        dl, N = self.dl, self.N
        d = max(range(N), key=lambda i: (dl[i], -i))
        order = sorted(range(N), key=lambda i: -dl[i])
        cur_ss = sum(x * x for x in dl)
        best, best_move = (dl[d], cur_ss), None

        def consider(delta: dict[int, float], move: tuple) -> None:
            nonlocal best, best_move
            m = -math.inf
            ss = cur_ss
            for dd, dv in delta.items():
                v = dl[dd] + dv
                m = v if v > m else m
                ss += v * v - dl[dd] * dl[dd]
            for dd in order:
                if dd not in delta:
                    m = dl[dd] if dl[dd] > m else m
                    break
            if m < best[0] - self.eps or (m <= best[0] + self.eps and ss < best[1] - self.eps2):
                best, best_move = (m, ss), move

        for e in sorted(self.held[d]):
            pe = self.per(e)
            r_e = len(self.devs[e])
            pe_add = self.per(e, +1)
            grow_e = {dd: pe_add - pe for dd in self.devs[e]}  # e gains a replica elsewhere
            if r_e >= 2:  # drop the replica of e on d; its share goes to e's other replicas
                pe_drop = self.per(e, -1)
                delta = {dd: pe_drop - pe for dd in self.devs[e]}
                delta[d] = -pe
                consider(delta, ("drop", e, d))
            for d2 in range(N):
                if d2 == d or e in self.held[d2]:
                    continue
                if len(self.held[d2]) < self.S:
                    consider({d: -pe, d2: pe}, ("move", e, d, d2))
                    delta = dict(grow_e)
                    delta[d2] = pe_add
                    consider(delta, ("add", e, d2))
                for f in sorted(self.held[d2]):
                    pf = self.per(f)
                    if pf < pe and f not in self.held[d]:
                        consider({d: pf - pe, d2: pe - pf}, ("swap", e, d, f, d2))
                    if len(self.devs[f]) >= 2:  # re-target f's replica on d2 to e
                        pf_drop = self.per(f, -1)
                        delta = dict(grow_e)
                        for dd in self.devs[f]:
                            delta[dd] = delta.get(dd, 0.0) + pf_drop - pf
                        delta[d2] = delta.get(d2, 0.0) + pe_add - pf_drop
                        consider(delta, ("retarget", e, f, d2))
        if best_move is not None:
            self.apply(best_move)
        return best_move

    def _place(self, e: int, d: int) -> None:
        self.devs[e].add(d)
        self.held[d].add(e)

    def _remove(self, e: int, d: int) -> None:
        self.devs[e].discard(d)
        self.held[d].discard(e)

    def apply(self, move: tuple) -> None:
        kind = move[0]
        if kind == "drop":
            _, e, d = move
            self._remove(e, d)
        elif kind == "move":
            _, e, d, d2 = move
            self._remove(e, d)
            self._place(e, d2)
        elif kind == "add":
            _, e, d2 = move
            self._place(e, d2)
        elif kind == "swap":
            _, e, d, f, d2 = move
            self._remove(e, d)
            self._remove(f, d2)
            self._place(e, d2)
            self._place(f, d)
        elif kind == "retarget":
            _, e, f, d2 = move
            self._remove(f, d2)
            self._place(e, d2)
        else:  # pragma: no cover - internal
            raise AssertionError(kind)
        self.dl = [0.0] * self.N  # recompute exactly (no drift from incremental updates)
        for x, devs in enumerate(self.devs):
            share = self.load[x] / len(devs)
            for dd in devs:
                self.dl[dd] += share

    def result(self, load: np.ndarray) -> Placement:
        return make_placement([sorted(s) for s in self.devs], load, self.N, self.S)


def improve(p: Placement, load: np.ndarray, max_steps: int) -> Placement:
    s = LocalSearch(p, load)
    for _ in range(max_steps):
        if s.step() is None:
            break
    return s.result(load)


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
            reps = lpt_replicas(lo, trial, N, S)
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



__all__ = ["LocalSearch", "improve", "count_search"]
