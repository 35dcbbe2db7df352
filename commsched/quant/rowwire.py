"""Quantized rows on an all-to-all: the shared codec as a :class:`commsched.comm.all2all.RowFormat`.

Legend: R rows, F values per row (the product of the trailing dimensions), W bytes of
one row record.

``all_to_all(x, counts, wire=Wire(forward=QuantRows(8)))`` sends every row as a *row
record* (:func:`commsched.quant.codec.encode_records`: the codec's stochastic b-bit
payload, then the row's float32 scale and zero point), ``record_bytes(F, b)`` = F + 8
bytes at 8 bits instead of 4F, and decodes it on arrival into the caller's dtype. The
quantization is the codec's (:mod:`commsched.quant.reference` is its specification; the
native CPU kernel, the fused torch path or the Triton kernel run it), so a decoded value is
within one level step of the value sent (``|x' - x| <= scale = (max - min) / (2^b - 1)`` of
its row, plus float32 rounding) and its expectation is the value sent (unbiased).

Limits (nothing is read back on the host, so nothing is checked): a row holding NaN or inf
decodes to NaN or inf; so does a finite row whose range max - min overflows float32
(values spanning more than about 3.4e38, e.g. +3e38 and -3e38): every value of that row
comes back NaN, the other rows as usual. The codec's ``quantize()`` refuses both by name.

Keys: each encoded message draws its 32-bit key from the format's own host random stream
(``random.Random(seed)``): a host integer, so encoding never reads the device; the same
seed and the same sequence of messages give the same bytes. Give each rank and each layer
its own seed (:func:`format_seed`), so that no two messages share random bits. The stream's
position is :meth:`QuantRows.state_dict` (plain ints): a checkpoint holds it, and a resumed run
continues it (:meth:`QuantRows.load_state_dict`) to draw the keys an uninterrupted run draws.

Why stochastic rounding, not round-to-nearest: it is the codec AdaQP's exchange already
uses (one codec, one set of kernels and tests), and it is unbiased, so quantizing the
dispatched tokens (and, in the backward pass, the expert outputs' gradients) leaves the
gradient estimator unbiased; at 8 bits its extra variance (at most scale^2 / 4 per value)
is far below the minibatch noise (docs/moe.md, "Quantized expert all-to-all").
"""

from __future__ import annotations

import random
import threading

import torch

from .codec import IMPLS, decode_records, encode_records
from .reference import key_from_seed
from .wire import BITS, record_bytes


def format_seed(*parts: int) -> int:
    """A 32-bit seed from integers (rank, layer, ...): hashed, so neighbouring values give
    unrelated streams."""
    h = 0
    for p in parts:
        h = key_from_seed((h ^ (int(p) & 0xFFFFFFFF)) + 1)
    return h


class QuantRows:
    """Rows sent as ``bits``-bit row records of the shared codec (module docstring).

    ``seed`` starts the host stream of message keys; ``impl`` picks the codec's
    implementation (``"auto"``: native / fused torch on the CPU, Triton on CUDA)."""

    def __init__(self, bits: int = 8, *, seed: int = 0, impl: str = "auto"):
        if isinstance(bits, bool) or bits not in BITS:
            raise ValueError(f"QuantRows: bits must be one of {BITS}, got {bits!r}")
        if impl not in IMPLS:
            raise ValueError(f"QuantRows: impl must be one of {IMPLS}, got {impl!r}")
        self.bits, self.impl, self.seed = int(bits), impl, int(seed)
        self.name = f"q{self.bits}"
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()  # keys in call order when a comm lane encodes too

    def __repr__(self) -> str:
        return f"QuantRows(bits={self.bits}, seed={self.seed}, impl={self.impl!r})"

    def row_bytes(self, row_numel: int) -> int:
        """Bytes of one encoded row of ``row_numel`` values."""
        return record_bytes(int(row_numel), self.bits)

    def next_key(self) -> int:
        with self._lock:
            return self._rng.getrandbits(32)

    def state_dict(self) -> dict:
        """The key stream's position: ``{"seed": int, "state": [int] * 625}`` (the host
        generator's state; plain values, so a ``weights_only`` checkpoint holds it)."""
        with self._lock:
            version, internal, _ = self._rng.getstate()
        return {"seed": self.seed, "version": int(version), "state": [int(v) for v in internal]}

    def load_state_dict(self, st: dict) -> None:
        """Continue the key stream of :meth:`state_dict` (ValueError for a damaged state or
        one of another stream: another seed)."""
        try:
            seed, version = int(st["seed"]), int(st.get("version", 3))
            internal = tuple(int(v) for v in st["state"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"QuantRows: the key stream state is damaged ({type(e).__name__}: {e})") from None
        if seed != self.seed:
            raise ValueError(f"QuantRows: the key stream state is of seed {seed}, this format's is "
                             f"{self.seed} (another rank or layer)")
        rng = random.Random()
        try:
            rng.setstate((version, internal, None))
        except (TypeError, ValueError) as e:
            raise ValueError(f"QuantRows: the key stream state is damaged ({e})") from None
        with self._lock:
            self._rng = rng

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 [R, W] row records of the rows of ``x`` ([R, ...] floating point)."""
        if not x.dtype.is_floating_point:
            raise ValueError(f"QuantRows encodes floating-point rows, got {x.dtype}")
        R = x.shape[0]
        F = int(torch.Size(x.shape[1:]).numel())
        return encode_records(x.reshape(R, F), self.bits, self.next_key(), impl=self.impl)

    def decode(self, w: torch.Tensor, row_shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """[R, *row_shape] rows of ``dtype`` from row records."""
        F = int(torch.Size(row_shape).numel())
        y = decode_records(w, self.bits, F, impl=self.impl)
        return y.reshape(w.shape[0], *row_shape).to(dtype)


__all__ = ["QuantRows", "format_seed"]
