"""The GPU check: what only a GPU can show, in one command of a few minutes.

    python -m commsched.bench.gpucheck --out DIR [--device cuda] [--procs 2,4] [--quick]

Sections (each reports ``ok``, ``failed`` with the error, or ``skipped`` with the reason):

* ``kernels``: the Triton kernels against the torch reference on the device, bit for bit
  (payload, metadata, decoded rows) at irregular shapes and every width.
* ``codec``: quantize / dequantize throughput against ``torch.clone`` of the same tensor,
  and the clone's share of the card's memory bandwidth (from its name when known).
* ``frontends``: GNN training (Vanilla and AdaQP), MoE training (Lina; DeepSpeed when
  installed) and MoE inference, a few steps each at world size 1 on the device, with the
  peak device memory of each (> 0 shows it ran there).
* ``nccl``: at world size 1 commsched's exchanges short-circuit, so the backend itself is
  called in a child process: ``all_reduce``, ``all_to_all_single`` with split sizes,
  ``batch_isend_irecv``, reduce-scatter / all-gather into tensors, ``Work.wait`` /
  ``is_completed`` and event timing, on NCCL with ``device_id`` (gloo on the CPU, where the
  calls gloo lacks are skipped by name).
* ``cuda_tests``: the test suite's ``cuda``-marked tests (``pytest -m cuda``), when the
  package runs from a repository checkout.
* ``shared``: 2-4 processes sharing the one GPU over gloo with CUDA tensors: the direct
  all_to_all and a multi-segment exchange against a point-to-point reference, and the
  gradient executor's ordering: ``finish()`` returns only once every reduction is in the
  gradients (NCCL refuses two ranks on one GPU, so this runs on gloo).

The whole check has a deadline (``--deadline``, default 480 s = 8 minutes); each section has
its share of it (:data:`SECTION_SHARES`, adding up to it): a section past its budget fails
(a child process is killed; an in-process section is left behind on its thread) and the check
goes on; none starts once the deadline is spent. What was skipped is printed at the end,
one line each (``skipped: SECTION[/PART]: reason``) and listed in the JSON (``skipped``).

Writes ``DIR/gpucheck.json`` and ``DIR/gpucheck.log``; exits 1 when a section failed. With
``--device cpu`` the same code runs on the CPU (the kernel section is skipped): the test
suite runs it that way.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from ..results import write_json

# memory bandwidth of cards by name (bytes/s), for the clone's share of it
CARD_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12,
                  "A10": 0.6e12, "V100": 0.9e12}
KERNEL_SHAPES = ((1, 1), (3, 127), (70, 300), (257, 33), (1000, 1000), (0, 20))


class Log:
    """Lines to stdout and to the log file, with the seconds since the start."""

    def __init__(self, path: Path):
        self.f = open(path, "w")
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f} s] {msg}"
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def _section(name: str, fn: Callable[[], dict], log: Log) -> dict:
    log(f"{name}: start")
    t = time.perf_counter()
    try:
        res = fn()
        res.setdefault("status", "ok")
    except _Skip as e:
        res = {"status": "skipped", "reason": str(e)}
    except Exception as e:  # reported, and the check goes on with the next section
        res = {"status": "failed", "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()}
    res["seconds"] = time.perf_counter() - t
    log(f"{name}: {res['status']}" + (f" ({res.get('reason') or res.get('error')})"
                                      if res["status"] != "ok" else "") + f" in {res['seconds']:.1f} s")
    return res


class _Skip(Exception):
    """A section that cannot run here, and why."""


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise _Skip(f"{module} is not installed")


# --------------------------------------------------------------------------- kernels
def check_kernels(device: torch.device, quick: bool) -> dict:
    """Triton against the reference, bit for bit, on the device."""
    if device.type != "cuda":
        raise _Skip("the Triton kernels need a CUDA device (the CPU suite runs them under the "
                    "interpreter and compiles them for sm_90)")
    from ..quant.codec import dequantize, quantize
    from ..quant.wire import BITS

    g = torch.Generator().manual_seed(0)
    cases = []
    for N, D in KERNEL_SHAPES[:3] if quick else KERNEL_SHAPES:
        x = torch.randn(N, D, generator=g) * 3 - 1
        for b in BITS:
            ref = quantize(x, b, seed=1234 + b, impl="reference")
            got = quantize(x.to(device), b, seed=1234 + b, impl="triton")
            same_p = torch.equal(got.payload.cpu(), ref.payload)
            same_m = torch.equal(got.meta.cpu(), ref.meta)
            dec = dequantize(got, impl="triton").cpu()
            same_d = torch.equal(dec, dequantize(ref, impl="reference"))
            cases.append({"N": N, "D": D, "bits": b, "payload": same_p, "meta": same_m, "decoded": same_d})
    bad = [c for c in cases if not (c["payload"] and c["meta"] and c["decoded"])]
    return {"status": "ok" if not bad else "failed", "cases": len(cases), "mismatches": bad}


# --------------------------------------------------------------------------- codec
def check_codec(device: torch.device, quick: bool) -> dict:
    """Throughput of the codec beside torch.clone on the same tensor."""
    from ..clock import Clock
    from ..quant.codec import dequantize, quantize

    rows, dim = (1 << 20, 256) if device.type == "cuda" and not quick else (2000, 256)
    x = torch.randn(rows, dim, device=device)
    clock = Clock(device)
    nbytes = x.numel() * 4

    def best(fn, reps: int = 5) -> float:
        fn()  # warm-up (compiles)
        times = []
        for _ in range(reps):
            a = clock.mark()
            fn()
            times.append(clock.seconds(a, clock.mark()))
        return min(times)

    out: dict[str, Any] = {"rows": rows, "dim": dim, "device": str(device)}
    t_clone = best(lambda: x.clone())
    out["clone_GBps"] = 2 * nbytes / t_clone / 1e9  # a read and a write
    for b in (2, 4, 8):
        q = quantize(x, b, seed=b)
        tq = best(lambda b=b: quantize(x, b, seed=b))
        td = best(lambda q=q: dequantize(q))
        out[f"b{b}"] = {"quantize_GBps": nbytes / tq / 1e9, "dequantize_GBps": nbytes / td / 1e9,
                        "quantize_vs_clone": t_clone / tq, "dequantize_vs_clone": t_clone / td}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        out["card"] = name
        bw = next((v for k, v in CARD_BANDWIDTH.items() if k in name), None)
        if bw:
            out["clone_share_of_bandwidth"] = out["clone_GBps"] * 1e9 / bw
    return out


# --------------------------------------------------------------------------- front-ends
def frontend_runs(device: torch.device, quick: bool, out: Path) -> list[tuple[str, str, list[str], str | None]]:
    """(name, module, argv, dependency) of each front-end run: a few steps, small sizes."""
    dev = ["--device", "cuda" if device.type == "cuda" else "cpu"]
    epochs = "2" if quick else "4"
    steps = ["--steps", "3", "--warmup", "1", "--probe-steps", "1", "--eval-batches", "1"]
    small = ["--batch-size", "2", "--seq-len", "32", "--d-model", "64", "--heads", "2", "--layers", "2",
             "--d-ff", "128", "--expert-hidden", "128", "--experts", "4"]
    return [
        ("gnn-vanilla", "commsched.gnn.train", ["--mode", "vanilla", "--epochs", epochs, *dev], "pymetis"),
        ("gnn-adaqp", "commsched.gnn.train", ["--mode", "adaqp", "--epochs", epochs, *dev], "ortools"),
        ("moe-train-lina", "commsched.moe.train", ["--schedule", "lina", *steps, *small, *dev], None),
        ("moe-train-deepspeed", "commsched.moe.train", ["--impl", "deepspeed", *steps, *small, *dev],
         "deepspeed"),
        # --compute real: the default, emulated, is the CPU model of an accelerator (refused on cuda)
        ("moe-infer-lina", "commsched.moe.infer", ["--placement", "lina", "--compute", "real", "--batches", "3",
                                                   "--warmup", "1", *dev], None),
    ]


# runs one entry point's main() in a child process and reports its peak device memory,
# also when the entry point leaves through os._exit (the DeepSpeed run does, to skip a
# teardown abort): python -c _CHILD REPORT.json MODULE ARGS...
_CHILD = """
import json, os, sys, importlib, torch
report, module, args = sys.argv[1], sys.argv[2], sys.argv[3:]
def write():
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    with open(report, "w") as f:
        json.dump({"peak_device_MiB": peak}, f)
