"""Distributed GNN layers in PyG's message -> aggregate -> update shape.

Legend: n owned nodes, R remote nodes, L = n + R local nodes, E edges of a block,
F input width, H output width.

A layer sees one rank's part through a :class:`LocalGraph`: the owned rows ``h_nF``
(central first, then marginal), the halo exchange, and the central / marginal blocks
of the normalised adjacency. Its forward pass is

    handle = halo.start(h_nF, layer, ctx)     # send boundary rows (may run in background)
    agg_c  = propagate(central block, h_nF)   # needs no remote rows
    h_RF   = handle.wait()
    agg_m  = propagate(marginal block, [h_nF; h_RF])
    out    = update([agg_c; agg_m], h_nF)

``propagate`` runs ``message`` then ``aggregate`` (the general, slow path), or a fused
sparse-matrix product when the layer keeps the default weighted-sum message and
aggregation (the fast path; a test asserts they agree). To add a model, subclass
:class:`DistMessagePassing`, pick the edge weights with ``norm`` and implement
``update`` (and ``message``/``aggregate`` if they are not a weighted sum); register
it as a layer kind: ``LAYERS.register("mine", FastLayer(conv=MyConv))``
(:mod:`commsched.gnn.nn.models`).

Every forward pass takes the pass's :class:`~commsched.gnn.context.PassContext` (epoch,
training flag, timer, byte counters), built by the trainer and handed down to each layer
and to the exchange; without one, a pass follows the module's ``training`` flag at epoch
0 with a scratch timer.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..context import PassContext
from ..exchange.halo import HaloExchange
from ..graph.book import NORMS, Block, PartitionBook, split_blocks
from ..timing import Breakdown
from .emulated import conv_forward

_M32 = 0xFFFFFFFF


# --------------------------------------------------------------------------- blocks
def _csr(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, shape: tuple[int, int],
         dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """CSR matrix from COO sorted by (row, col), on ``device`` (default: the CPU)."""
    crow = np.zeros(shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=shape[0]), out=crow[1:])
    crow_t, col_t = torch.from_numpy(crow), torch.from_numpy(cols.astype(np.int64))
    val_t = torch.from_numpy(vals).to(dtype)
    if device is not None and device.type != "cpu":
        crow_t, col_t, val_t = crow_t.to(device), col_t.to(device), val_t.to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        return torch.sparse_csr_tensor(crow_t, col_t, val_t, size=shape, check_invariants=False)


class TorchBlock:
    """A block as tensors on ``device`` (default: the CPU): CSR ``A`` [num_dst, num_src]
    and its transpose (for backward); the COO arrays ``src``, ``dst``, ``w`` of the general
    message/aggregate path are made on first use (fused layers never need them)."""

    def __init__(self, b: Block, dtype: torch.dtype, device: torch.device | None = None):
        self.num_dst, self.num_src = b.num_dst, b.num_src
        self.nnz = int(b.src.size)
        self.A = _csr(b.dst, b.src, b.w, (b.num_dst, b.num_src), dtype, device)
        order = np.lexsort((b.dst, b.src))
        self.AT = _csr(b.src[order], b.dst[order], b.w[order], (b.num_src, b.num_dst), dtype, device)

    @classmethod
    def from_block(cls, b: Block, dtype: torch.dtype, device: torch.device | None = None) -> "TorchBlock":
        return cls(b, dtype, device)

    @functools.cached_property
    def src(self) -> torch.Tensor:  # int64 [E]
        return self.A.col_indices()

    @functools.cached_property
    def dst(self) -> torch.Tensor:  # int64 [E]
        crow = self.A.crow_indices()
        return torch.repeat_interleave(torch.arange(self.num_dst, device=crow.device), crow[1:] - crow[:-1])

    @functools.cached_property
    def w(self) -> torch.Tensor:    # [E]
        return self.A.values()


class _SpMM(torch.autograd.Function):
    """out = A @ x with backward A^T @ g; both timed under ``key``. The product runs in the
    block's dtype even under autocast (``--dtype bfloat16``: the aggregation stays float32;
    torch's CPU CSR product has no bfloat16 kernel)."""

    @staticmethod
    def forward(ctx, x_SF, blk: TorchBlock, timer: Breakdown, key: str):  # noqa: D401
        ctx.blk, ctx.timer, ctx.key, ctx.in_dtype = blk, timer, key, x_SF.dtype
        with timer.time(key):
            if blk.nnz == 0:
                return x_SF.new_zeros((blk.num_dst, x_SF.shape[1]))
            if x_SF.dtype != blk.A.dtype or torch.is_autocast_enabled(x_SF.device.type):
                with torch.autocast(x_SF.device.type, enabled=False):
                    return blk.A @ x_SF.to(blk.A.dtype)
            return blk.A @ x_SF

    @staticmethod
    def backward(ctx, g_DF):
        blk = ctx.blk
        with ctx.timer.time(ctx.key):
            if blk.nnz == 0:
                gx = g_DF.new_zeros((blk.num_src, g_DF.shape[1]))
            else:
                gx = blk.AT @ g_DF.contiguous().to(blk.AT.dtype)
        return gx.to(ctx.in_dtype), None, None, None


