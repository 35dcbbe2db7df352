"""Token dispatch to experts: the local reference and the expert-parallel exchange.

Legend: T tokens, D model width, E experts in the layer, P ranks of the expert-parallel
(EP) group, L = E / P experts per rank, K choices per token, A kept (token, expert)
assignments of this rank, C chunks of the pipelined exchange, R rows received.

Three paths compute the same thing, ``out[t] = sum_k gate[t, k] * expert_{e[t, k]}(x[t])``:

* :func:`local_moe` -- the reference: every expert is held here, no communication.
* :func:`ep_moe` with ``pipeline=False`` -- the plain expert-parallel path: rows go to the
  rank that owns their expert through the uneven ``commsched.all_to_all`` (differentiable),
  experts run, rows come back through the reverse exchange, the gates weight them. With
  ``chunks > 1`` it does the same chunk by chunk, one after another.
* :func:`ep_moe` with ``pipeline=True`` -- the fast path: tokens are cut into C chunks,
  every chunk's exchange is queued at once (on a comm lane that sends them one after
  another), and expert compute on a chunk starts as soon as it has landed while later
  chunks are still on the wire; the combine exchange of a chunk is queued as soon as its
  experts are done. The backward pass is pipelined the same
  way (a custom autograd function), so gradients flow chunk by chunk too.
* :func:`ep_moe` with ``pipeline=True, merge=True`` -- the pipelined path's arithmetic
  without its pipelining: every chunk is encoded and computed exactly as above (the same
  rows, keys, expert calls and gradient sums, so the same bits), but the C chunks of each
  exchange travel together as one all-to-all (a peer's rows of chunk 0, then of chunk 1,
  ...), one exchange each way instead of C: for links where every exchange pays a large
  latency and every peer's skew (a bridge between hosts) and the overlap does not pay it
  back, without changing a bit of the pipelined arithmetic.

Rows sent by a rank are ordered by (chunk, expert); chunk c holds the tokens
``[c*T/C, (c+1)*T/C)``. Expert e lives on EP rank ``e // L``. One small exchange of
counts per layer call tells every rank how many rows of each chunk and local expert it
will receive from each peer.

An :class:`~commsched.comm.observe.A2AObserver` (the priority scheduler, an
:class:`~commsched.comm.observe.A2ATimer`, or an :class:`~commsched.comm.observe.A2AEvents` passing
the reports on) is told when each exchange starts and ends and when the expert block of a
backward pass starts and ends: the plain path passes it to ``commsched.all_to_all``
(``observer=``, ``backward_block=``), which reports the forward and the backward exchanges;
the pipelined path, whose autograd function runs its own backward, reports through
:class:`~commsched.comm.observe.A2AReport`.

Wire formats (``wires=``, a :class:`MoEWires`, made by :func:`moe_wires` from the
``--a2a-bits`` of :class:`~commsched.moe.model.layer.DispatchConfig`): the dispatch exchange and
the combine exchange each carry a :class:`commsched.comm.all2all.Wire` (a row format for the
forward rows and one for the backward pass's gradients). At 8 bits the rows that travel
*to* the experts (the dispatched tokens, and in the backward pass the gradients of the
expert outputs) are 8-bit row records of the shared codec
(:class:`commsched.quant.rowwire.QuantRows`), the rows that come *back* (the expert
outputs, and the gradients of the dispatched tokens) bfloat16; at 16 bits everything is
bfloat16; at 32 the exchange is the plain one, bit for bit. Both paths encode before and
decode after each exchange, so the observer and the counters see the shorter messages.

Devices: every index tensor (token order, the regrouping permutations) and the count
exchange live on the device of the routing and the tokens, so a CUDA layer never mixes
host and device tensors; the counts come back to the host once per layer call (an uneven
exchange needs its sizes there). The time the caller was blocked on an exchange is the
host clock on the CPU and CUDA events on CUDA (waited for when reported).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ...agree import check_same_config
from ...comm.all2all import (
    BF16,
    A2APlan,
    RowFormat,
    Wire,
    all_to_all,
    all_to_all_async,
    decode_rows,
    encode_rows,
    make_plan,
)
from ...comm.lanes import Lanes
from ...comm.observe import A2AObserver, A2AReport
from ...quant.rowwire import QuantRows, format_seed
from .experts import ExpertFFN, expert_apply
from .router import Routing


# --------------------------------------------------------------------------- placement of experts
@dataclass(frozen=True)
class ExpertGroup:
    """Experts spread over the P ranks of an EP process group, L = E / P on each, in blocks."""

    num_experts: int
    size: int
    rank: int
    group: object | None = None  # torch.distributed process group; None: the default group

    def __post_init__(self) -> None:
        if self.size < 1 or self.num_experts % self.size:
            raise ValueError(f"{self.num_experts} experts cannot be split evenly over an expert-parallel "
                             f"group of {self.size} ranks; choose num_experts as a multiple of the group size")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside an expert-parallel group of {self.size}")

    @property
    def num_local(self) -> int:
        return self.num_experts // self.size

    def validate(self, row_numel: int, dtype: torch.dtype) -> None:
        """Check once, collectively on the EP group, that every rank holds the same number
        of experts and exchanges rows of ``row_numel`` elements of ``dtype`` (the model
        width, the all-to-all dtype): a disagreement is the same ValueError on every rank,
        naming the rank, instead of a size mismatch inside the backend's all-to-all."""
        if self.size == 1:
            return
        check_same_config({"num_experts": self.num_experts, "ep_size": self.size}, self.group,
                          what="expert-parallel layout")
        make_plan((1,) * self.size, group=self.group, rows=self.size, dtype=dtype, row_numel=row_numel)

    @property
    def first(self) -> int:
        return self.rank * self.num_local


