"""Triton kernels of the codec under TRITON_INTERPRET=1, bit for bit against the reference.

Legend: N rows, D features, b bits.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import warnings

import numpy as np
import pytest
import torch

from commsched.quant import reference as R
from commsched.quant.codec import GroupLayout, pack_groups, quantize, unpack_groups

WIDTHS = R.BITS
_MODULE = "commsched.kernels.quant"


@contextlib.contextmanager
def _fresh_kernels(interpret: bool):
    """The kernels module imported anew with ``TRITON_INTERPRET`` set or unset (chosen when
    the kernels are decorated, i.e. at import), forgotten afterwards with the environment
    restored."""
    before = os.environ.pop("TRITON_INTERPRET", None)
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.modules.pop(_MODULE, None)
    try:
        yield importlib.import_module(_MODULE)
    finally:
        sys.modules.pop(_MODULE, None)
        os.environ.pop("TRITON_INTERPRET", None)
        if before is not None:
            os.environ["TRITON_INTERPRET"] = before


@pytest.fixture(scope="module")
def K():
    """The kernels module under the interpreter."""
    with _fresh_kernels(interpret=True) as mod:
        assert type(mod.quantize_pack_kernel).__name__ == "InterpretedFunction"
        yield mod


def _cases():
    g = torch.Generator().manual_seed(0)
    yield "N=1,D=1", torch.randn(1, 1, generator=g)
    yield "D=127", torch.randn(3, 127, generator=g)
    yield "D=1000", torch.randn(2, 1000, generator=g) * 3 - 1
    x = torch.randn(6, 33, generator=g)
    x[1] = 0.0  # a row of zeros
    x[2] = -7.5  # a constant row
    x[3] *= 1e37  # huge values (range below float32 max)
    x[4] = x[4] * 1e-30  # a range below 2^-100: sent as constant
    x[5] = x[5] * 1e-28  # small range, subnormal differences
    yield "zeros,constant,huge,tiny", x
    x = torch.full((2, 9), 1.5e38)
    x[:, ::2] = -1.5e38  # a range of 3e38, just inside float32
    yield "huge range", x
    yield "N=0", torch.empty(0, 20)


@pytest.mark.parametrize("bits", WIDTHS)
def test_kernels_equal_reference_bit_for_bit(K, bits):
    with np.errstate(all="ignore"):
        for i, (name, x) in enumerate(_cases()):
            key, row0 = 0xFFFF0000 + 977 * i, 3 * i
            p_ref, m_ref = R.quantize_reference(x, bits, key, row0=row0)
            p, m = K.quantize_pack(x, bits, key, row0)
            assert torch.equal(p, p_ref), name
            assert torch.equal(m, m_ref), name
            y_ref = R.dequantize_reference(p_ref, m_ref, bits, x.shape[1])
            assert torch.equal(K.unpack_dequantize(p_ref, m_ref, bits, x.shape[1]), y_ref), name


@pytest.mark.parametrize("bits", WIDTHS)
def test_kernel_clamps_the_top_level(K, bits):
    """Key 0 makes element (0, 0) round up; its level must stay L (see the codec tests)."""
    L = (1 << bits) - 1
    cand = np.random.default_rng(bits).uniform(0.5, 2.0, 4000).astype(np.float32)
    over = cand[cand * ((np.float32(1) / cand) * np.float32(L)) > L][:3]
    assert len(over)
    D = 2 * (8 // bits)
    for r in over:
        x = torch.zeros(1, D)
        x[0, 0] = float(r)
        p, _ = K.quantize_pack(x, bits, 0, 0)
        assert R.unpack_levels(p, bits, D)[0].tolist() == [L] + [0] * (D - 1)


def test_kernel_flags_non_finite_rows(K):
    x = torch.randn(4, 10)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    with np.errstate(all="ignore"):
        _, m = K.quantize_pack(x, 4, 1)
    assert torch.isfinite(m[[0, 3]]).all()
    assert torch.isnan(m[1, 1]) and torch.isnan(m[2, 1])  # the zero point carries the flag


def test_kernel_writes_into_a_strided_payload_view(K):
    x = torch.randn(5, 21)
    buf = torch.zeros(3 + 5 * 11, dtype=torch.uint8)
    out = buf[3:].view(5, 11)
    p, m = K.quantize_pack(x, 4, 77, 0, out=out)
    assert p is out and torch.equal(out, R.quantize_reference(x, 4, 77)[0])
    assert (buf[:3] == 0).all()
    dest = torch.zeros(7, 30)
    y = K.unpack_dequantize(out, m, 4, 21, out=dest[1:6, 4:25])  # row stride 30
    assert torch.equal(y, R.dequantize_reference(out, m, 4, 21))
    assert dest[:, :4].abs().sum() == 0 and dest[:, 25:].abs().sum() == 0
    xs = torch.randn(6, 40)[:, :21]  # a row stride larger than D
    assert torch.equal(K.quantize_pack(xs, 2, 5)[0], R.quantize_reference(xs, 2, 5)[0])


def test_codec_dispatches_to_the_kernels(K):
    """impl="triton" through the public API (CUDA tensors take this path automatically)."""
    x = torch.randn(11, 50)
    q = quantize(x, 2, seed=9, impl="triton")
    assert torch.equal(q.payload, R.quantize_reference(x, 2, R.key_from_seed(9))[0])
    layout = GroupLayout(50, (4, 0, 7), (8, 2, 4))
    buf = pack_groups(x, layout, seed=3, impl="triton")
    assert torch.equal(buf, pack_groups(x, layout, seed=3, impl="reference"))
    assert torch.equal(unpack_groups(buf, layout, impl="triton"),
                       unpack_groups(buf, layout, impl="reference"))


def test_launcher_validation(K):
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="bits"):
        K.quantize_pack(x, 3, 0)
    with pytest.raises(ValueError, match="float32"):
        K.quantize_pack(x.double(), 2, 0)
    with pytest.raises(ValueError, match="float32"):
        K.quantize_pack(x[0], 2, 0)
    with pytest.raises(ValueError, match="at least one column"):
        K.quantize_pack(torch.empty(3, 0), 2, 0)
    with pytest.raises(ValueError, match="out must be uint8"):
        K.quantize_pack(x, 2, 0, out=torch.empty(3, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="payload must be uint8"):
        K.unpack_dequantize(torch.empty(3, 3, dtype=torch.uint8), torch.empty(3, 2), 2, 8)
    with pytest.raises(ValueError, match="meta must be float32"):
        K.unpack_dequantize(torch.empty(3, 2, dtype=torch.uint8), torch.empty(2, 2), 2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        K.unpack_dequantize(torch.empty(0, 2, dtype=torch.uint8), torch.empty(0, 2), 2, 8)


@pytest.fixture(scope="module")
def compiled_module():
    """The kernels module as a GPU build sees it (real ``@triton.jit`` functions)."""
    with _fresh_kernels(interpret=False) as mod:
        assert type(mod.quantize_pack_kernel).__name__ == "JITFunction"
        yield mod


@pytest.mark.parametrize("bits", WIDTHS)
def test_kernels_compile_to_cubin_for_sm90(compiled_module, bits):
    # the whole code generator (the interpreter skips it): TTIR -> PTX -> cubin via ptxas
    built = compiled_module.compile_for_target(bits, 37, arch=90)
    assert set(built) == {"quantize_pack_kernel", "unpack_dequantize_kernel"}
    for name, k in built.items():
        assert len(k.asm["cubin"]) > 1000, name
        ptx = k.asm["ptx"]
        assert ".target sm_90" in ptx
        assert "fma.rn.f32" not in ptx, name  # enable_fp_fusion=False: no contracted multiply-add
    # the spec's IEEE division (not the approximate default) survives code generation
    assert "div.rn.f32" in built["quantize_pack_kernel"].asm["ptx"]


def test_compile_catches_a_non_constexpr_global(compiled_module, monkeypatch):
    # what the interpreter let through before: a plain float global read inside jit code
    monkeypatch.setattr(compiled_module, "_FLT_MAX", 3.4028234663852886e38)
    with pytest.raises(Exception, match="_FLT_MAX"):
        compiled_module.compile_for_target(8, 5)


def test_row_count_is_not_specialised(compiled_module):
    """Triton specialises integer arguments on divisibility by 16 unless told not to: the row
    count varies per message, so each new N would compile another variant inside epoch 0."""
    K = compiled_module
    assert "N" in [p.name for p in K.quantize_pack_kernel.params if p.do_not_specialize]
    assert "N" in [p.name for p in K.unpack_dequantize_kernel.params if p.do_not_specialize]


def test_cpu_implementations_refuse_cuda_rows(monkeypatch):
    """impl="compiled" on CUDA rows would reach Inductor's own Triton code, not the pinned
    kernels; "native" and "eager" are CPU code: all three refuse another device."""
    from commsched.quant import codec

    for impl in ("compiled", "native", "eager"):
        with pytest.raises(ValueError, match="CPU implementation.*cuda"):
            codec._resolve(impl, torch.device("cuda", 0))
    assert codec._resolve("auto", torch.device("cuda", 0)) == "triton"
    assert codec._resolve("auto", torch.device("cpu")) == "fast"
