"""Emulated compute for GNN training: every kernel of a pass on a device clock, the host asleep.

Legend: n owned nodes, R remote (halo) nodes, T rows sent, E edges of a block, F input
width, H output width, K classes.

With ``--compute emulated`` a rank computes nothing: each kernel the real GPU would run --
the sparse aggregation (SpMM) of the central and the marginal block, the dense layer's
GEMMs, dropout, LayerNorm and ReLU, the loss, Adam, the halo gather and scatter, the
codec's quantize / dequantize -- is queued on the rank's
:class:`~commsched.cluster.device.DeviceClock` for the roofline time its FLOPs and bytes
give on the device model (times the dilation k), and returns at once a tensor of the
right shape whose values are zeros (a zero-stride view: no memory, no host work). The host
sleeps only where a real host waits for its GPU: before it reads rows to send (the forward
halo rows, the backward gradient rows, the encoded records of the quantized modes), before
it reads the parameters' gradients (the gradient allreduce) and the loss, and at the end
of the epoch. The communication stays real: every exchange moves the bytes it moves with
real compute (the rows it sends are real tensors of the modelled size: views of one
shared zero buffer, :meth:`EmulatedCompute.zeros`, so the host neither gathers nor fills
them), over the run's process groups.

So the overlap of the modes is emulated as it runs on a GPU: a mode that overlaps
(``adaqp``) queues the central aggregation and goes on to wait for the marginal exchange
while the device works; a mode that does not (``adaqp-q``, ``vanilla``) finishes the
exchange before it queues the central aggregation, and the device idles meanwhile.

Backward: an emulated kernel returns no gradient (``None``) for its tensor inputs and a
zero gradient for parameters (the gradient allreduce moves their real size); autograd
still runs every node, so each kernel queues its backward time and the halo exchanges run
their backward transfers with gradient rows of the real size.

Costs (``e``: bytes per element of the compute dtype; indices int64):

========================  ===========  ===========================================
kernel                    op class     FLOPs / bytes
========================  ===========  ===========================================
SpMM (forward, backward)  reduction    2 E F / E F e + E (8 + e) + dst F e
GEMM x W (per linear)     gemm         2 n F H / (n F + F H + n H) e; backward 2x
dropout                   elementwise  - / 2 n F e + n F (mask)
LayerNorm, ReLU           elementwise  - / 2 n H e each (backward: 3 n H e each)
concat, gather, scatter   copy         - / 2 x the rows moved
cross-entropy             reduction    - / m K e (backward: n K e)
Adam                      optimizer    - / 28 bytes per parameter (fp32 p, g, m, v)
quantize / dequantize     quant        - / T F 4 + the wire bytes
========================  ===========  ===========================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ...cluster.device import DeviceClock, dtype_name

# one kernel: (op class, FLOPs, bytes)
Kernel = tuple[str, float, float]


@dataclass
class _Spec:
    compute: "EmulatedCompute"
    shape: tuple[int, ...]
    dtype: torch.dtype
    fwd: Sequence[Kernel]
    bwd: Sequence[Kernel]


class _Emulated(torch.autograd.Function):
    """One emulated kernel (or a few): forward queues ``spec.fwd`` and returns zeros of
    ``spec.shape``; backward queues ``spec.bwd``, waits for the device when a parameter's
    gradient is due (the host reads it next), and returns zero gradients for parameters,
    none for the other inputs."""

    @staticmethod
    def forward(ctx, spec: _Spec, *inputs):  # noqa: D401
        ctx.set_materialize_grads(False)
        ctx.spec = spec
        ctx.params = [(tuple(t.shape), t.dtype, t.device) if isinstance(t, nn.Parameter) else None
                      for t in inputs]
        spec.compute.queue(spec.fwd)
        return spec.compute.blank(spec.shape, spec.dtype)

    @staticmethod
    def backward(ctx, g):
        spec = ctx.spec
        spec.compute.queue(spec.bwd)
        grads = []
        for i, p in enumerate(ctx.params):
            grads.append(torch.zeros(p[0], dtype=p[1], device=p[2])
                         if p is not None and ctx.needs_input_grad[i + 1] else None)
        if any(x is not None for x in grads):
            spec.compute.sync()  # the host reads these gradients next (the allreduce)
        return (None, *grads)


class _SyncBackward(torch.autograd.Function):
    """The identity; backward waits for the device before the gradient goes on (to an
    exchange that reads it), as zeros of its real size (no fill: the shared zero buffer)."""

    @staticmethod
    def forward(ctx, x, compute):  # noqa: D401
        ctx.set_materialize_grads(False)
        ctx.compute, ctx.shape, ctx.dtype, ctx.device = compute, tuple(x.shape), x.dtype, x.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.compute.sync()
        if g is None or not g.is_contiguous():
            g = ctx.compute.zeros(ctx.shape, ctx.dtype, ctx.device)
        return g, None


class EmulatedCompute:
    """One rank's compute on an emulated GPU: the kernels of a GNN pass queued on
    ``clock`` (see the module doc). ``dtype``: the compute dtype (float32; bfloat16 for the
    mixed-precision baseline) whose peak and element size the roofline takes."""

    def __init__(self, clock: DeviceClock, *, dtype: torch.dtype = torch.float32):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"--compute emulated models float32 or bfloat16 compute, not {dtype} "
                             "(the device models give no float64 peak): use --dtype float32 or bfloat16")
        self.clock = clock
        self.dtype = dtype
        self.dname = dtype_name(dtype)
        self.e = torch.empty((), dtype=dtype).element_size()
        self.kernels = 0
        self._zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    # ---- the clock ------------------------------------------------------------------------
    def run(self, op: str, *, flops: float = 0.0, bytes: float = 0.0, dtype: str | None = None) -> float:
        """Queue one kernel; its token."""
        self.kernels += 1
        return self.clock.run(op, flops=float(flops), bytes=float(bytes), dtype=dtype or self.dname)

    def queue(self, kernels: Sequence[Kernel]) -> None:
        for op, fl, by in kernels:
            self.run(op, flops=fl, bytes=by)

    def sync(self) -> None:
        """Sleep until the device has run everything queued."""
        self.clock.wait()

    @staticmethod
    def blank(shape: Sequence[int], dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> torch.Tensor:
        """Zeros of ``shape``: a zero-stride view of one element (no memory, no work)."""
        return torch.zeros((), dtype=dtype, device=device).expand(tuple(shape))

    def zeros(self, shape: Sequence[int], dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> torch.Tensor:
        """Contiguous zeros of ``shape`` for the host to read (rows to send): a view of one
        zero buffer per dtype, grown to the largest request and never written, so that
        sending modelled-size rows costs neither a gather nor a fill. Read-only."""
        numel = 1
        for s in shape:
            numel *= int(s)
        key = (dtype, torch.device(device))
        buf = self._zeros.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._zeros[key] = torch.zeros(max(numel, 1), dtype=dtype, device=device)
        return buf[:numel].view(*shape)

    def kernel(self, shape: Sequence[int], inputs: Sequence[torch.Tensor], fwd: Sequence[Kernel],
               bwd: Sequence[Kernel], dtype: torch.dtype | None = None) -> torch.Tensor:
        """Zeros of ``shape`` as the output of emulated kernels ``fwd`` on ``inputs`` (in
        the graph when one needs grad), whose backward queues ``bwd``."""
        spec = _Spec(self, tuple(int(s) for s in shape), dtype or self.out_dtype, fwd, bwd)
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            return _Emulated.apply(spec, *inputs)
        self.queue(fwd)
        return self.blank(spec.shape, spec.dtype)

    @property
    def out_dtype(self) -> torch.dtype:
        """The dtype of the activations (float32 also under mixed precision: the layers'
        outputs are cast back by the trainer)."""
        return torch.float32

    def sync_backward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``, whose gradient waits for the device before it goes on (an exchange reads it)."""
        return _SyncBackward.apply(x, self) if x.requires_grad and torch.is_grad_enabled() else x

    # ---- the kernels of a layer -------------------------------------------------------------
    def spmm_cost(self, nnz: int, num_dst: int, width: int) -> Kernel:
        e = self.e
        return ("reduction", 2.0 * nnz * width, nnz * width * e + nnz * (8 + e) + num_dst * width * e)

    def spmm(self, blk, num_src: int, *srcs: torch.Tensor) -> torch.Tensor:
        """``blk.A`` [dst, num_src] times the rows ``srcs`` stacked ([num_src, F]): [dst, F]
        (more than one part: their concatenation first, a copy)."""
        F = int(srcs[0].shape[1])
        fwd = [self.spmm_cost(blk.nnz, blk.num_dst, F)]
        if len(srcs) > 1:
            fwd.insert(0, ("copy", 0.0, 2.0 * num_src * F * self.e))
        return self.kernel((blk.num_dst, F), srcs, fwd, [self.spmm_cost(blk.nnz, num_src, F)])

    def copy(self, rows: int, width: int, *, times: float = 2.0) -> float:
        """Queue a copy of ``rows`` x ``width`` elements (read and write); its token."""
        return self.run("copy", bytes=times * rows * width * self.e)

    def linears(self, module: nn.Module, rows: int, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The dense update of ``module`` (every ``nn.Linear`` in it applied to ``rows``
        rows, the results summed): [rows, H]."""
        lins = [m for m in module.modules() if isinstance(m, nn.Linear)]
        if not lins:
            raise ValueError(f"--compute emulated: {type(module).__name__} has no linear layer to time")
        e, n = self.e, rows
        F0 = lins[0].in_features
        fwd: list[Kernel] = [("copy", 0.0, 2.0 * n * F0 * e)]  # the aggregates' concatenation
        bwd: list[Kernel] = []
        for lin in lins:
            F, H = lin.in_features, lin.out_features
            by = (n * F + F * H + n * H) * e
            fwd.append(("gemm", 2.0 * n * F * H, by))
            bwd += [("gemm", 2.0 * n * F * H, by), ("gemm", 2.0 * n * F * H, by)]
            if lin.bias is not None:
                bwd.append(("reduction", 0.0, n * H * e))
        H = lins[0].out_features
        if len(lins) > 1:
            fwd.append(("elementwise", 0.0, 3.0 * n * H * e))
        return self.kernel((n, H), [*inputs, *module.parameters()], fwd, bwd)

    def dropout(self, h: torch.Tensor) -> torch.Tensor:
        n, F = int(h.shape[0]), int(h.shape[1])
        k = ("elementwise", 0.0, 2.0 * n * F * self.e + n * F)
        return self.kernel((n, F), [h], [k], [k])

    def norm_relu(self, h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """LayerNorm (if ``norm`` is one) then ReLU of ``h`` [n, H]."""
        n, H = int(h.shape[0]), int(h.shape[1])
        fwd = [("elementwise", 0.0, 2.0 * n * H * self.e)]
        bwd = [("elementwise", 0.0, 3.0 * n * H * self.e)]
        if isinstance(norm, nn.LayerNorm):
            fwd.append(("reduction", 0.0, 2.0 * n * H * self.e))
            bwd.append(("reduction", 0.0, 3.0 * n * H * self.e))
        return self.kernel((n, H), [h, *norm.parameters()], fwd, bwd)

    def loss(self, logits: torch.Tensor, m: int) -> torch.Tensor:
        """The cross-entropy of ``m`` of the rows of ``logits`` [n, K]: a scalar."""
        n, K = int(logits.shape[0]), int(logits.shape[1])
        return self.kernel((), [logits], [("reduction", 0.0, (m * K + n * K) * self.e)],
                           [("elementwise", 0.0, 2.0 * n * K * self.e)])

    def optimizer(self, params: Sequence[torch.Tensor]) -> float:
        """Queue Adam on ``params`` (fp32 parameter, gradient and two moments: read 4, write
        3); its token."""
        numel = sum(int(p.numel()) for p in params)
        return self.run("optimizer", bytes=28.0 * numel, dtype="fp32")

    def quant(self, rows: int, width: int, wire_bytes: float) -> float:
        """Queue the quantize (or dequantize) of ``rows`` x ``width`` float32 values to (from)
        ``wire_bytes``; its token."""
        return self.run("quant", bytes=4.0 * rows * width + wire_bytes, dtype="fp32")


def conv_forward(conv: nn.Module, h_nF: torch.Tensor, g, layer: int, ctx) -> torch.Tensor:
    """The emulated forward of a :class:`~commsched.gnn.nn.layers.DistMessagePassing` layer
    ``conv`` on ``g`` (a :class:`~commsched.gnn.nn.layers.LocalGraph` whose ``compute`` is
    an :class:`EmulatedCompute`): the real layer's order of kernels and exchanges."""
    cmp: EmulatedCompute = g.compute
    n = int(h_nF.shape[0])
    T = int(g.halo.send_idx.numel())
    if T:
        cmp.copy(T, int(h_nF.shape[1]))  # the gather of the boundary rows
    cmp.sync()  # the host sends them next: they must exist
    handle = g.halo.start(h_nF, layer, ctx)
    central, marginal = g.blocks(conv.norm)
    agg_c = cmp.spmm(central, n, h_nF)       # queued: runs while the exchange is in flight
    h_RF = cmp.sync_backward(handle.wait())  # its gradient is read by the backward exchange
    R = int(h_RF.shape[0])
    agg_m = cmp.spmm(marginal, n + R, h_nF, h_RF)
    return cmp.linears(conv, n, [agg_c, agg_m, h_nF])


__all__ = ["EmulatedCompute", "conv_forward"]
