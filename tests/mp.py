"""The one multi-process harness: spawn, gloo, file rendezvous, a timeout per run.

``run_ranks(world, fn, *args)`` starts ``world`` spawned processes that join one gloo
group through a fresh rendezvous file (so ports never clash), runs
``fn(rank, world, *args)`` in each, and returns the per-rank results. A rank that
raises, or a run that exceeds its timeout, fails the caller with the failing rank's
traceback. ``run_cases`` runs many named cases in one spawn so the suite stays fast.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

DEFAULT_TIMEOUT_S = 120.0


def _worker(rank: int, world: int, init_file: str, pg_timeout_s: float, fn: Callable,
            args: tuple, q, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        import torch.distributed as dist

        from commsched.dist import prepare_process_group_import

        torch.set_num_threads(1)
        prepare_process_group_import()
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        try:
            res = fn(rank, world, *args)
            q.put((rank, "ok", res))
        finally:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
    except BaseException:
        q.put((rank, "err", traceback.format_exc()))


def run_ranks(world: int, fn: Callable, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
              pg_timeout_s: float = 30.0, allow_missing: Sequence[int] = (),
              env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return results by rank.

    Ranks in ``allow_missing`` may exit without reporting (for dead-peer tests); their
    result is None.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="commsched-rdzv-")
    os.close(fd)
    os.unlink(init_file)  # the file store creates it
    procs = [ctx.Process(target=_worker, args=(r, world, init_file, pg_timeout_s, fn, args, q,
                                               dict(env or {})), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    needed = set(range(world)) - set(allow_missing)
    try:
        while not needed.issubset(results):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(needed - set(results))
                raise AssertionError(f"ranks {missing} did not finish within {timeout_s:.0f} s "
                                     f"(hang or deadlock); reported: {sorted(results)}")
            try:
                rank, status, payload = q.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r in needed and r not in results and p.exitcode not in (None, 0)]
                if dead:
                    time.sleep(0.5)  # let a traceback that is on its way arrive
                    while True:
                        try:
                            rank, status, payload = q.get_nowait()
                            results[rank] = (status, payload)
                        except queue_mod.Empty:
                            break
                    if any(s == "err" for s, _ in results.values()):
                        break
                    raise AssertionError(f"ranks {dead} died with exit codes "
                                         f"{[procs[r].exitcode for r in dead]} and no traceback") from None
                continue
            results[rank] = (status, payload)
            if status == "err":
                break
        errs = {r: p for r, (s, p) in results.items() if s == "err"}
        if errs:
            r0 = min(errs)
            raise AssertionError(f"rank {r0} of {world} failed:\n{errs[r0]}")
        return [results[r][1] if r in results else None for r in range(world)]
    finally:
        for r in allow_missing:  # a frozen rank of a fault test would never exit by itself
            if procs[r].is_alive():
                procs[r].kill()
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        try:
            os.unlink(init_file)
        except OSError:
            pass


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
    """Run named cases (``case(rank, world)``, module-level functions) in one spawn.

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