# --------------------------------------------------------------------------- dropout
def _fmix32(x: int) -> int:
    """murmur3's 32-bit finaliser on a Python int (the scalar reference)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    x ^= x >> 16
    return x


def _fmix32_t(x: torch.Tensor) -> torch.Tensor:
    """The same finaliser on an int64 tensor holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def _as_i32(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _salt(seed: int, epoch: int, layer: int) -> int:
    return _fmix32(seed * 0x9E3779B1 ^ _fmix32(epoch * 0x85EBCA77 + _fmix32(layer + 0x27D4EB2F)))


def dropout_keep(gids_n: torch.Tensor, width: int, p: float, seed: int, epoch: int,
                 layer: int) -> torch.Tensor:
    """Dropout keep-mask [n, width] (bool) that depends only on (seed, epoch, layer, global
    node id, column): the same node gets the same mask whichever rank owns it, so N-rank
    training draws exactly the single-process masks. Each element is kept with
    probability 1 - p (to 2^-32).

    Element (g, j): x = rowkey(g) ^ colkey(j) (both murmur3-finalised), then
    x *= K1; x ^= x >> 15; x *= K2 (mod 2^32); kept when x, read as an unsigned 32-bit
    number, is >= p * 2^32. :func:`_keep_scalar` is the same in plain Python.
    """
    s = _salt(seed, epoch, layer)
    g = gids_n.to(torch.int64)
    rk = _fmix32_t(((g & _M32) * 0x9E3779B1 + s) & _M32 ^ _fmix32_t((g >> 32) & _M32))
    ck = _fmix32_t((torch.arange(width, dtype=torch.int64, device=g.device) * 0xCC9E2D51 + (s ^ 0x5BD1E995)) & _M32)
    x = torch.bitwise_xor(_as_i32(rk)[:, None], _as_i32(ck)[None, :])  # int32, wraps like uint32
    x.mul_(-2048144789)                                                # K1 = 0x85EBCA6B
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15).bitwise_and_(0x1FFFF))  # logical >> 15
    x.mul_(-1028477387)                                                # K2 = 0xC2B2AE35
    thr = min(int(round(p * (1 << 32))), (1 << 32) - 1) - (1 << 31)    # unsigned -> signed order
    return x.bitwise_xor_(-(1 << 31)) >= thr


def _keep_scalar(gid: int, col: int, p: float, seed: int, epoch: int, layer: int) -> bool:
    """The slow twin of :func:`dropout_keep` for one element (Python ints)."""
    s = _salt(seed, epoch, layer)
    rk = _fmix32(((gid & _M32) * 0x9E3779B1 + s) & _M32 ^ _fmix32((gid >> 32) & _M32))
    ck = _fmix32((col * 0xCC9E2D51 + (s ^ 0x5BD1E995)) & _M32)
    x = (rk ^ ck) & _M32
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 15
    x = (x * 0xC2B2AE35) & _M32
    return x >= min(int(round(p * (1 << 32))), (1 << 32) - 1)


