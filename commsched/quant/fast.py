"""CPU fast path of the codec: fused quantize+pack and unpack+dequantize under ``torch.compile``.

The two functions here compute exactly what ``commsched.quant.reference`` specifies
(the tests compare them bit for bit), written so that Inductor emits one loop nest per
row that reads the row once: the minimum and maximum, then, in the [N, B] iteration
space of the packed bytes, the counter hash (wrapping int32 arithmetic), the stochastic
rounding and the OR of the K planar slots of each byte. No random tensor and no float
levels are ever written to memory. What made the difference when this was measured
(single thread, [100000, 256], see docs/quant.md):

* random bits from a counter hash computed in the same pass, instead of ``torch.rand``;
* the column counter loaded from a small int32 ``iota`` input instead of an in-graph
  ``arange`` (which Inductor builds lane by lane in every iteration);
* the rounding as a select between f and f + 1, the level converted to int32 and clamped
  there (one integer min), slots shifted and ORed in int32 and narrowed to uint8 once:
  each of these replaced mask conversions or saturating float clamps in the vector loop;
* planar packing, so every slot is a contiguous slice and the pack is a shift and an OR;
* decoding straight into the destination rows (through an [N, K, B] view of them): the
  decode itself runs at about 4x the clone rate, and a fresh output tensor costs as much
  again in page faults as the decode, so the codec allocates the output once (and
  ``unpack_groups`` writes every group into its rows of it).

Compilation is lazy (on the first call large enough to profit), cached per process and
per (function, bits, D), each with its own code object so that their graphs do not
evict each other from Dynamo's cache; N is marked dynamic, so messages of different row
counts share one kernel. If compiling fails (no C++ compiler, unsupported platform) the
same functions run eagerly and a warning says so once.

Compiling takes seconds per kernel (a minute or more for a run's set on a fresh machine;
Inductor caches the results on disk, so later runs are faster). It never happens
silently: the first call of a kernel prints one line on stderr before it compiles and one
with the time it took after (:func:`warm_codec` compiles a whole set under a single pair
of lines). ``COMMSCHED_COMPILE=0`` (:mod:`commsched.config`; ``AdaQPConfig(compile=False)``
and ``--no-compile`` for the AdaQP exchange) runs the eager twin and never compiles:
the same bits, more time per message.

**1-bit sign rows** (:func:`sign_encode_fast`, :func:`sign_decode_fast`): the sign format
of ``commsched.quant.reference`` (items 6-9) as fused functions in the same style (one
pass per row: the float64 row sum of |m|, the signs packed with eight shifted ORs in
int32, the error-feedback residual ``m - where(m < 0, -s, s)`` taken from the signs, not
by decoding the packed bytes again; decoding through an [N, F, B] view of the output),
run eagerly on any device, or compiled on the CPU (``compile=True``; the onebit exchange
compiles them for its row widths at set-up, :func:`warm_sign_codec`). The same bytes as
the reference: the same comparisons, exact +-scale, and the row sum in float64 rounded
once to float32 (a float64 sum in another order could round differently only for a row
whose sum lies within float64 rounding of a float32 rounding boundary; the tests compare
the compiled and eager paths with the reference bit for bit).

Legend: N rows, D features, b bits, K = 8 // b slots per byte, B = ceil(D * b / 8).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
import types
import warnings
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from ..config import read_env
from .reference import HASH_M1, HASH_M2, RANDOM_BITS, RANGE_MIN, payload_bytes
from .wire import BITS

# the hash multipliers as signed int32 (two's complement), for wrapping int32 arithmetic
_M1_I32 = HASH_M1 - (1 << 32) if HASH_M1 >= 1 << 31 else HASH_M1
_M2_I32 = HASH_M2 - (1 << 32) if HASH_M2 >= 1 << 31 else HASH_M2

# Messages with fewer elements run the eager twin: compiling one (bits, D) pair costs seconds,
# which only pays off for messages this large and up (and keeps small test graphs fast).
CPU_COMPILE_MIN_ELEMENTS = 1 << 20


def _lowbias32_i32(h: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 tensors; the masks turn the arithmetic shifts into logical ones."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _M1_I32
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * _M2_I32
    h = h ^ ((h >> 16) & 0xFFFF)
    return h


def quantize_fused(x_ND: torch.Tensor, key: torch.Tensor, row0: torch.Tensor,
                   iota_B: torch.Tensor, out_NB: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize float32 [N, D] into ``out_NB`` (uint8 [N, B]); returns meta float32 [N, 2].

    ``key`` and ``row0`` are 0-d int64 tensors (the message key in [0, 2^32) and the
    counter offset in rows), ``iota_B`` is ``arange(B)`` as int32.
    """
    N, D = x_ND.shape
    levels = (1 << bits) - 1
    K, B = 8 // bits, payload_bytes(D, bits)
    lo = x_ND.amin(dim=1, keepdim=True)
    hi = x_ND.amax(dim=1, keepdim=True)
    rng = hi - lo
    big = rng >= RANGE_MIN
    zero = torch.zeros_like(rng)
    inv = torch.where(big, torch.reciprocal(rng) * levels, zero)
    x_NKB = F.pad(x_ND, (0, K * B - D)).view(N, K, B)
    # per-row counter base, truncated to 32 bits; the column is added in int32 (mod 2^32)
    base_N1 = ((torch.arange(N, dtype=torch.int64, device=x_ND.device)[:, None] + row0) * D
               + key).to(torch.int32)
    top = torch.tensor(levels, dtype=torch.int32, device=x_ND.device)
    packed = None
    for s in range(K):
        if s * B >= D:  # this slot and the ones after it hold no column of the row
            break
        col_B = iota_B + s * B
        h = _lowbias32_i32(base_N1 + col_B)
        r = ((h >> (32 - RANDOM_BITS)) & ((1 << RANDOM_BITS) - 1)).to(torch.float32)
        t = (x_NKB[:, s] - lo) * inv
        f = torch.floor(t)
        # f + up, clamped to L in int32 (t >= 0, so the conversion truncates exactly)
        q = torch.where(r < (t - f) * float(1 << RANDOM_BITS), f + 1.0, f).to(torch.int32)
        q = torch.minimum(q, top)
        if (s + 1) * B > D:
            q = torch.where(col_B < D, q, torch.zeros_like(q))
        if s:
            q = q << (s * bits)
        packed = q if packed is None else packed | q
    out_NB.copy_(packed.to(torch.uint8))
    scale = torch.where(big, rng / levels, zero)
    return torch.cat([scale, lo], dim=1)