exit_now = os._exit
def leave(code):
    write(); sys.stdout.flush(); sys.stderr.flush(); exit_now(code)
os._exit = leave
rc = importlib.import_module(module).main(args)
write()
sys.exit(rc or 0)
"""


def check_frontends(device: torch.device, quick: bool, out: Path, timeout_s: float = 600) -> dict:
    """Each front-end's own entry point as a one-process job (torchrun's environment) on
    the device: its exit status, the metrics it wrote and its peak device memory (CUDA).
    ``timeout_s`` is the whole section's budget: a run gets what is left of it."""
    import socket
    import subprocess

    res: dict[str, Any] = {}
    failed = False
    end = time.monotonic() + timeout_s
    for name, module, argv, dep in frontend_runs(device, quick, out):
        if dep is not None and importlib.util.find_spec(dep) is None:
            res[name] = {"status": "skipped", "reason": f"{dep} is not installed"}
            continue
        left = end - time.monotonic()
        if left < 5:
            res[name] = {"status": "skipped", "reason": f"the section's budget of {timeout_s:.0f} s was spent"}
            continue
        run_dir = out / "frontends" / name
        run_dir.mkdir(parents=True, exist_ok=True)
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), COMMSCHED_PROGRESS="0")
        cmd = [sys.executable, "-c", _CHILD, str(run_dir / "peak.json"), module, *argv,
               "--out", str(run_dir), "--overwrite"]
        t = time.perf_counter()
        with open(run_dir / "log.txt", "w") as logf:
            try:
                rc = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                    timeout=left).returncode
                err = None if rc == 0 else f"exit status {rc}; log: {run_dir / 'log.txt'}"
            except subprocess.TimeoutExpired:
                err = f"ran past the {left:.0f} s left of the section's budget; log: {run_dir / 'log.txt'}"
        r: dict[str, Any] = {"status": "failed" if err else "ok", "seconds": time.perf_counter() - t,
                             "command": f"python -m {module} " + " ".join(argv)}
        if err:
            r["error"] = err
            failed = True
        peak = run_dir / "peak.json"
        if peak.exists():
            r.update(json.loads(peak.read_text()))
        if device.type == "cuda" and not err and not (r.get("peak_device_MiB") or 0) > 0:
            r["status"], r["error"] = "failed", "no device memory used: it did not run on the GPU"
            failed = True
        mpath = run_dir / "metrics.json"
        if mpath.exists():
            m = json.loads(mpath.read_text())
            r["metrics"] = {k: m[k] for k in ("device", "loss", "epoch_time_s", "step_time_s",
                                              "latency_ms", "test_acc") if k in m}
        elif not err:
            r["status"], r["error"] = "failed", "no metrics.json written"
            failed = True
        res[name] = r
    res["status"] = "failed" if failed else "ok"
    return res


