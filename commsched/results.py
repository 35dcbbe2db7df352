"""What every run writes and shows: one median, one JSON writer, one progress bar, and the
base of the typed metrics records.

Front-ends describe their ``metrics.json`` as a frozen dataclass deriving from
:class:`Record`; ``Record.write`` puts it on disk with :func:`write_json`. No
``torch.distributed`` here: these are plain helpers, importable without torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping


def median(xs: Iterable[float | int | None]) -> float | None:
    """The median of the finite numbers in ``xs`` (``None`` and NaN skipped); None when empty."""
    vals = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(statistics.median(vals)) if vals else None


class OutputError(ValueError):
    """A run's output could not be written (a full disk, a read-only folder, a quota): one
    line naming the file and the OS's reason. A ValueError, so the front-ends' edge
    (``commsched.dist.cli_main``) prints it as one line and marks the run FAILED."""


def _write_failure(path: Path, e: BaseException) -> str:
    """Why writing ``path`` failed, in words: the OS's reason and errno name when there is
    one (also inside torch's serializer errors, which hide it), else the first line."""
    import errno as _errno

    err = e
    while err is not None and not (isinstance(err, OSError) and err.errno):
        err = err.__cause__ or err.__context__
    if isinstance(err, OSError) and err.errno:
        return f"{err.strerror or os.strerror(err.errno)} ({_errno.errorcode.get(err.errno, err.errno)})"
    try:  # torch's "[enforce fail at inline_container.cc] ... file write failed": ask the disk
        st = os.statvfs(path.parent)
        if st.f_bavail * st.f_frsize < 1 << 16:
            return f"{os.strerror(_errno.ENOSPC)} (ENOSPC)"
    except OSError:
        pass
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def write_atomic(path: str | os.PathLike, write: Callable[[Any], None], *, what: str = "file") -> Path:
    """Write ``path`` through ``write(f)`` (``f`` a binary file open on a temporary file beside
    it), then flush it to the disk (fsync) and rename it into place, so a killed run never
    leaves half a file and a crash after the rename never leaves an empty one; parent
    folders are made. Any failure (a full disk above all) removes the temporary file and
    raises :class:`OutputError`: ``cannot write WHAT PATH: No space left on device (ENOSPC)``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - OSError, or a serializer's RuntimeError around one
        try:
            tmp.unlink()
        except OSError:
            pass
        raise OutputError(f"cannot write {what} {path}: {_write_failure(path, e)}") from None
    try:  # the rename itself reaches the disk with the folder's entry
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return path


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, +-inf; numpy's too) replaced by None, mappings
    and sequences walked, so that strict JSON (``allow_nan=False``) can hold it: a diverged
    run's loss is ``null``, never a bare ``NaN`` token that strict parsers reject."""
    if isinstance(obj, Mapping):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    if isinstance(obj, numbers.Real) and not isinstance(obj, numbers.Integral):
        return float(obj) if math.isfinite(obj) else None
    return obj


def dumps_json(obj: Any, *, indent: int | None = None) -> str:
    """``obj`` as strict JSON (:func:`finite_json`; dataclasses as their fields, other
    unknown values as ``str``): what every file and line of results commsched writes holds."""
    return json.dumps(finite_json(_plain(obj)), indent=indent, default=str, allow_nan=False)


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2) -> Path:
    """Write ``obj`` as strict JSON (:func:`dumps_json`: non-finite floats as ``null``) to
    ``path`` atomically (:func:`write_atomic`: a temporary file flushed and renamed into
    place; a full disk is an :class:`OutputError` naming the file); parent folders are made.
    Dataclasses are written as their fields; other unknown values as ``str``."""
    data = dumps_json(obj, indent=indent).encode()
    return write_atomic(path, lambda f: f.write(data), what="metrics file" if Path(path).name == "metrics.json" else "file")


def save_torch(obj: Any, path: str | os.PathLike, what: str = "checkpoint") -> Path:
    """``torch.save(obj)`` to ``path`` through :func:`write_atomic` (fsync, rename; a full
    disk is one :class:`OutputError` line naming the file, no temporary left behind)."""
    import torch

    return write_atomic(path, lambda f: torch.save(obj, f), what=what)


# a run whose (agreed) training loss is not finite this many steps or epochs in a row stops:
# once NaN reaches the parameters through Adam it never leaves them
NONFINITE_STOP_AFTER = 5


class DivergedError(ValueError):
    """The training loss stayed non-finite for :data:`NONFINITE_STOP_AFTER` steps in a row: one
    line at the front-ends' edge, exit status 2, the run folder marked FAILED."""


