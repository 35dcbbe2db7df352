"""Process-group set-up and guards shared by every front-end.

Every collective commsched issues runs under the process group's timeout, and every
failure of one is turned into a :class:`CommError` that names this rank, the peer when
known, and the cause.
"""

from __future__ import annotations

import datetime
import hashlib
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist

from ._lazy import MissingExtra
from .config import read_env


class CommError(RuntimeError):
    """A collective failed: a peer died, timed out, or the ranks disagreed."""


def current_rank() -> int:
    """This process's rank in the default group (0 before there is one): the rank error messages name."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# After a failed collective each rank checks in under this key of the default store and
# waits at most LIVENESS_WAIT_MAX_S (or the timeout, when shorter) for its peers to do the
# same; the ranks that never do are the ones that stopped answering.
LIVENESS_KEY = "commsched/failed/{rank}"
LIVENESS_WAIT_MAX_S = 10.0
# one rank's one-off work before a collective (rank 0 partitioning a large graph) may take
# longer than the collective timeout: the other ranks wait for it on the store this long
LONG_WORK_WAIT_S = 4 * 3600.0
LONG_WORK_KEY = "commsched/done/{seq}"
_long_work_seq = [0]


@contextmanager
def comm_guard(what: str, group=None) -> Iterator[None]:
    """Re-raise any failure inside as a CommError that says where and why.

    Before raising, the ranks of ``group`` that did not check in after their own failure
    (see :func:`unresponsive_ranks`) are named: on a timeout or a closed connection that is
    the rank that died or froze.
    """
    try:
        yield
    except CommError:
        raise
    except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
        msg = str(e).strip().splitlines()
        cause = msg[0] if msg else type(e).__name__
        cause = cause.split(". This is typically")[0]  # gloo's advice adds nothing here
        hint = peer_failure_hint(str(e))
        # only a peer's failure is worth the liveness check: a local error (bad sizes) would
        # wait for peers that are still blocked in the collective and misname them
        note = unresponsive_note(group) if hint is not None else ""
        raise CommError(f"rank {current_rank()}: {what} failed: {hint or 'the collective failed'}: "
                        f"{cause}{note}") from e


def peer_failure_hint(text: str) -> str | None:
    """What a backend's error text says about the peers: a timeout or a closed connection
    (in words for a message), else None (a local or other error). Pure."""
    low = text.lower()
    if "timeout" in low or "timed out" in low:
        return "a peer did not take part within the timeout (dead, hung or out of step)"
    if "connection" in low or "closed" in low or "reset" in low or "broken pipe" in low:
        return "a peer process died or closed its connection"
    return None


def unresponsive_ranks(group=None, wait_s: float | None = None) -> list[int] | None:
    """The global ranks of ``group`` that did not check in within ``wait_s`` seconds
    (default: the configured timeout, at most :data:`LIVENESS_WAIT_MAX_S`); None when the
    rendezvous store cannot be reached (it may live in the dead process).

    Called by a rank after one of its collectives failed: it checks in under
    :data:`LIVENESS_KEY` in the default store and waits for its peers, which check in when
    their own collectives fail in turn (every rank blocked on a dead or frozen peer fails
    within the timeout). Returns at once when every peer has checked in. Works on any
    backend, gloo included: only the store is used, never the (possibly broken) group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    wait = min(LIVENESS_WAIT_MAX_S, read_env().timeout_s) if wait_s is None else float(wait_s)
    me = dist.get_rank()
    try:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 -- a best-effort diagnosis
        return None
    old = store.timeout
    try:
        store.set_timeout(datetime.timedelta(seconds=max(wait, 1.0)))
        store.set(LIVENESS_KEY.format(rank=me), "1")
        keys = {r: LIVENESS_KEY.format(rank=r) for r in ranks if r != me}
        deadline = time.monotonic() + wait
        missing = sorted(keys)
        while missing:
            missing = [r for r in missing if not store.check([keys[r]])]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        return missing
    except Exception:  # noqa: BLE001 -- the store went away with its host
        return None
    finally:
        try:
            store.set_timeout(old)
        except Exception:  # noqa: BLE001
            pass


