"""Loader of the native CPU codec kernels (``quant_cpu.c`` beside this file).

The C source is built once per machine with the system C compiler into a shared library
in commsched's cache folder (``COMMSCHED_CACHE_DIR``, default ``$XDG_CACHE_HOME/commsched``
or ``~/.cache/commsched``), named by a hash of the source, the compiler, its flags and the
host, so a changed source, compiler or machine builds anew and an unchanged one is
loaded in milliseconds. Ranks that start together on one machine take a file lock in
turn: the first builds (about a second), the others load its result. There is one
library for every width and shape (no per-shape compilation).

``load()`` returns the library, or None when it cannot be had (no C compiler, a failed
build, a platform without ``fcntl``); the codec then falls back to its other CPU paths and
the reason is in :func:`status`. Nothing here runs at import.

Kernel contracts (the Python launchers in ``commsched.quant.fast`` validate them):

* ``cs_quantize(x, N, D, x_row_stride, out, out_row_stride, meta, bits, key, row0)``:
  float32 [N, D] rows (unit column stride) into uint8 [N, B] payload rows and float32
  [N, 2] contiguous metadata; returns how many rows have non-finite metadata.
* ``cs_dequantize(payload, N, B, payload_row_stride, meta, y, D, y_row_stride, bits)``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("quant_cpu.c")
ABI_VERSION = 1
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared",
          "-std=c11")


@dataclass(frozen=True)
class NativeStatus:
    """What :func:`load` did: ``state`` is "built", "loaded" (from the cache), "off" or
    "failed"; ``path`` the library, ``seconds`` the build or load time, ``reason`` why
    not (for "off" and "failed"), ``compiler`` the command that built it."""

    state: str
    path: Path | None = None
    seconds: float = 0.0
    reason: str = ""
    compiler: str = ""

    def describe(self) -> str:
        """One line for the user."""
        if self.state == "built":
            return (f"built the native CPU codec kernel with {self.compiler} in "
                    f"{self.seconds:.1f} s (once per machine; cached at {self.path})")
        if self.state == "loaded":
            return f"native CPU codec kernel loaded from the cache ({self.path})"
        return f"native CPU codec kernel not used: {self.reason}"


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_status: NativeStatus | None = None


def _compiler(cc: str | None = None) -> str | None:
    """The compiler ``cc`` names (on PATH or a path; None if not found), or without it the
    first of cc, gcc, clang on PATH."""
    if cc:
        return shutil.which(cc) or None
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _key(cc: str) -> str:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = []
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), cc.encode(), " ".join(CFLAGS).encode(),
                 "".join(version).encode(), platform.machine().encode(),
                 platform.node().encode(), str(ABI_VERSION).encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    if lib.cs_abi_version() != ABI_VERSION:
        raise OSError(f"{path} has ABI {lib.cs_abi_version()}, expected {ABI_VERSION}")
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.cs_quantize.argtypes = [vp, i64, i64, i64, vp, i64, vp, ctypes.c_int, ctypes.c_uint32, i64]
    lib.cs_quantize.restype = i64
    lib.cs_dequantize.argtypes = [vp, i64, i64, i64, vp, vp, i64, i64, ctypes.c_int]
    lib.cs_dequantize.restype = None
    return lib


def _build(cc: str, target: Path) -> None:
    """Compile into a temporary file beside ``target``, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=target.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True,
                           text=True, timeout=300)
        if r.returncode != 0:
            raise OSError(f"{Path(cc).name} exited {r.returncode}: "
                          f"{(r.stderr or r.stdout).strip().splitlines()[-1:] or ''}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_locked(enabled: bool, folder: Path, cc: str | None = None) -> None:
    global _lib, _status
    if not enabled:
        _status = NativeStatus("off", reason="COMMSCHED_COMPILE=0 (no compiling of any kind)")
        return
    if sys.platform == "win32":
        _status = NativeStatus("off", reason="not built on Windows")
        return
    cc = _compiler(cc)
    if cc is None:
        _status = NativeStatus("failed", reason="no C compiler found (set CC, or install gcc)")
        return
    t = time.perf_counter()
    try:
        import fcntl

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / f"quant_cpu-{_key(cc)}.so"
        state = "loaded"
        with open(folder / "quant_cpu.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per machine; the others wait
            try:
                if not target.exists():
                    _build(cc, target)
                    state = "built"
                lib = _bind(target)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    except Exception as e:  # noqa: BLE001 -- any failure means: use the other CPU paths
        first = str(e).splitlines()[0] if str(e) else ""
        _status = NativeStatus("failed", reason=f"{type(e).__name__}: {first}", compiler=cc)
        return
    _lib = lib
    _status = NativeStatus(state, path=target, seconds=time.perf_counter() - t, compiler=Path(cc).name)


def load(cache_dir: str | os.PathLike, enabled: bool = True, cc: str | None = None) -> ctypes.CDLL | None:
    """The native library (built in ``cache_dir`` or loaded from it on the first call in
    this process), or None. ``enabled=False`` (``COMMSCHED_COMPILE=0``) never builds; the
    first call decides for the process. ``cc``: the C compiler to build with (the ``CC``
    variable; None: the first of cc, gcc, clang on PATH). (``commsched.config`` reads
    ``COMMSCHED_CACHE_DIR`` and ``CC``; the kernels package imports nothing of commsched.)"""
    with _lock:
        if _status is None:
            _load_locked(enabled, Path(cache_dir), cc)
        return _lib


def library() -> ctypes.CDLL | None:
    """The library the first :func:`load` of this process gave (None before it, or if none)."""
    return _lib


def status() -> NativeStatus | None:
    """What the first :func:`load` of this process did (None before it)."""
    return _status


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux
_libc: list = []


def empty_rows(shape: tuple[int, ...], dtype):
    """``torch.empty(shape, dtype)`` on the CPU, asking Linux for transparent huge pages on
    its interior 2 MiB pages when it is large (>= 4 MiB) and fresh: a new 100 MB output
    otherwise costs more in page faults (one per 4 KiB page) than decoding into it does.
    Only advice: where the kernel or the allocator does not take it, nothing changes."""
    import torch

    t = torch.empty(shape, dtype=dtype)
    n = t.numel() * t.element_size()
    if n < 2 * _HUGE_PAGE or not sys.platform.startswith("linux"):
        return t
    if not _libc:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise.restype = ctypes.c_int
            _libc.append(libc)
        except (OSError, AttributeError):
            _libc.append(None)
    libc = _libc[0]
    if libc is not None:
        p = t.data_ptr()
        a, e = -(-p // _HUGE_PAGE) * _HUGE_PAGE, (p + n) // _HUGE_PAGE * _HUGE_PAGE
        if e > a:
            libc.madvise(a, e - a, _MADV_HUGEPAGE)  # advice: a failure changes nothing
    return t


def _reset_for_tests() -> None:
    """Forget this process's library (tests only: a fresh first load)."""
    global _lib, _status
    with _lock:
        _lib, _status = None, None


__all__ = ["ABI_VERSION", "CFLAGS", "NativeStatus", "SOURCE", "empty_rows", "library", "load", "status"]
