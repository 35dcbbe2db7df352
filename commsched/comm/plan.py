"""Plans of the uneven all-to-all: one rank's counts and offsets, and the one small header
exchange that makes ranks agree on them (:func:`make_plan`) or checks a plan built locally.

Legend: P ranks in the group.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from ..agree import CODE_DTYPES as _CODE_DTYPES
from ..agree import DTYPE_CODES as _DTYPE_CODES
from ..dist import comm_guard, control_device

# header status codes (one per rank, all-gathered so every rank raises the same error)
_OK, _BAD_LEN, _NEGATIVE, _ROWS, _BAD_RECV, _FRACTION, _META, _BAD_RANK = range(8)
_HEAD = 7  # header entries before the counts: status, len, dtype, row numel, rows, index, plan rank


# --------------------------------------------------------------------------- plans
@dataclass(frozen=True)
class A2APlan:
    """Counts and offsets of one exchange, as seen by one rank; reusable while counts hold.

    send_counts[p]: rows this rank sends to p; recv_counts[p]: rows it receives from p
    (whole numbers >= 0).

    How far a plan is trusted when :func:`all_to_all` reuses it:

    * a plan built here (``A2APlan(send, recv, rank)``) is checked against the peers at
      every call: one small all_gather of its counts and of the rows' dtype and width, so
      that counts, dtypes or row widths that disagree between ranks raise the same
      ValueError on every rank instead of failing inside the backend;
    * a plan from :func:`make_plan` is agreed (the counts were exchanged) and bound to the
      rows it was made for (``dtype`` and ``row_numel``; not given: the rows of its first
      use, checked against the peers' then, once), in both directions (its
      ``reversed()`` carries rows of the same kind back): a call with other rows is a
      ValueError on the rank that passes them, raised before anything is sent (its peers
      then see it stop, a :class:`CommError`);
    * ``agreed=True``: the caller vouches that the counts match the peers' and the rows
      agree (counts derived from an exchanged count matrix, rows checked once, e.g. by
      ``ExpertGroup.validate``); used as it is, with no exchange of its own.
    """

    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    rank: int
    agreed: bool = field(default=False, compare=False)
    send_offsets: tuple[int, ...] = field(init=False, repr=False)
    recv_offsets: tuple[int, ...] = field(init=False, repr=False)
    # make_plan's plans: [the (dtype, row numel) it is bound to, or None until its first
    # use], one cell shared with its reversed() copies; None: not bound (agreed=True or local)
    _rows: list | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.send_counts) != len(self.recv_counts):
            raise ValueError(f"send_counts has {len(self.send_counts)} entries, recv_counts "
                             f"{len(self.recv_counts)}: both need one per rank")
        for name in ("send_counts", "recv_counts"):
            counts = getattr(self, name)
            whole = [_whole(c) for c in counts]
            if None in whole:
                i = whole.index(None)
                raise ValueError(f"{name}[{i}] is {counts[i]!r}: counts are whole numbers of rows")
            object.__setattr__(self, name, tuple(whole))
        if any(c < 0 for c in self.send_counts) or any(c < 0 for c in self.recv_counts):
            raise ValueError(f"counts must be >= 0, got send {self.send_counts} recv {self.recv_counts}")
        if not 0 <= self.rank < len(self.send_counts):
            raise ValueError(f"rank {self.rank} outside a world of {len(self.send_counts)}")
        object.__setattr__(self, "send_offsets", _offsets(self.send_counts))
        object.__setattr__(self, "recv_offsets", _offsets(self.recv_counts))

    @property
    def world_size(self) -> int:
        return len(self.send_counts)

    @property
    def total_send(self) -> int:
        return self.send_offsets[-1]

    @property
    def total_recv(self) -> int:
        return self.recv_offsets[-1]

    @property
    def peer_rows(self) -> int:
        """Rows this rank sends to other ranks (its own rows stay here)."""
        return self.total_send - self.send_counts[self.rank]

    def reversed(self) -> "A2APlan":
        """The plan of the reverse exchange (the backward pass), trusted as this one is."""
        r = A2APlan(self.recv_counts, self.send_counts, self.rank, agreed=self.agreed)
        object.__setattr__(r, "_rows", self._rows)
        return r

    def ring_rounds(self) -> list[tuple[int, int]]:
        """[(dst, src)] for rounds 1..P-1 of the ring pattern."""
        P, r = self.world_size, self.rank
        return [((r + i) % P, (r - i) % P) for i in range(1, P)]


def _whole(c) -> int | None:
    """``c`` as an int when it is a whole number (int, numpy or 0-d tensor ints, 2.0), else None."""
    try:
        return operator.index(c)
    except TypeError:
        pass
    try:
        f = float(c)
    except (TypeError, ValueError):
        return None
    return int(f) if f.is_integer() else None


def _offsets(counts: Sequence[int]) -> tuple[int, ...]:
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return tuple(out)


def make_plan(send_counts: Sequence[int], *, group=None, rows: int | None = None,
              dtype: torch.dtype | None = None, row_numel: int | None = None,
              recv_counts: Sequence[int] | None = None,
              device: torch.device | str | None = None) -> A2APlan:
    """Build a plan by exchanging counts once (one small all_gather).

    Every rank takes part even when its own input is wrong, so that a bad count list
    (wrong length, negative or not whole numbers), a row total that does not match
    ``rows``, a dtype / row shape that differs between ranks, rows on the ``meta`` device
    (``device``) or ``recv_counts`` (when given) that differ from what the peers send
    raise the same ValueError on every rank instead of leaving peers hanging. The plan is
    agreed and bound to the rows it carries (:class:`A2APlan`).
    """
    return _agree(send_counts, group=group, rows=rows, dtype=dtype, row_numel=row_numel,
                  recv_counts=recv_counts, device=device)


def _agree(send_counts, *, group, rows, dtype, row_numel, recv_counts, device,
           plan_rank: int | None = None) -> A2APlan:
    """:func:`make_plan`; ``plan_rank``: the rank a caller's plan was made for (checked)."""
    P = dist.get_world_size(group)
    me = dist.get_rank(group)
    whole = [_whole(c) for c in send_counts]
    recv = None if recv_counts is None else [_whole(c) for c in recv_counts]
    counts = [0 if c is None else c for c in whole]
    status, index = _OK, -1
    if len(counts) != P:
        status = _BAD_LEN
    elif None in whole:
        status, index = _FRACTION, whole.index(None)
    elif any(c < 0 for c in counts):
        status = _NEGATIVE
    elif rows is not None and sum(counts) != rows:
        status = _ROWS
    elif recv is not None and (len(recv) != P or None in recv or any(c < 0 for c in recv)):
        status = _BAD_RECV
    elif device is not None and torch.device(device).type == "meta":
        status = _META
    elif plan_rank is not None and plan_rank != me:
        status = _BAD_RANK
    head = [status, len(counts), _DTYPE_CODES.get(dtype, 0) if dtype is not None else 0,
            -1 if row_numel is None else int(row_numel), -1 if rows is None else int(rows), index,
            -1 if plan_rank is None else int(plan_rank)]
    body = counts + (recv if recv is not None else [-1] * P) if status == _OK else [0] * (2 * P)
    mine = torch.tensor(head + body, dtype=torch.int64, device=control_device(group))
    allv = [torch.empty_like(mine) for _ in range(P)]
    with comm_guard("exchanging all_to_all counts", group):
        dist.all_gather(allv, mine, group=group)
    M = torch.stack(allv).cpu()  # [P, _HEAD + 2P]; read on the host once
    bad = [(r, int(M[r, 0])) for r in range(P) if int(M[r, 0]) != _OK]
    if bad:
        why = {
            _BAD_LEN: lambda r: f"rank {r} gave {int(M[r, 1])} send counts for a group of {P}",
            _NEGATIVE: lambda r: f"rank {r} gave a negative send count",
            _ROWS: lambda r: f"rank {r}'s send counts sum to a different number of rows than its tensor has ({int(M[r, 4])})",
            _BAD_RECV: lambda r: f"rank {r} gave recv_counts of the wrong length, negative or not whole numbers",
            _FRACTION: lambda r: f"rank {r}'s send count for rank {int(M[r, 5])} is not a whole number of rows",
            _META: lambda r: f"rank {r} passed a tensor on the meta device (no data): pass rows on a real device",
            _BAD_RANK: lambda r: f"rank {r} passed a plan made for rank {int(M[r, 6])}",
        }
        raise ValueError("all_to_all: counts disagree between ranks: "
                         + "; ".join(why[s](r) for r, s in bad))
    codes = {int(M[r, 2]) for r in range(P)} - {0}
    if len(codes) > 1:
        names = {r: str(_CODE_DTYPES.get(int(M[r, 2]), "?")) for r in range(P)}
        raise ValueError(f"all_to_all: tensors have different dtypes on different ranks: {names}")
    numels = {int(M[r, 3]) for r in range(P)} - {-1}
    if len(numels) > 1:
        raise ValueError("all_to_all: rows have different sizes on different ranks "
                         f"(elements per row: {[int(M[r, 3]) for r in range(P)]}); "
                         "every rank must send rows of the same trailing shape")
    matrix, claimed = M[:, _HEAD:_HEAD + P], M[:, _HEAD + P:]
    wrong = [r for r in range(P) if int(claimed[r, 0]) != -1 and not torch.equal(claimed[r], matrix[:, r])]
    if wrong:
        raise ValueError("all_to_all: plans disagree between ranks: " + "; ".join(
            f"rank {r} expects to receive {tuple(claimed[r].tolist())} rows but its peers send "
            f"{tuple(matrix[:, r].tolist())}" for r in wrong))
    plan = A2APlan(tuple(counts), tuple(int(matrix[p, me]) for p in range(P)), me, agreed=True)
    bound = (dtype, int(row_numel)) if dtype is not None and row_numel is not None else None
    object.__setattr__(plan, "_rows", [bound])
    return plan


__all__ = ["A2APlan", "make_plan"]
