"""The quantization codec: its maths (unbiasedness, variance), wire format, fast path, errors.

Legend: N rows, D features, M independent round trips, b bits, S = row scale.
"""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import commsched.quant as Q
from commsched.quant import fast as F
from commsched.quant import reference as R
from commsched.quant.codec import (
    GroupLayout,
    QuantizedRows,
    message_bytes,
    pack_groups,
    unpack_groups,
)

WIDTHS = R.BITS


def _rows(seed: int, N: int, D: int) -> torch.Tensor:
    """Rows of mixed character: normal, offset, constant, zero, huge, small, near-constant,
    below 2^-100 in range, or with subnormal differences."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g)
    kinds = torch.randint(0, 9, (N,), generator=g)
    for n in range(N):
        k = int(kinds[n])
        if k == 1:
            x[n] = x[n] * 1e3 + 5e3
        elif k == 2:
            x[n] = float(x[n, 0])
        elif k == 3:
            x[n] = 0.0
        elif k == 4:
            x[n] = x[n] * 1e36
        elif k == 5:
            x[n] = x[n] * 1e-25
        elif k == 6:
            x[n] = x[n].abs() * 1e-6 + 1.0
        elif k == 7:  # range below 2^-100: sent as a constant row
            x[n] = x[n] * 1e-33
        elif k == 8:  # normal range, but x - min and t go subnormal for some columns
            x[n] = x[n].abs() * 1e-29
            x[n, ::3] = x[n, ::3] * 1e-11
    return x


# --------------------------------------------------------------------------- the spec, by hand
def _lowbias32_py(h: int) -> int:
    h &= 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x7FEB352D) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x846CA68B) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def test_hash_matches_plain_python():
    vals = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF]
    got = R.lowbias32(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [_lowbias32_py(v) for v in vals]
    # counters: ((row0 + n) * D + d + key) mod 2^32, top 24 bits of the hash
    r = R.random_bits(key=0xFFFFFFF0, rows=2, dim=3, row0=7)
    want = [[_lowbias32_py(((7 + n) * 3 + d + 0xFFFFFFF0) & 0xFFFFFFFF) >> 8 for d in range(3)]
            for n in range(2)]
    assert r.tolist() == want


def test_hand_worked_rows():
    # [0, 1, 2, 3] at 2 bits: scale 1, every t is an integer, no randomness involved
    p, m = R.quantize_reference(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), 2, key=99)
    assert m.tolist() == [[1.0, 0.0]]
    assert p.tolist() == [[0 | 1 << 2 | 2 << 4 | 3 << 6]]  # one byte, slots 0..3
    # [0, 0.5] at 8 bits: inv = fl(1/0.5) * 255 = 510, levels 0 and 255
    p, m = R.quantize_reference(torch.tensor([[0.0, 0.5]]), 8, key=1)
    assert p.tolist() == [[0, 255]]
    assert m[0, 0].item() == np.float32(0.5) / np.float32(255)
    # D = 5 at 4 bits: B = 3 bytes; byte j holds columns j and j + 3; column 5 is padding
    x = torch.tensor([[0.0, 15.0, 30.0, 45.0, 60.0]])  # scale 4, t = 0, 3.75, 7.5, 11.25, 15
    q = R.levels_reference(x, 4, *R.row_scale(x, 4), r_ND=torch.zeros(1, 5, dtype=torch.int64))
    assert q.tolist() == [[0, 4, 8, 12, 15]]  # r = 0 < frac * 2^24 rounds every fraction up
    p = R.pack_levels(q, 4)
    assert p.tolist() == [[0 | 12 << 4, 4 | 15 << 4, 8]]
    assert R.unpack_levels(p, 4, 5).tolist() == q.tolist()


def test_rounding_probability_is_exact_in_the_random_integer():
    # 2 bits, range 1: inv = 3 exactly and t = 0.75 for x = 0.25; up iff r < 0.75 * 2^24
    xs = torch.tensor([[0.0, 1.0, 0.25]]).repeat(2, 1)
    r = torch.tensor([[0, 0, 12582911], [0, 0, 12582912]], dtype=torch.int64)
    q = R.levels_reference(xs, 2, *R.row_scale(xs, 2), r_ND=r)
    assert q[:, 2].tolist() == [1, 0]


# --------------------------------------------------------------------------- sizes, wire format
@settings(max_examples=40, deadline=None)
@given(N=st.integers(0, 9), D=st.integers(1, 70), bits=st.sampled_from(WIDTHS),
       seed=st.integers(0, 2**32 - 1))
def test_sizes_and_metadata_round_trip(N, D, bits, seed):
    x = _rows(seed % 1000, N, D)
    q = Q.quantize(x, bits, seed=seed)
    B = math.ceil(D * bits / 8)
    assert tuple(q.payload.shape) == (N, B) and tuple(q.meta.shape) == (N, 2)
    assert q.nbytes == N * (B + Q.META_BYTES) == message_bytes(N, D, bits)
    wire = q.to_bytes()
    assert wire.numel() == q.nbytes
    # read back from an unaligned position, as from a segment of a received buffer
    big = torch.zeros(wire.numel() + 3, dtype=torch.uint8)
    big[3:] = wire
    back = QuantizedRows.from_bytes(big[3:], N, D, bits)
    assert torch.equal(back.payload, q.payload) and torch.equal(back.meta, q.meta)
    assert torch.equal(Q.dequantize(back), Q.dequantize(q))
    assert back.scale.tolist() == q.meta[:, 0].tolist()
    assert back.zero_point.tolist() == x.amin(dim=1).tolist() if N else True


def test_meta_bytes_layout_is_float32_scale_then_min():
    x = torch.tensor([[1.0, 4.0, -2.0]])
    q = Q.quantize(x, 2, seed=0)
    wire = q.to_bytes()
    scale, lo = np.frombuffer(wire[:8].numpy().tobytes(), dtype="<f4")
    assert scale == np.float32(6.0) / np.float32(3.0) and lo == -2.0
    assert Q.META_BYTES == 8


# --------------------------------------------------------------------------- fast path == reference
@settings(max_examples=40, deadline=None)
@given(N=st.integers(0, 12), D=st.integers(1, 300), bits=st.sampled_from(WIDTHS),
       key=st.integers(0, 2**32 - 1), row0=st.integers(0, 10**6), seed=st.integers(0, 999))
def test_eager_fast_path_equals_reference_bit_for_bit(N, D, bits, key, row0, seed):
    x = _rows(seed, N, D)
    p_ref, m_ref = R.quantize_reference(x, bits, key, row0=row0)
    p, m = F.quantize_cpu(x, bits, key, row0, compile=False)
    assert torch.equal(p, p_ref) and torch.equal(m, m_ref)
    y_ref = R.dequantize_reference(p_ref, m_ref, bits, D)
    assert torch.equal(F.dequantize_cpu(p_ref, m_ref, bits, D, compile=False), y_ref)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [2, 8])
def test_compiled_fast_path_equals_reference_bit_for_bit(bits):
    """The torch.compile'd kernels (dynamic N, any storage offset) against the reference."""
    D = 127
    x = _rows(bits, 300, D)
    for N, row0, off in [(300, 0, 0), (77, 5000, 3), (2, 2**31, 1)]:
        key = 0xFFFFFF00 + N
        p_ref, m_ref = R.quantize_reference(x[:N], bits, key, row0=row0)
        B = p_ref.shape[1]
        buf = torch.zeros(off + N * B, dtype=torch.uint8)
        out = buf[off:].view(N, B)
        _, m = F.quantize_cpu(x[:N], bits, key, row0, out_NB=out, compile=True)
        assert torch.equal(out, p_ref) and torch.equal(m, m_ref), (N, row0)
        y = F.dequantize_cpu(out, m_ref, bits, D, compile=True)
        y_ref = R.dequantize_reference(p_ref, m_ref, bits, D)
        assert torch.equal(y, y_ref)
        dest = torch.full((N + 5, D), 7.0)  # decode into rows of a bigger matrix
        F.dequantize_cpu(out, m_ref, bits, D, out_ND=dest[2:2 + N], compile=True)
        assert torch.equal(dest[2:2 + N], y_ref)
        assert (dest[:2] == 7).all() and (dest[2 + N:] == 7).all()
    # the clamp (see test_no_level_spills_into_its_neighbour): key 0 makes element (0, 0) round up
    L = (1 << bits) - 1
    xs = torch.zeros(2, D)
    xs[:, 0] = float(_over_ranges(bits, 1)[0])
    p, m = F.quantize_cpu(xs, bits, 0, 0, compile=True)
    assert R.unpack_levels(p, bits, D)[0].tolist() == [L] + [0] * (D - 1)