# --------------------------------------------------------------------------- shared GPU, gloo
def _shared_worker(rank: int, world: int, init_file: str, device_name: str, q) -> None:
    try:
        import torch.distributed as dist

        from ..all2all import SegmentLayout, all_to_all, exchange_segments
        from ..dist import prepare_process_group_import

        prepare_process_group_import()
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        dev = torch.device(device_name)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        res: dict[str, Any] = {}
        # direct all_to_all: rank r sends (r + p + 1) rows to p, each row tagged (src, dst, i)
        counts = [rank + p + 1 for p in range(world)]
        x = torch.cat([torch.tensor([[rank, p, i] for i in range(counts[p])], dtype=torch.float32)
                       for p in range(world)]).to(dev)
        y = all_to_all(x, counts, pattern="direct").cpu()
        want = torch.cat([torch.tensor([[s, rank, i] for i in range(s + rank + 1)], dtype=torch.float32)
                          for s in range(world)])
        res["all_to_all"] = bool(torch.equal(y, want))
        # segments: two byte segments per peer, sizes known to both sides
        segs = [[torch.full((rank + p + 1,), rank, dtype=torch.uint8, device=dev),
                 torch.full((2,), p, dtype=torch.uint8, device=dev)] for p in range(world)]
        layout = SegmentLayout(tuple((s + rank + 1, 2) for s in range(world)))
        got = exchange_segments(segs, layout, pattern="direct", validate=True, device=dev)
        res["segments"] = all(torch.equal(got[s][0].cpu(), torch.full((s + rank + 1,), s, dtype=torch.uint8))
                              and torch.equal(got[s][1].cpu(), torch.full((2,), rank, dtype=torch.uint8))
                              for s in range(world))
        res["executor"] = _executor_check(rank, world, dev)
        dist.destroy_process_group()
        q.put((rank, "ok", res))
    except BaseException:
        q.put((rank, "err", traceback.format_exc()))


