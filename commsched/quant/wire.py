"""The wire format's numbers, defined once and without torch (the pure planners use them).

Per-row asymmetric quantization sends, for each row, ``payload_bytes(D, b)`` bytes of
b-bit levels packed along D and ``META_BYTES`` bytes of metadata (a float32 scale and a
float32 zero point). ``commsched.quant.reference.BITS`` and
``commsched.quant.codec.META_BYTES`` are these same objects. A *row record* (the
expert all-to-all's form, one self-contained record per row so that rows can be split
between peers anywhere) is the same two parts in one row: ``record_bytes(D, b)`` =
payload then metadata.

The 1-bit sign format (``--mode onebit``, :func:`commsched.quant.reference.sign_encode_reference`)
sends, for each row, ``sign_payload_bytes(D)`` = ceil(D / 8) bytes of packed signs and
``SIGN_SCALE_BYTES`` bytes of scale (one float32): ``sign_row_bytes(D)`` in all.
"""

from __future__ import annotations

BITS = (2, 4, 8)  # the widths the codec, the kernels and the assigner support
META_BYTES = 8  # float32 scale + float32 zero point per row


def payload_bytes(dim: int, bits: int) -> int:
    """Payload bytes of one row: ceil(dim * bits / 8)."""
    return (dim * bits + 7) // 8


def message_bytes(rows: int, dim: int, bits: int) -> int:
    """Bytes of a message of ``rows`` rows of ``dim`` values at ``bits``: rows * (B + META_BYTES)."""
    return rows * (payload_bytes(dim, bits) + META_BYTES)


def record_bytes(dim: int, bits: int) -> int:
    """Bytes of one *row record* (the all-to-all form of a quantized row,
    :func:`commsched.quant.codec.encode_records`): its payload, then its metadata,
    ceil(dim * bits / 8) + META_BYTES."""
    return payload_bytes(dim, bits) + META_BYTES


SIGN_SCALE_BYTES = 4  # float32 scale per row of the 1-bit sign format


def sign_payload_bytes(dim: int) -> int:
    """Packed-sign bytes of one row of ``dim`` values: ceil(dim / 8)."""
    return payload_bytes(dim, 1)


def sign_row_bytes(dim: int) -> int:
    """Bytes of one row in the 1-bit sign format: ceil(dim / 8) + SIGN_SCALE_BYTES."""
    return sign_payload_bytes(dim) + SIGN_SCALE_BYTES


__all__ = ["BITS", "META_BYTES", "SIGN_SCALE_BYTES", "message_bytes", "payload_bytes", "record_bytes",
           "sign_payload_bytes", "sign_row_bytes"]
