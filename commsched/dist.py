"""Process-group set-up and guards shared by every front-end.

Every collective commsched issues runs under the process group's timeout, and every
failure of one is turned into a :class:`CommError` that names this rank, the peer when
known, and the cause.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import torch
import torch.distributed as dist

from .config import read_env


class CommError(RuntimeError):
    """A collective failed: a peer died, timed out, or the ranks disagreed."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextmanager
def comm_guard(what: str, group=None) -> Iterator[None]:
    """Re-raise any failure inside as a CommError that says where and why."""
    try:
        yield
    except CommError:
        raise
    except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
        msg = str(e).strip().splitlines()
        cause = msg[0] if msg else type(e).__name__
        low = str(e).lower()
        if "timeout" in low or "timed out" in low:
            hint = "a peer did not take part within the timeout (dead, hung or out of step)"
        elif "connection" in low or "closed" in low or "reset" in low or "broken pipe" in low:
            hint = "a peer process died or closed its connection"
        else:
            hint = "the collective failed"
        raise CommError(f"rank {_rank()}: {what} failed: {hint}: {cause}") from e


def cli_error(prog: str, err: BaseException, out=None) -> int:
    """The CLI edge of an error commsched detected itself (a ValueError or CommError): one
    line on stderr, ``prog (rank R): message`` when the job has more than one rank, the
    same line appended to ``out``/FAILED when ``out`` is given; returns the exit status 2.
    The rank comes from the process group, or torchrun's environment before there is one."""
    from .results import mark_failed

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        try:
            env = read_env()
            rank, world = env.rank or 0, env.world_size or 1
        except ValueError:
            rank, world = 0, 1
    msg = " ".join(str(err).split()) or type(err).__name__
    if world > 1 and msg.startswith(f"rank {rank}: "):
        msg = msg[len(f"rank {rank}: "):]  # a CommError names its rank already
    line = f"{prog} (rank {rank}): {msg}" if world > 1 else f"{prog}: {msg}"
    print(line, file=sys.stderr, flush=True)
    mark_failed(out, line)
    return 2


DEVICE_CHOICES = ("auto", "cpu", "cuda")  # the --device of every entry point


class DistInfo(NamedTuple):
    """What :func:`init_distributed` returns: this rank, the world size, the device the job
    computes on (``cuda:LOCAL_RANK`` or ``cpu``)."""

    rank: int
    world_size: int
    device: torch.device


def choose_device(choice: str, *, cuda_available: bool, device_count: int,
                  local_rank: int | None, local_world_size: int | None) -> tuple[str, str]:
    """The device a rank runs on, and why (pure: the caller supplies what it found).

    ``cpu``: the CPU. ``cuda``: ``cuda:LOCAL_RANK``; a ValueError when CUDA is missing or
    there are more local ranks than GPUs (NCCL needs one GPU per rank). ``auto``: CUDA when
    every local rank has its own GPU, else the CPU.
    """
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"--device must be one of {DEVICE_CHOICES}, got {choice!r}")
    lr = local_rank or 0
    lws = local_world_size or 1
    if choice == "cpu":
        return "cpu", "--device cpu"
    if choice == "cuda":
        if not cuda_available or device_count < 1:
            raise ValueError("--device cuda: CUDA is not available here (torch.cuda.is_available() "
                             "is False); run with --device cpu or auto")
        if lws > device_count:
            raise ValueError(f"--device cuda: {lws} local ranks but {device_count} GPU(s); each rank "
                             "needs its own GPU (NCCL refuses two ranks on one device): start at most "
                             f"{device_count} processes per node, or use --device cpu")
        return f"cuda:{lr}", f"--device cuda: GPU {lr} of {device_count}"
    if not cuda_available or device_count < 1:
        return "cpu", "--device auto: no CUDA device, running on the CPU"
    if lws > device_count:
        return "cpu", (f"--device auto: {lws} local ranks share {device_count} GPU(s), running on "
                       "the CPU (gloo)")
    return f"cuda:{lr}", f"--device auto: GPU {lr} of {device_count}"


def resolve_device(choice: str = "auto") -> tuple[torch.device, str]:
    """:func:`choose_device` for this process (torch's CUDA view, torchrun's environment)."""
    env = read_env()
    name, why = choose_device(choice, cuda_available=torch.cuda.is_available(),
                              device_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
                              local_rank=env.local_rank, local_world_size=env.local_world_size)
    return torch.device(name), why


