"""The native CPU codec (kernels/quant_cpu.c through commsched.kernels.cpu): the spec bit
for bit at irregular shapes and strides, non-finite input caught, built once per machine
(a file lock between processes, a cache keyed by source and compiler), and a clean fall
back when no compiler is there."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from commsched.kernels import cpu as C
from hypothesis import given, settings
from hypothesis import strategies as st

import commsched.quant as Q
from commsched.quant import fast as F
from commsched.quant import reference as R
from tests.quant.test_codec import _rows

LIB = F.native_library()
needs_native = pytest.mark.skipif(LIB is None, reason=f"no native codec: {C.status() and C.status().describe()}")


@needs_native
@settings(max_examples=60, deadline=None)
@given(N=st.integers(0, 12), D=st.integers(1, 300), bits=st.sampled_from((2, 4, 8)),
       key=st.integers(0, 2**32 - 1), row0=st.integers(0, 2**33), seed=st.integers(0, 999))
def test_native_equals_reference_bit_for_bit(N, D, bits, key, row0, seed):
    x = _rows(seed, N, D)
    p_ref, m_ref = R.quantize_reference(x, bits, key, row0=row0)
    p, m = F.quantize_cpu(x, bits, key, row0, native=True)
    assert torch.equal(p, p_ref) and torch.equal(m, m_ref)
    y_ref = R.dequantize_reference(p_ref, m_ref, bits, D)
    assert torch.equal(F.dequantize_cpu(p_ref, m_ref, bits, D, native=True), y_ref)


@needs_native
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_native_wide_rows_and_strided_views(bits):
    """Rows long enough for every vector loop and its tail, payload into an unaligned slice
    of a buffer, decoding into rows of a bigger matrix (row stride > D)."""
    D, N = 1037, 41
    x_big = _rows(bits, N, D + 9)
    x = x_big[:, 3:3 + D]  # row stride D + 9
    key, row0 = 0xFFFFFFF0, 2**31 - 5
    p_ref, m_ref = R.quantize_reference(x.contiguous(), bits, key, row0=row0)
    B = p_ref.shape[1]
    buf = torch.zeros(1 + N * (B + 2), dtype=torch.uint8)
    out = buf[1:].view(N, B + 2)[:, 1:1 + B]  # row stride B + 2, odd offset
    _, m = F.quantize_cpu(x, bits, key, row0, out_NB=out, native=True)
    assert torch.equal(out, p_ref) and torch.equal(m, m_ref)
    assert int(buf[0]) == 0 and bool((buf[1:].view(N, B + 2)[:, 0] == 0).all())
    dest = torch.full((N + 4, D + 3), 7.0)
    F.dequantize_cpu(out, m_ref, bits, D, out_ND=dest[2:2 + N, :D], native=True)
    assert torch.equal(dest[2:2 + N, :D], R.dequantize_reference(p_ref, m_ref, bits, D))
    assert bool((dest[:2] == 7).all()) and bool((dest[2 + N:] == 7).all())
    assert bool((dest[:, D:] == 7).all())


@needs_native
def test_native_clamp_keeps_levels_in_their_slot():
    for bits in (2, 4, 8):
        L, D = (1 << bits) - 1, 37
        from tests.quant.test_codec import _over_ranges

        xs = torch.zeros(2, D)
        xs[:, 0] = float(_over_ranges(bits, 1)[0])
        p, _ = F.quantize_cpu(xs, bits, 0, 0, native=True)
        assert R.unpack_levels(p, bits, D)[0].tolist() == [L] + [0] * (D - 1)


@needs_native
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_native_public_api_refuses_non_finite_input(bad):
    x = torch.randn(50, 40)
    x[17, 23] = bad
    with pytest.raises(ValueError, match="non-finite"):
        Q.quantize(x, 4, seed=0, impl="native")
    x = torch.randn(5, 8)
    x[2, 0], x[2, 1] = -3e38, 3e38  # max - min overflows float32
    with pytest.raises(ValueError, match="float32"):
        Q.quantize(x, 8, seed=0, impl="native")


@needs_native
def test_public_api_runs_native_by_default(monkeypatch):
    """auto on the CPU is the native kernel at every size; no torch.compile happens."""
    monkeypatch.setattr(F, "_compiled", lambda *a: pytest.fail("torch.compile was used"))
    x = _rows(5, 2000, 600)
    q = Q.quantize(x, 2, seed=9)
    p_ref, m_ref = R.quantize_reference(x, 2, R.key_from_seed(9))
    assert torch.equal(q.payload, p_ref) and torch.equal(q.meta, m_ref)
    assert torch.equal(Q.dequantize(q), R.dequantize_reference(p_ref, m_ref, 2, 600))
    layout = Q.GroupLayout(600, (700, 0, 1300), (8, 2, 4))
    buf = Q.pack_groups(x, layout, seed=4)
    assert torch.equal(buf, Q.pack_groups(x, layout, seed=4, impl="reference"))
    assert torch.equal(Q.unpack_groups(buf, layout), Q.unpack_groups(buf, layout, impl="reference"))


def test_empty_rows_is_an_ordinary_tensor():
    t = C.empty_rows((3000, 1000), torch.float32)  # 12 MB: huge-page advice
    assert t.shape == (3000, 1000) and t.dtype == torch.float32 and t.is_contiguous()
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * 3e6
    assert C.empty_rows((0, 7), torch.uint8).shape == (0, 7)


def _in_child(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _env(tmp_path, **extra) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("CC", "COMMSCHED_COMPILE")}
    env.update(COMMSCHED_CACHE_DIR=str(tmp_path / "cache"), **extra)
    return env


STATUS = """
    import torch
    from commsched.quant import fast as F
    from commsched.kernels import cpu as C
    ok = F.warm_native(say=print)
    x = torch.randn(30, 70)
    q = __import__("commsched.quant", fromlist=["x"]).quantize(x, 4, seed=1)
    print("STATE", C.status().state, ok)