class DivergenceGuard:
    """Watches a run's training loss, the same number on every rank (all-reduced), so that
    every rank stops at the same step. The first non-finite loss is said once through
    ``say`` (rank 0's; None: silent) naming the ``unit`` (step, epoch) and its number;
    ``stop_after`` non-finite ones in a row raise :class:`DivergedError` with ``hint``."""

    def __init__(self, unit: str = "step", *, say: Callable[[str], None] | None = None,
                 stop_after: int = NONFINITE_STOP_AFTER, hint: str = ""):
        if stop_after < 1:
            raise ValueError(f"stop_after must be >= 1, got {stop_after}")
        self.unit, self.say, self.stop_after, self.hint = unit, say, int(stop_after), hint
        self.run: list[int] = []  # the numbers of the non-finite ones in a row
        self.warned = False

    def check(self, number: int, loss: float | None) -> None:
        """``loss`` of step (epoch) ``number``; None (no loss computed) counts as finite."""
        if loss is None or math.isfinite(loss):
            self.run = []
            return
        self.run.append(number)
        if not self.warned and self.say is not None:
            self.say(f"warning: the training loss is {loss} at {self.unit} {number}: the run is diverging; it "
                     f"stops after {self.stop_after} non-finite {self.unit}s in a row")
        self.warned = True
        if len(self.run) >= self.stop_after:
            raise DivergedError(f"the training loss was not finite for {len(self.run)} {self.unit}s in a row "
                                f"({self.unit}s {self.run[0]}-{self.run[-1]}): the run diverged" +
                                (f"; {self.hint}" if self.hint else ""))


DIGESTS = "digests"  # the key of a checkpoint's per-tensor digests (with_digests)


def tensor_digest(t: Any) -> int:
    """A 64-bit digest (signed, an int64) of a tensor's dtype, shape and bytes (blake2b of
    its contiguous bytes, read on the host; any device)."""
    import hashlib

    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=8)
    h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return int.from_bytes(h.digest(), "little", signed=True)


def tensor_digests(obj: Any, prefix: str = "") -> dict[str, int]:
    """:func:`tensor_digest` of every tensor inside nested dicts, lists and tuples, keyed by
    its dotted path (``model.blocks.0.attn.qkv.weight``, ``optimizer.state.3.exp_avg``)."""
    import torch

    out: dict[str, int] = {}

    def walk(o: Any, name: str) -> None:
        if isinstance(o, torch.Tensor):
            out[name] = tensor_digest(o)
        elif isinstance(o, Mapping):
            for k, v in o.items():
                if not (o is obj and k == DIGESTS):
                    walk(v, f"{name}.{k}" if name else str(k))
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(v, f"{name}.{i}" if name else str(i))

    walk(obj, prefix)
    return out


def with_digests(state: dict) -> dict:
    """``state`` plus :data:`DIGESTS`: the digest of each tensor it holds (what every
    checkpoint commsched writes carries; :func:`check_digests` verifies it on load)."""
    return {**state, DIGESTS: tensor_digests(state)}


def check_digests(state: Any, path: str | os.PathLike, what: str) -> bool:
    """Verify the digests a checkpoint ``state`` (read from ``path``) was written with: True
    when every tensor matches, False when it carries none (written before digests existed);
    a ValueError naming the file and the first tensor whose bytes changed, or went missing,
    when the file is damaged."""
    if not isinstance(state, dict) or not isinstance(state.get(DIGESTS), dict):
        return False
    want, got = state[DIGESTS], tensor_digests(state)
    for name in sorted(set(want) | set(got), key=lambda n: (n not in want, n)):
        if want.get(name) != got.get(name):
            how = ("is missing" if name not in got else "is not listed in its digests" if name not in want
                   else "does not match the digest written with it")
            raise ValueError(f"{what} {path} is damaged: tensor {name} {how}; restore the file or "
                             "start the run again without it")
    return True


FAILED_MARKER = "FAILED"  # the file a failed run leaves in its --out folder
LOCK_FILE = ".lock"  # in a run folder: held (flock) by the run writing there, with its pid


class FolderLock:
    """An exclusive ``flock`` on ``folder/.lock`` (:func:`lock_folder`), held until
    :meth:`release` or the process ends (the kernel drops it then, so a dead run never
    blocks the next)."""

    def __init__(self, fd: int | None, folder: Path):
        self.fd, self.folder = fd, folder

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the file drops the flock
            self.fd = None

    def __del__(self) -> None:
        self.release()


