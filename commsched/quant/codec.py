"""Stochastic integer quantization of message rows: public API, wire format, dispatch.

Each row of a float matrix is cut to b = 2, 4 or 8 bits per value with per-row
asymmetric stochastic rounding (zero point = row minimum, scale = (max - min) / (2^b - 1)),
so that E[dequantize(quantize(x))] = x. The rules, bit for bit, are in
``commsched.quant.reference``; ``docs/quant.md`` explains the choices.

Wire format of a message of N rows of D values at b bits (little-endian):

    meta     N x 8 bytes   per row: scale (float32), zero point = row minimum (float32)
    payload  N x B bytes   per row: B = ceil(D * b / 8) bytes, planar bit packing
                           (byte j holds columns j, j + B, j + 2B, ... in bit slots
                           0, b, 2b, ...; unused high slots are zero)

so a message occupies ``N * (B + META_BYTES)`` bytes. A multi-width message (the groups
of one peer, each with its own width) is the concatenation of its groups' messages in
group order; ``GroupLayout`` gives the sizes and offsets that both sides derive from
(group row counts, widths, D) without communicating.

Dispatch: CUDA tensors go to the Triton kernels (``commsched.kernels.quant``); CPU tensors
to the native C kernel (``commsched.kernels.cpu``: built once per machine, one kernel for
every width and shape), or, where no C compiler is found, to the fused torch path
(``commsched.quant.fast``, compiled with ``torch.compile`` for large messages); anything
else to the plain-torch reference. ``impl=`` forces one: ``native``, ``eager`` (the fused
torch path uncompiled) and ``compiled`` (with torch.compile) are CPU-only and refuse
other devices; ``triton`` is CUDA; ``reference`` runs anywhere.

**1-bit sign rows** (``--mode onebit``): :func:`encode_signs` / :func:`decode_signs` turn
float rows into *sign records*, uint8 [N, W] with W = ``sign_row_bytes(D)`` = ceil(D / 8)
+ 4: per row its packed signs (planar, as above with b = 1) then its scale (float32, the
mean absolute value), so a message of sign rows is a plain uint8 matrix with one record per
row (it travels through ``commsched.all_to_all`` with the rows' own counts). With
``error=`` the rows are encoded with error feedback and the new error comes back (the
spec, items 6-9 of ``commsched.quant.reference``). ``impl="auto"`` runs the fast twin
(``commsched.quant.fast.sign_encode_fast``: whole-tensor torch operations, any device),
``"reference"`` the spec; both give the same bytes.

**Row records** (the expert all-to-all, :mod:`commsched.quant.rowwire`):
:func:`encode_records` / :func:`decode_records` keep each quantized row in one record,
uint8 [N, W] with W = ``record_bytes(D, b)`` = B + 8: the row's payload (planar, as above),
then its scale and zero point (float32 each), so a message of records splits between
peers at any row, like the sign records. The quantization is the codec's, bit for bit
(the same key and counter give the same payload and metadata as :func:`quantize`), through
the same dispatch (native kernel / fused torch on the CPU, Triton on CUDA); neither function
reads a device value on the host (non-finite rows decode to non-finite values, which the
caller's loss shows, instead of a synchronising check).

Legend: N (or R) rows, D features per row, B payload bytes per row, G groups, W bytes
of one sign or row record.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from .._lazy import require
from . import reference as _ref
from .wire import (
    BITS,
    META_BYTES,
    SIGN_SCALE_BYTES,
    message_bytes,
    payload_bytes,
    record_bytes,
    sign_row_bytes,
)

IMPLS = ("auto", "reference", "native", "eager", "compiled", "triton")


# --------------------------------------------------------------------------- validation
def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or int(bits) not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    return int(bits)


def _check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def _check_rows(x, name: str = "x") -> torch.Tensor:
    """A 2-D floating tensor with at least one column, as contiguous float32."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, features], got shape {tuple(x.shape)}; "
                         "reshape it (for example x.reshape(-1, x.shape[-1]))")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}; "
                         "convert it with x.float()")
    if x.shape[1] == 0:
        raise ValueError(f"{name} has no columns (shape {tuple(x.shape)}); there is nothing to quantize")
    return x.to(torch.float32).contiguous()