def _executor_check(rank: int, world: int, dev: torch.device) -> bool:
    """Gradients reduced by the Lina executor are the ranks' mean, read right after
    ``finish()`` (no race: finish returns only when every reduction is in place)."""
    from ..priority.executor import GradScheduler
    from ..priority.policy import ScheduleConfig

    params = [torch.nn.Parameter(torch.zeros(n, device=dev)) for n in (70_000, 3, 40_000, 1)]
    cfg = ScheduleConfig("lina", microop_bytes=16 << 10)
    ok = True
    with GradScheduler([(p, None, 1.0 / world) for p in params], cfg) as s:
        for step in range(3):
            for p in params:
                p.grad = None
            s.begin_step()
            loss = sum((i + 1) * (rank + 1 + step) * p.sum() for i, p in enumerate(params))
            loss.backward()
            s.finish()
            for i, p in enumerate(params):  # mean over ranks of (i + 1) * (r + 1 + step)
                want = (i + 1) * ((world + 1) / 2 + step)
                ok &= bool(torch.allclose(p.grad, torch.full_like(p.grad, want), rtol=1e-6))
    return ok


def check_shared(device: torch.device, procs: tuple[int, ...], timeout_s: float = 360) -> dict:
    """2-4 processes on the one device over gloo (CUDA tensors when the device is CUDA);
    ``timeout_s``: the section's budget, shared by the process counts."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {}
    failed = False
    end = time.monotonic() + timeout_s
    for i, world in enumerate(procs):
        q = ctx.Queue()
        with tempfile.TemporaryDirectory() as d:
            init = os.path.join(d, "rdzv")
            ps = [ctx.Process(target=_shared_worker, args=(r, world, init, str(device), q))
                  for r in range(world)]
            for p in ps:
                p.start()
            res, errs = {}, []
            deadline = time.monotonic() + (end - time.monotonic()) / (len(procs) - i)
            while len(res) + len(errs) < world and time.monotonic() < deadline:
                try:
                    r, status, val = q.get(timeout=5)
                except Exception:
                    continue
                (res.__setitem__(r, val) if status == "ok" else errs.append(val))
            for p in ps:
                p.join(timeout=2 if errs or len(res) < world else 10)
                if p.is_alive():
                    p.kill()
        if errs or len(res) < world:
            failed = True
            out[f"world{world}"] = {"error": errs[0] if errs else "ran past its share of the section's budget"}
        else:
            per = {k: all(res[r][k] for r in range(world)) for k in res[0]}
            failed |= not all(per.values())
            out[f"world{world}"] = per
    out["status"] = "failed" if failed else "ok"
    return out


# --------------------------------------------------------------------------- NCCL at world size 1
def _nccl_worker(init_file: str, device_name: str, q) -> None:
    """torch.distributed's own calls on a one-rank group (NCCL on CUDA, gloo on the CPU),
    bypassing commsched's one-rank shortcuts; puts (status, {check: bool}, {check: reason})."""
    try:
        import torch.distributed as dist

        from ..clock import Clock
        from ..dist import prepare_process_group_import

        prepare_process_group_import()
        dev = torch.device(device_name)
        kw: dict[str, Any] = {}
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            kw["device_id"] = dev  # eager communicator: a bad device fails here, not later
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60), **kw)
        res: dict[str, bool] = {}
        skipped: dict[str, str] = {}
        clock = Clock(dev)
        # all_reduce, asynchronous: Work.wait(), then is_completed() once the device is idle
        t = torch.arange(1000, dtype=torch.float32, device=dev)
        a = clock.mark()
        w = dist.all_reduce(t, async_op=True)
        w.wait()  # NCCL: the current stream waits for it
        b = clock.mark()
        res["all_reduce"] = bool(torch.equal(t.cpu(), torch.arange(1000, dtype=torch.float32)))
        clock.sync()
        res["work_is_completed"] = bool(w.is_completed())
        res["event_timing"] = clock.seconds(a, b) >= 0.0
        # all_to_all_single with explicit split sizes (one rank: one split of 7 rows)
        x = torch.arange(21, dtype=torch.float32, device=dev).reshape(7, 3)
        y = torch.empty_like(x)
        w = dist.all_to_all_single(y, x, [7], [7], async_op=True)
        w.wait()
        res["all_to_all_single_splits"] = bool(torch.equal(y.cpu(), x.cpu()))
        # batch_isend_irecv to itself (the ring pattern's call)
        sb, rb = torch.full((5,), 3.0, device=dev), torch.zeros(5, device=dev)
        try:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sb, 0), dist.P2POp(dist.irecv, rb, 0)])
            for w in works:
                w.wait()
            res["batch_isend_irecv"] = bool(torch.equal(rb.cpu(), sb.cpu()))
        except RuntimeError as e:
            if backend != "gloo":
                raise
            skipped["batch_isend_irecv"] = f"gloo cannot send to its own rank ({str(e).splitlines()[0][:80]})"
        # a reduce-scatter and an all-gather into tensors (the hierarchical reduction's phases)
        src = torch.arange(6, dtype=torch.float32, device=dev)
        out = torch.empty(6, device=dev)
        try:
            dist.reduce_scatter_tensor(out, src, async_op=True).wait()
            res["reduce_scatter_tensor"] = bool(torch.equal(out.cpu(), src.cpu()))
        except (RuntimeError, ValueError) as e:
            if backend != "gloo":
                raise
            skipped["reduce_scatter_tensor"] = f"not on gloo ({str(e).splitlines()[0][:80]})"
        g = torch.empty(6, device=dev)
        dist.all_gather_into_tensor(g, src, async_op=True).wait()
        res["all_gather_into_tensor"] = bool(torch.equal(g.cpu(), src.cpu()))
        dist.destroy_process_group()
        q.put(("ok", res, skipped))
    except BaseException:
        q.put(("err", traceback.format_exc(), {}))