def dequantize_fused(payload_NB: torch.Tensor, meta_N2: torch.Tensor, out_ND: torch.Tensor,
                     bits: int, dim: int) -> None:
    """Decode (payload uint8 [N, B], meta float32 [N, 2]) into ``out_ND`` (float32 [N, dim],
    unit column stride), as the reference.

    The F = dim // B full slots are written through an [N, F, B] view of the output (one
    vectorized loop over the payload bytes), the partial last slot, if any, through a slice.
    """
    N, B = payload_NB.shape
    mask = (1 << bits) - 1
    full = dim // B
    scale, lo = meta_N2[:, 0:1], meta_N2[:, 1:2]
    p = payload_NB.to(torch.int32)
    if full:
        shifts = torch.arange(full, dtype=torch.int32, device=p.device) * bits
        q = ((p.unsqueeze(1) >> shifts[None, :, None]) & mask).to(torch.float32)
        out_ND[:, :full * B].view(N, full, B).copy_(lo[:, :, None] + scale[:, :, None] * q)
    width = dim - full * B
    if width:
        q = ((p[:, :width] >> (full * bits)) & mask).to(torch.float32)
        out_ND[:, full * B:].copy_(lo + scale * q)


def say_stderr(msg: str) -> None:
    """Print one line on stderr (the default voice of the compile notices)."""
    print(msg, file=sys.stderr, flush=True)