def lock_folder(path: str | os.PathLike, *, flag: str = "--out") -> FolderLock:
    """Take the run folder ``path`` (it exists) for this process: an exclusive, non-blocking
    ``flock`` on ``path/.lock``, which then holds this process's pid. A folder another live
    process holds is one ValueError line: ``--out DIR is in use by another run (pid N)``.
    Where the file system has no locks (some network mounts) the run goes on unlocked,
    said once on stderr."""
    import errno
    import fcntl

    p = Path(path)
    try:
        fd = os.open(p / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ValueError(f"{flag} {p}: cannot create {LOCK_FILE} ({read_error(e)})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            pid = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(f"{flag} {p} is in use by another run (pid {pid}); wait for it to end "
                             "or choose another folder") from None
        os.close(fd)
        print(f"commsched: {flag} {p}: this file system has no locks ({read_error(e)}); "
              "the folder is not guarded against a second run", file=sys.stderr, flush=True)
        return FolderLock(None, p)
    try:  # the pid is for the message a second run prints; a full disk leaves it out
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass
    return FolderLock(fd, p)


def prepare_out(path: str | os.PathLike, *, overwrite: bool = False, resume: bool = False,
                flag: str = "--out") -> Path:
    """Make the run folder ``path`` before any work, or refuse it with one ValueError line:
    a path that cannot be created or written, or a folder that already holds a run's
    ``metrics.json`` (unless ``overwrite``, which removes that file and the old
    ``timeline.json``, or ``resume``, which continues that run). A previous run's
    :data:`FAILED_MARKER` is removed. :func:`claim_out` does the same under a lock."""
    p = _make_out(Path(path), flag)
    _clean_out(p, overwrite=overwrite, resume=resume, flag=flag)
    return p


def claim_out(path: str | os.PathLike, *, overwrite: bool = False, resume: bool = False,
              flag: str = "--out") -> FolderLock:
    """:func:`prepare_out` for the one process that owns a run (rank 0): the folder is made,
    then locked (:func:`lock_folder`: a folder another live run holds is refused with
    ``--out DIR is in use by another run (pid N)``, and nothing in it is touched), then
    checked and cleaned as :func:`prepare_out` does. Keep the lock for the run's life."""
    p = _make_out(Path(path), flag)
    held = lock_folder(p, flag=flag)
    try:
        _clean_out(p, overwrite=overwrite, resume=resume, flag=flag)
    except ValueError:
        held.release()
        raise
    return held


def _make_out(p: Path, flag: str) -> Path:
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {p}: exists and is not a folder; give a folder path")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {p}: cannot create the folder ({read_error(e)})") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {p}: the folder is not writable; choose another one")
    return p


def _clean_out(p: Path, *, overwrite: bool, resume: bool, flag: str) -> None:
    if (p / "metrics.json").exists() and not (overwrite or resume):
        raise ValueError(f"{flag} {p} already holds a run (metrics.json); pass --overwrite to "
                         "replace it, or choose another folder")
    stale = [FAILED_MARKER] + (["metrics.json", "timeline.json"] if overwrite and not resume else [])
    for name in stale:
        try:
            (p / name).unlink(missing_ok=True)
        except OSError as e:
            raise ValueError(f"{flag} {p}: cannot remove the old {name} ({read_error(e)})") from None


def mark_failed(path: str | os.PathLike | None, message: str) -> None:
    """Append ``message`` (one line) to ``path``/FAILED, so a failed run is never mistaken
    for a finished one; best effort (never raises), a no-op for ``path`` None or absent."""
    if path is None:
        return
    try:
        p = Path(path)
        if p.is_dir():
            with open(p / FAILED_MARKER, "a") as f:
                f.write(" ".join(str(message).split()) + "\n")
    except OSError:
        pass


def read_error(e: BaseException) -> str:
    """One line saying why reading (or writing) a file failed: the OS's reason, or the
    exception's type and the first line of its message."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def load_torch_file(path: str | os.PathLike, what: str, *, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``, any failure a ValueError naming the file:
    missing, truncated or garbage, holding objects that only an unsafe load would build
    (commsched never retries with ``weights_only=False``), or a dict carrying tensor
    digests (:func:`with_digests`) whose tensors no longer match them (:func:`check_digests`;
    torch's reader checks no checksum of the tensor bytes)."""
    import pickle
    import zipfile

    import torch

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} {p}: no such file")
    try:
        obj = torch.load(p, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch.save writes a zip archive; bytes that are not one and fail to unpickle are
        # garbage, not a file of unsafe objects
        if "weights_only" in str(e) and zipfile.is_zipfile(p):
            raise ValueError(f"{what} {p}: holds objects that a safe load (weights_only=True) refuses; "
                             "commsched does not load such files: write it again with commsched") from None
        raise ValueError(f"{what} {p}: not a readable torch file (corrupt or truncated: "
                         f"{_without_unsafe_advice(read_error(e))})") from None
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise ValueError(f"{what} {p}: not a readable torch file (corrupt or truncated: "
                         f"{_without_unsafe_advice(read_error(e))})") from None
    check_digests(obj, p, what)
    return obj


def _without_unsafe_advice(msg: str) -> str:
    """torch's load errors end by advising ``weights_only=False`` (arbitrary code execution
    on an untrusted file): commsched never gives that advice, so it is cut off."""
    for cut in (" In PyTorch 2.6", " Re-running `torch.load`", " (1) In PyTorch", " Please file an issue"):
        i = msg.find(cut)
        if i > 0:
            msg = msg[:i]
    return msg.rstrip(" .") or msg


def _plain(obj: Any) -> Any:
    if isinstance(obj, Record):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


@dataclasses.dataclass(frozen=True)
class Record:
    """Base of a run's metrics record: the documented ``metrics.json`` fields as typed
    attributes, plus ``extra`` for the workload-specific rest (merged into the file's top
    level). ``to_dict()`` is what ``metrics.json`` holds."""

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        extra = d.pop("extra", None) or {}
        clash = sorted(set(extra) & set(d))
        if clash:
            raise ValueError(f"{type(self).__name__}: extra fields {clash} shadow documented fields")
        return {**json.loads(json.dumps(d, default=str)), **extra}

    def write(self, path: str | os.PathLike, *, indent: int | None = 2) -> Path:
        return write_json(path, self.to_dict(), indent=indent)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "extra")


