"""MoE training on an emulated device (``--compute emulated``): the model's compute on a
per-rank :class:`~commsched.cluster.device.DeviceClock`, its communication real.

Legend: B batch, S sequence, T = B*S tokens, D model width, F dense FFN width, X expert
hidden width, E experts per layer, L = E / P experts per rank, K choices per token, V
vocabulary, e bytes of one compute element (4 float32, 2 bfloat16), C chunks.

The model is :class:`~commsched.moe.model.lm.MoETransformerLM` itself -- the same modules,
parameters (names, shapes, order, expert attributes), MoE layers, observer and dispatch
config -- built on the meta device and then given parameters that are views of one shared
read-only zero buffer, so a rank holds the model's structure at the cost of its largest
parameter. Each module's forward is replaced by its emulated twin (the classes below):
instead of computing, it queues the time of its kernels on the rank's device clock
(FLOPs and bytes at the modelled sizes, :meth:`DeviceModel.op_time
<commsched.cluster.device.DeviceModel.op_time>`, times the dilation k) and passes on a
one-element dependency tensor, so that autograd runs the backward pass in the order a real
one would. Modules are still called through ``nn.Module.__call__``: ``lina-overlap``'s
forward pre-hooks wait for each module's reduction exactly as in a real run.

What is real: every collective. The MoE layer draws a routing (each token's K experts
uniformly at random, seeded by the run's seed, the layer, the rank and the call; the
capacity rule of the router applied), exchanges the counts with
:func:`~commsched.moe.model.dispatch.build_chunk_plans`, and moves rows of the modelled size
(``a2a_row_bytes``: D elements of the compute dtype, or the 8-bit codec's records, or
bfloat16) through the real :func:`~commsched.comm.all2all.all_to_all` -- or, pipelined, the
real pipelined exchange (:class:`~commsched.moe.model.dispatch._Pipeline` and the layer's
comm lane) -- reported to the layer's observer, so the gradient scheduler sees every
exchange and expert block. Gradients are float32 tensors of each parameter's shape (their
values are never read: uninitialised memory, only their bytes cross the links), released by
autograd's post-accumulate hooks to the real :class:`~commsched.priority.runtime.executor.GradScheduler`
of every schedule; the optimizer (:class:`EmulatedAdam`) is the time of a fused Adam step.

Where the host waits for the device (:meth:`DeviceClock.wait`): where a real GPU job's
collective depends on a kernel's output -- before the count exchange (the routing), before
each row exchange (the packed rows, their encoding), before a gradient is handed to the
scheduler (its kernel ends), at the end of a step (what ``loss.item()`` waits for) -- and
nowhere else: the host queues kernels and sleeps.

Approximations: the routing is a uniform random router's, not a trained one's; the
gradients' and rows' values are not computed; Adam keeps no state (its time is modelled);
the codec of ``--a2a-bits 8`` and ``--grad-bits`` is a ``quant`` kernel's time, not the
codec itself (:class:`EmulatedCompressedLauncher`). Host costs the scheduler has on any backend
remain real (fifo's bucket copies, gloo's sums).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ...cluster.device import (
    DeviceClock,
    DeviceModel,
    HostCPU,
    dtype_name,
    load_device_model,
    peak_rss_mib,
)
from ...comm.all2all import A2APlan, all_to_all
from ...comm.lanes import Lanes
from ...comm.observe import A2AObserver
from ...priority.runtime.executor import LOCAL
from ...quant.allreduce import _NOTE_BYTES, CompressedLauncher
from ...quant.wire import record_bytes
from ..model.dispatch import Assignments, ChunkPlan, ExpertGroup, _Pipeline, build_chunk_plans
from ..model.experts import ExpertFFN, is_expert_param
from ..model.layer import MoELayer
from ..model.lm import Attention, Block, DenseFFN, MoETransformerLM
from ..model.router import Router, capacity_keep

COMPUTES = ("real", "emulated")  # --compute
# bytes Adam moves per float32 parameter: reads parameter, gradient, two moments; writes
# parameter and moments (a fused multi-tensor step)
ADAM_BYTES = 7 * 4
ADAM_FLOPS = 12  # per parameter: moments, bias corrections, the update


Kernel = tuple[str, float, float]  # (op class, FLOPs, bytes)


class Emulation:
    """One rank's emulated device and what the modules share: the clock, the compute dtype,
    the tokens per step, the run's seed and the row bytes of the exchanges."""

    def __init__(self, clock: DeviceClock, *, dtype: str, tokens: int, seed: int, rank: int,
                 row_bytes: tuple[int, int, int, int], a2a_bits: int):
        self.t_start = time.perf_counter()  # the run's start (start-up time: to its first timed step)
        self.clock, self.dtype, self.T, self.seed, self.rank = clock, dtype, tokens, seed, rank
        self.e = 2 if dtype_name(dtype) in ("bf16", "fp16") else 4
        self.row_bytes, self.a2a_bits = row_bytes, a2a_bits
        self.rows_exchanged = 0  # token rows dispatched to the experts (each crosses four exchanges)

    def queue(self, kernels: Sequence[Kernel]) -> float:
        """Queue kernels on the device; the token of the last (now, when none)."""
        tok = self.clock.issued()
        for op, flops, nbytes in kernels:
            tok = self.clock.run(op, flops=flops, bytes=nbytes, dtype=self.dtype)
        return tok

    def wait(self, token: float | None = None) -> None:
        self.clock.wait(token)