def compile_enabled() -> bool:
    """False when ``COMMSCHED_COMPILE=0``: every codec call runs its eager twin."""
    return read_env().compile


class _LazyCompiled:
    """``torch.compile(fn)`` on first use; ``fn`` itself if compiling fails.

    ``static`` are trailing Python-int arguments fixed for this instance; the tensor
    arguments at ``dynamic_args`` get their first dimension marked dynamic (on fresh
    views, so the caller's tensors are left untouched). The first call (the one that
    compiles) says so on stderr, before and after with the seconds it took, unless it
    runs with ``say=None`` (:func:`warm_codec` speaks for a whole set).
    """

    def __init__(self, fn: Callable, name: str, static: tuple, dynamic_args: tuple[int, ...]):
        self._fn = fn
        self._name = name
        self._static = static
        self._dynamic_args = dynamic_args
        self._compiled: Callable | None = None
        self._ran = False  # the compiled function ran once (so it is compiled)
        self._failed = False
        self._lock = threading.Lock()

    @property
    def compiled(self) -> bool:
        """Whether the kernel has been compiled (a first call ran and did not fail)."""
        return self._ran and not self._failed

    def __call__(self, *args, say: Callable[[str], None] | None = say_stderr):
        if self._failed:
            return self._fn(*args, *self._static)
        args = list(args)
        if args[self._dynamic_args[0]].shape[0] > 1:  # 0 and 1 are always specialised
            for i in self._dynamic_args:
                args[i] = args[i].view(args[i].shape)
                torch._dynamo.mark_dynamic(args[i], 0)
        try:
            with self._lock:
                if self._compiled is None:
                    self._compiled = torch.compile(self._fn, dynamic=False)
                first = not self._ran
                if first:  # compile under the lock: one thread compiles, the others wait
                    if say is not None:
                        say(f"commsched.quant: compiling the {self._name} codec kernel with "
                            "torch.compile (first use in this process; slow on a fresh machine, "
                            "cached on disk afterwards; COMMSCHED_COMPILE=0 skips compiling) ...")
                    t = time.perf_counter()
                    out = self._compiled(*args, *self._static)
                    self._ran = True
                    if say is not None:
                        say(f"commsched.quant: compiled {self._name} in {time.perf_counter() - t:.1f} s")
                    return out
            return self._compiled(*args, *self._static)
        except Exception as e:  # noqa: BLE001 -- any compiler failure means: run eagerly
            self._failed = True
            first = str(e).splitlines()[0] if str(e) else ""
            warnings.warn(f"commsched.quant: torch.compile of {self._name} failed "
                          f"({type(e).__name__}: {first}); using its eager twin "
                          "(same results, slower)", RuntimeWarning, stacklevel=3)
            return self._fn(*args, *self._static)