# Without a terminal (stderr redirected to a file or a pipe) a progress bar's carriage-return
# redraws pile up on one line; a plain line is written instead, at most this often (and at
# the start and the end), the convention of tqdm users for logs.
LINE_INTERVAL_S = 30.0


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a file
        return False


def plural(unit: str) -> str:
    """The English plural of a unit name (``epoch`` -> ``epochs``, ``batch`` -> ``batches``,
    ``p95 batch`` -> ``p95 batches``)."""
    return unit + ("es" if unit.endswith(("s", "x", "z", "sh", "tch")) else "s")


class Progress:
    """A tqdm bar on stderr when stderr is a terminal; plain lines otherwise (a line at the
    start, at most one every ``LINE_INTERVAL_S`` seconds, one at the end); nothing when
    ``enabled`` is false (COMMSCHED_PROGRESS=0, a rank other than 0). ``update``,
    ``postfix``, ``write`` and ``close`` are safe either way; ``write`` still reaches the
    user when the bar is off (through ``say``, default a line on stderr). Use as a context
    manager to close it."""

    def __init__(self, total: int, desc: str, unit: str, *, enabled: bool = True,
                 initial: int = 0, say: Callable[[str], None] | None = None,
                 interval_s: float = LINE_INTERVAL_S):
        self.bar = None
        self.say = say or (lambda s: print(s, file=sys.stderr, flush=True))
        self._lines = False  # line mode: no terminal
        if enabled and _is_terminal(sys.stderr):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr,
                            dynamic_ncols=True, leave=True)
        elif enabled:
            self._lines = True
            self._total, self._desc, self._unit, self._n = total, desc, unit, initial
            self._interval = interval_s
            self._post = ""
            self._t0 = self._last = time.monotonic()
            self._shown = initial
            self._line()

    def _line(self, final: bool = False) -> None:
        el = time.monotonic() - self._t0
        post = f", {self._post}" if self._post else ""
        when = f", done in {el:.0f} s{post}" if final else f" ({el:.0f} s{post})"
        self.say(f"{self._desc}: {self._n}/{self._total} {plural(self._unit)}{when}")
        self._last, self._shown = time.monotonic(), self._n

    @property
    def active(self) -> bool:
        """Whether a bar is shown."""
        return self.bar is not None

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)
        elif self._lines:
            self._n += n
            if time.monotonic() - self._last >= self._interval:
                self._line()

    def postfix(self, text: str | None = None, **values: Any) -> None:
        if self._lines:
            self._post = text if text is not None else ", ".join(f"{k}={v}" for k, v in values.items())
            return
        if self.bar is None:
            return
        if text is not None:
            self.bar.set_postfix_str(text)
        else:
            self.bar.set_postfix(**values)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            self.say(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self._lines:
            self._lines = False
            self._line(final=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pick(d: Mapping[str, Any], dotted: str) -> Any:
    """``d["a"]["b"]`` for ``"a.b"``; None when a key is missing."""
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


__all__ = ["DIGESTS", "FAILED_MARKER", "FolderLock", "LOCK_FILE", "NONFINITE_STOP_AFTER", "DivergedError",
           "DivergenceGuard", "OutputError", "Progress", "Record", "check_digests", "claim_out", "dumps_json",
           "finite_json", "load_torch_file", "lock_folder", "mark_failed", "median", "pick", "prepare_out",
           "read_error", "save_torch", "tensor_digest", "tensor_digests", "with_digests", "write_atomic",
           "write_json"]