# --------------------------------------------------------------------------- marks
class DeviceMarks:
    """The training loop's clock on the emulated device: a mark is when the device's
    stream reaches it (a CUDA event's time): the later of now and the queued work's end."""

    def __init__(self, clock: DeviceClock):
        self.clock = clock

    def mark(self) -> float:
        return max(time.perf_counter(), self.clock.issued())

    @staticmethod
    def seconds(a: float, b: float) -> float:
        return b - a


# --------------------------------------------------------------------------- optimizer
class EmulatedAdam(torch.optim.Optimizer):
    """The time of a fused Adam step over its parameters (float32 master weights), queued on
    the device; the weights are not changed and no moments are kept."""

    def __init__(self, params, emu: Emulation):
        super().__init__(params, {})
        self._emu = emu

    def step(self, closure=None):  # noqa: D102 - torch.optim's protocol
        n = sum(p.numel() for g in self.param_groups for p in g["params"])
        if n:
            self._emu.clock.run("optimizer", flops=ADAM_FLOPS * n, bytes=ADAM_BYTES * n, dtype="fp32")
        return None


# --------------------------------------------------------------------------- compressed reduction
def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class EmulatedCompressedLauncher(CompressedLauncher):
    """``--grad-bits 16|8|4|2`` on the emulated device: the launcher's batching, keys and
    collectives as :class:`~commsched.quant.allreduce.CompressedLauncher`'s (the same
    ``all_to_all_single`` and ``all_gather_into_tensor`` of the same byte counts, the
    ranks' batch notes among them), the codec's encode, decode and sum as device kernels
    (``quant``; a bfloat16 cast at 16 bits) instead of host arithmetic. The codec's kernels
    take their turn on the rank's device with the compute (a side stream shares the
    GPU's SMs). :attr:`wire_bytes_sent` counts the bytes this rank sent."""

    def __init__(self, emu: Emulation, bits: int, **kw: Any):
        super().__init__(bits, **kw)
        self._emu = emu
        self.wire_bytes_sent = 0

    def _sum_items(self, items, group, note):
        if self.bits == 32 or dist.get_world_size(group) == 1:
            return super()._sum_items(items, group, note)
        items = [(f, k) for f, k in items if f.numel()]
        if not items:
            return None
        emu, F = self._emu, self.row_values
        P = dist.get_world_size(group)
        W = 2 * F if self.bits == 16 else record_bytes(F, self.bits)  # bytes of one row on the wire
        op = "elementwise" if self.bits == 16 else "quant"
        # rows per owner chunk of each item: its values in rows of F, the rows in P chunks
        rows = sum(_ceil(_ceil(f.numel(), F), P) for f, _ in items)

        def codec(n: int) -> Kernel:  # encode or decode n rows
            return (op, 4.0 * n * F, n * (4 * F + W))

        # 1. reduce-scatter: every row encoded; each owner decodes and sums its peers' chunks
        emu.wait(emu.queue([codec(P * rows)]))
        send = self._zeros(P * rows * W).view(P, rows * W)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv.view(-1), send.view(-1), group=group)
        # 2. all-gather of each owner's summed chunk, encoded once (and this rank's note)
        emu.wait(emu.queue([codec(P * rows), ("elementwise", P * rows * F, 3.0 * P * rows * F * 4),
                            codec(rows)]))
        part = self._zeros(rows * W + (_NOTE_BYTES if note is not None else 0))
        if note is not None:
            part = part.clone()
            part[rows * W:] = torch.tensor([int(note)], dtype=torch.int64).view(torch.uint8)
        gathered = torch.empty(P * part.numel(), dtype=torch.uint8)
        dist.all_gather_into_tensor(gathered, part, group=group)
        emu.wait(emu.queue([codec(P * rows)]))  # every rank decodes the sums
        self.wire_bytes_sent += 2 * (P - 1) * rows * W
        if note is None:
            return None
        return gathered.view(P, -1)[:, rows * W:].clone().view(torch.int64)[:, 0].tolist()

    def _zeros(self, n: int) -> torch.Tensor:
        buf = getattr(self, "_buf", None)
        if buf is None or buf.numel() < n:
            buf = self._buf = torch.zeros(n, dtype=torch.uint8)
        return buf[:n]


