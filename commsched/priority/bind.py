"""The gradient reduction on gloo groups bound to an address of its own.

Legend: none (no tensors here).

``ScheduleConfig.reduce_address`` names a local address; the scheduler then reduces over
*twins* of its groups (the same ranks, the same number of gloo worker threads) whose gloo
device binds to that address instead of the default interface's. Nothing else changes: the
collectives, their order and their results are those of the original groups. What it is
for: the bandwidth emulator's link classes (``commsched netem --classes ADDR``,
``commsched bench --link-model collective``) give every packet from or to ADDR its own
equal share of the emulated link, so the allreduce and the all-to-all contend per
collective, as two NCCL communicators' channels do, instead of per TCP flow (docs/netem.md,
docs/results.md, "MoE training").

Making the twins is collective over the default group (every rank makes the twins of every
rank's groups, in one order), as every group construction is.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..dist import DEFAULT_GLOO_THREADS, RunGroups, all_gather_object, check_address


def group_threads(group) -> int:
    """The gloo worker threads of ``group`` (gloo's default when it does not say)."""
    try:
        return int(group._get_backend(torch.device("cpu")).options._threads)
    except Exception:  # not a gloo group, or a torch without the attribute
        return DEFAULT_GLOO_THREADS


def members(group) -> tuple[int, ...]:
    """The global ranks of ``group`` (None: the default group)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def twins(groups: Sequence[Any], run: RunGroups, *, address: str | None = None, threads: int | None = None,
          what: str = "listing the groups to twin") -> dict[int, Any]:
    """``{id(group): twin}`` for every process group in ``groups`` (others -- ``LOCAL``,
    fakes -- are left out): a group of the same ranks made in ``run``, bound to ``address``
    when given (on gloo), with ``threads`` gloo worker threads (default: the most any rank's
    group of those ranks has). Collective over the default group: every rank lists its
    groups (``what`` names the step for an error), then every rank makes the twins of all
    of them, in one order."""
    real = [g for g in groups if g is None or isinstance(g, dist.ProcessGroup)]
    mine: dict[tuple[int, ...], int] = {}
    for g in real:
        mine.setdefault(members(g), threads if threads is not None else group_threads(g))
    every: dict[tuple[int, ...], int] = {}
    for ms in all_gather_object(sorted(mine.items()), what):
        for m, t in ms:
            every[tuple(m)] = max(every.get(tuple(m), 1), int(t))
    made = {m: run.new(m, threads=every[m], address=address) for m in sorted(every)}
    return {id(g): made[members(g)] for g in real}


def bound_twins(groups: Sequence[Any], address: str | None, run: RunGroups) -> dict[int, Any]:
    """:func:`twins` of ``groups`` bound to ``address``, each with its group's threads; {}
    when ``address`` is None, the backend is not gloo or the world is one rank."""
    if address is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return {}
    if dist.get_backend() != "gloo":
        return {}
    return twins(groups, run, address=check_address(address), what="listing the gradient groups to bind "
                 "to reduce_address")


__all__ = ["bound_twins", "check_address", "group_threads", "members", "twins"]