def _own_code(fn: Callable, name: str) -> Callable:
    """A copy of ``fn`` with its own code object (Dynamo caches graphs per code object)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


@functools.cache
def _compiled(kind: str, bits: int, dim: int) -> _LazyCompiled:
    """One lazily compiled function per (kind, bits, dim), cached for the process."""
    name = f"{kind}_fused_b{bits}_d{dim}"
    if kind == "quantize":
        return _LazyCompiled(_own_code(quantize_fused, name), name, (bits,), (0, 4))
    if kind == "sign_encode":
        return _LazyCompiled(_own_code(sign_encode_fused, name), name, (), (0, 1))
    if kind == "sign_encode_ef":
        return _LazyCompiled(_own_code(sign_encode_ef_fused, name), name, (), (0, 1, 2))
    if kind == "sign_decode":
        return _LazyCompiled(_own_code(sign_decode_fused, name), name, (dim,), (0, 1, 2))
    return _LazyCompiled(_own_code(dequantize_fused, name), name, (bits, dim), (0, 1, 2))


def _use_compiled(compile: bool | None, rows: int, dim: int) -> bool:
    if compile is None:
        want = rows > 1 and rows * dim >= CPU_COMPILE_MIN_ELEMENTS
    else:
        want = bool(compile) and rows > 1
    return want and compile_enabled()  # COMMSCHED_COMPILE=0 wins over everything


@contextlib.contextmanager
def _machine_lock(name: str):
    """An exclusive file lock in commsched's cache folder, shared by every process of this
    machine (a no-op where ``fcntl`` or the folder is missing)."""
    try:
        import fcntl

        folder = read_env().cache_dir
        folder.mkdir(parents=True, exist_ok=True)
        f = open(folder / f"{name}.lock", "a+")
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def warm_native(*, say: Callable[[str], None] | None = say_stderr) -> bool:
    """Build (once per machine) or load the native CPU codec now; whether it is there.
    The first call of a process tells ``say`` (None: silent) in one line what happened
    and from where (built with which compiler and how long, loaded from the cache, or why
    not); later calls say nothing."""
    from commsched.kernels import cpu as _cpu

    first = _cpu.status() is None
    lib = native_library()
    if first and say is not None and _cpu.status() is not None:
        say("commsched.quant: " + _cpu.status().describe())
    return lib is not None


def warm_codec(dims: Iterable[int], bits: Iterable[int] = BITS, *,
               say: Callable[[str], None] | None = say_stderr) -> float:
    """Make the CPU codec ready for every (bits, dim) now; returns the seconds it took.

    Where the native kernel can be had (:func:`warm_native`: one kernel for every width and
    shape, built once per machine) that is all it does. Otherwise it compiles the
    torch.compile kernels of every (bits, dim) (0.0 when all were compiled already, or
    compiling is off with ``COMMSCHED_COMPILE=0``). ``say`` (default: a line on stderr;
    None: silent) hears one line before (what, how many kernels) and one after (the
    time), instead of one pair per kernel."""
    if not compile_enabled():
        return 0.0
    t = time.perf_counter()
    if warm_native(say=say):
        return time.perf_counter() - t
    todo = [(b, d) for d in sorted(set(int(d) for d in dims)) for b in bits
            if not (_compiled("quantize", b, d).compiled and _compiled("dequantize", b, d).compiled)]
    if not todo:
        return 0.0
    if say is not None:
        say(f"commsched.quant: compiling the CPU quantization codec with torch.compile: "
            f"{2 * len(todo)} kernels (bits {sorted({b for b, _ in todo})} x row widths "
            f"{sorted({d for _, d in todo})}); first use on this machine takes a while (about "
            "5-10 s per kernel), later runs reuse Inductor's disk cache; COMMSCHED_COMPILE=0 or "
            "--no-compile runs the eager codec instead ...")
    t = time.perf_counter()
    with _machine_lock("torch_compile"):  # ranks of a machine in turn: the later ones load
        for b, d in todo:                  # Inductor's disk cache instead of compiling again
            x = torch.randn(64, d, generator=torch.Generator().manual_seed(d))
            pay, meta = quantize_cpu(x, b, 1, 0, compile=True, _say=None)
            dequantize_cpu(pay, meta, b, d, compile=True, _say=None)
    dt = time.perf_counter() - t
    if say is not None:
        say(f"commsched.quant: codec compiled in {dt:.1f} s")
    return dt


def native_library():
    """The native CPU codec (``commsched.kernels.cpu``: C built once per machine, one
    kernel for every width and shape), or None when it cannot be had or
    ``COMMSCHED_COMPILE=0``; the first call of a process builds or loads it."""
    from commsched.kernels import cpu as _cpu

    if _cpu.status() is not None:  # decided for this process: no environment read per message
        return _cpu.library()
    env = read_env()
    return _cpu.load(env.cache_dir, env.compile, env.cc)


def native_status() -> str:
    """One line: what the native CPU codec is in this process (built, loaded, or why not)."""
    from commsched.kernels import cpu as _cpu

    native_library()
    return _cpu.status().describe()


def _empty(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    from commsched.kernels.cpu import empty_rows

    return empty_rows(shape, dtype)


def _native_for(native: bool | None, compile: bool | None):
    """The library when this call runs natively: ``native=True`` requires it (ValueError
    if it cannot be had), None uses it when available unless ``compile`` forces a
    torch.compile choice (True: compiled, False: eager), False never."""
    if native is False or (native is None and compile is not None):
        return None
    lib = native_library()
    if lib is None and native:
        from commsched.kernels import cpu as _cpu

        raise ValueError(f"impl='native' was asked for but {_cpu.status().describe()}")
    return lib


# Both entry points run under no_grad: their outputs are never differentiated, and the
# compiled kernels are guarded on grad mode, so a caller that quantizes in a forward pass
# (grad on) and again in autograd's backward (grad off) would compile every kernel twice.
@torch.no_grad()
def quantize_cpu(x_ND: torch.Tensor, bits: int, key: int, row0: int = 0, *,
                 out_NB: torch.Tensor | None = None, compile: bool | None = None,
                 native: bool | None = None,
                 _say: Callable[[str], None] | None = say_stderr) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a contiguous float32 CPU tensor; returns (payload uint8 [N, B], meta [N, 2]).

    ``out_NB`` (a uint8 [N, B] view with unit column stride, for example into a send
    buffer) receives the payload if given. By default the native kernel runs (when it can
    be had; ``native=True`` requires it, ``False`` never uses it); otherwise
    ``compile=None`` compiles with torch.compile when the message is large enough,
    ``True`` forces that (N > 1), ``False`` runs the eager twin. ``COMMSCHED_COMPILE=0``
    means the eager twin whatever these say.
    """
    N, D = x_ND.shape
    B = payload_bytes(D, bits)
    if out_NB is None:
        out_NB = _empty((N, B), torch.uint8, x_ND.device)
    lib = _native_for(native, compile) if x_ND.device.type == "cpu" else None
    if lib is not None:
        meta = torch.empty((N, 2), dtype=torch.float32)
        if N:
            if x_ND.stride(1) != 1 or (B > 1 and out_NB.stride(1) != 1):
                raise ValueError("the native codec needs unit column strides")
            lib.cs_quantize(x_ND.data_ptr(), N, D, x_ND.stride(0), out_NB.data_ptr(),
                            out_NB.stride(0), meta.data_ptr(), bits, key & 0xFFFFFFFF, row0)
        return out_NB, meta
    key_t = torch.tensor(key & 0xFFFFFFFF, dtype=torch.int64)  # 0-d: usable with any device
    row0_t = torch.tensor(row0, dtype=torch.int64)
    iota_B = torch.arange(B, dtype=torch.int32, device=x_ND.device)
    if _use_compiled(compile, N, D):
        meta = _compiled("quantize", bits, D)(x_ND, key_t, row0_t, iota_B, out_NB, say=_say)
    else:
        meta = quantize_fused(x_ND, key_t, row0_t, iota_B, out_NB, bits)
    return out_NB, meta