def test_compile_failure_falls_back_to_the_eager_twin(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    fn = F._LazyCompiled(F.quantize_fused, "quantize_fused_test", (4,), (0, 4))
    x = _rows(3, 5, 33)
    out = torch.empty(5, 17, dtype=torch.uint8)
    args = (x, torch.tensor(7), torch.tensor(0), torch.arange(17, dtype=torch.int32), out)
    with pytest.warns(RuntimeWarning, match="eager twin"):
        meta = fn(*args)
    p_ref, m_ref = R.quantize_reference(x, 4, 7)
    assert torch.equal(out, p_ref) and torch.equal(meta, m_ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, then silent
        fn(*args)


def test_public_api_compiles_only_large_messages(monkeypatch):
    """Without the native kernel (no C compiler), torch.compile only for large messages."""
    monkeypatch.setattr(F, "native_library", lambda: None)
    monkeypatch.setattr(F, "_compiled", lambda *a: pytest.fail("compiled a small message"))
    x = torch.randn(10, 16)
    q = Q.quantize(x, 4, seed=1)
    y = Q.dequantize(q)
    calls = []

    def spy(kind, bits, dim):  # stands in for the compiled function: the eager twin
        fn = F.quantize_fused if kind == "quantize" else F.dequantize_fused
        static = (bits,) if kind == "quantize" else (bits, dim)
        return lambda *args, say=None: calls.append((kind, bits, dim)) or fn(*args, *static)

    monkeypatch.setattr(F, "_compiled", spy)
    monkeypatch.setattr(F, "CPU_COMPILE_MIN_ELEMENTS", 100)
    assert torch.equal(Q.dequantize(Q.quantize(x, 4, seed=1)), y)
    assert calls == [("quantize", 4, 16), ("dequantize", 4, 16)]


# --------------------------------------------------------------------------- the maths
def _stat_rows(seed: int) -> torch.Tensor:
    """[8, 48] rows whose quantization steps are far above float32 resolution."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 48, generator=g)
    x = x * torch.tensor([1.0, 1e-20, 1e-3, 1.0, 1e3, 1e30, 1.0, 0.0])[:, None]
    x[3] += 10.0  # an offset row
    x[6] = x[6].abs() ** 3  # a skewed row
    x[7] = -2.5  # a constant row
    return x


def _theory(x_ND: torch.Tensor, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per element (exact level fraction f, scale S) in float64 from the float32 metadata."""
    scale, lo, inv = R.row_scale(x_ND, bits)
    t = ((x_ND - lo[:, None]) * inv[:, None]).double().numpy()
    f = t - np.floor(t)
    return f, np.broadcast_to(scale.double().numpy()[:, None], f.shape)


def _round_trips(x_ND: torch.Tensor, bits: int, copies: int, calls: int) -> torch.Tensor:
    """[calls * copies, N, D]: independent round trips (distinct counters and keys)."""
    N, D = x_ND.shape
    outs = []
    for c in range(calls):
        q = Q.quantize(x_ND.repeat(copies, 1), bits, seed=1000 + c, impl="eager")
        outs.append(Q.dequantize(q, impl="eager").view(copies, N, D))
    return torch.cat(outs).double()


@pytest.mark.parametrize("bits", WIDTHS)
def test_unbiased_within_clt_bound(bits):
    x = _stat_rows(11)
    M = 3000
    y = _round_trips(x, bits, copies=1000, calls=3)
    mean = y.mean(0).numpy()
    f, S = _theory(x, bits)
    sd = S * np.sqrt(f * (1 - f) / M)  # exact std of the mean of M round trips
    xd = x.double().numpy()
    lo, hi = xd.min(1, keepdims=True), xd.max(1, keepdims=True)
    # float32 rounding: a few ulps of t (relative to the row range) and of the decode
    tol = 4e-7 * (hi - lo) + 1.5e-7 * (np.abs(xd) + np.abs(lo))
    err = mean - x.double().numpy()
    assert np.all(np.abs(err) <= 5 * sd + tol), np.max(np.abs(err) / (5 * sd + tol))
    # the sum of standardized errors over the random elements ~ N(0, 1): catches small biases
    live = sd > 20 * tol
    assert live.sum() > 200
    z = (err[live] / sd[live]).sum() / np.sqrt(live.sum())
    assert abs(z) < 5, z


@pytest.mark.parametrize("bits", WIDTHS)
def test_variance_within_bound(bits):
    x = _stat_rows(12)
    D = x.shape[1]
    y = _round_trips(x, bits, copies=1000, calls=2)
    var_row = y.var(0, unbiased=True).sum(1).numpy()  # [N], summed over the row
    f, S = _theory(x, bits)
    theory = (S**2 * f * (1 - f)).sum(1)
    bound = D * S[:, 0] ** 2 / 4
    assert np.all(var_row <= bound)
    # and it is the variance the maths predicts, within sampling error, row by row
    assert np.all(np.abs(var_row - theory) <= 0.15 * theory + 1e-12 * bound), (var_row, theory)


def test_float32_metadata_keeps_unbiasedness_where_bfloat16_breaks_it():
    """AdaQP kept scale and minimum in bfloat16; rounding them biases every round trip.

    Here the same levels are decoded with float32 metadata (the wire format) and with the
    metadata rounded to bfloat16: the first passes the CLT test, the second fails it badly.
    """
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 32, generator=g) + 1000.3  # offset rows: the minimum needs precision
    bits, copies = 4, 2000
    q = Q.quantize(x.repeat(copies, 1), bits, seed=3, impl="eager")
    levels = R.unpack_levels(q.payload, bits, 32).double()
    meta32 = q.meta.double()
    meta16 = q.meta.to(torch.bfloat16).double()
    f, S = _theory(x, bits)
    sd = S * np.sqrt(f * (1 - f) / copies)
    live = sd > 0
    zs = {}
    for name, meta in (("float32", meta32), ("bfloat16", meta16)):
        y = (meta[:, 1:2] + meta[:, 0:1] * levels).view(copies, 16, 32)
        err = (y.mean(0).numpy() - x.double().numpy())[live]
        zs[name] = abs((err / sd[live]).sum() / np.sqrt(live.sum()))
    assert zs["float32"] < 5 and zs["bfloat16"] > 100, zs


# --------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("bits", WIDTHS)
def test_constant_rows_round_trip_exactly(bits):
    x = torch.tensor([[0.0] * 5, [-3.25] * 5, [1e30] * 5, [-1e-30] * 5, [7.0] * 5])
    assert torch.equal(Q.dequantize(Q.quantize(x, bits, seed=1)), x)
    # values closer than 2^-100 are sent as a constant row: they decode to the row minimum
    tiny = torch.tensor([[0.0, 1e-31, 5e-32]])
    y = Q.dequantize(Q.quantize(tiny, bits, seed=1))
    assert torch.equal(y, torch.zeros_like(tiny))


def test_empty_and_single_column():
    for bits in WIDTHS:
        q = Q.quantize(torch.empty(0, 7), bits, seed=0)
        assert q.nbytes == 0 and tuple(Q.dequantize(q).shape) == (0, 7)
        x = torch.randn(6, 1)
        q = Q.quantize(x, bits, seed=0)
        assert q.payload.shape == (6, 1) and q.nbytes == 6 * 9
        assert torch.equal(Q.dequantize(q), x)  # a one-value row is constant


def test_other_float_dtypes_and_strides():
    x = torch.randn(5, 40, dtype=torch.float64)
    q64 = Q.quantize(x, 4, seed=2)
    q32 = Q.quantize(x.float(), 4, seed=2)
    assert torch.equal(q64.payload, q32.payload)
    xt = torch.randn(40, 5).t()  # non-contiguous
    assert torch.equal(Q.quantize(xt, 8, seed=1).payload, Q.quantize(xt.contiguous(), 8, seed=1).payload)
    assert Q.dequantize(Q.quantize(x.half(), 2, seed=1)).dtype == torch.float32
    q = Q.quantize(x, 4, seed=2)
    dest = torch.zeros(7, 40)
    assert Q.dequantize(q, out=dest[1:6]) is not None
    assert torch.equal(dest[1:6], Q.dequantize(q)) and dest[0].abs().sum() == 0
    with pytest.raises(ValueError, match="out must be"):
        Q.dequantize(q, out=torch.zeros(5, 40, dtype=torch.float64))


def _over_ranges(bits: int, n: int = 8) -> np.ndarray:
    """Row ranges r for which t = fl(r * fl(fl(1/r) * L)) exceeds L (float32)."""
    L = (1 << bits) - 1
    cand = np.random.default_rng(bits).uniform(0.5, 2.0, 20000).astype(np.float32)
    inv = (np.float32(1) / cand) * np.float32(L)
    over = cand[(cand * inv) > L]  # float32 products
    assert len(over) >= n  # the case is real
    return over[:n]


@pytest.mark.parametrize("impl", ["reference", "eager"])
@pytest.mark.parametrize("bits", WIDTHS)
def test_no_level_spills_into_its_neighbour(bits, impl):
    """The row maximum can land just above level L; with key 0 the random integer of element
    (0, 0) is lowbias32(0) >> 8 = 0, so it always rounds up, to L + 1 without the clamp, whose
    top bit would land in the next column's slot (or wrap to 0 at 8 bits)."""
    L, K = (1 << bits) - 1, 8 // bits
    D = 2 * K  # B = 2 bytes: column 0 in slot 0 of byte 0, column 2 in slot 1 of byte 0
    for r in _over_ranges(bits):
        x = torch.zeros(1, D)
        x[:, 0] = float(r)  # the maximum, in slot 0 of byte 0
        q = Q.quantize(x, bits, seed=0, impl=impl)
        levels = R.unpack_levels(q.payload, bits, D)
        assert levels[0].tolist() == [L] + [0] * (D - 1)
        assert torch.equal(Q.dequantize(q, impl=impl)[:, 1:], x[:, 1:])


def test_generator_and_seed():
    x = torch.randn(20, 30)
    a = Q.quantize(x, 2, generator=torch.Generator().manual_seed(4))
    b = Q.quantize(x, 2, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.payload, b.payload)
    g = torch.Generator().manual_seed(4)
    c, d = Q.quantize(x, 2, generator=g), Q.quantize(x, 2, generator=g)
    assert not torch.equal(c.payload, d.payload)  # the generator advances
    torch.manual_seed(9)
    e = Q.quantize(x, 2)
    torch.manual_seed(9)
    assert torch.equal(e.payload, Q.quantize(x, 2).payload)
    assert torch.equal(Q.quantize(x, 2, seed=5).payload,
                       R.quantize_reference(x, 2, R.key_from_seed(5))[0])


def _round_up_decisions(key: int | None = None, seed: int | None = None) -> torch.Tensor:
    """Rounding decisions (1 = up) of 64 x 256 values sitting exactly half-way between two
    2-bit levels (row [0, 3, 1.5, 1.5, ...]: t = 1.5), flattened in counter order."""
    x = torch.full((64, 256), 1.5)
    x[:, 0], x[:, 1] = 0.0, 3.0
    if seed is not None:
        q = Q.quantize(x, 2, seed=seed, impl="reference")
        levels = R.unpack_levels(q.payload, 2, 256)
    else:
        levels = R.unpack_levels(R.quantize_reference(x, 2, key)[0], 2, 256)
    return (levels[:, 2:] - 1).flatten().double()


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


def test_consecutive_seeds_give_uncorrelated_rounding():
    """The seed is hashed into the key (reference.key_from_seed): were it the key, seed k+1's
    stream would be seed k's shifted by one element (correlation 1 at lag 1)."""
    for k in (0, 1, 7, 1000, 2**32 - 2):
        a, b = _round_up_decisions(seed=k), _round_up_decisions(seed=k + 1)
        assert 0.4 < float(a.mean()) < 0.6
        for lag in (0, 1):  # element-wise, and aligned as an unhashed key would shift them
            assert abs(_corr(a[lag:], b[:b.numel() - lag])) < 0.05, (k, lag)
    # what hashing prevents: consecutive raw keys are one stream shifted by one element
    raw_a, raw_b = _round_up_decisions(key=7), _round_up_decisions(key=8)
    row = 254  # decisions of one row are contiguous counters
    assert torch.equal(raw_a[1:row], raw_b[:row - 1])
    assert len({R.key_from_seed(s) for s in range(4096)}) == 4096
    assert R.key_from_seed(5) == R.key_from_seed(5 + 2**32)  # seeds count mod 2^32, as before


# --------------------------------------------------------------------------- multi-width groups
@settings(max_examples=30, deadline=None)
@given(counts=st.lists(st.integers(0, 9), min_size=1, max_size=6),
       D=st.integers(1, 90), data=st.data())
def test_pack_unpack_groups_round_trip(counts, D, data):
    bits = [data.draw(st.sampled_from(WIDTHS)) for _ in counts]
    seed = data.draw(st.integers(0, 2**32 - 1))
    layout = GroupLayout(D, tuple(counts), tuple(bits))
    R_ = sum(counts)
    x = _rows(seed % 997, R_, D)
    buf = pack_groups(x, layout, seed=seed)
    assert buf.numel() == layout.nbytes == sum(message_bytes(c, D, b) for c, b in zip(counts, bits))
    # each group's bytes are that group's message, quantized with the message key at its rows
    for g, (c, b) in enumerate(zip(counts, bits)):
        r0, b0 = layout.row_offsets[g], layout.byte_offsets[g]
        assert layout.group_nbytes(g) == message_bytes(c, D, b)
        p, m = R.quantize_reference(x[r0:r0 + c], b, R.key_from_seed(seed), row0=r0)
        want = QuantizedRows(p, m, b, D).to_bytes()
        assert torch.equal(buf[b0:b0 + layout.group_nbytes(g)], want)
    # the receiver decodes from an unaligned slice of a bigger buffer
    off = data.draw(st.integers(0, 7))
    recv = torch.zeros(off + buf.numel() + 5, dtype=torch.uint8)
    recv[off:off + buf.numel()] = buf
    y = unpack_groups(recv[off:off + buf.numel()], layout)
    assert y.shape == (R_, D)
    dest = torch.full((R_ + 3, D), -1.0)
    rows = dest[1:1 + R_]
    assert unpack_groups(buf, layout, out=rows) is rows
    assert torch.equal(dest[1:1 + R_], y) and (dest[0] == -1).all() and (dest[1 + R_:] == -1).all()
    parts = [R.dequantize_reference(*R.quantize_reference(x[layout.row_offsets[g]:layout.row_offsets[g + 1]],
                                                          b, R.key_from_seed(seed), row0=layout.row_offsets[g]),
                                    b, D)
             for g, b in enumerate(bits)]
    assert torch.equal(y, torch.cat(parts))


def test_single_group_pack_equals_single_width_message():
    x = torch.randn(33, 50)
    buf = pack_groups(x, GroupLayout(50, (33,), (4,)), seed=8)
    assert torch.equal(buf, Q.quantize(x, 4, seed=8).to_bytes())
    out = torch.empty(buf.numel(), dtype=torch.uint8)
    assert pack_groups(x, GroupLayout(50, (33,), (4,)), seed=8, out=out) is out
    assert torch.equal(out, buf)
    assert unpack_groups(torch.empty(0, dtype=torch.uint8), GroupLayout(50, (0, 0), (2, 8))).shape == (0, 50)


def test_layout_spans_skip_empty_groups():
    # (rows, bits, first row, first byte, payload bytes of a row): 10 values at 2 bits = 3 bytes
    assert list(GroupLayout(10, (2, 0, 3), (2, 4, 8)).spans()) == [(2, 2, 0, 0, 3), (3, 8, 2, 22, 10)]


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("bits", [0, 1, 3, 16, 4.0, True, "4", None])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits must be one of"):
        Q.quantize(torch.randn(2, 3), bits)


@pytest.mark.parametrize("x, msg", [
    (torch.randint(0, 5, (3, 4)), "floating-point"),
    (torch.randn(3, 4, dtype=torch.complex64), "floating-point"),
    (torch.randn(5), "2-D"),
    (torch.randn(2, 3, 4), "2-D"),
    (torch.randn(3, 0), "no columns"),
])
def test_bad_input(x, msg):
    with pytest.raises(ValueError, match=msg):
        Q.quantize(x, 4)
    with pytest.raises(TypeError):
        Q.quantize([[1.0]], 4)


def test_non_finite_input_names_how_many_and_where():
    x = torch.zeros(5, 6)
    x[1, 2] = float("nan")
    x[3, 0] = float("inf")
    x[3, 5] = -float("inf")
    with pytest.raises(ValueError, match=re.escape("3 non-finite values (1 NaN, 2 inf) in 2 of 5 rows")) as e:
        Q.quantize(x, 2)
    assert "(1, 2), (3, 0), (3, 5)" in str(e.value)
    # a multi-width message reports on the whole of x
    with pytest.raises(ValueError, match=re.escape("(1, 2), (3, 0), (3, 5)")):
        pack_groups(x, GroupLayout(6, (2, 3), (8, 2)))
    with pytest.raises(ValueError, match="1 row spans more than the float32 range"):
        Q.quantize(torch.tensor([[3e38, -3e38, 0.0]]), 8)


def test_bad_arguments():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="either generator or seed"):
        Q.quantize(x, 2, seed=1, generator=torch.Generator())
    with pytest.raises(TypeError):
        Q.quantize(x, 2, seed=1.5)
    with pytest.raises(ValueError, match="impl"):
        Q.quantize(x, 2, impl="fastest")
    with pytest.raises(TypeError):
        Q.dequantize(x)
    with pytest.raises(ValueError, match="counts has 2 groups but bits has 1"):
        GroupLayout(3, (1, 2), (4,))
    with pytest.raises(ValueError, match="counts"):
        GroupLayout(3, (-1,), (4,))
    with pytest.raises(ValueError, match="bits"):
        GroupLayout(3, (1,), (5,))
    with pytest.raises(ValueError, match="dim"):
        GroupLayout(0, (1,), (4,))
    layout = GroupLayout(3, (1, 2), (4, 8))
    with pytest.raises(ValueError, match=re.escape("layout describes [3, 3]")):
        pack_groups(torch.randn(4, 3), layout)
    assert layout.nbytes == 1 * (2 + 8) + 2 * (3 + 8)
    with pytest.raises(ValueError, match="needs 32"):
        unpack_groups(torch.zeros(30, dtype=torch.uint8), layout)
    with pytest.raises(ValueError, match="1-D uint8"):
        unpack_groups(torch.zeros(32), layout)
    with pytest.raises(ValueError, match=re.escape("out must be a float32 [3, 3]")):
        unpack_groups(torch.zeros(32, dtype=torch.uint8), layout, out=torch.zeros(3, 4))
    with pytest.raises(ValueError, match="payload must be uint8"):
        QuantizedRows(torch.zeros(2, 3, dtype=torch.uint8), torch.zeros(2, 2), 4, 3)
    with pytest.raises(ValueError, match="meta must be float32"):
        QuantizedRows(torch.zeros(2, 2, dtype=torch.uint8), torch.zeros(2, 3), 4, 3)
    with pytest.raises(ValueError, match="need 20"):
        QuantizedRows.from_bytes(torch.zeros(17, dtype=torch.uint8), 2, 3, 4)