def _draw_key(generator: torch.Generator | None, seed: int | None) -> int:
    """The 32-bit message key: :func:`~commsched.quant.reference.key_from_seed` of ``seed``
    (a hash, so consecutive seeds give unrelated random streams) if given, else drawn from
    ``generator`` (the default CPU generator when None, so ``torch.manual_seed`` reproduces
    it). Computed once on the host, before any implementation is dispatched."""
    if seed is not None:
        if generator is not None:
            raise ValueError("pass either generator or seed, not both")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        return _ref.key_from_seed(int(seed))
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    device = generator.device if generator is not None else "cpu"
    k = torch.randint(0, 1 << 32, (1,), generator=generator, dtype=torch.int64, device=device)
    return int(k.item())


def _nonfinite_error(x_ND: torch.Tensor, name: str) -> ValueError:
    """The error for rows whose metadata came out non-finite, naming what and where."""
    finite = torch.isfinite(x_ND)
    n_bad = int((~finite).sum())
    if n_bad:
        n_nan = int(torch.isnan(x_ND).sum())
        bad_rows = (~finite).any(dim=1).nonzero().flatten()
        where = [(int(r), int(c)) for r, c in (~finite).nonzero()[:5].tolist()]
        return ValueError(
            f"{name} holds {n_bad} non-finite value{'s' if n_bad != 1 else ''} "
            f"({n_nan} NaN, {n_bad - n_nan} inf) in {len(bad_rows)} of {x_ND.shape[0]} rows; "
            f"first at (row, column) {', '.join(map(str, where))}"
            f"{' ...' if n_bad > len(where) else ''}. Quantization needs finite input: look for "
            "an overflow or a division by zero upstream, or clean it with torch.nan_to_num.")
    lo, hi = x_ND.amin(dim=1), x_ND.amax(dim=1)
    bad = (~torch.isfinite(hi - lo)).nonzero().flatten()
    r = int(bad[0]) if len(bad) else 0
    return ValueError(
        f"{name}: {len(bad)} row{'s span' if len(bad) != 1 else ' spans'} more than the float32 "
        f"range (max - min overflows), first row {r} with min {float(lo[r]):.4g} and max "
        f"{float(hi[r]):.4g}; scale the input down before quantizing it.")


def _check_meta(x_ND: torch.Tensor, meta_N2: torch.Tensor, name: str) -> None:
    """Raise if any row's metadata is non-finite (non-finite input or an overflowing range)."""
    if meta_N2.numel() and not bool(torch.isfinite(meta_N2).all()):
        raise _nonfinite_error(x_ND, name)


# --------------------------------------------------------------------------- dispatch
def _resolve(impl: str, device: torch.device) -> str:
    if impl == "auto":
        return "triton" if device.type == "cuda" else "fast" if device.type == "cpu" else "reference"
    if impl in ("native", "eager", "compiled") and device.type != "cpu":
        # "compiled" would hand CUDA rows to Inductor-generated Triton, not the kernels
        # whose float32 arithmetic is pinned to the reference: refused, as the CPU-only
        # native and eager paths are
        raise ValueError(f"impl={impl!r} is a CPU implementation but the rows are on {device}; "
                         "use impl='auto' (the Triton kernels on CUDA) or 'reference'")
    return impl


def _triton_kernels():
    """``commsched.kernels.quant`` (the Triton kernels of CUDA rows; the ``gpu`` extra)."""
    require("triton", "quantizing CUDA tensors (the Triton kernels)")
    from commsched.kernels import quant

    return quant