def node_dropout(h_nF: torch.Tensor, gids_n: torch.Tensor, p: float, *, seed: int, epoch: int,
                 layer: int, rng: str = "node", rank: int = 0) -> torch.Tensor:
    """Inverted dropout with rank-count-independent masks (``rng="node"``), or with a fast
    per-rank torch generator (``rng="local"``: a valid dropout, but N-rank training then
    no longer equals single-process training)."""
    if p <= 0.0:
        return h_nF
    if p >= 1.0:
        return h_nF * 0.0
    if rng == "node":
        keep = dropout_keep(gids_n, h_nF.shape[1], p, seed, epoch, layer)
    elif rng == "local":
        # a generator on the rows' device (CUDA's Philox on CUDA: other masks than the CPU's)
        gen = torch.Generator(device=h_nF.device).manual_seed(_salt(seed ^ (rank * 0x632BE5AB), epoch, layer))
        keep = torch.rand(h_nF.shape, generator=gen, device=h_nF.device) >= p
    else:
        raise ValueError(f"dropout rng must be 'node' or 'local', got {rng!r}")
    return h_nF.mul(keep).mul_(1.0 / (1.0 - p))


# --------------------------------------------------------------------------- local graph
class LocalGraph:
    """What the layers see of one rank's part: book, halo exchange, blocks, dropout seed.

    Blocks are built once per edge normalisation and kept, on ``device`` (default: the
    exchange's device), as are the owned nodes' global ids (the dropout keys). Nothing per
    pass lives here: the epoch (dropout masks depend on it), the training flag and the
    timer come with each pass's :class:`PassContext`.
    """

    def __init__(self, book: PartitionBook, halo: HaloExchange, *, dtype: torch.dtype = torch.float32,
                 seed: int = 0, dropout_rng: str = "node", device: torch.device | str | None = None):
        self.book = book
        self.halo = halo
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else halo.device
        self.owned_gids = torch.from_numpy(book.owned_ids).to(self.device)
        self.seed = seed
        self.dropout_rng = dropout_rng
        self._blocks: dict[str, tuple[TorchBlock, TorchBlock]] = {}
        # an EmulatedCompute (--compute emulated): the layers queue their kernels on its
        # device clock instead of computing (commsched.gnn.nn.emulated); None: real compute
        self.compute = None

    def blocks(self, norm: str) -> tuple[TorchBlock, TorchBlock]:
        if norm not in self._blocks:
            c, m = split_blocks(self.book, norm)
            self._blocks[norm] = (TorchBlock.from_block(c, self.dtype, self.device),
                                  TorchBlock.from_block(m, self.dtype, self.device))
        return self._blocks[norm]

    def dropout(self, h_nF: torch.Tensor, p: float, layer: int, ctx: PassContext) -> torch.Tensor:
        """Dropout of ``layer``'s input in a training pass (masks of ``ctx.epoch``); the
        identity in an evaluation pass."""
        if not ctx.training:
            return h_nF
        return node_dropout(h_nF, self.owned_gids, p, seed=self.seed, epoch=ctx.epoch, layer=layer,
                            rng=self.dropout_rng, rank=self.book.rank)