def group_device(choice: str = "auto", group=None) -> torch.device:
    """The device of a run on an already initialised process group: ``choice`` resolved as
    :func:`resolve_device` does, except that ``auto`` stays on the CPU when the group's
    backend has no NCCL (a gloo group carries CPU tensors, as the test harness's does), and
    ``cuda`` on a gloo group of more than one rank is a ValueError (gloo has no CUDA
    send/recv). Without a process group it is :func:`resolve_device`."""
    if choice == "cpu":
        return torch.device("cpu")
    if dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend(group)).lower()
        if "nccl" not in backend:
            if choice == "auto":
                return torch.device("cpu")
            if dist.get_world_size(group) > 1:
                raise ValueError("--device cuda needs a process group with NCCL for its CUDA tensors "
                                 f"(init_distributed(device='cuda') makes one); this group's backend "
                                 f"is {backend!r}")
    return resolve_device(choice)[0]


def default_backend(device: torch.device | None = None) -> str:
    """``COMMSCHED_BACKEND`` when set; else gloo for a CPU job and ``cpu:gloo,cuda:nccl`` for
    a CUDA job (NCCL carries the CUDA tensors, gloo the small CPU control tensors)."""
    env = read_env()
    if env.backend:
        return env.backend
    return "cpu:gloo,cuda:nccl" if device is not None and device.type == "cuda" else "gloo"


def control_device(group=None) -> torch.device:
    """Where small control tensors (counts, flags, headers) of ``group`` live: the CPU when
    its backend carries CPU tensors (gloo, or ``cpu:gloo,cuda:nccl``), else the current
    CUDA device (NCCL alone carries only CUDA tensors)."""
    if not dist.is_initialized():
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and "cpu" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def prepare_process_group_import() -> None:
    """Import ``torch._dynamo`` before the default process group is made.

    With torch 2.13, importing dynamo *after* ``init_process_group`` (``torch.optim`` and
    DeepSpeed do so on first use) keeps the gloo group alive past
    ``destroy_process_group``: its worker threads then outlive the interpreter and a
    collective's late clean-up aborts the process at exit ("terminate called without an
    active exception"). Importing it first avoids that.
    """
    import torch._dynamo  # noqa: F401


def init_distributed(backend: str | None = None, timeout_s: float | None = None,
                     device: str | torch.device = "auto", *, say=None) -> DistInfo:
    """Initialise the default process group from torchrun's environment.

    ``device`` is ``auto``, ``cpu``, ``cuda`` (see :func:`choose_device`) or a
    ``torch.device``; a CUDA device is made current before the group is created, and the
    backend follows it (:func:`default_backend`). Returns ``DistInfo(rank, world_size,
    device)``. Works without torchrun too (single process, world 1). Idempotent: an
    already initialised group is kept. ``say`` (default: a line on stderr from rank 0)
    hears which device ``auto`` chose.
    """
    if isinstance(device, torch.device):
        dev, why = device, f"device {device}"
    else:
        dev, why = resolve_device(device)
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), dev)
    prepare_process_group_import()
    env = read_env()
    t = timeout_s if timeout_s is not None else env.timeout_s
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend or default_backend(dev)
    if env.world_size is None:
        # single process without torchrun: a private file store, world of one
        import tempfile

        f = tempfile.NamedTemporaryFile(prefix="commsched-pg-", delete=False)
        f.close()
        dist.init_process_group(backend, init_method=f"file://{f.name}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=t))
    else:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=t))
    if device == "auto" and dist.get_rank() == 0:
        (say or (lambda m: print(f"commsched: {m}", file=sys.stderr, flush=True)))(why)
    return DistInfo(dist.get_rank(), dist.get_world_size(), dev)


GLOO_THREADED = "commsched_gloo"  # a gloo backend with a chosen number of worker threads


def gloo_devices() -> list:
    """The devices torch's own gloo groups use: one per interface in GLOO_SOCKET_IFNAME
    (comma-separated; emulated hosts set it, read in :mod:`commsched.config`), else the
    default one."""
    from torch.distributed import ProcessGroupGloo

    ifnames = read_env().gloo_ifnames
    if ifnames:
        return [ProcessGroupGloo.create_device(interface=i) for i in ifnames]
    return [ProcessGroupGloo.create_default_device()]