# --------------------------------------------------------------------------- wire formats
A2A_BITS = (32, 16, 8)  # --a2a-bits: the expert all-to-all's width (module docstring)


@dataclass(frozen=True)
class MoEWires:
    """The wires of an MoE layer's two exchanges (None: plain): ``dispatch`` (tokens to the
    experts; its backward sends the tokens' gradients back), ``combine`` (expert outputs
    back; its backward sends the outputs' gradients to the experts)."""

    dispatch: Wire | None = None
    combine: Wire | None = None
    bits: int = 32


def moe_wires(bits: int, seed: int = 0, *, impl: str = "auto") -> MoEWires:
    """The wires of ``--a2a-bits`` ``bits`` (module docstring); ``seed`` starts the 8-bit
    format's key stream (give every rank and layer its own: :func:`format_seed`)."""
    if isinstance(bits, bool) or bits not in A2A_BITS:
        raise ValueError(f"--a2a-bits must be one of {A2A_BITS}, got {bits!r}")
    if bits == 32:
        return MoEWires()
    if bits == 16:
        return MoEWires(Wire(BF16, BF16), Wire(BF16, BF16), 16)
    q = QuantRows(8, seed=seed, impl=impl)
    return MoEWires(dispatch=Wire(q, BF16), combine=Wire(BF16, q), bits=8)


def _fmt(wire: Wire | None, backward: bool) -> RowFormat | None:
    if wire is None:
        return None
    return wire.backward if backward else wire.forward


# --------------------------------------------------------------------------- token side
@dataclass
class Assignments:
    """This rank's kept (token, expert) choices, sorted by (chunk, expert).

    token_A: int64 token of each row; expert_A: int64 expert; gate_A: float gate
    (differentiable); counts_CE: int64 [C, E] rows per chunk and expert.
    """

    token_A: torch.Tensor
    expert_A: torch.Tensor
    gate_A: torch.Tensor
    counts_CE: torch.Tensor


