"""The one multi-process harness: gloo ranks from a session pool, file rendezvous, a
timeout per run.

``run_ranks(world, fn, *args)`` runs ``fn(rank, world, *args)`` on ``world`` ranks that
join one gloo group through a fresh rendezvous file (so ports never clash) and returns
the per-rank results. A rank that raises or dies, or a run that exceeds its timeout,
fails the caller with the failing rank's traceback. ``run_cases`` runs many named cases
in one run.

The pool. Starting a rank (a spawned interpreter importing torch) costs seconds, so each
test process keeps a *rank group* per world size (and environment) for the whole
session: ``world`` spawned processes that have imported torch and commsched and wait for
work. Each run forks every rank of the group once: the forked child joins the run's own
process group, runs ``fn`` and exits, so a run starts from the pristine state of the
group (whatever a test patches in its ranks, or leaves in a process group, dies with the
child) and pays milliseconds instead of a spawn. A group whose run failed, timed out or
lost a rank on purpose (``allow_missing``) is killed whole (each rank is the leader of its
own process group, so its children go with it) and started afresh the next time.
``COMMSCHED_TEST_POOL=0`` spawns a fresh group for every run instead.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

DEFAULT_TIMEOUT_S = 120.0
# idle pooled ranks a test process keeps at most (each holds an imported torch); the
# group used longest ago goes first
MAX_POOLED_RANKS = 8


def _run_job(rank: int, world: int, job: tuple) -> tuple[str, Any]:
    init_file, pg_timeout_s, fn, args = job
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    try:
        return "ok", fn(rank, world, *args)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _child(rank: int, world: int, job: tuple, w: int) -> None:
    """The forked child of a pooled rank: run the job, write its pickled outcome to ``w``."""
    try:
        outcome = _run_job(rank, world, job)
    except BaseException:
        outcome = ("err", traceback.format_exc())
    try:
        data = pickle.dumps(outcome)
    except Exception:
        data = pickle.dumps(("err", f"rank {rank}'s result cannot be pickled:\n{traceback.format_exc()}"))
    try:
        with os.fdopen(w, "wb") as f:
            f.write(data)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(0)


def _rank_main(rank: int, world: int, conn: Connection, env: dict[str, str]) -> None:
    """A pooled rank: import once, then fork a child per job and relay its outcome."""
    os.setpgid(0, 0)  # the rank leads its own process group: killing it kills its children
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed  # noqa: F401

    import commsched  # noqa: F401
    from commsched.dist import prepare_process_group_import

    torch.set_num_threads(1)
    prepare_process_group_import()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        try:
            job = pickle.loads(msg)
        except BaseException:
            conn.send(("err", f"rank {rank} could not unpickle its job:\n{traceback.format_exc()}"))
            continue
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            conn.close()
            _child(rank, world, job, w)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        if data:
            conn.send(pickle.loads(data))
        else:
            code = os.waitstatus_to_exitcode(status)
            conn.send(("dead", f"rank {rank} died with exit code {code} and no traceback"))


class RankGroup:
    """``world`` pooled ranks started with ``env``; :meth:`run` runs one job on all."""

    def __init__(self, world: int, env: dict[str, str]):
        ctx = mp.get_context("spawn")
        self.world = world
        self.conns: list[Connection] = []
        self.procs = []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(r, world, child, dict(env)), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, args: tuple, *, timeout_s: float, pg_timeout_s: float,
            allow_missing: Sequence[int]) -> list[Any]:
        """Results by rank; raises AssertionError naming the rank that failed (and leaves
        the group unusable: the caller closes it)."""
        fd, init_file = tempfile.mkstemp(prefix="commsched-rdzv-")
        os.close(fd)
        os.unlink(init_file)  # the file store creates it
        try:
            job = pickle.dumps((init_file, pg_timeout_s, fn, args))
            for c in self.conns:
                c.send(job)
            return self._collect(timeout_s, allow_missing)
        finally:
            try:
                os.unlink(init_file)
            except OSError:
                pass

    def _collect(self, timeout_s: float, allow_missing: Sequence[int]) -> list[Any]:
        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        needed = set(range(self.world)) - set(allow_missing)
        pending = {c: r for r, c in enumerate(self.conns)}
        while not needed.issubset(results):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(needed - set(results))
                raise AssertionError(f"ranks {missing} did not finish within {timeout_s:.0f} s "
                                     f"(hang or deadlock); reported: {sorted(results)}")
            ready = wait(list(pending), timeout=min(left, 1.0))
            for c in ready:
                r = pending.pop(c)
                try:
                    results[r] = c.recv()
                except (EOFError, OSError):
                    results[r] = ("dead", f"rank {r} of the pool died (exit code "
                                          f"{self.procs[r].exitcode}) and no traceback")
            errs = {r: p for r, (s, p) in results.items() if s == "err"}
            dead = {r: p for r, (s, p) in results.items() if s == "dead" and r in needed}
            if errs:
                r0 = min(errs)
                raise AssertionError(f"rank {r0} of {self.world} failed:\n{errs[r0]}")
            if dead:
                time.sleep(0.5)  # a survivor's traceback on its way names the cause better
                for c in wait(list(pending), timeout=0):
                    r = pending.pop(c)
                    try:
                        results[r] = c.recv()
                    except (EOFError, OSError):
                        continue
                    if results[r][0] == "err":
                        raise AssertionError(f"rank {r} of {self.world} failed:\n{results[r][1]}")
                r0 = min(dead)
                raise AssertionError(dead[r0])
        return [results[r][1] if r in results and results[r][0] == "ok" else None
                for r in range(self.world)]

    def close(self) -> None:
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for c in self.conns:
            c.close()


_POOL: OrderedDict[tuple, RankGroup] = OrderedDict()


def _pooled(world: int, env: dict[str, str]) -> RankGroup:
    key = (world, tuple(sorted(env.items())))
    group = _POOL.pop(key, None)
    if group is not None and not group.alive():
        group.close()
        group = None
    if group is None:
        while _POOL and sum(g.world for g in _POOL.values()) + world > MAX_POOLED_RANKS:
            _POOL.popitem(last=False)[1].close()
        group = RankGroup(world, env)
    _POOL[key] = group  # most recently used last
    return group


@atexit.register
def close_pool() -> None:
    """Stop every pooled rank (and its children)."""
    while _POOL:
        _POOL.popitem()[1].close()


def run_ranks(world: int, fn: Callable, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
              pg_timeout_s: float = 30.0, allow_missing: Sequence[int] = (),
              env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return results by rank.

    ``fn`` and ``args`` must pickle (module-level functions). Ranks in ``allow_missing``
    may stop without reporting (for dead-peer tests); their result is None. ``env`` is
    set in the ranks before they import torch.
    """
    env = dict(env or {})
    pooled = os.environ.get("COMMSCHED_TEST_POOL", "1") != "0"
    group = _pooled(world, env) if pooled else RankGroup(world, env)
    key = (world, tuple(sorted(env.items())))
    ok = False
    try:
        res = group.run(fn, args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s,
                        allow_missing=allow_missing)
        ok = not allow_missing
        return res
    finally:
        if not (ok and pooled):
            if _POOL.get(key) is group:
                del _POOL[key]
            group.close()


def _run_cases(rank: int, world: int, cases: Sequence[tuple[str, Callable]]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    failed = None
    for name, case in cases:
        if failed is not None:
            out[name] = f"not run: case {failed!r} failed first"
            continue
        try:
            case(rank, world)
            out[name] = None
        except BaseException:
            out[name] = traceback.format_exc()
            failed = name
    return out


def run_cases(world: int, cases: Sequence[tuple[str, Callable]], **kw) -> dict[str, dict[int, str | None]]:
    """Run named cases (``case(rank, world)``, module-level functions) in one run.

    Returns {case: {rank: None or traceback}}. After a failure the remaining cases are
    not run (ranks may be out of step), and say so.
    """
    per_rank = run_ranks(world, _run_cases, list(cases), **kw)
    return {name: {r: per_rank[r][name] for r in range(world)} for name, _ in cases}


def assert_case(results: dict[str, dict[int, str | None]], name: str) -> None:
    bad = {r: tb for r, tb in results[name].items() if tb is not None}
    if bad:
        r = min(bad)
        raise AssertionError(f"case {name!r} failed on ranks {sorted(bad)}; rank {r}:\n{bad[r]}")