@torch.no_grad()
def dequantize_cpu(payload_NB: torch.Tensor, meta_N2: torch.Tensor, bits: int, dim: int, *,
                   out_ND: torch.Tensor | None = None, compile: bool | None = None,
                   native: bool | None = None,
                   _say: Callable[[str], None] | None = say_stderr) -> torch.Tensor:
    """Dequantize on the CPU into ``out_ND`` (float32 [N, dim] with unit column stride, for
    example rows of a bigger matrix) or a new tensor; ``compile``, ``native`` as in
    ``quantize_cpu``."""
    N = payload_NB.shape[0]
    if out_ND is None:
        out_ND = _empty((N, dim), torch.float32, payload_NB.device)
    lib = _native_for(native, compile) if payload_NB.device.type == "cpu" else None
    if lib is not None:
        if N:
            B = payload_NB.shape[1]
            meta = meta_N2.contiguous()
            if (B > 1 and payload_NB.stride(1) != 1) or (dim > 1 and out_ND.stride(1) != 1):
                raise ValueError("the native codec needs unit column strides")
            lib.cs_dequantize(payload_NB.data_ptr(), N, B, payload_NB.stride(0), meta.data_ptr(),
                              out_ND.data_ptr(), dim, out_ND.stride(0), bits)
        return out_ND
    if _use_compiled(compile, N, dim):
        _compiled("dequantize", bits, dim)(payload_NB, meta_N2, out_ND, say=_say)
    else:
        dequantize_fused(payload_NB, meta_N2, out_ND, bits, dim)
    return out_ND


