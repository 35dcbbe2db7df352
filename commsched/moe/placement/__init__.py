"""Expert placement for MoE inference: replicate popular experts, pack unpopular ones.

Legend: E experts, N devices, S slots per device (how many experts' weights a device
may hold at once), R replicas in all, T tokens (or token assignments), P source ranks,
H hosts.

A *placement* says which devices hold each expert. An expert with r replicas (shares)
has its tokens split evenly over them, so each carries ``load_e / r``; a device's load is
the sum over the shares it holds (a device may hold several shares of one expert: one
copy of its weights, one slot). The all-to-all of a layer waits for the
busiest device, so every planner here minimises the *maximum* device load.

Planners (all pure, no process group):

* :func:`eplb_placement` -- DeepSeek's EPLB, rewritten from its published algorithm: all
  N*S slots are filled, each spare one to the expert with the highest load per replica
  (no cap); the replicas are packed in descending load, each onto the lightest device
  with room (:func:`balanced_packing`, exactly S per device), and two replicas of one
  expert may land on one device; the hierarchical variant packs expert groups onto
  nodes first. It returns an :class:`EplbPlan` (physical slots), the baseline the
  planner is measured against.
* :func:`greedy_placement` -- the greedy: every spare slot goes, one at a time, to the
  expert with the highest load per replica (at most N replicas each); the replicas are
  then packed in descending per-replica load, each onto the lightest device with room
  that does not already hold that expert. Fast: the online planner.
* :func:`plan_placement` -- the planner the runtime uses. It tries several total replica
  counts (the greedy apportionment of each), packs each by LPT, improves the best
  packings, the greedy's and EPLB's own layouts by a numpy local search over share
  matrices (:class:`~.search.ShareSearch`: transfer, swap, add, drop and re-target
  shares on the busiest device; a device may hold several shares of one expert), on
  small instances searches over replica counts, and returns the best layout found, so it
  is never worse than the greedy nor than EPLB by construction.
* :func:`rebalance_experts` -- the planner as a drop-in EPLB policy: DeepSeek EPLB's
  signature and results (``phy2log``, ``log2phy``, ``logcnt``), every layer (every node of it
  under the hierarchical rule) planned by :func:`plan_slots`, the planner in EPLB's model of
  physical slots (a slot per share, every slot filled), never busier than EPLB's layout.
* :func:`static_placement` -- E/N contiguous experts per device and no replicas, as
  DeepSpeed serves experts.
* :func:`lower_bound` -- no placement can have a lower maximum device load.

The strategies of the inference runtime are these functions on different inputs:
``static`` is :func:`static_placement`; ``eplb`` is a planner (default
:func:`plan_placement`; ``eplb_placement`` on request) on a historical mean load;
``lina`` is :func:`plan_placement` on the estimated load (see ``popularity.py``);
``oracle`` is :func:`plan_placement` on the actual load.

Node-aware placement (devices on hosts, the rows through the busiest host link counted)
is described in :mod:`.node_aware`.

:func:`split_tokens` maps each token of a replicated expert to one of its replicas,
round robin, so every replica gets an equal share (within one token); with a host-local
placement, round robin over the replicas of :meth:`Placement.candidates`.

Rooms (all pure: numpy only, no torch, no process group):

* :mod:`.types` -- :class:`Placement`, device loads, :func:`imbalance`
* :mod:`.checks` -- the input checks every planner shares
* :mod:`.packing` -- greedy replica counts, :func:`lower_bound`, LPT packing
* :mod:`.greedy` -- :func:`greedy_placement`, :func:`static_placement`
* :mod:`.eplb` -- :func:`eplb_placement`, :class:`EplbPlan`, :func:`balanced_packing`
* :mod:`.search` -- local search on the busiest device, the search over replica counts
* :mod:`.planner` -- :func:`plan_placement`, :func:`plan_slots`, :func:`rebalance_experts`
* :mod:`.node_aware` -- :func:`node_cost`, the node-aware planner (the host-local split
  lives in :mod:`.types`)
* :mod:`.split` -- :func:`split_tokens`, :func:`split_offsets`
* :mod:`.registry` -- :data:`PLANNERS` (name -> planner), EPLB as a :class:`Placement`

Names are resolved lazily from their submodules; importing ``commsched.moe.placement``
runs nothing.
"""

from __future__ import annotations

from ..._lazy import lazy_getattr

_EXPORTS: dict[str, str] = {
    "Placement": "types",
    "imbalance": "types",
    "device_loads": "types",
    "plan_placement": "planner",
    "plan_slots": "planner",
    "rebalance_experts": "planner",
    "greedy_placement": "greedy",
    "static_placement": "greedy",
    "eplb_placement": "eplb",
    "EplbPlan": "eplb",
    "balanced_packing": "eplb",
    "lower_bound": "packing",
    "replica_counts_greedy": "packing",
    "pack_lpt": "packing",
    "split_tokens": "split",
    "split_offsets": "split",
    "even_origin": "types",
    "host_local_loads": "types",
    "cross_rows": "node_aware",
    "node_cost": "node_aware",
    "PLANNERS": "registry",
    "eplb_layout": "registry",
    "eplb_hier_layout": "registry",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