def long_work_done(what: str, src: int = 0, *, wait_s: float | None = None) -> None:
    """Every rank calls this where rank ``src`` has finished one-off work that the others
    wait for (rank 0 partitioning the graph before it scatters the parts): ``src`` marks
    it done in the default store at once; the others wait for that mark for up to
    ``wait_s`` seconds (default the larger of :data:`LONG_WORK_WAIT_S` and the collective
    timeout), so the collective that follows does not time out while ``src`` is still
    working. ``src`` calls it whether its work succeeded or not (the collective carries the
    error). A wait past the deadline, or a store that went away with its host, raises
    RuntimeError naming ``what``. Calls pair up by their order on each rank; a no-op
    without a process group of more than one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    _long_work_seq[0] += 1
    key = LONG_WORK_KEY.format(seq=_long_work_seq[0])
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == src:
        store.set(key, "1")
        return
    wait = max(LONG_WORK_WAIT_S, read_env().timeout_s) if wait_s is None else float(wait_s)
    deadline = time.monotonic() + wait
    try:
        while not store.check([key]):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{what}: rank {src} did not finish within {wait:g} s")
            time.sleep(0.2)
    except RuntimeError as e:
        if str(e).startswith(what):
            raise
        raise RuntimeError(f"{what}: rank {src} went away while the others waited for it ({e})") from e


def unresponsive_note(group=None) -> str:
    """What :func:`unresponsive_ranks` found, as the tail of an error message ("; rank 2
    stopped answering ..."); empty when the store could not be asked. For code that
    detects a failure itself (a wait that timed out) rather than through
    :func:`comm_guard`."""
    missing = unresponsive_ranks(group)
    if missing is None:
        return ""
    if missing:
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
        return (f"; {who} stopped answering (no sign of life within "
                f"{min(LIVENESS_WAIT_MAX_S, read_env().timeout_s):.0f} s of the failure: "
                "dead, frozen, or gone after an error of its own)")
    return "; every rank of the group is alive (out of step, or the backend failed)"


def _cli_rank() -> tuple[int, int]:
    """(rank, world size) from the process group, or torchrun's environment before one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        env = read_env()
        return env.rank or 0, env.world_size or 1
    except ValueError:
        return 0, 1


def cli_error(prog: str, err: BaseException, out=None) -> int:
    """The CLI edge of an error commsched detected itself (a ValueError, CommError or
    MissingExtra): one
    line on stderr, ``prog (rank R): message`` when the job has more than one rank, the
    same line appended to ``out``/FAILED when ``out`` is given; returns the exit status 2.
    The rank comes from the process group, or torchrun's environment before there is one."""
    from .results import mark_failed

    rank, world = _cli_rank()
    msg = " ".join(str(err).split()) or type(err).__name__
    if world > 1 and msg.startswith(f"rank {rank}: "):
        msg = msg[len(f"rank {rank}: "):]  # a CommError names its rank already
    line = f"{prog} (rank {rank}): {msg}" if world > 1 else f"{prog}: {msg}"
    print(line, file=sys.stderr, flush=True)
    mark_failed(out, line)
    return 2


class Stopped(BaseException):
    """The process was asked to stop (SIGTERM: torchrun stopping the survivors after a peer
    died, a scheduler's time limit, ``kill``). A BaseException, so no ``except Exception``
    on the way swallows it."""

    def __init__(self, signum: int):
        import signal

        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def cli_main(prog: str, body, *, out=None) -> int:
    """The edge of every entry point: run ``body()`` (returns the exit status) so that

    * a ValueError, :class:`CommError` or :class:`~commsched._lazy.MissingExtra` (an
      optional dependency not installed) it raises is one line on stderr (``prog (rank R):
      message``), appended to ``out()``/FAILED when ``out`` (a callable: the run folder, or
      None before there is one) gives a folder, exit status 2 (:func:`cli_error`);
    * SIGTERM ends it with the same kind of line, ``stopped by SIGTERM``, and the FAILED
      marker, exit status 143 (128 + 15): a run stopped from outside is never mistaken for
      a finished one;
    * any other exception keeps its traceback (it is raised on) and leaves
      ``prog (rank R): Type: message`` in the FAILED marker;
    * whatever happened, the process groups are destroyed last (after the error line,
      which names the rank from the group), once the body has made them.

    The SIGTERM handler is installed for the call (main thread only) and restored after."""
    import signal
    import threading

    from .results import mark_failed

    def on_term(signum, frame):
        raise Stopped(signum)

    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, on_term)
    try:
        return body()
    except (ValueError, CommError, MissingExtra) as e:
        return cli_error(prog, e, out() if out is not None else None)
    except Stopped as e:
        cli_error(prog, e, out() if out is not None else None)
        return 128 + e.signum
    except BaseException as e:  # not one of ours: the traceback stays, the folder says it failed
        mark_failed(out() if out is not None else None, f"{prog} (rank {_cli_rank()[0]}): {type(e).__name__}: {e}")
        raise
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


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
    ``torch.device``; a CUDA device is made current before the group is created and the
    group is bound to it (``device_id``: NCCL's communicator is made at once), and the
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
    kw: dict[str, Any] = {}
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        # bound to its device, the group makes its NCCL communicator now (eagerly): a bad
        # device or an absent peer fails here, within the timeout, not at the first exchange;
        # and batched point-to-point calls (the ring pattern) find the group-wide communicator
        # made, so a rank with nothing to send in a round cannot stall its creation
        kw["device_id"] = torch.device("cuda", torch.cuda.current_device())
    backend = backend or default_backend(dev)
    if env.world_size is None:
        # single process without torchrun: a private file store, world of one
        import tempfile

        f = tempfile.NamedTemporaryFile(prefix="commsched-pg-", delete=False)
        f.close()
        dist.init_process_group(backend, init_method=f"file://{f.name}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=t), **kw)
    else:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=t), **kw)
    if device == "auto" and dist.get_rank() == 0:
        (say or (lambda m: print(f"commsched: {m}", file=sys.stderr, flush=True)))(why)
    return DistInfo(dist.get_rank(), dist.get_world_size(), dev)


