"""The bucket layout of :class:`~commsched.priority.runtime.executor.GradScheduler`: which slices of
which gradients every allreduce operation carries, over which group. Pure (no torch, no
process group): the executor describes its parameters as :class:`GradSlot` rows and
builds its operations from the :class:`BucketLayout` this returns.

Legend: none (a gradient is one flat run of ``numel`` elements).

The rules (those the executor always ran):

* the communicated gradients come first, in the order given, then the scale-only ones
  (group :data:`LOCAL`), which no operation carries;
* an operation never spans two groups, nor, for buckets, two dtypes: the communicated
  gradients are cut into runs of consecutive entries with the same group and dtype, and
  each run into the operations of :func:`~commsched.priority.policy.allreduce_ops`
  (fused buckets of ``bucket_bytes`` under ``fifo``, micro-ops of ``microop_bytes``
  otherwise), numbered in that order over all runs.

Also here, because it is a plain comparison of what the ranks registered:
:func:`registration_mismatch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..microops import CommOp
from ..policy import ScheduleConfig

LOCAL = "local"  # group of a gradient that is scaled but not communicated


@dataclass(frozen=True)
class GradSlot:
    """One gradient as the layout sees it: ``group``, an id of its communication group
    (equal ids: the same group; :data:`LOCAL`: scaled only), its dtype's name, its element
    count and the bytes of one element."""

    group: object
    dtype: str
    numel: int
    element_size: int


@dataclass(frozen=True)
class BucketLayout:
    """``order[j]``: the index (in the slots given) of the scheduler's parameter ``j``
    (communicated first); ``ops``: the operations, their pieces' ``tensor`` a position in
    ``order``; ``op_first[k]``: the first parameter (position in ``order``) of the run
    operation ``k`` belongs to -- its group is that parameter's; ``ops_of_param[j]``: the
    sequence numbers of the operations that carry parameter ``j``."""

    order: tuple[int, ...]
    ops: tuple[CommOp, ...]
    op_first: tuple[int, ...]
    ops_of_param: tuple[tuple[int, ...], ...]


def group_ids(groups: Sequence[object]) -> list[object]:
    """One id per entry: the same object (identity, not equality) the same small int,
    :data:`LOCAL` kept -- the ``group`` of :class:`GradSlot`."""
    seen: list[object] = []
    out: list[object] = []
    for g in groups:
        if g is LOCAL:
            out.append(LOCAL)
            continue
        k = next((k for k, h in enumerate(seen) if h is g), None)
        if k is None:
            k = len(seen)
            seen.append(g)
        out.append(k)
    return out


def plan_buckets(slots: Sequence[GradSlot], cfg: ScheduleConfig) -> BucketLayout:
    """The operations ``cfg`` cuts these gradients into (module docstring)."""
    order = ([i for i, s in enumerate(slots) if s.group is not LOCAL]
             + [i for i, s in enumerate(slots) if s.group is LOCAL])
    ranked = [slots[i] for i in order]
    n_comm = sum(1 for s in ranked if s.group is not LOCAL)
    ops: list[CommOp] = []
    first: list[int] = []
    start = 0
    while start < n_comm:
        end = start
        while (end < n_comm and ranked[end].group == ranked[start].group
               and ranked[end].dtype == ranked[start].dtype):
            end += 1
        numels = [s.numel for s in ranked[start:end]]
        for op in cfg.allreduce_ops(numels, ranked[start].element_size):
            shifted = tuple(type(pc)(pc.tensor + start, pc.offset, pc.numel) for pc in op.pieces)
            ops.append(CommOp(len(ops), shifted, op.nbytes))
            first.append(start)
        start = end
    of_param: list[list[int]] = [[] for _ in ranked]
    for op in ops:
        for t in op.tensors:
            of_param[t].append(op.seq)
    return BucketLayout(tuple(order), tuple(ops), tuple(first), tuple(tuple(o) for o in of_param))


# ------------------------------------------------------------------ what the ranks registered
def describe(name: str, p: Any, group_size: int) -> tuple:
    """``(name, shape, dtype, group size)`` of parameter ``p`` (anything with ``shape`` and
    ``dtype``): what :func:`registration_mismatch` compares."""
    return (name, tuple(p.shape), str(p.dtype).replace("torch.", ""), group_size)


def _show(d: tuple) -> str:
    name, shape, dtype, n = d
    where = "scaled only" if n == 1 else f"reduced over {n} ranks"
    return f"{name!r} {list(shape)} {dtype} ({where})"


def registration_mismatch(lists: Sequence[Sequence[tuple]]) -> str | None:
    """The first difference between the ranks' parameter lists (each entry ``(name, shape,
    dtype, group size)``, rank 0's list the reference), as one sentence; None when they agree.
    Pure: :class:`GradScheduler` calls it on what every rank registered."""
    ref = lists[0]
    for r, got in enumerate(lists[1:], start=1):
        for i, (a, b) in enumerate(zip(ref, got)):
            if a != b:
                return (f"rank {r} registered parameter {i} as {_show(b)}, rank 0 as {_show(a)}; every rank "
                        "must register the same parameters in the same order with the same shapes and dtypes")
        if len(got) != len(ref):
            i = min(len(got), len(ref))
            extra = _show(got[i]) if len(got) > i else _show(ref[i])
            return (f"rank {r} registered {len(got)} parameters, rank 0 {len(ref)} (the first unmatched is "
                    f"parameter {i}, {extra} on rank {r if len(got) > i else 0}); every rank must register "
                    "the same parameters in the same order")
    return None


__all__ = ["LOCAL", "BucketLayout", "GradSlot", "describe", "group_ids", "plan_buckets", "registration_mismatch"]
