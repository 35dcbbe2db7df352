"""Cutting gradient tensors into communication operations (pure; no process group).

Legend: N elements of one tensor, B bytes.

* :func:`partition` -- Lina's tensor partitioning: every tensor is cut into equal
  micro-ops of at most ``microop_bytes`` (sizes differ by at most one element), and a
  micro-op never spans two tensors. A tensor smaller than the size is one micro-op.
* :func:`bucket` -- the fused buckets of a DDP-style baseline: consecutive tensors are
  packed into one buffer until it would exceed ``bucket_bytes`` (a tensor larger than
  that gets a bucket of its own). Used by the ``fifo`` schedule.

Both return operations in the order given (the launch order every rank follows), each
with ``seq`` = its index in that order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Piece:
    """Elements ``[offset, offset + numel)`` of tensor ``tensor``."""

    tensor: int
    offset: int
    numel: int


@dataclass(frozen=True)
class CommOp:
    """One allreduce: the pieces it carries (one for a micro-op, several for a bucket)."""

    seq: int
    pieces: tuple[Piece, ...]
    nbytes: int

    @property
    def tensors(self) -> tuple[int, ...]:
        return tuple(sorted({p.tensor for p in self.pieces}))

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


def _check(numels: Sequence[int], element_size: int, size: int, what: str) -> None:
    if element_size < 1:
        raise ValueError(f"element_size must be >= 1 byte, got {element_size}")
    if size < element_size:
        raise ValueError(f"{what} must hold at least one element ({element_size} bytes), got {size}")
    if any(n < 0 for n in numels):
        raise ValueError(f"tensor sizes must be >= 0, got {list(numels)}")


def split_equal(numel: int, element_size: int, microop_bytes: int) -> list[tuple[int, int]]:
    """[(offset, numel)] of the equal chunks of one tensor (at most ``microop_bytes`` each)."""
    _check([numel], element_size, microop_bytes, "microop_bytes")
    if numel == 0:
        return []
    per = microop_bytes // element_size
    n = math.ceil(numel / per)
    base, extra = divmod(numel, n)
    out, off = [], 0
    for i in range(n):
        k = base + (1 if i < extra else 0)
        out.append((off, k))
        off += k
    return out


def partition(numels: Sequence[int], element_size: int, microop_bytes: int) -> list[CommOp]:
    """Micro-ops of the tensors in the order given; never fused across tensors."""
    _check(numels, element_size, microop_bytes, "microop_bytes")
    ops: list[CommOp] = []
    for t, n in enumerate(numels):
        for off, k in split_equal(n, element_size, microop_bytes):
            ops.append(CommOp(len(ops), (Piece(t, off, k),), k * element_size))
    return ops


def bucket(numels: Sequence[int], element_size: int, bucket_bytes: int) -> list[CommOp]:
    """DDP-style fused buckets of whole tensors, in the order given."""
    _check(numels, element_size, bucket_bytes, "bucket_bytes")
    ops: list[CommOp] = []
    cur: list[Piece] = []
    cur_bytes = 0
    for t, n in enumerate(numels):
        if n == 0:
            continue
        b = n * element_size
        if cur and cur_bytes + b > bucket_bytes:
            ops.append(CommOp(len(ops), tuple(cur), cur_bytes))
            cur, cur_bytes = [], 0
        cur.append(Piece(t, 0, n))
        cur_bytes += b
    if cur:
        ops.append(CommOp(len(ops), tuple(cur), cur_bytes))
    return ops


__all__ = ["CommOp", "Piece", "bucket", "partition", "split_equal"]