GLOO_GROUP = "commsched_gloo"  # gloo with a chosen number of worker threads, on a chosen address
DEFAULT_GLOO_THREADS = 2       # gloo's own default


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
    """A commsched gloo group's worker threads and the local address its connections bind
    to (None: :func:`gloo_devices`), handed to :func:`_create_gloo` through ``pg_options``."""

    threads: int
    address: str | None = None


def _create_gloo(backend_opts, options: GlooGroupOptions):
    """The one factory of commsched's gloo groups (threaded, bound or both)."""
    from torch.distributed import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    opts._devices = (gloo_devices() if options.address is None
                     else [ProcessGroupGloo.create_device(hostname=options.address)])
    opts._threads = options.threads
    timeout = backend_opts.timeout
    opts._timeout = timeout if timeout is not None else datetime.timedelta(minutes=30)
    return ProcessGroupGloo(backend_opts.store, backend_opts.group_rank, backend_opts.group_size, opts)


def check_address(address: str) -> str:
    """``address`` if this process can bind a socket to it, else a ValueError that says so."""
    if not isinstance(address, str) or not address:
        raise ValueError(f"reduce_address must be a local IPv4 address such as 127.0.0.2, got {address!r}")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
    except OSError as e:
        raise ValueError(f"reduce_address {address!r} is not an address of this machine ({e}); on the "
                         "emulated loopback any 127.x.y.z works, elsewhere give one of the host's addresses "
                         "or drop --reduce-address") from None
    return address


def new_group(ranks: list[int], *, threads: int | None = None, timeout_s: float | None = None,
              backend: str | None = None, address: str | None = None, local: bool = False):
    """``dist.new_group(ranks)`` under the configured timeout (``timeout_s``, default
    ``COMMSCHED_TIMEOUT_S``: torch's own default for a new group is 30 minutes whatever the
    default group's is); on gloo with ``threads``, a group whose collectives run on that
    many worker threads (gloo's default is 2; ``new_group`` ignores options for gloo); on
    gloo with ``address``, a group whose connections bind to that local address (checked:
    :func:`check_address`; :mod:`commsched.priority.bind`).

    Asynchronous collectives queued on one gloo group run at most ``threads`` at a time, so
    many small operations in flight (Lina's micro-ops) pay one latency each in turn; more
    threads let their latencies overlap. Other backends ignore ``threads`` and ``address``.
    Every rank must call it, in the same order, like ``dist.new_group``; with ``local``, only
    the ranks in ``ranks`` (a group made inside a sub-group's run): torch names such a group
    by its ranks, so it is made once per process and set of options and kept (never
    destroyed: a second group of the same ranks would meet the first's rendezvous). Every group
    commsched creates is made here (a run's through :class:`RunGroups`). ``backend``: the
    group's backend (default: the default group's); a group that only carries CPU control
    tensors is :meth:`RunGroups.control`'s.
    """
    t = read_env().timeout_s if timeout_s is None else float(timeout_s)
    if not t > 0:
        raise ValueError(f"timeout_s must be > 0, got {t}")
    timeout = datetime.timedelta(seconds=t)
    if local:
        key = (tuple(ranks), threads, backend, address)
        if key in _LOCAL_GROUPS and _LOCAL_GROUPS[key] not in dist.distributed_c10d._world.pg_map:
            del _LOCAL_GROUPS[key]  # the default group was destroyed (and made again) since
        if key not in _LOCAL_GROUPS:
            with _local_group_name(key):
                _LOCAL_GROUPS[key] = _new_group(list(ranks), timeout, threads, backend, address,
                                                {"use_local_synchronization": True})
        return _LOCAL_GROUPS[key]
    return _new_group(list(ranks), timeout, threads, backend, address, {})


_LOCAL_GROUPS: dict[tuple, Any] = {}  # new_group(..., local=True): one per rank set, kept
_LOCAL_MADE: dict[tuple, int] = {}  # how many local groups of each rank set this process made