def sort_assignments(routing: Routing, num_experts: int, chunks: int = 1) -> Assignments:
    """Flatten the kept choices and order them by (chunk of their token, expert)."""
    T, K = routing.expert_TK.shape
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    token_TK = torch.arange(T, device=routing.expert_TK.device).unsqueeze(1).expand(T, K)
    keep = routing.keep_TK.reshape(-1)
    token_A = token_TK.reshape(-1)[keep]
    expert_A = routing.expert_TK.reshape(-1)[keep]
    gate_A = routing.gate_TK.reshape(-1)[keep]
    chunk_A = token_A * chunks // max(T, 1)
    key_A = chunk_A * num_experts + expert_A
    order = torch.sort(key_A, stable=True).indices
    counts = torch.bincount(key_A, minlength=chunks * num_experts).reshape(chunks, num_experts)
    return Assignments(token_A[order], expert_A[order], gate_A[order], counts)


def combine(rows_AD: torch.Tensor, asg: Assignments, num_tokens: int) -> torch.Tensor:
    """``out[t] = sum of gate * row`` over the rows of token t; returns [T, D]."""
    weighted = rows_AD * asg.gate_A.to(rows_AD.dtype).unsqueeze(1)
    out = rows_AD.new_zeros((num_tokens, rows_AD.shape[1]))
    return out.index_add(0, asg.token_A, weighted)


# --------------------------------------------------------------------------- reference
def local_moe(x_TD: torch.Tensor, routing: Routing, experts: ExpertFFN) -> torch.Tensor:
    """Every expert held here; no communication. The reference the EP paths must equal."""
    E = experts.num_experts
    if experts.first != 0 or experts.num_local != E:
        raise ValueError("local_moe needs all experts on this rank (ExpertFFN with first=0, num_local=E)")
    asg = sort_assignments(routing, E)
    y_AD = experts(x_TD[asg.token_A], asg.counts_CE[0].tolist())
    return combine(y_AD, asg, x_TD.shape[0])


# --------------------------------------------------------------------------- exchange plan
@dataclass
class ChunkPlan:
    """One chunk's exchange as seen by this rank.

    plan: the dispatch exchange (send rows to expert owners); rows [send_lo, send_hi) of
    the sorted send buffer; recv_PL[p][j]: rows of local expert j from peer p;
    perm_R: received (source-major) rows -> expert-major; inv_R: the inverse.
    """

    plan: A2APlan
    send_lo: int
    send_hi: int
    recv_PL: list[list[int]]
    counts_L: list[int]
    perm_R: torch.Tensor
    inv_R: torch.Tensor


