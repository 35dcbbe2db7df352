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

import socket
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..dist import DEFAULT_GLOO_THREADS, RunGroups, all_gather_object, new_group


def check_address(address: str) -> str:
    """``address`` if this process can bind a socket to it, else a ValueError that says so."""
    if not isinstance(address, str) or not address:
        raise ValueError(f"reduce_address must be a local IPv4 address such as 127.0.0.2, got {address!r}")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
    except OSError as e:
        raise ValueError(f"reduce_address {address!r} is not an address of this machine ({e}); on the "
                         "emulated loopback any 127.x.y.z works, elsewhere give one of the host's addresses "
                         "or drop --reduce-address") from None
    return address


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


def bound_twins(groups: Sequence[Any], address: str | None, run: RunGroups, *,
                threads: int | None = None) -> dict[int, Any]:
    """``{id(group): twin}`` for every process group in ``groups`` (others -- ``LOCAL``,
    fakes -- are left out), each twin bound to ``address`` and made in ``run``; {} when
    ``address`` is None, the backend is not gloo or the world is one rank. Collective over
    the default group: every rank lists its groups, then every rank makes the twins of all
    of them, in one order. ``threads``: the twins' gloo worker threads (default: each
    group's own)."""
    if address is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return {}
    if dist.get_backend() != "gloo":
        return {}
    check_address(address)
    real = [g for g in groups if g is None or isinstance(g, dist.ProcessGroup)]
    mine: dict[tuple[int, ...], int] = {}
    for g in real:
        mine.setdefault(members(g), threads if threads is not None else group_threads(g))
    every: dict[tuple[int, ...], int] = {}
    for ms in all_gather_object(sorted(mine.items()), "listing the gradient groups to bind to reduce_address"):
        for m, t in ms:
            every[tuple(m)] = max(every.get(tuple(m), 1), int(t))
    made = {m: run.new(m, threads=every[m], address=address) for m in sorted(every)}
    out: dict[int, Any] = {}
    for g in real:
        out[id(g)] = made[members(g)]
    return out


def bind_new_group(ranks: Sequence[int], address: str | None, threads: int | None, run: RunGroups | None = None):
    """:func:`commsched.dist.new_group` of ``ranks`` with ``threads``, bound to ``address``
    when it is given (checked here) and the backend is gloo; made in ``run`` when given.
    Collective."""
    if address is not None and dist.get_backend() == "gloo":
        check_address(address)
    return (run.new if run is not None else new_group)(list(ranks), threads=threads, address=address)


__all__ = ["bind_new_group", "bound_twins", "check_address", "group_threads"]