# --------------------------------------------------------------------------- layers
class DistMessagePassing(nn.Module):
    """Base of distributed layers (see the module docstring). ``norm`` names the edge
    weights passed to ``message``: "gcn" (symmetric, with self loops), "mean" (1/in-degree)
    or "sum" (1)."""

    norm = "sum"

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.norm not in NORMS:
            raise ValueError(f"layer {cls.__qualname__}: norm = {cls.norm!r} is not an edge "
                             f"normalisation the halo exchange knows; supported: "
                             f"{', '.join(NORMS)} (symmetric GCN, 1/in-degree, plain sum)")

    # -- the three steps a model defines ---------------------------------------------------
    def message(self, h_j_EF: torch.Tensor, w_E: torch.Tensor) -> torch.Tensor:
        """Message along each edge from its source row ``h_j`` with edge weight ``w``."""
        return h_j_EF * w_E.unsqueeze(1)

    def aggregate(self, msg_EF: torch.Tensor, index_E: torch.Tensor, num_dst: int) -> torch.Tensor:
        """Combine the messages of each target (``index`` = target row)."""
        out = msg_EF.new_zeros((num_dst, msg_EF.shape[1]))
        return out.index_add(0, index_E, msg_EF)

    def update(self, agg_nF: torch.Tensor, h_nF: torch.Tensor) -> torch.Tensor:
        """New owned rows from the aggregated messages and the old owned rows."""
        raise NotImplementedError

    # -- machinery -------------------------------------------------------------------------
    def _fused(self) -> bool:
        cls = type(self)
        return cls.message is DistMessagePassing.message and cls.aggregate is DistMessagePassing.aggregate

    def propagate(self, blk: TorchBlock, h_src: torch.Tensor, timer: Breakdown, key: str,
                  fused: bool | None = None) -> torch.Tensor:
        """Aggregated messages into the block's target rows, [num_dst, F]."""
        if fused if fused is not None else self._fused():
            return _SpMM.apply(h_src, blk, timer, key)
        with timer.time(key):
            msg = self.message(h_src.index_select(0, blk.src), blk.w)
            return self.aggregate(msg, blk.dst, blk.num_dst)

    def forward(self, h_nF: torch.Tensor, g: LocalGraph, layer: int, ctx: PassContext | None = None,
                *, fused: bool | None = None) -> torch.Tensor:
        """New owned rows [n, H] from ``h_nF`` [n, F]; ``ctx``: the pass (see the module doc)."""
        ctx = ctx if ctx is not None else PassContext(training=self.training)
        if g.compute is not None:
            return conv_forward(self, h_nF, g, layer, ctx)
        handle = g.halo.start(h_nF, layer, ctx)
        central, marginal = g.blocks(self.norm)
        agg_c = self.propagate(central, h_nF, ctx.timer, "central", fused)
        h_RF = handle.wait()
        h_all = torch.cat([h_nF, h_RF]) if h_RF.shape[0] else h_nF
        if h_RF.shape[0] == 0 and h_RF.requires_grad:
            h_all = h_all + h_RF.sum() * 0  # keep the (empty) exchange in the backward graph
        agg_m = self.propagate(marginal, h_all, ctx.timer, "marginal", fused)
        if agg_m.shape[0] == 0 and not agg_m.requires_grad:
            agg = agg_c                 # nothing marginal (one rank): skip the copy
        elif agg_c.shape[0] == 0 and not agg_c.requires_grad:
            agg = agg_m
        else:
            agg = torch.cat([agg_c, agg_m])
        return self.update(agg, h_nF)


class GCNConv(DistMessagePassing):
    """Kipf & Welling's graph convolution: D^-1/2 (A + I) D^-1/2 H W + b."""

    norm = "gcn"

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.lin = nn.Linear(in_dim, out_dim)

    def update(self, agg_nF, h_nF):
        return self.lin(agg_nF)


class SAGEConv(DistMessagePassing):
    """GraphSAGE with the mean aggregator: W_l mean_{u in N(v)} h_u + W_r h_v + b."""

    norm = "mean"

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.lin_l = nn.Linear(in_dim, out_dim)
        self.lin_r = nn.Linear(in_dim, out_dim, bias=False)

    def update(self, agg_nF, h_nF):
        return self.lin_l(agg_nF) + self.lin_r(h_nF)


class DistGNN(nn.Module):
    """L stacked layers: for each, dropout -> conv -> (LayerNorm -> ReLU unless last)."""

    def __init__(self, conv: type[DistMessagePassing], in_dim: int, hidden: int, out_dim: int,
                 layers: int = 3, dropout: float = 0.5, layer_norm: bool = True):
        super().__init__()
        if layers < 1:
            raise ValueError(f"a model needs at least one layer, got {layers}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout}")
        dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
        self.convs = nn.ModuleList(conv(dims[i], dims[i + 1]) for i in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) if layer_norm else nn.Identity()
                                   for _ in range(layers - 1))
        self.dropout = dropout

    def forward(self, x_nF: torch.Tensor, g: LocalGraph, ctx: PassContext | None = None, *,
                fused: bool | None = None) -> torch.Tensor:
        """Logits [n, K] of the owned nodes; ``ctx``: the pass, handed to every layer (its
        ``training`` flag decides dropout)."""
        ctx = ctx if ctx is not None else PassContext(training=self.training)
        h = x_nF
        last = len(self.convs) - 1
        emu = g.compute
        for i, conv in enumerate(self.convs):
            if emu is not None:  # the same kernels, on the emulated device
                h = emu.dropout(h) if ctx.training and self.dropout > 0 else h
                h = conv(h, g, i, ctx, fused=fused)
                h = emu.norm_relu(h, self.norms[i]) if i < last else h
                continue
            h = g.dropout(h, self.dropout, i, ctx)
            h = conv(h, g, i, ctx, fused=fused)
            if i < last:
                h = F.relu(self.norms[i](h))
        return h


__all__ = ["DistGNN", "DistMessagePassing", "GCNConv", "LocalGraph", "SAGEConv",
           "TorchBlock", "dropout_keep", "node_dropout"]
