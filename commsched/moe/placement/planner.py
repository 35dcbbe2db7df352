"""The planner the runtime uses (:func:`plan_placement`): candidate replica counts
packed by LPT, the best improved by local search, then a search over replica counts.

Legend: E experts, N devices, S slots per device.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .checks import check_load, check_positive_int, check_sizes
from .eplb import balanced_packing, eplb_placement
from .greedy import greedy_placement
from .node_aware import NODE_CANDIDATES, node_aware_placement, node_inputs
from .packing import greedy_sequence, lpt_replicas
from .search import ShareSearch, _first_least, _top2, count_search, counts_matrix, matrix_replicas
from .types import Placement, make_placement, matrix_key

# packings improved by local search besides the greedy's and EPLB's layouts, for up to
# REFINE_SMALL_SLOTS slots (N*S) and above; at 256 x 64 the extra starts changed the
# maximum load by under 0.01% for about twice the time
REFINE_SMALL = 6
REFINE_LARGE = 1
REFINE_SMALL_SLOTS = 256
# at most this many total replica counts are packed above REFINE_SMALL_SLOTS slots
LARGE_CANDIDATES = 6
# up to this many slots (N*S) a search over replica counts follows the local search, every
# count change decoded by LPT and local search (milliseconds there); none above it
COUNT_SEARCH_SLOTS = 16


def lpt_starts(load: np.ndarray, N: int, S: int, max_candidates: int) -> list[tuple[tuple[float, float], np.ndarray]]:
    """(key, [E, N] share matrix) of the greedy apportionment of up to ``max_candidates``
    total replica counts between E and min(N*S, N*E) (at most :data:`LARGE_CANDIDATES`
    above :data:`REFINE_SMALL_SLOTS` slots), each packed by LPT onto distinct devices,
    ascending in the total (the last: :func:`greedy_placement`'s layout)."""
    E = load.size
    top = min(N * S, N * E)
    if N * S > REFINE_SMALL_SLOTS:  # each LPT packing costs about a search step there
        max_candidates = min(max_candidates, LARGE_CANDIDATES)
    if top - E + 1 <= max_candidates:
        totals = list(range(E, top + 1))
    else:
        totals = sorted({int(round(x)) for x in np.linspace(E, top, max_candidates)})
    lo = [float(x) for x in load]
    seq = greedy_sequence(lo, N, top - E)  # the apportionment of every total: a prefix of it
    packed = []
    for R in totals:
        counts = 1 + np.bincount(seq[:R - E], minlength=E)
        C = counts_matrix(lpt_replicas(lo, counts.tolist(), N, S), E, N)
        packed.append((matrix_key(C, load), C))
    return packed


def slots_matrix(slots: Sequence[Sequence[int]], E: int) -> np.ndarray:
    """[E, N] int64 share matrix of a physical layout (``slots[d]``: the expert of each slot
    of device d; an expert twice on a device is two shares there)."""
    C = np.zeros((E, len(slots)), dtype=np.int64)
    for d, row in enumerate(slots):
        np.add.at(C[:, d], list(row), 1)
    return C


def plan_placement(load_E: Sequence[float] | np.ndarray, num_devices: int,
                   slots_per_device: int, *, max_candidates: int = 16,
                   refine: int | None = None, max_steps: int | None = None,
                   count_evals: int = 1000, device_host: Sequence[int] | None = None,
                   cross_weight: float = 0.0, origin_HE: np.ndarray | None = None) -> Placement:
    """Place E experts on N devices with at most S experts each, minimising the maximum
    device load (an expert's load split evenly over its replicas).

    Node-aware (``device_host``: the host 0..H-1 of each device, H >= 2, and
    ``cross_weight`` > 0): minimises :func:`node_cost` instead, the busiest device's load
    plus ``cross_weight`` times the rows through the busiest host link, with the
    host-local split (:mod:`.node_aware`); ``origin_HE`` [H, E]
    gives each host's tokens per expert (default :func:`even_origin`). The result carries
    ``device_host`` (a host-local placement), unless the flat plan with the flat split has
    the lower cost: then it is that plan. Without hosts, with one host or with
    ``cross_weight`` 0 the result is exactly the flat planner's.

    Popular experts get more replicas; unpopular ones are packed together. Method: for up
    to ``max_candidates`` total replica counts between E and N*S (at most
    :data:`LARGE_CANDIDATES` above :data:`REFINE_SMALL_SLOTS` slots), take the greedy
    apportionment (:func:`replica_counts_greedy`) and pack it by LPT (:func:`pack_lpt`);
    the ``refine`` best packings (default :data:`REFINE_SMALL` up to
    :data:`REFINE_SMALL_SLOTS` slots, :data:`REFINE_LARGE` above), the greedy
    (:func:`greedy_placement`) and EPLB's own layout (:meth:`EplbPlan.shares`: two of an
    expert's shares on one device kept) are improved by the numpy local search
    (:class:`~.search.ShareSearch`, ``max_steps`` moves each, default 20*N*S), which may
    put several shares of one expert on one device. Up to :data:`COUNT_SEARCH_SLOTS`
    slots a search over replica counts (up to ``count_evals`` re-packings; 0 turns it off)
    follows. The best layout found wins (maximum device load, then sum of squares). The
    greedy and EPLB's layout are candidates, so the result is never worse than
    :func:`greedy_placement` nor than :func:`eplb_placement`'s own maximum load.

    load_E: [E] non-negative finite loads (tokens routed to each expert, or an estimate).
    Raises ValueError when N*S < E or a load is negative or not finite.
    """
    load = check_load(load_E)
    E = load.size
    N, S = check_sizes(E, num_devices, slots_per_device)
    if (max_candidates < 1 or (refine is not None and refine < 0) or (max_steps is not None and max_steps < 0)
            or count_evals < 0):
        raise ValueError(f"need max_candidates >= 1, refine >= 0, max_steps >= 0 and "
                         f"count_evals >= 0; got {max_candidates}, {refine}, {max_steps}, "
                         f"{count_evals}")
    node = node_inputs(load, N, device_host, cross_weight, origin_HE)
    if node is not None:
        def flat(ld, n, s):
            return [list(r) for r in plan_placement(ld, n, s, max_candidates=max_candidates, refine=refine,
                                                    max_steps=max_steps, count_evals=count_evals).replicas]

        return node_aware_placement(load, N, S, node[0], float(cross_weight), node[1], flat, NODE_CANDIDATES)
    steps = 20 * N * S if max_steps is None else max_steps
    if refine is None:
        refine = REFINE_SMALL if N * S <= REFINE_SMALL_SLOTS else REFINE_LARGE
    if N == 1 or load.sum() == 0.0:
        return greedy_placement(load, N, S)
    # every layout below is a share matrix C [E, N] keyed by Placement.key's sums
    # (matrix_key); a Placement is built for the winner only
    packed = lpt_starts(load, N, S, max_candidates)
    greedy = packed[-1]  # greedy_placement: the apportionment of all `top` slots, by LPT
    packed.sort(key=lambda t: t[0])
    C = slots_matrix(eplb_placement(load, N, S).slots, E)  # EPLB's own layout, two shares on a device kept
    eplb = (matrix_key(C, load), C)
    starts: list[tuple] = []
    for p in [greedy, eplb] + packed[:max(0, refine)]:
        if all((p[1] != q[1]).any() for q in starts):  # the greedy is often packed[0]
            starts.append(p)
    # small: numpy's per-call cost dominates, so all starts in lockstep; large: one at a time
    # (the retarget tier would hold [starts, S, E, N])
    batches = [starts] if N * S <= REFINE_SMALL_SLOTS else [[p] for p in starts]
    finals = []
    for batch in batches:
        search = ShareSearch([C for _, C in batch], load, S)
        search.run(steps)
        finals += list(search.C)
    improved = [(matrix_key(C, load), C) for C in finals]
    best = min(starts + packed + improved, key=lambda t: t[0])
    result = make_placement(matrix_replicas(best[1]), load, N, S)
    if count_evals > 0 and N * S <= COUNT_SEARCH_SLOTS:
        result = min(result, count_search(result, load, count_evals, True), key=lambda p: p.key)
    return result

# ------------------------------------------------------------- physical slots (EPLB's model)
def fill_slots(C_EN: np.ndarray, load_E: np.ndarray, slots_per_device: int) -> np.ndarray:
    """A copy of the share matrix with every device's S physical slots used: each free slot,
    one at a time, takes the share (expert e, device d with a free slot) that leaves the
    lowest maximum device load, then the lowest sum of squares (ties: lower e, then d).
    A share added where all of an expert's shares already are changes no load."""
    C = np.array(C_EN, dtype=np.int64)
    load = np.asarray(load_E, dtype=np.float64)
    scale = max(1.0, float(load.sum()))
    eps, eps2 = 1e-12 * scale, 1e-12 * scale * scale
    while True:
        devs = np.flatnonzero(C.sum(axis=0) < slots_per_device)
        if devs.size == 0:
            return C
        cnt = C.sum(axis=1)
        per, p_add = load / cnt, load / (cnt + 1)
        base = (per @ C)[None, :] + (p_add - per)[:, None] * C     # [E, N] loads once e has one more share
        top, arg, sec = _top2(base)                                 # [E]
        w = base[:, devs] + p_add[:, None]                          # [E, F] the device that gets it
        m = np.maximum(np.where(arg[:, None] == devs[None, :], sec[:, None], top[:, None]), w)
        bb = base * base
        ss = bb.sum(axis=1)[:, None] - bb[:, devs] + w * w
        pool = m <= m.min() + eps
        e, j = divmod(int(_first_least(pool.ravel(), ss.ravel(), eps2)), devs.size)
        C[e, devs[j]] += 1


def plan_slots(load_E: Sequence[float] | np.ndarray, num_devices: int, slots_per_device: int, *,
               max_candidates: int = 16, max_steps: int | None = None) -> np.ndarray:
    """The planner in EPLB's model of physical slots: [E, N] int64 shares ``C[e, d]``, every
    device's S slots filled (``C.sum(axis=0) == S``), each slot one share of an expert
    (its load split evenly over its ``C[e].sum()`` shares), every expert at least one.

    The starts are EPLB's own layout (:func:`eplb_placement`) and the best LPT packings
    of :func:`plan_placement` (their free slots filled by :func:`fill_slots`); each is
    improved by the local search with a slot per share (:class:`~.search.ShareSearch`,
    ``physical=True``, ``max_steps`` moves each, default 20*N*S) and filled again. The
    best by (maximum device load, sum of squares) wins, EPLB's layout among them: never
    worse than EPLB's maximum device load."""
    load = check_load(load_E)
    E = load.size
    N, S = check_sizes(E, num_devices, slots_per_device)
    eplb = slots_matrix(eplb_placement(load, N, S).slots, E)
    if N == 1 or load.sum() == 0.0:
        return eplb
    steps = 20 * N * S if max_steps is None else max_steps
    refine = REFINE_SMALL if N * S <= REFINE_SMALL_SLOTS else REFINE_LARGE
    starts = [eplb]
    for _, C in sorted(lpt_starts(load, N, S, max_candidates), key=lambda t: t[0])[:refine]:
        F = fill_slots(C, load, S)
        if all((F != q).any() for q in starts):
            starts.append(F)
    batches = [starts] if N * S <= REFINE_SMALL_SLOTS else [[C] for C in starts]
    finals = []
    for batch in batches:
        search = ShareSearch(batch, load, S, physical=True)
        search.run(steps)
        finals += [fill_slots(C, load, S) for C in search.C]
    return min(starts + finals, key=lambda C: matrix_key(C, load))


def _check_policy(weight_LE, num_replicas, num_groups, num_nodes, num_gpus):
    """(weight as float64 [L, E], hierarchical?) of a checked :func:`rebalance_experts` call."""
    R = check_positive_int(num_replicas, "num_replicas")
    G = check_positive_int(num_groups, "num_groups")
    M = check_positive_int(num_nodes, "num_nodes")
    N = check_positive_int(num_gpus, "num_gpus")
    try:
        w = np.array(weight_LE.detach().cpu().double().numpy() if hasattr(weight_LE, "detach") else weight_LE,
                     dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"weight must be a [layers, num_logical_experts] tensor of loads, got "
                        f"{type(weight_LE).__name__}") from None
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"weight must be [layers, num_logical_experts] with at least one of each, "
                         f"got shape {tuple(w.shape)}")
    for row in w:
        check_load(row, "weight")
    E = w.shape[1]
    if R % N:
        raise ValueError(f"num_replicas={R} must be a multiple of num_gpus={N} (every GPU holds "
                         "the same number of physical experts)")
    if R < E:
        raise ValueError(f"num_replicas={R} cannot hold {E} logical experts (each needs at least one "
                         f"physical replica): use num_replicas >= {E}")
    hier = G % M == 0
    if hier and E % G:
        raise ValueError(f"num_groups={G} must divide the {E} logical experts (groups of consecutive "
                         "experts, equal size)")
    if hier and N % M:
        raise ValueError(f"num_gpus={N} must be a multiple of num_nodes={M} (nodes of consecutive "
                         "GPUs, equal size)")
    return w, hier


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """The planner as a drop-in EPLB policy: DeepSeek EPLB's ``rebalance_experts`` interface
    (also vLLM's EPLB policy's), each layer planned by :func:`plan_slots`.

    weight: [L, E] loads of the E logical experts in each of L layers (a tensor, CPU or
    not, or anything numpy reads); num_replicas R physical experts (R/num_gpus slots on
    each GPU, GPU g holding physical experts g*R/num_gpus onward).

    Hierarchical (``num_groups % num_nodes == 0``; groups of E/num_groups consecutive experts,
    nodes of num_gpus/num_nodes consecutive GPUs): the groups are packed onto the nodes as
    EPLB packs them (:func:`balanced_packing` of their loads, equal counts), then each node
    is planned on its own experts and GPUs, so every slot of a node holds an expert of a
    group of that node. Otherwise the global policy: all GPUs planned as one node. Each
    (node of a) layer is never worse than EPLB's maximum GPU load there.

    Returns, as EPLB (int64, CPU):
      phy2log [L, R]    -- the logical expert of each physical slot (a GPU's slots in
                           ascending expert order)
      log2phy [L, E, X] -- the physical slots of each logical expert in ascending order,
                           padded with -1 (X: the most replicas of any expert, any layer)
      logcnt  [L, E]    -- the physical replicas of each logical expert (>= 1, sum R)
    Raises ValueError when R is not a multiple of num_gpus or R < E, for the hierarchical
    policy when num_groups does not divide E or num_nodes does not divide num_gpus, or
    for loads that are negative or not finite (TypeError: a count that is not an int)."""
    import torch  # the package stays importable without torch; EPLB's interface is torch's

    w, hier = _check_policy(weight, num_replicas, num_groups, num_nodes, num_gpus)
    L, E = w.shape
    R, N = int(num_replicas), int(num_gpus)
    G, M = (int(num_groups), int(num_nodes)) if hier else (1, 1)
    S, size, per_node = R // N, E // G, N // M
    phy2log = np.empty((L, R), dtype=np.int64)
    for layer in range(L):
        load = w[layer]
        node_of, rank = balanced_packing(load.reshape(G, size).sum(axis=1), M)
        C = np.zeros((E, N), dtype=np.int64)
        for n in range(M):
            groups = np.flatnonzero(node_of == n)
            groups = groups[np.argsort(rank[groups], kind="stable")]
            experts = (groups[:, None] * size + np.arange(size)).reshape(-1)
            C[experts, n * per_node:(n + 1) * per_node] = plan_slots(load[experts], per_node, S)
        phy2log[layer] = np.concatenate([np.repeat(np.arange(E), C[:, d]) for d in range(N)])
    logcnt = np.stack([np.bincount(row, minlength=E) for row in phy2log])
    X = int(logcnt.max())
    log2phy = np.full((L, E, X), -1, dtype=np.int64)
    for layer in range(L):
        order = np.argsort(phy2log[layer], kind="stable")  # the slots of expert 0, then 1, ...
        rank_in = np.arange(R) - np.repeat(np.cumsum(logcnt[layer]) - logcnt[layer], logcnt[layer])
        log2phy[layer, phy2log[layer][order], rank_in] = order
    return torch.from_numpy(phy2log), torch.from_numpy(log2phy), torch.from_numpy(logcnt)


__all__ = ["rebalance_experts", "plan_slots", "fill_slots", "lpt_starts", "slots_matrix", "plan_placement", "REFINE_SMALL", "REFINE_LARGE", "REFINE_SMALL_SLOTS", "LARGE_CANDIDATES", "COUNT_SEARCH_SLOTS"]