def quantize_rows(x_ND: torch.Tensor, bits: int, key: int, row0: int, impl: str,
                   out_NB: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload uint8 [N, B], meta float32 [N, 2]) of contiguous float32 rows with counter
    offset ``row0``, by ``impl`` (see the module doc); unchecked: for callers that validated
    their rows once (``pack_groups``, AdaQP's exchange) and call it per message."""
    how = _resolve(impl, x_ND.device)
    if how == "triton":
        return _triton_kernels().quantize_pack(x_ND, bits, key, row0, out=out_NB)
    if how in ("fast", "native", "eager", "compiled"):
        from .fast import quantize_cpu

        return quantize_cpu(x_ND, bits, key, row0, out_NB=out_NB, **_cpu_choice(how))
    payload, meta = _ref.quantize_reference(x_ND, bits, key, row0=row0)
    if out_NB is not None:
        out_NB.copy_(payload)
        payload = out_NB
    return payload, meta


def _cpu_choice(how: str) -> dict:
    """``quantize_cpu`` / ``dequantize_cpu`` keywords of a CPU implementation name: "fast"
    (auto) is the native kernel when it can be had, else torch.compile for large messages."""
    return {"fast": {}, "native": {"native": True}, "eager": {"compile": False},
            "compiled": {"compile": True}}[how]


def dequantize_rows(payload_NB: torch.Tensor, meta_N2: torch.Tensor, bits: int, dim: int,
                     impl: str, out_ND: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [N, dim], written into ``out_ND`` (unit column stride) if given; unchecked."""
    how = _resolve(impl, payload_NB.device)
    if how == "triton":
        return _triton_kernels().unpack_dequantize(payload_NB, meta_N2, bits, dim, out=out_ND)
    if how in ("fast", "native", "eager", "compiled"):
        from .fast import dequantize_cpu

        return dequantize_cpu(payload_NB, meta_N2, bits, dim, out_ND=out_ND, **_cpu_choice(how))
    y = _ref.dequantize_reference(payload_NB, meta_N2, bits, dim)
    return y if out_ND is None else out_ND.copy_(y)


def _meta_from_bytes(meta_bytes: torch.Tensor, rows: int) -> torch.Tensor:
    """float32 [rows, 2] from 8 * rows bytes (copied if the bytes are not 4-byte aligned)."""
    if meta_bytes.storage_offset() % 4 or meta_bytes.data_ptr() % 4:
        meta_bytes = meta_bytes.clone()
    return meta_bytes.view(torch.float32).view(rows, 2)


# --------------------------------------------------------------------------- single width
@dataclass(frozen=True, eq=False)
class QuantizedRows:
    """A quantized message: ``payload`` uint8 [N, B], ``meta`` float32 [N, 2] (scale, zero point).

    ``bits`` is the width of every value, ``dim`` = D the number of values per row.
    """

    payload: torch.Tensor
    meta: torch.Tensor
    bits: int
    dim: int

    def __post_init__(self) -> None:
        bits = _check_bits(self.bits)
        if isinstance(self.dim, bool) or not isinstance(self.dim, numbers.Integral) or self.dim < 1:
            raise ValueError(f"dim must be a positive int, got {self.dim!r}")
        B = payload_bytes(int(self.dim), bits)
        p, m = self.payload, self.meta
        if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8 or p.dim() != 2 or p.shape[1] != B:
            raise ValueError(f"payload must be uint8 [N, {B}] for dim={self.dim} at {bits} bits, got "
                             f"{getattr(p, 'dtype', type(p).__name__)} {tuple(getattr(p, 'shape', ()))}")
        if not isinstance(m, torch.Tensor) or m.dtype != torch.float32 or tuple(m.shape) != (p.shape[0], 2):
            raise ValueError(f"meta must be float32 [{p.shape[0]}, 2] (scale, zero point per row), got "
                             f"{getattr(m, 'dtype', type(m).__name__)} {tuple(getattr(m, 'shape', ()))}")
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "dim", int(self.dim))

    @property
    def rows(self) -> int:
        return self.payload.shape[0]

    @property
    def scale(self) -> torch.Tensor:
        """float32 [N]: the step between levels of each row."""
        return self.meta[:, 0]

    @property
    def zero_point(self) -> torch.Tensor:
        """float32 [N]: the row minimum (level 0)."""
        return self.meta[:, 1]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire, metadata included: N * (ceil(D * bits / 8) + META_BYTES)."""
        return message_bytes(self.rows, self.dim, self.bits)

    def to_bytes(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The wire form: uint8 [nbytes] = meta (N x 8 bytes) then payload (N x B bytes)."""
        n = self.rows
        if out is None:
            out = torch.empty(self.nbytes, dtype=torch.uint8, device=self.payload.device)
        elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != self.nbytes:
            raise ValueError(f"out must be a 1-D uint8 tensor of {self.nbytes} bytes, got "
                             f"{out.dtype} {tuple(out.shape)}")
        out[:n * META_BYTES].copy_(self.meta.contiguous().view(torch.uint8).view(-1))
        out[n * META_BYTES:].copy_(self.payload.reshape(-1))
        return out

    @classmethod
    def from_bytes(cls, buf_B: torch.Tensor, rows: int, dim: int, bits: int) -> "QuantizedRows":
        """Read a message written by ``to_bytes`` (views into ``buf_B`` where alignment allows)."""
        bits = _check_bits(bits)
        need = message_bytes(rows, dim, bits)
        if not isinstance(buf_B, torch.Tensor) or buf_B.dtype != torch.uint8 or buf_B.dim() != 1:
            raise ValueError("buf must be a 1-D uint8 tensor")
        if buf_B.numel() != need:
            raise ValueError(f"buf holds {buf_B.numel()} bytes but {rows} rows of {dim} values at "
                             f"{bits} bits need {need}")
        meta = _meta_from_bytes(buf_B[:rows * META_BYTES], rows)
        payload = buf_B[rows * META_BYTES:].view(rows, payload_bytes(dim, bits))
        return cls(payload, meta, bits, dim)


def quantize(x_ND: torch.Tensor, bits: int, *, generator: torch.Generator | None = None,
             seed: int | None = None, impl: str = "auto") -> QuantizedRows:
    """Stochastically quantize each row of ``x_ND`` (float [N, D]) to ``bits`` in {2, 4, 8}.

    The random bits come from a counter hash keyed by a 32-bit key: the hash of ``seed``
    (:func:`~commsched.quant.reference.key_from_seed`) if given, else drawn from ``generator`` (default: torch's default CPU generator).
    Unbiased: E[dequantize(quantize(x))] = x up to float32 rounding. Raises ValueError
    for bits outside {2, 4, 8}, non-float or non-2-D input and non-finite values.
    """
    bits = _check_bits(bits)
    _check_impl(impl)
    x = _check_rows(x_ND)
    key = _draw_key(generator, seed)
    payload, meta = quantize_rows(x, bits, key, 0, impl)
    _check_meta(x, meta, "x")
    return QuantizedRows(payload, meta, bits, x.shape[1])


def dequantize(q: QuantizedRows, *, out: torch.Tensor | None = None,
               impl: str = "auto") -> torch.Tensor:
    """Decode a ``QuantizedRows`` to float32 [N, D]: zero point + scale * level.

    ``out`` (float32 [N, D], unit column stride, on the payload's device) receives the
    rows if given, for example rows of a bigger matrix; it is returned.
    """
    if not isinstance(q, QuantizedRows):
        raise TypeError(f"dequantize expects a QuantizedRows, got {type(q).__name__}")
    _check_impl(impl)
    if out is not None:
        _check_out(out, (q.rows, q.dim), q.payload.device)
    return dequantize_rows(q.payload, q.meta.contiguous(), q.bits, q.dim, impl, out_ND=out)


def _check_out(out, shape: tuple[int, int], device: torch.device) -> None:
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or tuple(out.shape) != shape
            or out.device != device or (shape[1] > 1 and out.stride(1) != 1)):
        raise ValueError(f"out must be a float32 {list(shape)} tensor on {device} with unit "
                         f"column stride, got {getattr(out, 'dtype', type(out).__name__)} "
                         f"{tuple(getattr(out, 'shape', ()))}")


# --------------------------------------------------------------------------- multi width
@dataclass(frozen=True)
class GroupLayout:
    """The byte layout of one peer's multi-width message.

    ``counts[g]`` rows of ``dim`` values each are sent at ``bits[g]``; the rows of group g
    are rows ``row_offsets[g] : row_offsets[g + 1]`` of the matrix, and its message
    (meta then payload, see the module docstring) is bytes
    ``byte_offsets[g] : byte_offsets[g + 1]`` of the buffer. Sender and receiver build
    the same layout from the same (counts, bits, dim), so no sizes travel.
    """

    dim: int
    counts: tuple[int, ...]
    bits: tuple[int, ...]
    row_offsets: tuple[int, ...] = field(init=False, repr=False)
    byte_offsets: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, numbers.Integral) or self.dim < 1:
            raise ValueError(f"dim must be a positive int, got {self.dim!r}")
        counts = tuple(self.counts)
        bits = tuple(self.bits)
        if len(counts) != len(bits):
            raise ValueError(f"counts has {len(counts)} groups but bits has {len(bits)}")
        for g, c in enumerate(counts):
            if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 0:
                raise ValueError(f"counts[{g}] must be an int >= 0, got {c!r}")
        bits = tuple(_check_bits(b) for b in bits)
        counts = tuple(int(c) for c in counts)
        rows, nbytes = [0], [0]
        for c, b in zip(counts, bits):
            rows.append(rows[-1] + c)
            nbytes.append(nbytes[-1] + message_bytes(c, int(self.dim), b))
        object.__setattr__(self, "dim", int(self.dim))
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "row_offsets", tuple(rows))
        object.__setattr__(self, "byte_offsets", tuple(nbytes))

    @property
    def groups(self) -> int:
        return len(self.counts)

    def spans(self):
        """(rows n, bits, first row, first byte, payload bytes B of a row) of each non-empty group,
        in order: its meta is bytes ``[b0, b0 + n * META_BYTES)``, its payload the ``n * B`` after."""
        for n, bits, r0, b0 in zip(self.counts, self.bits, self.row_offsets, self.byte_offsets):
            if n:
                yield n, bits, r0, b0, payload_bytes(self.dim, bits)

    @property
    def rows(self) -> int:
        """R, the rows of the whole message."""
        return self.row_offsets[-1]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole message: sum over groups of count * (ceil(dim * bits / 8) + META_BYTES)."""
        return self.byte_offsets[-1]

    def group_nbytes(self, g: int) -> int:
        return self.byte_offsets[g + 1] - self.byte_offsets[g]


def _empty_like_rows(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new output (on the CPU with huge-page advice when large: fewer page faults)."""
    if device.type == "cpu":
        from commsched.kernels.cpu import empty_rows

        return empty_rows(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def _check_layout(layout) -> GroupLayout:
    if not isinstance(layout, GroupLayout):
        raise TypeError(f"layout must be a GroupLayout, got {type(layout).__name__}")
    return layout


def pack_groups(x_RD: torch.Tensor, layout: GroupLayout, *,
                generator: torch.Generator | None = None, seed: int | None = None,
                out: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """Quantize the rows of ``x_RD`` group by group into one uint8 buffer [layout.nbytes].

    Rows ``layout.row_offsets[g]:layout.row_offsets[g + 1]`` are quantized at
    ``layout.bits[g]``; one key serves the whole message (each row's random bits depend
    on its position in ``x_RD``). ``out`` (1-D uint8 of ``layout.nbytes``) receives the
    bytes if given, for example a slice of a send buffer.
    """
    layout = _check_layout(layout)
    _check_impl(impl)
    x = _check_rows(x_RD)
    if tuple(x.shape) != (layout.rows, layout.dim):
        raise ValueError(f"x has shape {tuple(x.shape)} but the layout describes "
                         f"[{layout.rows}, {layout.dim}] (counts {layout.counts})")
    key = _draw_key(generator, seed)
    if out is None:
        out = _empty_like_rows((layout.nbytes,), torch.uint8, x.device)
    elif (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1
          or out.numel() != layout.nbytes or out.device != x.device):
        raise ValueError(f"out must be a 1-D uint8 tensor of {layout.nbytes} bytes on {x.device}")
    ok = None
    for n, bits, r0, b0, B in layout.spans():
        xg = x[r0:r0 + n]
        payload_view = out[b0 + n * META_BYTES:b0 + n * (META_BYTES + B)].view(n, B)
        _, meta = quantize_rows(xg, bits, key, r0, impl, out_NB=payload_view)
        out[b0:b0 + n * META_BYTES].copy_(meta.contiguous().view(torch.uint8).view(-1))
        if meta.numel():  # on the device: one host read for the whole message, below
            ok = torch.isfinite(meta).all() if ok is None else ok & torch.isfinite(meta).all()
    if ok is not None and not bool(ok):
        raise _nonfinite_error(x, "x")  # reports on the whole of x
    return out


def unpack_groups(buf_B: torch.Tensor, layout: GroupLayout, *, out: torch.Tensor | None = None,
                  impl: str = "auto") -> torch.Tensor:
    """Decode a buffer written by ``pack_groups`` with the same layout: float32 [R, D].

    Every group is decoded straight into its rows of ``out`` (float32 [R, D] with unit
    column stride on the buffer's device, for example the halo rows of a feature matrix)
    or of a new tensor; returns it.
    """
    layout = _check_layout(layout)
    _check_impl(impl)
    if not isinstance(buf_B, torch.Tensor) or buf_B.dtype != torch.uint8 or buf_B.dim() != 1:
        raise ValueError(f"buf must be a 1-D uint8 tensor, got "
                         f"{getattr(buf_B, 'dtype', type(buf_B).__name__)} {tuple(getattr(buf_B, 'shape', ()))}")
    if buf_B.numel() != layout.nbytes:
        raise ValueError(f"buf holds {buf_B.numel()} bytes but the layout (counts {layout.counts}, "
                         f"bits {layout.bits}, dim {layout.dim}) needs {layout.nbytes}; both sides "
                         "must build the same GroupLayout")
    shape = (layout.rows, layout.dim)
    if out is None:
        out = _empty_like_rows(shape, torch.float32, buf_B.device)
    else:
        _check_out(out, shape, buf_B.device)
    for n, bits, r0, b0, B in layout.spans():
        meta = _meta_from_bytes(buf_B[b0:b0 + n * META_BYTES], n)
        payload = buf_B[b0 + n * META_BYTES:b0 + n * (META_BYTES + B)].view(n, B)
        dequantize_rows(payload, meta, bits, layout.dim, impl, out_ND=out[r0:r0 + n])
    return out


# --------------------------------------------------------------------------- row records
def encode_records(x_ND: torch.Tensor, bits: int, key: int, *, impl: str = "auto",
                   row0: int = 0) -> torch.Tensor:
    """Row records of float rows ``x_ND`` [N, D] at ``bits``: uint8 [N, B + META_BYTES], per
    row the payload then (scale, zero point) as float32 (module docstring). ``key``: the
    message's 32-bit key (a host int, as :func:`quantize_rows` takes; no host read of the
    device), ``row0`` the counter offset. Checks shapes and types only: no synchronising
    finite check."""
    bits = _check_bits(bits)
    _check_impl(impl)
    if not isinstance(x_ND, torch.Tensor) or x_ND.dim() != 2 or not x_ND.dtype.is_floating_point:
        raise ValueError(f"x must be a floating-point [rows, features] tensor, got "
                         f"{getattr(x_ND, 'dtype', type(x_ND).__name__)} {tuple(getattr(x_ND, 'shape', ()))}")
    N, D = x_ND.shape
    if D == 0:
        raise ValueError(f"x has no columns (shape {tuple(x_ND.shape)}); there is nothing to quantize")
    B = payload_bytes(D, bits)
    out = torch.empty((N, record_bytes(D, bits)), dtype=torch.uint8, device=x_ND.device)
    if N == 0:
        return out
    x = x_ND.to(torch.float32).contiguous()
    _, meta = quantize_rows(x, bits, int(key) & 0xFFFFFFFF, int(row0), impl, out_NB=out[:, :B])
    out[:, B:] = meta.contiguous().view(torch.uint8).view(N, META_BYTES)
    return out


def decode_records(records_NW: torch.Tensor, bits: int, dim: int, *, impl: str = "auto",
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [N, dim] from row records written by :func:`encode_records` (into ``out``,
    float32 [N, dim] with unit column stride, if given): ``zero + scale * level``, as
    :func:`dequantize` of the same payload and metadata."""
    bits = _check_bits(bits)
    _check_impl(impl)
    B = payload_bytes(int(dim), bits)
    W = B + META_BYTES
    if (not isinstance(records_NW, torch.Tensor) or records_NW.dtype != torch.uint8
            or records_NW.dim() != 2 or records_NW.shape[1] != W):
        raise ValueError(f"row records of {dim} values at {bits} bits must be uint8 [N, {W}], got "
                         f"{getattr(records_NW, 'dtype', type(records_NW).__name__)} "
                         f"{tuple(getattr(records_NW, 'shape', ()))}")
    N = records_NW.shape[0]
    if out is not None:
        _check_out(out, (N, int(dim)), records_NW.device)
    if N == 0:
        return out if out is not None else torch.empty((0, int(dim)), dtype=torch.float32,
                                                       device=records_NW.device)
    meta = records_NW[:, B:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # aligned [N, 2]
    return dequantize_rows(records_NW[:, :B], meta, bits, int(dim), impl, out_ND=out)


# --------------------------------------------------------------------------- 1-bit signs
SIGN_IMPLS = ("auto", "reference")  # "auto": the fast twin (commsched.quant.fast), any device


def encode_signs(x_ND: torch.Tensor, *, error: torch.Tensor | None = None, impl: str = "auto",
                 compile: bool | None = False, finite: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sign records of the rows of ``x_ND`` (float [N, D]): (uint8 [N, W], the new error).

    Without ``error`` the rows are encoded as they are and the second item is None. With
    ``error`` (float32 [N, D], the error kept from the previous message of these rows) the
    rows ``m = x + error`` are encoded and ``m - decode(encode(m))`` (float32 [N, D]) is
    returned, to be passed as ``error`` next time (error feedback). ``impl``: ``auto``
    (the fast twin; ``compile``: its compiled form on the CPU, see
    ``commsched.quant.fast.sign_encode_fast``) or ``reference``; both give the same bytes.
    Raises ValueError for
    non-2-D, non-float or non-finite input and for an ``error`` of another shape.

    ``finite`` (a 0-d bool tensor on the rows' device) defers the finite check: instead
    of reading the scales back on the host (a device synchronisation on CUDA) the call
    ANDs "every scale is finite" into it, for the caller to read once later (the onebit
    exchange reads it once an epoch)."""
    if impl not in SIGN_IMPLS:
        raise ValueError(f"impl must be one of {SIGN_IMPLS}, got {impl!r}")
    x = _check_rows(x_ND)
    if error is not None:
        if not isinstance(error, torch.Tensor) or tuple(error.shape) != tuple(x.shape):
            raise ValueError(f"error must be a float32 tensor of the rows' shape {tuple(x.shape)}, got "
                             f"{tuple(getattr(error, 'shape', ())) or type(error).__name__}")
        error = error.to(torch.float32)
    N, D = x.shape
    out = torch.empty((N, sign_row_bytes(D)), dtype=torch.uint8, device=x.device)
    B = out.shape[1] - SIGN_SCALE_BYTES
    if impl == "reference":
        if error is None:
            (payload, scale), new_err = _ref.sign_encode_reference(x), None
        else:
            payload, scale, new_err = _ref.sign_error_feedback_reference(x, error)
        out[:, :B] = payload
    else:
        from .fast import sign_encode_fast

        _, scale, new_err = sign_encode_fast(x, error, out_NB=out[:, :B], compile=compile)
    if finite is not None:
        if scale.numel():
            finite &= torch.isfinite(scale).all()
    elif scale.numel() and not bool(torch.isfinite(scale).all()):
        raise _nonfinite_error(x if error is None else x + error, "x" if error is None else "x + error")
    out[:, B:] = scale.reshape(N, 1).view(torch.uint8)
    return out, new_err


def decode_signs(records_NW: torch.Tensor, dim: int, *, impl: str = "auto",
                 compile: bool | None = False) -> torch.Tensor:
    """float32 [N, dim] from sign records written by :func:`encode_signs` (+-scale per row);
    ``impl``, ``compile`` as there."""
    if impl not in SIGN_IMPLS:
        raise ValueError(f"impl must be one of {SIGN_IMPLS}, got {impl!r}")
    W = sign_row_bytes(dim)
    if (not isinstance(records_NW, torch.Tensor) or records_NW.dtype != torch.uint8
            or records_NW.dim() != 2 or records_NW.shape[1] != W):
        raise ValueError(f"sign records of rows of {dim} values must be uint8 [N, {W}], got "
                         f"{getattr(records_NW, 'dtype', type(records_NW).__name__)} "
                         f"{tuple(getattr(records_NW, 'shape', ()))}")
    B = W - SIGN_SCALE_BYTES
    scale = records_NW[:, B:].reshape(-1).clone().view(torch.float32)  # a copy: 4-byte aligned
    if impl == "reference":
        return _ref.sign_decode_reference(records_NW[:, :B], scale, dim)
    from .fast import sign_decode_fast

    return sign_decode_fast(records_NW[:, :B], scale, dim, compile=compile)


__all__ = ["BITS", "GroupLayout", "IMPLS", "META_BYTES", "QuantizedRows", "SIGN_IMPLS", "dequantize",
           "decode_records", "decode_signs", "dequantize_rows", "encode_records", "record_bytes", "encode_signs", "message_bytes", "pack_groups", "payload_bytes", "quantize",
           "quantize_rows", "unpack_groups"]