"""


@pytest.mark.slow
@needs_native
def test_built_once_per_machine_then_loaded(tmp_path):
    """Three processes start together on an empty cache: one builds, the others wait on the
    lock and load its library; a later process loads it too."""
    env = _env(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(STATUS)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    states = sorted(line.split()[1] for o in outs for line in o.splitlines() if line.startswith("STATE"))
    assert states == ["built", "loaded", "loaded"], outs
    assert any("built the native CPU codec kernel" in o for o in outs)
    assert len(list((tmp_path / "cache").glob("quant_cpu-*.so"))) == 1
    r = _in_child(STATUS, env)
    assert "STATE loaded True" in r.stdout and "loaded from the cache" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_no_compiler_falls_back_and_says_why(tmp_path):
    r = _in_child(STATUS, _env(tmp_path, CC="/nonexistent/cc"))
    assert r.returncode == 0, r.stderr
    assert "STATE failed False" in r.stdout
    assert "not used: no C compiler found" in r.stdout
    r = _in_child(STATUS, _env(tmp_path, COMMSCHED_COMPILE="0"))
    assert "STATE off False" in r.stdout and "COMMSCHED_COMPILE=0" in r.stdout, r.stdout


@pytest.mark.slow
def test_broken_build_falls_back(tmp_path):
    """A compiler that fails: the reason (its last line) is said, the codec still works."""
    cc = tmp_path / "badcc"
    cc.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo badcc 1; exit 0; fi\n"
                  "echo 'fatal: out of luck' >&2; exit 3\n")
    cc.chmod(0o755)
    r = _in_child(STATUS, _env(tmp_path, CC=str(cc)))
    assert r.returncode == 0, r.stderr
    assert "STATE failed False" in r.stdout and "out of luck" in r.stdout, r.stdout
    assert not list((tmp_path / "cache").glob("quant_cpu-*.so"))


def test_native_impl_refused_when_unavailable(monkeypatch):
    monkeypatch.setattr(F, "native_library", lambda: None)
    monkeypatch.setattr(C, "_status", C.NativeStatus("failed", reason="no C compiler found"))
    with pytest.raises(ValueError, match="impl='native'.*no C compiler"):
        Q.quantize(torch.randn(4, 4), 2, seed=0, impl="native")


def test_torch_compile_lock_serialises_the_processes_of_a_machine(tmp_path, monkeypatch):
    """warm_codec's torch.compile path holds one file lock per machine: a second holder
    (another open of the same lock file, as another rank's) waits for the first."""
    import threading

    monkeypatch.setenv("COMMSCHED_CACHE_DIR", str(tmp_path))
    order: list[str] = []
    inside = threading.Event()

    def second():
        inside.wait(30)
        with F._machine_lock("torch_compile"):
            order.append("second")

    t = threading.Thread(target=second)
    t.start()
    with F._machine_lock("torch_compile"):
        inside.set()
        t.join(0.3)  # the other holder is blocked on the lock meanwhile
        order.append("first")
    t.join(30)
    assert order == ["first", "second"]
    assert (tmp_path / "torch_compile.lock").exists()