def _regroup(recv_PL: list[list[int]], device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation taking source-major rows (peer, then expert) to expert-major rows, and
    its inverse; built on the host, then moved to ``device`` (one copy each)."""
    P, L = len(recv_PL), len(recv_PL[0]) if recv_PL else 0
    off, offs = 0, [[0] * L for _ in range(P)]
    for p in range(P):
        for j in range(L):
            offs[p][j] = off
            off += recv_PL[p][j]
    parts = [torch.arange(offs[p][j], offs[p][j] + recv_PL[p][j]) for j in range(L) for p in range(P)
             if recv_PL[p][j]]
    perm = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    if device is not None and device.type != "cpu":
        perm, inv = perm.to(device, non_blocking=True), inv.to(device, non_blocking=True)
    return perm, inv


def exchange_counts(counts_CE: torch.Tensor, eg: ExpertGroup,
                    observer: A2AObserver | None = None) -> list[list[list[int]]]:
    """Tell each expert owner how many rows of each chunk and local expert it gets.

    Returns recv[c][p][j] (rows of chunk c for local expert j from peer p). One small
    equal-split all_to_all on the EP group, on the device of ``counts_CE``.
    """
    C, E = counts_CE.shape
    P, L = eg.size, eg.num_local
    send = counts_CE.reshape(C, P, L).permute(1, 0, 2).reshape(P, C * L).contiguous()
    plan = A2APlan((1,) * P, (1,) * P, eg.rank, agreed=True)  # eg.validate() checked the layout
    got = all_to_all(send, plan, group=eg.group, observer=observer).reshape(P, C, L)
    g = got.permute(1, 0, 2).tolist()  # [C][P][L]
    return g


def build_chunk_plans(asg: Assignments, eg: ExpertGroup,
                      observer: A2AObserver | None = None) -> list[ChunkPlan]:
    C = asg.counts_CE.shape[0]
    P, L = eg.size, eg.num_local
    recv = exchange_counts(asg.counts_CE, eg, observer)
    per_rank_CP = asg.counts_CE.reshape(C, P, L).sum(dim=2).tolist()
    plans, lo = [], 0
    for c in range(C):
        send_P = per_rank_CP[c]
        recv_P = [sum(recv[c][p]) for p in range(P)]
        perm, inv = _regroup(recv[c], asg.token_A.device)
        counts_L = [sum(recv[c][p][j] for p in range(P)) for j in range(L)]
        hi = lo + sum(send_P)
        plans.append(ChunkPlan(A2APlan(tuple(send_P), tuple(recv_P), eg.rank, agreed=True), lo, hi, recv[c],
                               counts_L, perm, inv))
        lo = hi
    return plans


# --------------------------------------------------------------------------- plain EP path
def _plain_chunks(x_send: torch.Tensor, plans: Sequence[ChunkPlan], experts: ExpertFFN, eg: ExpertGroup,
                  observer: A2AObserver | None, wires: MoEWires | None = None) -> torch.Tensor:
    """Chunk by chunk: dispatch, experts, combine. In the backward pass the combine
    exchange opens the expert block and the dispatch exchange closes it."""
    wires = wires or MoEWires()
    outs = []
    for cp in plans:
        xc = x_send[cp.send_lo:cp.send_hi]
        xr = all_to_all(xc, cp.plan, group=eg.group, observer=observer, backward_block="end",
                        wire=wires.dispatch)
        y = experts(xr[cp.perm_R], cp.counts_L)
        outs.append(all_to_all(y[cp.inv_R], cp.plan.reversed(), group=eg.group, observer=observer,
                               backward_block="begin", wire=wires.combine))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


# --------------------------------------------------------------------------- pipelined EP path
class _Pipeline:
    """What the pipelined function needs besides tensors (plans, group, observer, lanes).

    With ``lanes`` (a :class:`~commsched.comm.lanes.Lanes` with a ``comm`` lane) the exchanges
    run one after another on the comm lane, in submission order, so each has the link to
    itself while the compute thread works on chunks that have landed; without, they are
    started at once with the backend's asynchronous all_to_all and share the link.
    """

    def __init__(self, plans: Sequence[ChunkPlan], eg: ExpertGroup, observer: A2AObserver | None,
                 lanes: Lanes | None = None, wires: MoEWires | None = None, merge: bool = False,
                 apply=expert_apply):
        self.plans, self.eg, self.observer, self.lanes = list(plans), eg, observer, lanes
        self.apply = apply  # (rows, counts_L, *expert params) -> rows: the experts' arithmetic
        self.wires = wires or MoEWires()
        self.merge = merge

    def exchange(self, xs: Sequence[torch.Tensor], plans: Sequence[A2APlan], fmt: RowFormat | None):
        """Start the exchange of every chunk (``xs[c]`` through ``plans[c]``); returns a
        function ``get(c)`` giving chunk c's received rows, decoded (waiting as needed).
        Pipelined: one exchange per chunk, queued now. ``merge``: each chunk encoded as
        alone, in chunk order (the same keys), then every chunk's rows in one exchange and
        split again on arrival (rows are decoded one by one, so the same values)."""
        if not self.merge:
            hs = [self.start(x, pl, fmt) for x, pl in zip(xs, plans)]
            return lambda c: self.finish(hs[c])
        ws = [encode_rows(x.contiguous(), fmt) for x in xs]
        P, rank = self.eg.size, self.eg.rank
        parts = [w[pl.send_offsets[p]:pl.send_offsets[p + 1]] for p in range(P) for w, pl in zip(ws, plans)]
        send = parts[0] if len(parts) == 1 else torch.cat(parts)
        both = A2APlan(tuple(sum(pl.send_counts[p] for pl in plans) for p in range(P)),
                       tuple(sum(pl.recv_counts[p] for pl in plans) for p in range(P)), rank, agreed=True)
        got = all_to_all_async(send, both, group=self.eg.group, observer=self.observer).wait()
        pieces: list[list[torch.Tensor]] = [[] for _ in plans]
        off = 0
        for p in range(P):  # from peer p: its rows of chunk 0, of chunk 1, ...
            for c, pl in enumerate(plans):
                pieces[c].append(got[off:off + pl.recv_counts[p]])
                off += pl.recv_counts[p]
        outs = [decode_rows(pc[0] if len(pc) == 1 else torch.cat(pc), fmt, x.shape[1:], x.dtype)
                for pc, x in zip(pieces, xs)]
        return outs.__getitem__

    def returns(self, fmt: RowFormat | None) -> "_Returns":
        """The reverse exchanges of the chunks, added one by one as each is computed."""
        return _Returns(self, fmt)


    def start(self, x: torch.Tensor, plan: A2APlan, fmt: RowFormat | None = None):
        """Queue one exchange of ``x``'s rows in ``fmt`` (encoded here, on the caller's
        thread; reported as begun now); :meth:`finish` waits for it and decodes."""
        x = x.contiguous()
        w = encode_rows(x, fmt)
        like = (fmt, x.shape[1:], x.dtype)
        if self.lanes is None:  # the handle's wait() reports the end
            return all_to_all_async(w, plan, group=self.eg.group, observer=self.observer), None, like
        row_bytes = w[0].numel() * w.element_size() if w.shape[0] else 0
        report = A2AReport(self.observer, plan.peer_rows * row_bytes, w.device)
        return self.lanes.submit("comm", all_to_all, w, plan, group=self.eg.group), report, like

    def finish(self, handle) -> torch.Tensor:
        h, report, (fmt, row_shape, dtype) = handle
        out = h.wait() if report is None else report.finish(h.wait)
        return decode_rows(out, fmt, row_shape, dtype)


class _Returns:
    """Chunks added one by one (``add``): pipelined, each exchange is queued at once; with
    ``merge``, they are held and sent together by ``results()``, which returns every chunk's
    received rows in order."""

    def __init__(self, pipe: _Pipeline, fmt: RowFormat | None):
        self.pipe, self.fmt = pipe, fmt
        self.xs: list[torch.Tensor] = []
        self.plans: list[A2APlan] = []
        self.handles: list = []

    def add(self, x: torch.Tensor, plan: A2APlan) -> None:
        if self.pipe.merge:
            self.xs.append(x)
            self.plans.append(plan)
        else:
            self.handles.append(self.pipe.start(x, plan, self.fmt))

    def results(self) -> list[torch.Tensor]:
        if not self.pipe.merge:
            return [self.pipe.finish(h) for h in self.handles]
        get = self.pipe.exchange(self.xs, self.plans, self.fmt)
        return [get(c) for c in range(len(self.xs))]

class _PipelinedExperts(torch.autograd.Function):
    """x_send [A, D] (sorted by chunk, expert) -> expert outputs [A, D] in the same order,
    with every chunk's exchange overlapping the expert compute of the chunks before it."""

    @staticmethod
    def forward(ctx, x_send, pipe: _Pipeline, *params):
        pd = [p.detach().requires_grad_(True) for p in params]
        wd, wc = pipe.wires.dispatch, pipe.wires.combine
        plans = pipe.plans
        got = pipe.exchange([x_send[cp.send_lo:cp.send_hi] for cp in plans], [cp.plan for cp in plans],
                            _fmt(wd, False))
        saved, back = [], pipe.returns(_fmt(wc, False))
        for c, cp in enumerate(plans):
            xe = got(c)[cp.perm_R].requires_grad_(True)
            with torch.enable_grad():
                y = pipe.apply(xe, cp.counts_L, *pd)
            saved.append((xe, y))
            back.add(y.detach()[cp.inv_R], cp.plan.reversed())
        outs = back.results()
        ctx.pipe, ctx.saved, ctx.pd = pipe, saved, pd
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def backward(ctx, g_send):
        pipe, saved, pd = ctx.pipe, ctx.saved, ctx.pd
        obs = pipe.observer
        if obs is not None:
            obs.block_begin()
        g_send = g_send.contiguous()
        wd, wc = pipe.wires.dispatch, pipe.wires.combine
        # the combine's reverse (output gradients to the experts), then the dispatch's
        plans = pipe.plans
        got = pipe.exchange([g_send[cp.send_lo:cp.send_hi] for cp in plans], [cp.plan for cp in plans],
                            _fmt(wc, True))
        g_params: list[torch.Tensor | None] = [None] * len(pd)
        back = pipe.returns(_fmt(wd, True))
        for c, (cp, (xe, y)) in enumerate(zip(plans, saved)):
            ge = got(c)[cp.perm_R]
            if y.requires_grad and y.shape[0] > 0:
                grads = torch.autograd.grad(y, [xe, *pd], ge, allow_unused=True)
                gx = grads[0] if grads[0] is not None else torch.zeros_like(xe)
                for i, gp in enumerate(grads[1:]):
                    if gp is not None:
                        g_params[i] = gp if g_params[i] is None else g_params[i] + gp
            else:
                gx = torch.zeros_like(xe)
            back.add(gx.detach()[cp.inv_R], cp.plan.reversed())
        outs = back.results()
        ctx.saved = None
        if obs is not None:
            obs.block_end()
        g_x = outs[0] if len(outs) == 1 else torch.cat(outs)
        g_params = [torch.zeros_like(p) if g is None else g for p, g in zip(pd, g_params)]
        return (g_x, None, *g_params)