# --------------------------------------------------------------------------- 1-bit signs
def _sign_pack(m_ND: torch.Tensor, out_NB: torch.Tensor) -> torch.Tensor:
    """Pack the signs of ``m_ND`` into ``out_NB`` (planar, b = 1); return scale float32 [N]."""
    N, D = m_ND.shape
    B = payload_bytes(D, 1)
    scale = (m_ND.to(torch.float64).abs().sum(dim=1) / D).to(torch.float32)
    neg = (m_ND < 0).to(torch.int32)
    if 8 * B != D:
        neg = F.pad(neg, (0, 8 * B - D))
    neg_N8B = neg.view(N, 8, B)
    packed = neg_N8B[:, 0]
    for s in range(1, 8):
        packed = packed | (neg_N8B[:, s] << s)
    out_NB.copy_(packed.to(torch.uint8))
    return scale


def sign_encode_fused(x_ND: torch.Tensor, out_NB: torch.Tensor) -> torch.Tensor:
    """Signs of float32 [N, D] into ``out_NB`` (uint8 [N, B]); returns the scales [N]."""
    return _sign_pack(x_ND, out_NB)


def sign_encode_ef_fused(x_ND: torch.Tensor, err_ND: torch.Tensor, out_NB: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Error feedback: the signs of ``m = x + err`` into ``out_NB``; returns (scales [N],
    the new error ``m - where(m < 0, -scale, scale)`` [N, D])."""
    m = x_ND + err_ND
    scale = _sign_pack(m, out_NB)
    sc = scale[:, None]
    return scale, m - torch.where(m < 0, -sc, sc)


def sign_decode_fused(payload_NB: torch.Tensor, scale_N: torch.Tensor, out_ND: torch.Tensor,
                      dim: int) -> None:
    """+-scale from packed signs into ``out_ND`` (float32 [N, dim], unit column stride): the
    full slots through an [N, F, B] view, the partial last one through a slice."""
    N, B = payload_NB.shape
    full = dim // B
    sc = scale_N[:, None]
    p = payload_NB.to(torch.int32)
    if full:
        shifts = torch.arange(full, dtype=torch.int32, device=p.device)
        neg = ((p.unsqueeze(1) >> shifts[None, :, None]) & 1) != 0
        out_ND[:, :full * B].view(N, full, B).copy_(torch.where(neg, -sc[:, :, None], sc[:, :, None]))
    width = dim - full * B
    if width:
        neg = ((p[:, :width] >> full) & 1) != 0
        out_ND[:, full * B:].copy_(torch.where(neg, -sc, sc))


@torch.no_grad()
def sign_encode_fast(x_ND: torch.Tensor, err_ND: torch.Tensor | None = None, *,
                     out_NB: torch.Tensor | None = None, compile: bool | None = False,
                     _say: Callable[[str], None] | None = say_stderr
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(payload uint8 [N, B], scale float32 [N], new error or None) of contiguous float32
    rows, as ``reference.sign_encode_reference`` (``err_ND`` None) or
    ``reference.sign_error_feedback_reference``; ``out_NB`` (a uint8 [N, B] view, for
    example the payload columns of the sign records) receives the payload if given.
    ``compile``: False (default) the eager twin; True compiled (N > 1; CPU); None compiled
    for large messages; ``COMMSCHED_COMPILE=0`` means False."""
    N, D = x_ND.shape
    out = out_NB if out_NB is not None else torch.empty((N, payload_bytes(D, 1)), dtype=torch.uint8,
                                                        device=x_ND.device)
    cpu = x_ND.device.type == "cpu"
    if err_ND is None:
        fn = _compiled("sign_encode", 1, D) if cpu and _use_compiled(compile, N, D) else None
        scale = fn(x_ND, out, say=_say) if fn is not None else sign_encode_fused(x_ND, out)
        return out, scale, None
    fn = _compiled("sign_encode_ef", 1, D) if cpu and _use_compiled(compile, N, D) else None
    scale, new_err = fn(x_ND, err_ND, out, say=_say) if fn is not None else sign_encode_ef_fused(x_ND, err_ND, out)
    return out, scale, new_err


@torch.no_grad()
def sign_decode_fast(payload_NB: torch.Tensor, scale_N: torch.Tensor, dim: int, *,
                     out_ND: torch.Tensor | None = None, compile: bool | None = False,
                     _say: Callable[[str], None] | None = say_stderr) -> torch.Tensor:
    """float32 [N, dim] from packed signs and scales, as ``reference.sign_decode_reference``,
    into ``out_ND`` if given; ``compile`` as in :func:`sign_encode_fast`."""
    N = payload_NB.shape[0]
    if out_ND is None:
        out_ND = torch.empty((N, dim), dtype=torch.float32, device=payload_NB.device)
    scale_N = scale_N.to(torch.float32)
    if payload_NB.device.type == "cpu" and _use_compiled(compile, N, dim):
        _compiled("sign_decode", 1, dim)(payload_NB, scale_N, out_ND, say=_say)
    else:
        sign_decode_fused(payload_NB, scale_N, out_ND, dim)
    return out_ND


def warm_sign_codec(dims: Iterable[int], *, say: Callable[[str], None] | None = say_stderr) -> float:
    """Compile the sign encode (with and without error feedback) and decode kernels of every
    row width now; returns the seconds it took (0.0 when compiled already or compiling is
    off). ``say`` hears one line before and one after."""
    if not compile_enabled():
        return 0.0
    todo = [d for d in sorted(set(int(d) for d in dims))
            if not all(_compiled(k, 1, d).compiled for k in ("sign_encode", "sign_encode_ef", "sign_decode"))]
    if not todo:
        return 0.0
    if say is not None:
        say(f"commsched.quant: compiling the 1-bit sign codec with torch.compile: {3 * len(todo)} "
            f"kernels (row widths {todo}); COMMSCHED_COMPILE=0 runs the eager codec instead ...")
    t = time.perf_counter()
    for d in todo:
        # the layout of the exchange's calls (codec.encode_signs / decode_signs): the payload
        # is the first B columns of [N, B + 4] sign records, a strided view (a contiguous
        # stand-in would compile kernels whose guards the real calls fail: a recompile then)
        x = torch.randn(64, d, generator=torch.Generator().manual_seed(d))
        B = payload_bytes(d, 1)
        records = torch.empty((64, B + 4), dtype=torch.uint8)
        _, sc, _ = sign_encode_fast(x, compile=True, out_NB=records[:, :B], _say=None)
        sign_encode_fast(x, torch.zeros_like(x), compile=True, out_NB=records[:, :B], _say=None)
        sign_decode_fast(records[:, :B], sc, d, compile=True, _say=None)
    dt = time.perf_counter() - t
    if say is not None:
        say(f"commsched.quant: sign codec compiled in {dt:.1f} s")
    return dt


__all__ = ["CPU_COMPILE_MIN_ELEMENTS", "compile_enabled", "dequantize_cpu", "dequantize_fused",
           "native_library", "native_status", "warm_native",
           "quantize_cpu", "quantize_fused", "say_stderr", "sign_decode_fast", "sign_decode_fused",
           "sign_encode_ef_fused", "sign_encode_fast", "sign_encode_fused", "warm_codec", "warm_sign_codec"]