@contextmanager
def _local_group_name(key: tuple):
    """Name the local group being made from ``key`` alone, the same on every member.

    torch names a group made with ``use_local_synchronization`` by hashing its ranks with
    the number of groups the calling process holds; a rank outside some earlier group holds
    fewer, hashes another name, and waits for a rendezvous the other members never join
    (gloo's "Wait timeout"). Here the name is the ranks, the options and how many local
    groups of those ranks this process made before: the same on every member, since they
    make them in the same order."""
    c10d = dist.distributed_c10d
    hashed = getattr(c10d, "_hash_ranks_to_str", None)
    if hashed is None:  # a torch that names groups otherwise: keep its name
        yield
        return
    seq = _LOCAL_MADE.get(key, 0)
    _LOCAL_MADE[key] = seq + 1
    unique = f"commsched-local/{key!r}/{seq}"

    def name(ranks: list[int]) -> str:
        return hashlib.sha1(unique.encode(), usedforsecurity=False).hexdigest()

    c10d._hash_ranks_to_str = name
    try:
        yield
    finally:
        c10d._hash_ranks_to_str = hashed


def _new_group(ranks: list[int], timeout: datetime.timedelta, threads: int | None, backend: str | None,
               address: str | None, sync: dict):
    if backend is not None:
        if threads is not None:
            raise ValueError("new_group: threads is an option of the default gloo backend; give threads or "
                             f"backend, not both (got backend={backend!r}, threads={threads})")
        return dist.new_group(ranks, backend=backend, timeout=timeout, **sync)
    if (threads is None and address is None) or dist.get_backend() != "gloo":
        return dist.new_group(ranks, timeout=timeout, **sync)
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if address is not None:
        check_address(address)
    if GLOO_GROUP not in dist.Backend.backend_list:
        dist.Backend.register_backend(GLOO_GROUP, _create_gloo, extended_api=True,
                                      devices=["cpu", "cuda"])  # gloo reduces CUDA tensors too
    return dist.new_group(list(ranks), backend=GLOO_GROUP, timeout=timeout,
                          pg_options=GlooGroupOptions(threads or DEFAULT_GLOO_THREADS, address), **sync)


CONTROL_BACKEND = "gloo"  # the backend of groups that carry only CPU control tensors


class RunGroups:
    """The process groups of one run: every group a run needs beyond the default one
    (expert-parallel, expert-data-parallel, data-parallel, hierarchical, bound twins,
    control) is made here on demand (:meth:`new`, :meth:`control`: collective, as
    :func:`new_group`), kept, and destroyed once by :meth:`close` (or at the end of a
    ``with`` block), so no group outlives its run."""

    def __init__(self) -> None:
        self._made: list[Any] = []

    def new(self, ranks: Sequence[int], **kw: Any):
        """:func:`new_group` of ``ranks`` (its keywords), kept until :meth:`close`."""
        g = new_group(list(ranks), **kw)
        if not kw.get("local"):  # a local group is the process's (new_group)
            self._made.append(g)
        return g

    def control(self, ranks: Sequence[int], *, timeout_s: float | None = None):
        """A group of ``ranks`` for CPU control tensors only (counts, flags; never a CUDA
        tensor): gloo whatever the default backend, so a CUDA job gives it no NCCL
        communicator (and its device memory) that it would never use."""
        return self.new(ranks, timeout_s=timeout_s, backend=CONTROL_BACKEND)

    def close(self) -> None:
        """Destroy every group made here that is still alive; idempotent."""
        made, self._made = self._made, []
        if not (dist.is_available() and dist.is_initialized()):
            return
        live = dist.distributed_c10d._world.pg_map
        for g in reversed(made):
            if g in live:
                dist.destroy_process_group(g)

    def __enter__(self) -> "RunGroups":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def claim_run_folder(path: Any, *, overwrite: bool = False, resume: bool = False, flag: str = "--out"):
    """The run folder of a front-end, made and checked before any work (collective): rank 0
    takes it (:func:`commsched.results.claim_out`: a lock held for the run's life, so a
    second run into the same folder is refused, ``--out DIR is in use by another run (pid
    N)``, with nothing of the first touched) and every rank learns whether it could; then the
    other ranks make it too (:func:`commsched.results.prepare_out`, for folders not shared
    between hosts). Returns rank 0's :class:`~commsched.results.FolderLock` (None elsewhere):
    keep it until the run ends."""
    from .results import claim_out, prepare_out

    rank, world = current_rank(), (dist.get_world_size() if dist.is_initialized() else 1)
    held, err = None, None
    if rank == 0:
        try:
            held = claim_out(path, overwrite=overwrite, resume=resume, flag=flag)
        except ValueError as e:
            err = str(e)
    if world > 1:
        err = broadcast_object(err, "claiming the run folder")
    if err is not None:
        raise ValueError(err)
    if rank != 0:
        prepare_out(path, overwrite=overwrite, resume=resume, flag=flag)
    return held
