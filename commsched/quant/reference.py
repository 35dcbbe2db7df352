"""Plain-torch reference of the quantization codec: the executable specification.

Everything here is written for clarity, not speed. The CPU fast path
(``commsched.quant.fast``) and the Triton kernels (``commsched.kernels.quant``) must
produce exactly the same bytes as these functions for the same key, and the same
floats when decoding; the tests assert it.

Legend: N rows, D features per row, b bits per value (2, 4 or 8), K = 8 // b values per
byte, B = ceil(D * b / 8) payload bytes per row, L = 2^b - 1 the largest level.

The specification, for one row x[0..D) of float32 values (``fl32`` = one IEEE float32
operation, rounded to nearest; no fused multiply-add anywhere):

1. ``lo = min(x)``, ``hi = max(x)``, ``rng = fl32(hi - lo)``. If ``rng >= 2^-100``:
   ``scale = fl32(rng / L)`` and ``inv = fl32(fl32(1 / rng) * L)``; otherwise (a constant
   row, or one whose values differ by less than 2^-100) ``scale = inv = 0`` and the row
   decodes to ``lo`` exactly.
2. ``t = fl32(fl32(x - lo) * inv)`` (>= 0), ``f = floor(t)``; the value rounds up when
   ``r < fl32(t - f) * 2^24`` with ``r`` a 24-bit random integer; the level is
   ``q = f + up``, and ``q = L`` where that exceeds L (clamped, so no level spills into
   the next value's bits). ``t - f`` and the scaling by 2^24 are exact, so the decision is
   an exact comparison and P(up) = ceil((t - f) * 2^24) / 2^24.
3. The random integer of element (n, d) is ``lowbias32(c) >> 8`` with the counter
   ``c = ((row0 + n) * D + d + key) mod 2^32``, where ``row0`` is the position in its
   message of the first row quantized in this call (so the groups of one message never
   share random bits) and ``key`` is a 32-bit integer drawn per message. A message
   quantized with a ``seed`` uses ``key = key_from_seed(seed) = lowbias32((seed +
   0x9E3779B9) mod 2^32)``: a bijection of the 32-bit seeds, so seeds k and k + 1 give
   unrelated keys (were the seed the key, seed k + 1's stream would be seed k's shifted
   by one element).
4. Packing is planar along the feature dimension: byte j of a row holds the levels of
   columns j, j + B, j + 2B, ... in bit slots 0, b, 2b, ...; columns >= D contribute 0.
5. Decoding: ``x' = fl32(lo + fl32(scale * q))``.

**The 1-bit sign format** (``--mode onebit``; not one of BITS: a format of its own, with
no random bits): for one row x[0..D),

6. ``scale = fl32(S / D)`` where ``S = sum_d |x_d|`` is summed in float64 (the mean
   absolute value: the s that minimises ``sum_d (x_d - s * sign(x_d))^2``);
7. bit d is 1 where ``x_d < 0`` and 0 otherwise (zeros, -0.0 included, are positive),
   packed planar as in 4. with b = 1 (byte j holds columns j, j + B, ..., B = ceil(D / 8));
8. decoding: ``x'_d = -scale`` where bit d is 1, ``+scale`` otherwise (exact, no rounding);
9. error feedback (:func:`sign_error_feedback_reference`): the sender encodes
   ``m = fl32(x + e)``, where e is the error it kept from the previous message of the same
   rows (zeros at first), and keeps ``e' = fl32(m - decode(encode(m)))`` for the next one.

Why these choices: the quantizer rounds against exactly the float32 scale and zero point
that travel, so the only bias left is float32 rounding of ``t`` (a few ulps of the row
range) and the 2^-24 granularity of the rounding probability; see ``docs/quant.md``.
"""

from __future__ import annotations

import torch

from .wire import BITS, payload_bytes  # noqa: F401  (the spec's widths and row size: the wire format's)