# --------------------------------------------------------------------------- EP entry point
def ep_moe(x_TD: torch.Tensor, routing: Routing, experts: ExpertFFN, eg: ExpertGroup, *,
           chunks: int = 1, pipeline: bool = False, observer: A2AObserver | None = None,
           lanes: Lanes | None = None, wires: MoEWires | None = None, merge: bool = False) -> torch.Tensor:
    """Expert-parallel MoE over ``eg`` (see the module docstring). Collective on the EP group:
    every rank of it must call this, with the same ``chunks``, ``merge`` and wire widths.
    ``lanes`` (pipelined path): run the chunks' exchanges one at a time on its ``comm`` lane.
    ``merge`` (pipelined path): the chunks of each exchange in one all-to-all, the same bits.
    ``wires``: the exchanges' formats (:func:`moe_wires`; default plain). ``experts`` is an
    :class:`ExpertFFN` or any object with its ``num_experts``, ``first``, ``num_local``, a call
    on (rows, counts_L) and ``params()``; one with an ``apply_rows(rows, counts_L, *params)`` (the
    same arithmetic as a function of the parameters) brings its own to the pipelined path."""
    if experts.num_experts != eg.num_experts or experts.first != eg.first or experts.num_local != eg.num_local:
        raise ValueError(f"this rank holds experts [{experts.first}, {experts.first + experts.num_local}) "
                         f"but the expert group places [{eg.first}, {eg.first + eg.num_local}) here")
    if eg.size > 1 and not dist.is_initialized():
        raise ValueError("expert parallelism over more than one rank needs torch.distributed initialised")
    asg = sort_assignments(routing, eg.num_experts, chunks)
    plans = build_chunk_plans(asg, eg, observer)
    x_send = x_TD[asg.token_A]
    if pipeline:
        pipe = _Pipeline(plans, eg, observer, lanes, wires, merge, getattr(experts, "apply_rows", expert_apply))
        y_send = _PipelinedExperts.apply(x_send, pipe, *experts.params())
    else:
        y_send = _plain_chunks(x_send, plans, experts, eg, observer, wires)
    return combine(y_send, asg, x_TD.shape[0])


__all__ = ["A2A_BITS", "Assignments", "ChunkPlan", "ExpertGroup", "MoEWires", "build_chunk_plans",
           "combine", "ep_moe", "exchange_counts", "format_seed", "local_moe", "moe_wires", "sort_assignments"]