@dataclass(frozen=True)
class GlooGroupOptions:
    """Options of one threaded gloo group, handed to its creator through ``pg_options``."""

    threads: int


def _create_threaded_gloo(backend_opts, options: GlooGroupOptions):
    from torch.distributed import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    opts._devices = gloo_devices()
    opts._threads = options.threads
    timeout = backend_opts.timeout
    opts._timeout = timeout if timeout is not None else datetime.timedelta(minutes=30)
    return ProcessGroupGloo(backend_opts.store, backend_opts.group_rank, backend_opts.group_size, opts)


def new_group(ranks: list[int], *, threads: int | None = None):
    """``dist.new_group(ranks)``; on gloo with ``threads``, a group whose collectives run on
    that many worker threads (gloo's default is 2; ``new_group`` ignores options for gloo).

    Asynchronous collectives queued on one gloo group run at most ``threads`` at a time, so
    many small operations in flight (Lina's micro-ops) pay one latency each in turn; more
    threads let their latencies overlap. Other backends ignore ``threads``. Every rank must
    call it, in the same order, like ``dist.new_group``.
    """
    if threads is None or dist.get_backend() != "gloo":
        return dist.new_group(ranks)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if GLOO_THREADED not in dist.Backend.backend_list:
        dist.Backend.register_backend(GLOO_THREADED, _create_threaded_gloo, extended_api=True,
                                      devices=["cpu", "cuda"])  # gloo reduces CUDA tensors too
    return dist.new_group(ranks, backend=GLOO_THREADED, pg_options=GlooGroupOptions(threads))


# --------------------------------------------------------------------------- guarded collectives
# Every collective outside the hot paths goes through one of these: each runs under the
# process group's timeout and turns a failure into a CommError that says what was going on.

def barrier(what: str, group=None) -> None:
    """``dist.barrier`` under :func:`comm_guard`; ``what`` names the step for the error."""
    with comm_guard(what, group):
        dist.barrier(group=group)


def all_gather_object(obj: Any, what: str, group=None) -> list[Any]:
    """Every rank's ``obj``, in rank order of ``group`` (a list on every rank)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    with comm_guard(what, group):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, what: str, src: int = 0, group=None) -> Any:
    """``obj`` of global rank ``src`` on every rank (other ranks' ``obj`` is ignored)."""
    box = [obj]
    with comm_guard(what, group):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def scatter_object(objs: list[Any] | None, what: str, src: int = 0, group=None) -> Any:
    """``objs[i]`` of global rank ``src`` on the i-th rank of ``group``; ``objs`` is read on
    ``src`` only (pass None elsewhere)."""
    got: list[Any] = [None]
    with comm_guard(what, group):
        dist.scatter_object_list(got, objs if dist.get_rank() == src else None, src=src, group=group)
    return got[0]


def config_digest(config: Any) -> str:
    """Stable digest of a config (dataclass, dict or any JSON-able value)."""
    import dataclasses

    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def check_same_config(config: Any, group=None, what: str = "configuration") -> None:
    """Stop every rank with one clear error when ranks were started with different configs.

    All ranks take part; those that differ from rank 0 are named. Raises ValueError.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    digest = config_digest(config)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    with comm_guard(f"comparing the {what} across ranks", group):
        dist.all_gather_object(gathered, (digest, config if _small(config) else None), group=group)
    gathered = [(d, _as_dict(c)) for d, c in gathered]
    ref = gathered[0][0]
    bad = [r for r, (d, _) in enumerate(gathered) if d != ref]
    if bad:
        detail = ""
        c0, cb = gathered[0][1], gathered[bad[0]][1]
        if isinstance(c0, dict) and isinstance(cb, dict):
            diffs = sorted(k for k in set(c0) | set(cb) if c0.get(k) != cb.get(k))
            detail = "; differing: " + ", ".join(f"{k}: rank 0 has {c0.get(k)!r}, rank {bad[0]} has {cb.get(k)!r}" for k in diffs[:5])
        raise ValueError(f"ranks {bad} were started with a {what} different from rank 0's{detail}. "
                         "Start every rank with the same arguments.")


def _small(config: Any) -> bool:
    import dataclasses

    return isinstance(config, dict) or (dataclasses.is_dataclass(config) and not isinstance(config, type))


def _as_dict(config: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return config