# lowbias32 (C. Wellons' integer hash): two multiplies, three xor-shifts, all mod 2^32
HASH_M1 = 0x7FEB352D
HASH_M2 = 0x846CA68B
MASK32 = 0xFFFFFFFF
RANDOM_BITS = 24  # bits of the hash used for rounding (an exact float32 integer)
RANGE_MIN = 2.0**-100  # rows whose max - min is smaller are sent as constant rows


def _mul32(a_I: torch.Tensor, m: int) -> torch.Tensor:
    """(a * m) mod 2^32 for int64 tensors holding values in [0, 2^32), without overflow."""
    lo = a_I * (m & 0xFFFF)
    hi = ((a_I * (m >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def lowbias32(h_I: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons) of an int64 tensor of values in [0, 2^32); int64 result."""
    h = h_I & MASK32
    h = h ^ (h >> 16)
    h = _mul32(h, HASH_M1)
    h = h ^ (h >> 15)
    h = _mul32(h, HASH_M2)
    h = h ^ (h >> 16)
    return h


SEED_OFFSET = 0x9E3779B9  # added before hashing, so seed 0 does not map to key 0


def key_from_seed(seed: int) -> int:
    """The 32-bit message key of an integer ``seed``: ``lowbias32((seed + SEED_OFFSET) mod
    2^32)``. A bijection of the seeds mod 2^32, computed once on the host; consecutive
    seeds give unrelated keys, hence uncorrelated rounding."""
    h = (int(seed) + SEED_OFFSET) & MASK32
    h ^= h >> 16
    h = (h * HASH_M1) & MASK32
    h ^= h >> 15
    h = (h * HASH_M2) & MASK32
    h ^= h >> 16
    return h


def random_bits(key: int, rows: int, dim: int, row0: int = 0, device=None) -> torch.Tensor:
    """The 24-bit random integers of a [rows, dim] message (int64 [rows, dim])."""
    n = torch.arange(rows, dtype=torch.int64, device=device)[:, None]
    d = torch.arange(dim, dtype=torch.int64, device=device)[None, :]
    counter = ((row0 + n) * dim + d + key) & MASK32
    return lowbias32(counter) >> (32 - RANDOM_BITS)


def row_scale(x_ND: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (scale, zero point, inverse scale), float32 [N] each.

    A row holding NaN gets a NaN zero point, one holding inf (or whose range overflows)
    an inf or NaN zero point or scale: the caller checks ``isfinite`` on the metadata.
    """
    levels = (1 << bits) - 1
    lo = x_ND.amin(dim=1)
    hi = x_ND.amax(dim=1)
    rng = hi - lo
    big = rng >= RANGE_MIN
    zero = torch.zeros_like(rng)
    scale = torch.where(big, rng / levels, zero)
    inv = torch.where(big, torch.reciprocal(rng) * levels, zero)
    return scale, lo, inv


def levels_reference(x_ND: torch.Tensor, bits: int, scale_N: torch.Tensor, lo_N: torch.Tensor,
                     inv_N: torch.Tensor, r_ND: torch.Tensor) -> torch.Tensor:
    """Stochastic levels q in [0, 2^bits - 1] (int64 [N, D]) given the 24-bit random integers."""
    levels = (1 << bits) - 1
    t = (x_ND - lo_N[:, None]) * inv_N[:, None]
    f = torch.floor(t)
    up = r_ND.to(torch.float32) < (t - f) * float(1 << RANDOM_BITS)
    q = f + up.to(torch.float32)
    q = torch.where(q > levels, float(levels), q)
    return q.to(torch.int64)


def pack_levels(q_ND: torch.Tensor, bits: int) -> torch.Tensor:
    """Planar bit packing: uint8 [N, B], byte j holds columns j, j + B, ... (slot s at bit s*b)."""
    N, D = q_ND.shape
    K, B = 8 // bits, payload_bytes(D, bits)
    padded = torch.zeros(N, K * B, dtype=torch.int64, device=q_ND.device)
    padded[:, :D] = q_ND
    out = torch.zeros(N, B, dtype=torch.int64, device=q_ND.device)
    for s in range(K):
        out |= padded[:, s * B:(s + 1) * B] << (s * bits)
    return out.to(torch.uint8)


def unpack_levels(payload_NB: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of ``pack_levels``: int64 [N, dim]."""
    N, B = payload_NB.shape
    K, mask = 8 // bits, (1 << bits) - 1
    p = payload_NB.to(torch.int64)
    slots = [(p >> (s * bits)) & mask for s in range(K)]
    return torch.cat(slots, dim=1)[:, :dim] if slots else p[:, :0]


def quantize_reference(x_ND: torch.Tensor, bits: int, key: int, *, row0: int = 0,
                       r_ND: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 [N, D] rows; returns (payload uint8 [N, B], meta float32 [N, 2]).

    ``meta[:, 0]`` is the scale and ``meta[:, 1]`` the zero point (row minimum). The
    random integers are ``random_bits(key, N, D, row0)`` unless ``r_ND`` (int [N, D],
    values in [0, 2^24)) supplies them. Non-finite input gives a NaN or inf scale; the
    caller checks.
    """
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    x_ND = x_ND.to(torch.float32)
    N, D = x_ND.shape
    if r_ND is None:
        r_ND = random_bits(key, N, D, row0, device=x_ND.device)
    scale, lo, inv = row_scale(x_ND, bits)
    q = levels_reference(x_ND, bits, scale, lo, inv, r_ND)
    return pack_levels(q, bits), torch.stack([scale, lo], dim=1)


def dequantize_reference(payload_NB: torch.Tensor, meta_N2: torch.Tensor, bits: int,
                         dim: int) -> torch.Tensor:
    """Decode to float32 [N, dim]: zero + scale * level, one rounding per operation."""
    q = unpack_levels(payload_NB, bits, dim).to(torch.float32)
    return meta_N2[:, 1:2] + meta_N2[:, 0:1] * q


def sign_scale_reference(x_ND: torch.Tensor) -> torch.Tensor:
    """float32 [N]: the mean absolute value of each row (summed in float64, rounded once)."""
    D = x_ND.shape[1]
    return (x_ND.to(torch.float64).abs().sum(dim=1) / D).to(torch.float32)


def sign_encode_reference(x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit sign encoding of float32 [N, D] rows (spec items 6-7): (payload uint8 [N, B],
    B = ceil(D / 8), with bit d set where x < 0; scale float32 [N]). Non-finite input gives
    a non-finite scale; the caller checks."""
    x_ND = x_ND.to(torch.float32)
    neg = (x_ND < 0).to(torch.int64)
    return pack_levels(neg, 1), sign_scale_reference(x_ND)


def sign_decode_reference(payload_NB: torch.Tensor, scale_N: torch.Tensor, dim: int) -> torch.Tensor:
    """Decode the sign format (spec item 8): float32 [N, dim], +-scale per row."""
    neg = unpack_levels(payload_NB, 1, dim).bool()
    s = scale_N.to(torch.float32)[:, None].expand(-1, dim)
    return torch.where(neg, -s, s)


def sign_error_feedback_reference(x_ND: torch.Tensor, err_ND: torch.Tensor | None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One message with error feedback (spec item 9): (payload, scale, new error [N, D]) of
    ``m = x + err`` (``err`` None: zeros); the new error is ``m - decode(encode(m))``."""
    m = x_ND.to(torch.float32) if err_ND is None else x_ND.to(torch.float32) + err_ND
    payload, scale = sign_encode_reference(m)
    return payload, scale, m - sign_decode_reference(payload, scale, m.shape[1])


__all__ = ["BITS", "HASH_M1", "HASH_M2", "RANDOM_BITS", "RANGE_MIN", "SEED_OFFSET", "key_from_seed", "lowbias32",
           "dequantize_reference", "levels_reference", "pack_levels", "payload_bytes",
           "quantize_reference", "random_bits", "row_scale", "sign_decode_reference",
           "sign_encode_reference", "sign_error_feedback_reference", "sign_scale_reference",
           "unpack_levels"]