# --------------------------------------------------------------------------- the kernels' autograd node
class _Kernels(torch.autograd.Function):
    """Queues ``fwd`` now and ``bwd`` in the backward pass; the gradients of ``params`` are
    handed to autograd (and so to the gradient scheduler's hooks) when ``bwd`` has ended."""

    @staticmethod
    def forward(ctx, dep, emu: Emulation, fwd, bwd, *params):
        ctx.emu, ctx.bwd = emu, bwd
        ctx.shapes = [(p.shape, p.dtype) for p in params]
        emu.queue(fwd)
        return dep.new_zeros(1)

    @staticmethod
    def backward(ctx, g):
        tok = ctx.emu.queue(ctx.bwd)
        if ctx.shapes:
            ctx.emu.wait(tok)  # a gradient exists once its kernel has ended
        grads = [torch.empty(s, dtype=d) for s, d in ctx.shapes]
        return (g, None, None, None, *grads)


def _kernels(dep: torch.Tensor, emu: Emulation, fwd: Sequence[Kernel], bwd: Sequence[Kernel],
             params: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    return _Kernels.apply(dep, emu, tuple(fwd), tuple(bwd), *params)


def gemm(m: float, n: float, k: float, e: int) -> Kernel:
    """[m, k] @ [k, n]: 2mnk FLOPs, both operands and the result read or written once."""
    return ("gemm", 2.0 * m * n * k, e * (m * k + k * n + m * n))


def linear_kernels(rows: float, d_in: int, d_out: int, e: int) -> tuple[list[Kernel], list[Kernel]]:
    """A linear layer on ``rows`` rows: one GEMM forward; backward the input's gradient and
    the weight's (and bias's) gradient, one GEMM each."""
    return [gemm(rows, d_out, d_in, e)], [gemm(rows, d_in, d_out, e), gemm(d_in, d_out, rows, e)]


def _params(m: nn.Module) -> list[nn.Parameter]:
    return list(m.parameters(recurse=False))


# --------------------------------------------------------------------------- emulated modules
class EmulatedLinear(nn.Linear):
    def forward(self, dep):  # noqa: D102
        emu = self._emu
        f, b = linear_kernels(emu.T, self.in_features, self.out_features, emu.e)
        return _kernels(dep, emu, f, b, _params(self))


class EmulatedLayerNorm(nn.LayerNorm):
    def forward(self, dep):  # noqa: D102
        emu = self._emu
        n = emu.T * self.normalized_shape[0]
        return _kernels(dep, emu, [("reduction", 8.0 * n, 2.0 * n * emu.e)],
                        [("reduction", 12.0 * n, 3.0 * n * emu.e)], _params(self))


class EmulatedEmbedding(nn.Embedding):
    def forward(self, dep):  # noqa: D102
        emu = self._emu
        n = emu.T * self.embedding_dim
        return _kernels(dep, emu, [("copy", 0.0, 2.0 * n * emu.e)], [("reduction", n, 2.0 * n * 4)], _params(self))


class EmulatedAttention(Attention):
    def forward(self, dep):  # noqa: D102
        emu = self._emu
        D = self.proj.in_features
        B = emu.T // self._seq
        S = self._seq
        # causal attention: QK^T and PV over half the S x S scores (flash-style: Q, K, V, O
        # read or written once forward; backward about 2.5x the FLOPs and twice the bytes)
        flops = 2.0 * B * S * S * D
        h = self.qkv(dep)
        h = _kernels(h, emu, [("attention", flops, 4.0 * emu.T * D * emu.e)],
                     [("attention", 2.5 * flops, 8.0 * emu.T * D * emu.e)])
        return self.proj(h)


class EmulatedDenseFFN(DenseFFN):
    def forward(self, dep):  # noqa: D102
        emu = self._emu
        n = emu.T * self.fc1.out_features
        h = self.fc1(dep)
        h = _kernels(h, emu, [("elementwise", 8.0 * n, 2.0 * n * emu.e)], [("elementwise", 12.0 * n, 3.0 * n * emu.e)])
        return self.fc2(h), None


class EmulatedBlock(Block):
    def forward(self, dep, ffn=None):  # noqa: D102
        if ffn is not None:
            raise ValueError("the emulated model runs its own MoE layers (no moe_call)")
        emu = self._emu
        n = emu.T * self.ln1.normalized_shape[0]
        add = ([("elementwise", n, 3.0 * n * emu.e)], [("elementwise", n, 3.0 * n * emu.e)])
        h = self.attn(self.ln1(dep))
        h = _kernels(h, emu, *add)  # x + attn(ln1(x))
        y, _ = self.ffn(self.ln2(h))
        return _kernels(y, emu, *add), None


class EmulatedRouter(Router):
    def forward(self, dep):  # noqa: D102
        emu = self._emu
        E, D = self.weight.shape
        f, b = linear_kernels(emu.T, D, E, emu.e)
        soft = ("reduction", 5.0 * emu.T * E, 3.0 * emu.T * E * 4)  # softmax, top-k, gates (float32)
        return _kernels(dep, emu, [*f, soft], [soft, *b], _params(self))


class EmulatedExperts(ExpertFFN):
    """L experts on their received rows: per expert two GEMMs and a GELU forward, four
    GEMMs and the GELU's gradient backward (the row counts of the call)."""

    def kernels(self, counts_L: Sequence[int]) -> tuple[list[Kernel], list[Kernel]]:
        e, D, X = self._emu.e, self.d_model, self.d_hidden
        fwd: list[Kernel] = []
        bwd: list[Kernel] = []
        for n in counts_L:
            f1, b1 = linear_kernels(n, D, X, e)
            f2, b2 = linear_kernels(n, X, D, e)
            act = ("elementwise", 8.0 * n * X, 2.0 * n * X * e)
            fwd += [*f1, act, *f2]
            bwd += [*b2, ("elementwise", 12.0 * n * X, 3.0 * n * X * e), *b1]
        return fwd, bwd

    def forward(self, dep, counts_L):  # noqa: D102
        f, b = self.kernels(counts_L)
        return _kernels(dep, self._emu, f, b, _params(self))


# --------------------------------------------------------------------------- the exchanges
def _codec(emu: Emulation, rows: int, D: int, width: int) -> list[Kernel]:
    """Encoding (or decoding) ``rows`` rows of D compute elements to rows of ``width`` bytes:
    the 8-bit codec is a ``quant`` kernel, a cast an elementwise one, none when the rows
    travel as computed."""
    if width == D * emu.e or rows == 0:
        return []
    op = "quant" if width < 2 * D else "elementwise"
    return [(op, 4.0 * rows * D, rows * (D * emu.e + width))]


class _RowBuffer:
    """Zero bytes to send, grown as needed (the rows' values are never read)."""

    def __init__(self):
        self.buf = torch.zeros(0, dtype=torch.uint8)

    def rows(self, n: int, width: int) -> torch.Tensor:
        need = n * width
        if self.buf.numel() < need:
            self.buf = torch.zeros(need, dtype=torch.uint8)
        return self.buf[:need].view(n, width)


class _Exchange(torch.autograd.Function):
    """One row exchange of an MoE layer through the real all-to-all: forward ``plan`` at
    ``widths[0]`` bytes a row, backward its reverse at ``widths[1]``; ``block`` "begin" or
    "end": the exchange opens or closes the backward pass's expert block (as the real
    dispatch reports it)."""

    @staticmethod
    def forward(ctx, dep, layer: "EmulatedMoELayer", plan: A2APlan, widths: tuple[int, int], block: str):
        ctx.layer, ctx.plan, ctx.widths, ctx.block = layer, plan, widths, block
        layer._exchange(plan, widths[0])
        return dep.new_zeros(1)

    @staticmethod
    def backward(ctx, g):
        obs = ctx.layer.observer
        if obs is not None and ctx.block == "begin":
            obs.block_begin()
        ctx.layer._exchange(ctx.plan.reversed(), ctx.widths[1])
        if obs is not None and ctx.block == "end":
            obs.block_end()
        return g, None, None, None, None


class _Pipelined(torch.autograd.Function):
    """The pipelined exchange (``--pipeline``) through the real pipelined machinery: every
    chunk's dispatch queued at once, each chunk's experts queued on the device as it lands
    and its combine sent once they have run; backward the same way in reverse. The experts'
    gradients are handed over at its end, as the real pipelined function returns them."""

    @staticmethod
    def forward(ctx, dep, layer: "EmulatedMoELayer", plans: list[ChunkPlan], *params):
        ctx.layer, ctx.plans, ctx.shapes = layer, plans, [(p.shape, p.dtype) for p in params]
        w = layer._widths
        layer._pipelined(plans, w[0], w[1], backward=False)
        return dep.new_zeros(1)

    @staticmethod
    def backward(ctx, g):
        layer = ctx.layer
        obs = layer.observer
        if obs is not None:
            obs.block_begin()
        w = layer._widths
        layer._pipelined(ctx.plans, w[2], w[3], backward=True)
        if obs is not None:
            obs.block_end()
        grads = [torch.empty(s, dtype=d) for s, d in ctx.shapes]
        return (g, None, None, *grads)


class EmulatedMoELayer(MoELayer):
    """The MoE layer: router kernels, a drawn routing, the real count exchange, rows of the
    modelled size through the real exchanges, the experts' kernels on the received counts."""

    @property
    def _widths(self) -> tuple[int, int, int, int]:
        return self._emu.row_bytes

    def _route(self) -> torch.Tensor:
        """counts_CE of this call: each token's K experts drawn uniformly (seeded), the
        router's capacity applied."""
        emu, C = self._emu, self.dispatch.chunks
        cfg = self.router_cfg
        T, E = emu.T, cfg.num_experts
        g = torch.Generator().manual_seed(hash((emu.seed, self._index, emu.rank, self._calls)) & (2 ** 63 - 1))
        self._calls += 1
        expert_TK = torch.rand(T, E, generator=g).topk(cfg.k, dim=1).indices
        keep_TK = capacity_keep(expert_TK, E, cfg.capacity(T))
        chunk_TK = (torch.arange(T) * C // T).unsqueeze(1).expand_as(expert_TK)
        key = (chunk_TK * E + expert_TK)[keep_TK]
        return torch.bincount(key, minlength=C * E).reshape(C, E)

    def _exchange(self, plan: A2APlan, width: int) -> None:
        """Encode (device), send rows of ``width`` bytes through the real all-to-all, decode."""
        emu, D = self._emu, self.experts.d_model
        sent, got = sum(plan.send_counts), sum(plan.recv_counts)
        emu.wait(emu.queue(_codec(emu, sent, D, width)))  # the rows must exist before they leave
        all_to_all(self._buf.rows(sent, width), plan, group=self.expert_group.group, observer=self.observer)
        emu.queue(_codec(emu, got, D, width))

    def _pipelined(self, plans: list[ChunkPlan], w_in: int, w_out: int, *, backward: bool) -> None:
        """Dispatch (``w_in`` bytes a row), experts per chunk as it lands, combine (``w_out``)."""
        emu, D = self._emu, self.experts.d_model
        merge = self.dispatch.merge
        if not merge and (self._lanes is None or self._lanes.device.type != "cpu"):
            self.close()
            self._lanes = Lanes(torch.device("cpu"), names=("compute", "comm"))
        pipe = _Pipeline(plans, self.expert_group, self.observer, None if merge else self._lanes, None, merge)
        sends = [cp.plan for cp in plans]
        emu.wait(emu.queue([k for cp in plans for k in _codec(emu, sum(cp.plan.send_counts), D, w_in)]))
        bufs = self._buf, self._buf_out
        # every chunk's rows from one zero buffer (never written: the sends only read it)
        rows_in = [bufs[0].rows(max(sum(p.send_counts) for p in sends), w_in)[:sum(p.send_counts)] for p in sends]
        got = pipe.exchange(rows_in, sends, None)
        back = pipe.returns(None)
        out = bufs[1].rows(max(max(sum(p.recv_counts) for p in sends), 1), w_out)
        for c, cp in enumerate(plans):
            got(c)
            n = sum(cp.plan.recv_counts)
            f, b = self.experts.kernels(cp.counts_L)
            tok = emu.queue([*_codec(emu, n, D, w_in), *(b if backward else f), *_codec(emu, n, D, w_out)])
            emu.wait(tok)  # the chunk's results leave once computed
            back.add(out[:n], cp.plan.reversed())
        back.results()
        emu.queue([k for cp in plans for k in _codec(emu, sum(cp.plan.send_counts), D, w_out)])

    def forward(self, dep):  # noqa: D102
        emu = self._emu
        eg: ExpertGroup | None = self.expert_group
        D = self.experts.d_model
        r = self.router(dep)
        counts_CE = self._route()
        A = int(counts_CE.sum())
        pack = ("copy", 0.0, 2.0 * A * D * emu.e)  # rows gathered by expert (and their gradients)
        scatter = ("elementwise", 2.0 * A * D, 3.0 * A * D * emu.e)  # gate-weighted sum per token
        h = _kernels(r, emu, [pack], [scatter])
        if eg is None or eg.size == 1:
            h = self.experts(h, counts_CE.sum(0).tolist())
            return _kernels(h, emu, [scatter], [pack]), None
        emu.wait()  # the counts leave the device (the routing's kernels)
        emu.rows_exchanged += A  # each dispatched row: dispatch, combine and their reverses
        empty = torch.zeros(0, dtype=torch.int64)
        plans = build_chunk_plans(Assignments(empty, empty, empty, counts_CE), eg, self.observer)
        w = self._widths
        if self.dispatch.pipeline:
            h = _Pipelined.apply(h, self, plans, *self.experts.params())
        else:
            for cp in plans:
                h = _Exchange.apply(h, self, cp.plan, (w[0], w[3]), "end")
                h = self.experts(h, cp.counts_L)
                h = _Exchange.apply(h, self, cp.plan.reversed(), (w[1], w[2]), "begin")
        return _kernels(h, emu, [scatter], [pack]), None


class EmulatedLM(MoETransformerLM):
    def forward(self, tokens_BS=None, moe_call=None):  # noqa: D102
        if moe_call is not None:
            raise ValueError("the emulated model runs its own MoE layers (no moe_call)")
        emu = self._emu
        n = emu.T * self.cfg.d_model
        h = self.tok(torch.zeros(1))
        h = _kernels(h, emu, [("elementwise", n, 3.0 * n * emu.e)], [("reduction", n, 2.0 * n * 4)], [self.pos])
        for b in self.blocks:
            h, _ = b(h)
        return self.head(self.ln_f(h)), None

    def loss(self, tokens_BS=None, targets_BS=None):
        """(the loss's dependency, None): the cross-entropy's kernels (float32 logits)."""
        logits, _ = self(tokens_BS)
        n = self._emu.T * self.cfg.vocab
        return _kernels(logits, self._emu, [("reduction", 5.0 * n, 2.0 * n * 4)],
                        [("elementwise", 2.0 * n, 2.0 * n * 4)]), None


_TWINS: dict[type, type] = {
    MoETransformerLM: EmulatedLM, Block: EmulatedBlock, Attention: EmulatedAttention,
    DenseFFN: EmulatedDenseFFN, MoELayer: EmulatedMoELayer, Router: EmulatedRouter,
    ExpertFFN: EmulatedExperts, nn.Linear: EmulatedLinear, nn.LayerNorm: EmulatedLayerNorm,
    nn.Embedding: EmulatedEmbedding,
}


def emulate(model: MoETransformerLM, emu: Emulation) -> tuple[MoETransformerLM, int]:
    """``model`` (built on the meta device) made emulated in place: parameters become views of
    one shared zero buffer (float32, the largest parameter's size), every module its
    emulated twin. Returns the model and the shared buffer's bytes."""
    params = [(m, name, p) for m in model.modules() for name, p in m._parameters.items() if p is not None]
    shared = torch.zeros(max(p.numel() for _, _, p in params))
    for m, name, p in params:
        q = nn.Parameter(shared[:p.numel()].view(p.shape), requires_grad=p.requires_grad)
        q.__dict__.update(p.__dict__)  # the expert mark and its reduction group
        m.register_parameter(name, q)
    moe = 0
    for m in model.modules():
        if type(m) is nn.ModuleList:
            continue
        twin = _TWINS.get(type(m))
        if twin is None:
            raise TypeError(f"no emulated twin of {type(m).__name__}")
        m.__class__ = twin
        m._emu = emu
        if isinstance(m, EmulatedAttention):
            m._seq = model.cfg.seq_len
        if isinstance(m, EmulatedMoELayer):
            m._index, m._calls, m._buf, m._buf_out = moe, 0, _RowBuffer(), _RowBuffer()
            moe += 1
    return model, shared.numel() * shared.element_size()


def build_emulated(cfg: Any, groups: Any, observer: A2AObserver | None, emu: Emulation):
    """The emulated twin of :func:`commsched.moe.train.trainer.build_commsched`: the same
    parameters in the same order and groups, scale 1 (the values are not computed, so the
    1 / world scaling, a pass over every gradient, is left out)."""
    mcfg = cfg.model
    eg = ExpertGroup(mcfg.num_experts, groups.ep_size, groups.ep_rank, groups.ep_group)
    with torch.device("meta"):
        model = MoETransformerLM(mcfg, expert_group=eg, dispatch=cfg.dispatch, observer=observer,
                                 wire_seed=cfg.seed)
    model, _ = emulate(model, emu)
    eg.validate(mcfg.d_model, torch.uint8)
    sched_params = []
    for p in reversed(list(model.parameters())):
        if is_expert_param(p):
            sched_params.append((p, groups.edp_group if groups.edp_group is not None else LOCAL, 1.0))
        else:
            sched_params.append((p, groups.dp_group, 1.0))
    return model, sched_params


def make_emulation(cfg: Any, rank: int) -> Emulation:
    """The rank's device (``cfg.device_model``, dilated ``cfg.dilation``) and the sizes."""
    from .training import a2a_row_bytes

    model: DeviceModel = load_device_model(cfg.device_model)
    clock = DeviceClock(model, cfg.dilation)
    return Emulation(clock, dtype=cfg.dtype, tokens=cfg.batch_size * cfg.model.seq_len, seed=cfg.seed,
                     rank=rank, row_bytes=a2a_row_bytes(cfg), a2a_bits=cfg.dispatch.a2a_bits)


__all__ = ["ADAM_BYTES", "COMPUTES", "DeviceMarks", "EmulatedAdam", "EmulatedCompressedLauncher", "Emulation", "HostCPU", "build_emulated", "emulate",
           "gemm", "linear_kernels", "make_emulation", "peak_rss_mib"]