def check_nccl(device: torch.device, timeout_s: float = 60) -> dict:
    """At world size 1 commsched's exchanges short-circuit, so this section calls the backend
    directly in a child process (NCCL on CUDA; gloo on the CPU, where the calls gloo lacks are
    skipped, each named): all_reduce, all_to_all_single with split sizes, batch_isend_irecv,
    reduce_scatter / all_gather into tensors, Work.wait / is_completed, event timing. A hang
    ends at ``timeout_s`` with the child killed."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        p = ctx.Process(target=_nccl_worker, args=(os.path.join(d, "rdzv"), str(device), q))
        p.start()
        try:
            status, res, skipped = q.get(timeout=timeout_s)
        except Exception:
            status, res, skipped = "hang", None, {}
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    if status == "hang":
        return {"status": "failed", "error": f"ran past its budget of {timeout_s:.0f} s (a hang?)"}
    if status == "err":
        return {"status": "failed", "error": res.strip().splitlines()[-1], "traceback": res}
    out: dict[str, Any] = {"backend": "nccl" if device.type == "cuda" else "gloo", "checks": res}
    if skipped:
        out["skipped"] = skipped
    out["status"] = "ok" if all(res.values()) else "failed"
    return out


# --------------------------------------------------------------------------- cuda tests
def check_cuda_tests(device: torch.device, out: Path, timeout_s: float = 300) -> dict:
    """The test suite's ``cuda``-marked tests (a repository checkout only)."""
    import subprocess

    if device.type != "cuda":
        raise _Skip("the cuda-marked tests need a CUDA device")
    root = Path(__file__).resolve().parents[2]
    if not (root / "tests" / "conftest.py").exists():
        raise _Skip(f"no test suite beside the package ({root / 'tests'})")
    _needs("pytest")
    log = out / "cuda-tests.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"]
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=root, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return {"status": "failed", "error": f"ran past its budget of {timeout_s:.0f} s", "log": str(log)}
    tail = log.read_text().strip().splitlines()[-1:] or [""]
    return {"status": "ok" if rc == 0 else "failed", "summary": tail[0], "log": str(log),
            "command": " ".join(cmd[1:])}


