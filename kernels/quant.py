"""Triton kernels of the quantization codec: quantize+pack and unpack+dequantize.

Both must equal ``commsched.quant.reference`` bit for bit (``quantize_reference`` and
``dequantize_reference``) for the same key; ``tests/quant/test_kernels.py`` checks it
under ``TRITON_INTERPRET=1`` on the CPU. ``commsched.quant.codec`` calls the launchers
below for CUDA tensors.

Shape contract (legend: N rows, D values per row, b bits in {2, 4, 8}, K = 8 // b,
B = ceil(D * b / 8), L = 2^b - 1):

    quantize_pack_kernel
        x        float32 [N, D], unit column stride, row stride ``stride_x``
        payload  uint8   [N, B], unit column stride, row stride ``stride_p``   (written)
        meta     float32 [N, 2], contiguous: scale, zero point per row          (written)
        grid     (cdiv(N, ROWS),): each program owns ROWS rows and walks their B bytes
                 in tiles of BLOCK_B, loading the K planar slots of each tile
    unpack_dequantize_kernel
        payload  uint8   [N, B] as above;  meta float32 [N, 2] contiguous
        out      float32 [N, D], unit column stride, row stride ``stride_o``   (written)
        grid     (cdiv(N, ROWS), cdiv(B, BLOCK_B))

Only core builtins are used (``tl.reduce`` with local combine functions rather than
``tl.min``/``tl.max``/``tl.sum``/``tl.zeros``, which are jit functions of Triton's standard
library): the interpreter can then run these kernels even when ``triton.language`` was
imported before ``TRITON_INTERPRET`` was set (for example by ``torch.compile``).

Rounding is pinned to the reference: divisions use ``div_rn`` (IEEE round to nearest,
not the approximate default on NVIDIA GPUs) and the launchers pass
``enable_fp_fusion=False`` so that no multiply-add is contracted into an FMA. The random
bits come from the same counter hash as the reference (lowbias32 of
``(row0 + n) * D + d + key`` mod 2^32, top 24 bits), computed in the kernel. Rows with a
non-finite value get a NaN zero point (GPU min/max may skip NaN, so the kernel counts
them itself); the codec turns that into a ValueError.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the reference's constants, as constexprs: Triton's code generator (>= 3.0) refuses plain
# Python globals inside jit code; the interpreter does not, so only a compile shows it
_RANGE_MIN = tl.constexpr(2.0**-100)
_FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _min2(a, b):
    return tl.minimum(a, b)


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add2(a, b):
    return a + b


@triton.jit
def _lowbias32(h):
    """lowbias32 of a uint32 tensor (wrapping multiplies, logical shifts)."""
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    h = h ^ (h >> 16)
    return h


@triton.jit(do_not_specialize=["N", "row0", "key"])  # N varies per message: no recompiles
def quantize_pack_kernel(x_ptr, payload_ptr, meta_ptr, N, D, B, stride_x, stride_p, row0, key,
                         BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_B: tl.constexpr):
    K: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    lane = tl.arange(0, BLOCK_B)
    x_row = x_ptr + rows64[:, None] * stride_x

    # pass 1: row minimum, maximum and count of non-finite values
    lo = tl.full([ROWS], float("inf"), tl.float32)
    hi = tl.full([ROWS], float("-inf"), tl.float32)
    bad = tl.full([ROWS], 0, tl.int32)
    for j0 in range(0, B, BLOCK_B):
        j = j0 + lane
        for s in tl.static_range(K):
            col = s * B + j
            m = row_ok[:, None] & ((j < B) & (col < D))[None, :]
            v = tl.load(x_row + col[None, :], mask=m, other=0.0)
            lo = tl.minimum(lo, tl.reduce(tl.where(m, v, float("inf")), 1, _min2))
            hi = tl.maximum(hi, tl.reduce(tl.where(m, v, float("-inf")), 1, _max2))
            bad += tl.reduce((m & ~(tl.abs(v) <= _FLT_MAX)).to(tl.int32), 1, _add2)
    lo = tl.where(row_ok, lo, 0.0)  # rows past N: keep their (unused) arithmetic finite
    hi = tl.where(row_ok, hi, 0.0)
    rng = hi - lo
    big = rng >= _RANGE_MIN
    safe = tl.where(big, rng, 1.0)
    inv = tl.where(big, tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), safe) * LEVELS, 0.0)
    scale = tl.where(big, tl.math.div_rn(safe, tl.full([ROWS], LEVELS, tl.float32)), 0.0)
    tl.store(meta_ptr + rows64 * 2, scale, mask=row_ok)
    tl.store(meta_ptr + rows64 * 2 + 1, tl.where(bad > 0, float("nan"), lo), mask=row_ok)

    # pass 2: stochastic levels, packed K to a byte
    base = (row0.to(tl.int64) + rows64) * D + key.to(tl.int64)
    for j0 in range(0, B, BLOCK_B):
        j = j0 + lane
        jm = j < B
        acc = tl.full([ROWS, BLOCK_B], 0, tl.int32)
        for s in tl.static_range(K):
            col = s * B + j
            m = row_ok[:, None] & (jm & (col < D))[None, :]
            v = tl.load(x_row + col[None, :], mask=m, other=0.0)
            c = (base[:, None] + col[None, :].to(tl.int64)).to(tl.uint32)
            r = (_lowbias32(c) >> 8).to(tl.float32)
            t = (v - lo[:, None]) * inv[:, None]
            f = tl.floor(t)
            up = r < (t - f) * 16777216.0
            q = f + up.to(tl.float32)
            q = tl.where(q > LEVELS, LEVELS * 1.0, q)
            qi = tl.where(m, q.to(tl.int32), 0)
            acc = acc | (qi << (s * BITS))
        tl.store(payload_ptr + rows64[:, None] * stride_p + j[None, :], acc.to(tl.uint8),
                 mask=row_ok[:, None] & jm[None, :])


@triton.jit(do_not_specialize=["N"])
def unpack_dequantize_kernel(payload_ptr, meta_ptr, out_ptr, N, D, B, stride_p, stride_o,
                             BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_B: tl.constexpr):
    K: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    j = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    jm = j < B
    byte = tl.load(payload_ptr + rows64[:, None] * stride_p + j[None, :],
                   mask=row_ok[:, None] & jm[None, :], other=0).to(tl.int32)
    scale = tl.load(meta_ptr + rows64 * 2, mask=row_ok, other=0.0)
    lo = tl.load(meta_ptr + rows64 * 2 + 1, mask=row_ok, other=0.0)
    for s in tl.static_range(K):
        col = s * B + j
        m = row_ok[:, None] & (jm & (col < D))[None, :]
        q = ((byte >> (s * BITS)) & MASK).to(tl.float32)
        val = lo[:, None] + scale[:, None] * q
        tl.store(out_ptr + rows64[:, None] * stride_o + col[None, :], val, mask=m)


# --------------------------------------------------------------------------- launchers
def _tiles(B: int) -> tuple[int, int]:
    """(ROWS, BLOCK_B): about 1024 bytes of payload per tile."""
    block_b = min(triton.next_power_of_2(max(B, 1)), 256)
    rows = max(1, min(64, 1024 // block_b))
    return rows, block_b


def _check_bits(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits!r}")
    return bits


def quantize_pack(x_ND: torch.Tensor, bits: int, key: int, row0: int = 0, *,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 [N, D] rows; returns (payload uint8 [N, B], meta float32 [N, 2]).

    ``key`` is the 32-bit message key, ``row0`` the position of the first row in its
    message (both as in ``quantize_reference``); ``out`` (uint8 [N, B], unit column
    stride) receives the payload if given.
    """
    bits = _check_bits(bits)
    if not isinstance(x_ND, torch.Tensor) or x_ND.dim() != 2 or x_ND.dtype != torch.float32:
        raise ValueError(f"x must be a float32 [N, D] tensor, got "
                         f"{getattr(x_ND, 'dtype', type(x_ND).__name__)} {tuple(getattr(x_ND, 'shape', ()))}")
    N, D = x_ND.shape
    if D < 1:
        raise ValueError("x must have at least one column")
    if D > 1 and x_ND.stride(1) != 1:
        x_ND = x_ND.contiguous()
    if row0 < 0 or (row0 + N) * D + (1 << 32) >= 1 << 63:
        raise ValueError(f"row0={row0} is out of range")
    B = (D * bits + 7) // 8
    if out is None:
        out = torch.empty(N, B, dtype=torch.uint8, device=x_ND.device)
    elif (out.dtype != torch.uint8 or tuple(out.shape) != (N, B) or out.device != x_ND.device
          or (B > 1 and out.stride(1) != 1)):
        raise ValueError(f"out must be uint8 [{N}, {B}] on {x_ND.device} with unit column stride, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    meta = torch.empty(N, 2, dtype=torch.float32, device=x_ND.device)
    if N == 0:
        return out, meta
    rows, block_b = _tiles(B)
    quantize_pack_kernel[(triton.cdiv(N, rows),)](
        x_ND, out, meta, N, D, B, x_ND.stride(0), out.stride(0), int(row0), int(key) & 0xFFFFFFFF,
        BITS=bits, ROWS=rows, BLOCK_B=block_b, enable_fp_fusion=False)
    return out, meta


def unpack_dequantize(payload_NB: torch.Tensor, meta_N2: torch.Tensor, bits: int, dim: int, *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode (payload uint8 [N, B], meta float32 [N, 2]) to float32 [N, dim], into ``out``
    (unit column stride) if given."""
    bits = _check_bits(bits)
    B = (dim * bits + 7) // 8
    if (not isinstance(payload_NB, torch.Tensor) or payload_NB.dtype != torch.uint8
            or payload_NB.dim() != 2 or payload_NB.shape[1] != B):
        raise ValueError(f"payload must be uint8 [N, {B}] for dim={dim} at {bits} bits, got "
                         f"{getattr(payload_NB, 'dtype', None)} {tuple(getattr(payload_NB, 'shape', ()))}")
    N = payload_NB.shape[0]
    if (not isinstance(meta_N2, torch.Tensor) or meta_N2.dtype != torch.float32
            or tuple(meta_N2.shape) != (N, 2) or meta_N2.device != payload_NB.device):
        raise ValueError(f"meta must be float32 [{N}, 2] on {payload_NB.device}")
    if B > 1 and payload_NB.stride(1) != 1:
        payload_NB = payload_NB.contiguous()
    meta_N2 = meta_N2.contiguous()
    if out is None:
        out = torch.empty(N, dim, dtype=torch.float32, device=payload_NB.device)
    elif (out.dtype != torch.float32 or tuple(out.shape) != (N, dim) or out.device != payload_NB.device
          or (dim > 1 and out.stride(1) != 1)):
        raise ValueError(f"out must be float32 [{N}, {dim}] on {payload_NB.device} with unit column "
                         f"stride, got {out.dtype} {tuple(out.shape)} on {out.device}")
    if N == 0:
        return out
    rows, block_b = _tiles(B)
    unpack_dequantize_kernel[(triton.cdiv(N, rows), triton.cdiv(B, block_b))](
        payload_NB, meta_N2, out, N, dim, B, payload_NB.stride(0), out.stride(0),
        BITS=bits, ROWS=rows, BLOCK_B=block_b, enable_fp_fusion=False)
    return out


# --------------------------------------------------------------------------- ahead-of-time compile
# argument types of the kernels' runtime arguments (the launchers pass exactly these)
_SIGNATURES = {
    "quantize_pack_kernel": {"x_ptr": "*fp32", "payload_ptr": "*u8", "meta_ptr": "*fp32", "N": "i32",
                             "D": "i32", "B": "i32", "stride_x": "i32", "stride_p": "i32",
                             "row0": "i64", "key": "i64"},
    "unpack_dequantize_kernel": {"payload_ptr": "*u8", "meta_ptr": "*fp32", "out_ptr": "*fp32",
                                 "N": "i32", "D": "i32", "B": "i32", "stride_p": "i32",
                                 "stride_o": "i32"},
}


def compile_for_target(bits: int, dim: int, *, arch: int = 90, warp_size: int = 32) -> dict:
    """Compile both kernels, for ``bits`` and rows of ``dim`` values, through Triton's whole
    code generator (TTIR -> PTX -> cubin with the wheel's ptxas) for CUDA compute capability
    ``arch``; no GPU is needed. Returns ``{kernel name: compiled kernel}`` (``.asm`` holds
    ``ptx`` and ``cubin``). The interpreter skips the code generator, so only this proves
    the kernels build for a real GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bits = _check_bits(bits)
    rows, block_b = _tiles((dim * bits + 7) // 8)
    target = GPUTarget("cuda", arch, warp_size)
    out = {}
    for fn in (quantize_pack_kernel, unpack_dequantize_kernel):
        name = fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__
        sig = dict(_SIGNATURES[name], BITS="constexpr", ROWS="constexpr", BLOCK_B="constexpr")
        src = ASTSource(fn, sig, constexprs={"BITS": bits, "ROWS": rows, "BLOCK_B": block_b})
        out[name] = triton.compile(src, target=target, options={"enable_fp_fusion": False})
    return out


__all__ = ["compile_for_target", "quantize_pack", "quantize_pack_kernel", "unpack_dequantize",
           "unpack_dequantize_kernel"]
