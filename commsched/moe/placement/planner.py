"""The planner the runtime uses (:func:`plan_placement`): candidate replica counts
packed by LPT, the best improved by local search, then a search over replica counts.

Legend: E experts, N devices, S slots per device.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .checks import check_load, check_sizes
from .eplb import eplb_placement
from .greedy import greedy_placement
from .node_aware import NODE_CANDIDATES, node_aware_placement, node_inputs
from .packing import greedy_sequence, lpt_replicas
from .search import ShareSearch, count_search, counts_matrix, matrix_replicas
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
    top = min(N * S, N * E)
    if N * S > REFINE_SMALL_SLOTS:  # each LPT packing costs about a search step there
        max_candidates = min(max_candidates, LARGE_CANDIDATES)
    if top - E + 1 <= max_candidates:
        totals = list(range(E, top + 1))
    else:
        totals = sorted({int(round(x)) for x in np.linspace(E, top, max_candidates)})
    # every layout below is a share matrix C [E, N] keyed by Placement.key's sums
    # (matrix_key); a Placement is built for the winner only
    lo = [float(x) for x in load]
    seq = greedy_sequence(lo, N, top - E)  # the apportionment of every total: a prefix of it
    packed = []
    for R in totals:
        counts = 1 + np.bincount(seq[:R - E], minlength=E)
        C = counts_matrix(lpt_replicas(lo, counts.tolist(), N, S), E, N)
        packed.append((matrix_key(C, load), C))
    greedy = packed[-1]  # greedy_placement: the apportionment of all `top` slots, by LPT
    packed.sort(key=lambda t: t[0])
    plan = eplb_placement(load, N, S)  # EPLB's own layout, two shares on a device kept
    C = np.zeros((E, N), dtype=np.int64)
    for d, row in enumerate(plan.slots):
        np.add.at(C[:, d], list(row), 1)
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

__all__ = ["plan_placement", "REFINE_SMALL", "REFINE_LARGE", "REFINE_SMALL_SLOTS", "LARGE_CANDIDATES", "COUNT_SEARCH_SLOTS"]