# --------------------------------------------------------------------------- main
DEADLINE_S = 480.0  # the whole check's default deadline (8 minutes)
# each section's share of the deadline (they add up to 1: one hang cannot overrun the total)
SECTION_SHARES = {"kernels": 0.08, "codec": 0.05, "nccl": 0.07, "frontends": 0.45, "shared": 0.2,
                  "cuda_tests": 0.15}
SECTIONS = tuple(SECTION_SHARES)


def section_budgets(deadline_s: float) -> dict[str, float]:
    """Seconds each section may take under an overall deadline (they add up to it). Pure."""
    if not deadline_s > 0:
        raise ValueError(f"the deadline must be > 0 seconds, got {deadline_s}")
    return {k: deadline_s * v for k, v in SECTION_SHARES.items()}


def _with_budget(fn: Callable[[], dict], budget_s: float) -> Callable[[], dict]:
    """``fn`` on a daemon thread, given up after ``budget_s`` (an in-process section cannot
    be killed; a hung one is reported and left behind, and the check goes on)."""
    import threading

    def run() -> dict:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["res"] = fn()
            except BaseException as e:  # re-raised in the caller's thread
                box["err"] = e

        th = threading.Thread(target=target, daemon=True)
        th.start()
        th.join(budget_s)
        if th.is_alive():
            raise TimeoutError(f"ran past its budget of {budget_s:.0f} s (a hang?)")
        if "err" in box:
            raise box["err"]
        return box["res"]
    return run


def skipped_lines(results: dict) -> list[str]:
    """What the check skipped, one line each: a section, a front-end run or a single check."""
    lines = []
    for name, r in results.items():
        if not isinstance(r, dict) or name == "info":
            continue
        if r.get("status") == "skipped":
            lines.append(f"{name}: {r.get('reason')}")
            continue
        for sub, v in r.items():
            if isinstance(v, dict) and v.get("status") == "skipped":
                lines.append(f"{name}/{sub}: {v.get('reason')}")
        for sub, why in (r.get("skipped") or {}).items():
            lines.append(f"{name}/{sub}: {why}")
    return lines


def run_check(out: Path, device: torch.device, *, procs: tuple[int, ...] = (2, 4),
              quick: bool = False, sections: tuple[str, ...] | None = None,
              say: Log | None = None, deadline_s: float = DEADLINE_S) -> dict:
    """Run the sections (all by default) and write ``out/gpucheck.json``; returns it. Each
    section has its share of ``deadline_s`` (:func:`section_budgets`); a section past its
    budget fails, the check goes on, and no section starts once the deadline is spent."""
    out.mkdir(parents=True, exist_ok=True)
    log = say or Log(out / "gpucheck.log")
    budgets = section_budgets(deadline_s)
    table: dict[str, Callable[[float], dict]] = {
        "kernels": lambda b: _with_budget(lambda: check_kernels(device, quick), b)(),
        "codec": lambda b: _with_budget(lambda: check_codec(device, quick), b)(),
        "nccl": lambda b: check_nccl(device, timeout_s=b),
        "frontends": lambda b: check_frontends(device, quick, out, timeout_s=b),
        "shared": lambda b: check_shared(device, procs, timeout_s=b),
        "cuda_tests": lambda b: check_cuda_tests(device, out, timeout_s=b),
    }
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "command": " ".join(sys.argv),
                            "deadline_s": deadline_s}
    if device.type == "cuda":
        info["card"] = torch.cuda.get_device_name(device)
    log(f"gpucheck on {info.get('card', device)} (torch {torch.__version__}), deadline {deadline_s:.0f} s")
    results: dict[str, Any] = {"info": info}
    end = time.monotonic() + deadline_s
    for name, fn in table.items():
        if sections is not None and name not in sections:
            continue
        left = end - time.monotonic()
        if left < 1:
            results[name] = {"status": "skipped", "reason": f"the deadline of {deadline_s:.0f} s was spent"}
            log(f"{name}: skipped ({results[name]['reason']})")
            continue
        budget = min(budgets[name], left)
        results[name] = _section(name, lambda fn=fn, budget=budget: fn(budget), log)
    results["ok"] = all(r.get("status") != "failed" for k, r in results.items() if isinstance(r, dict) and k != "info")
    results["skipped"] = skipped_lines(results)
    write_json(out / "gpucheck.json", results)
    for line in results["skipped"]:
        log(f"skipped: {line}")
    log(f"gpucheck: {'ok' if results['ok'] else 'FAILED'}; {out / 'gpucheck.json'}")
    if say is None:
        log.close()
    return results


def main(argv: list[str] | None = None) -> int:
    from ..dist import DEVICE_CHOICES, resolve_device

    p = argparse.ArgumentParser(prog="python -m commsched.bench.gpucheck",
                                description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", choices=DEVICE_CHOICES, default="cuda")
    p.add_argument("--procs", default="2,4", help="process counts sharing the device")
    p.add_argument("--quick", action="store_true", help="fewer shapes, smaller runs")
    p.add_argument("--sections", default=None, help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--deadline", type=float, default=DEADLINE_S,
                   help=f"seconds for the whole check (default {DEADLINE_S:.0f}); each section has its share")
    a = p.parse_args(argv)
    try:
        device, _ = resolve_device(a.device)
    except ValueError as e:
        print(f"gpucheck: {e}", file=sys.stderr)
        return 2
    procs = tuple(int(x) for x in a.procs.split(",") if x)
    sections = tuple(a.sections.split(",")) if a.sections else None
    unknown = sorted(set(sections or ()) - set(SECTIONS))
    if unknown or not a.deadline > 0:
        print(f"gpucheck: unknown sections {unknown} (choose from {','.join(SECTIONS)})" if unknown
              else f"gpucheck: --deadline must be > 0, got {a.deadline}", file=sys.stderr)
        return 2
    res = run_check(a.out, device, procs=procs, quick=a.quick, sections=sections, deadline_s=a.deadline)
    print(json.dumps({k: v.get("status") for k, v in res.items() if isinstance(v, dict) and "status" in v}))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
