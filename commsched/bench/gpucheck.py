"""The GPU check: what only a GPU can show, in one command of a few minutes.

    python -m commsched.bench.gpucheck [--out DIR] [--device cuda] [--procs 2,4] [--quick]

Sections (:data:`SECTIONS`; each reports ``ok``, ``failed`` with the error, or ``skipped``
with the reason): ``warm`` (compile every Triton specialisation the others use), ``kernels``
(Triton against the torch reference, bit for bit), ``codec`` (throughput against
``torch.clone``), ``nccl`` and ``paths`` (the backend and the new paths at world size 1:
:mod:`commsched.bench.gpucheck_onerank`), ``frontends`` (each entry point for a few steps,
with its peak device memory), ``shared`` (2-4 processes on one GPU over gloo) and
``cuda_tests`` (the suite's ``cuda``-marked tests). What each checks: docs/methods/core.md.

One deadline (``--deadline``, :data:`DEADLINE_S`) is shared by the sections in proportion to
measured budgets (:data:`SECTION_BUDGET_S`); a section past its budget fails (a child process
is killed with its process group; an in-process section is left behind on its thread) and
the check goes on. Writes ``DIR/gpucheck.json`` and ``DIR/gpucheck.log`` (default DIR
``runs/gpucheck-<time>``), prints what was skipped, and exits 1 when a section failed. With
``--device cpu`` the same code runs on the CPU, skipping what only a GPU runs (the suite runs
``--device cpu --quick``).
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

from .._lazy import OPTIONAL
from ..results import write_json
from .gpucheck_onerank import PATH_CHECKS, RECORD_WIDTHS, check_nccl, check_paths  # noqa: F401 (re-exported)

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


# the tools of the test suite: the ``test`` extra installs them
TEST_TOOLS = ("pytest",)


def not_installed(module: str) -> str:
    """Why a section that needs ``module`` is skipped: the package is not installed, and the
    extra of commsched that installs it (:data:`commsched._lazy.OPTIONAL`; the test tools:
    ``test``)."""
    top = module.partition(".")[0]
    extra = OPTIONAL[top][1] if top in OPTIONAL else ("test" if top in TEST_TOOLS else None)
    how = f"; install it with pip install 'commsched[{extra}]'" if extra else ""
    return f"{module} is not installed{how}"


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise _Skip(not_installed(module))


# --------------------------------------------------------------------------- kernels
def warm_kernels(device: torch.device, quick: bool) -> dict:
    """Compile every Triton specialisation the later sections use (or load it from Triton's
    on-disk cache, which the ``paths`` child then finds filled), one row each, so that the
    ``kernels``, ``codec`` and ``paths`` budgets time checks, not cold compiles: quantize /
    dequantize at the kernel shapes' and the codec's widths, row records at the record
    widths, the allreduce's row width and the all-to-all check's, every width of bits."""
    if device.type != "cuda":
        raise _Skip("the Triton kernels need a CUDA device to compile for")
    from ..quant.allreduce import ROW_VALUES
    from ..quant.codec import decode_records, dequantize, encode_records, quantize
    from ..quant.wire import BITS

    flat = sorted({D for N, D in (KERNEL_SHAPES[:3] if quick else KERNEL_SHAPES) if N} | {256})
    records = sorted(set(RECORD_WIDTHS[:3] if quick else RECORD_WIDTHS) | {ROW_VALUES, 129})
    calls = 0
    for D in flat:
        x = torch.randn(1, D, device=device)
        for b in BITS:
            dequantize(quantize(x, b, seed=1, impl="triton"), impl="triton")
            calls += 2
    for D in records:
        x = torch.randn(1, D, device=device)
        for b in BITS:
            decode_records(encode_records(x, b, 1, impl="triton"), b, D, impl="triton")
            calls += 2
    torch.cuda.synchronize(device)
    return {"kernel_calls": calls, "flat_widths": flat, "record_widths": records}


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
# the new MoE paths of one run: 8-bit expert all-to-all, 8-bit gradient reduction, the chunked
# all-to-all pipelined with the experts
Q8_PIPELINE = ["--a2a-bits", "8", "--grad-bits", "8", "--chunks", "2", "--pipeline"]
# the CPU's --quick plan (the test suite runs it): one launch of every entry point, the MoE
# training one with every new path (Q8_PIPELINE and --merge); the others run on CUDA and in
# the CPU's full plan
CPU_QUICK_RUNS = ("gnn-vanilla", "moe-train-lina-merge", "moe-infer-lina")


def frontend_runs(device: torch.device, quick: bool, out: Path) -> list[tuple[str, str, list[str], str | None]]:
    """(name, module, argv, dependency) of each front-end run: a few steps, small sizes (a
    GNN run on the default synthetic graph takes minutes on a CPU and shows nothing more)."""
    dev = ["--device", "cuda" if device.type == "cuda" else "cpu"]
    epochs = "2" if quick else "4"
    graph = ["--syn-nodes", "2000", "--syn-edges", "10000", "--hidden", "32", "--layers", "2"]
    steps = ["--steps", "3", "--warmup", "1", "--probe-steps", "1", "--eval-batches", "1"]
    small = ["--batch-size", "2", "--seq-len", "32", "--d-model", "64", "--heads", "2", "--layers", "2",
             "--d-ff", "128", "--expert-hidden", "128", "--experts", "4"]
    return [
        ("gnn-vanilla", "commsched.gnn.train", ["--mode", "vanilla", "--epochs", epochs, *graph, *dev], "pymetis"),
        ("gnn-adaqp", "commsched.gnn.train", ["--mode", "adaqp", "--epochs", epochs, *graph, *dev], "ortools"),
        ("moe-train-lina", "commsched.moe.train", ["--schedule", "lina", *steps, *small, *dev], None),
        ("moe-train-lina-q8", "commsched.moe.train", ["--schedule", "lina", *Q8_PIPELINE, *steps, *small, *dev],
         None),
        ("moe-train-lina-merge", "commsched.moe.train",
         ["--schedule", "lina", *Q8_PIPELINE, "--merge", *steps, *small, *dev], None),
        ("moe-train-lina-overlap", "commsched.moe.train", ["--schedule", "lina-overlap", *steps, *small, *dev],
         None),
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
        if device.type != "cuda" and quick and name not in CPU_QUICK_RUNS:
            res[name] = {"status": "skipped", "reason": "not in the CPU's --quick plan (one run of each entry point: "
                         f"{', '.join(CPU_QUICK_RUNS)}); it runs on CUDA and in the CPU's full plan"}
            continue
        if dep is not None and importlib.util.find_spec(dep) is None:
            res[name] = {"status": "skipped", "reason": not_installed(dep)}
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
            rc = _run_in_own_group(cmd, left, env=env, stdout=logf, stderr=subprocess.STDOUT)
        if rc is None:
            err = f"ran past the {left:.0f} s left of the section's budget; log: {run_dir / 'log.txt'}"
        else:
            err = None if rc == 0 else f"exit status {rc}; log: {run_dir / 'log.txt'}"
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
    if failed:
        res["error"] = "failed: " + ", ".join(k for k, v in res.items() if isinstance(v, dict)
                                               and v.get("status") == "failed")
    return res


def _run_in_own_group(cmd: list[str], timeout_s: float, **kw) -> int | None:
    """Run ``cmd`` as the leader of a new process group; its exit status, or None when it ran
    past ``timeout_s``: then the whole group is killed (pytest's or a trainer's own children
    included, so none lingers on the device)."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, start_new_session=True, **kw)
    try:
        return proc.wait(timeout=max(timeout_s, 0.1))
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return None


# --------------------------------------------------------------------------- shared GPU, gloo
def _shared_worker(rank: int, world: int, init_file: str, device_name: str, q) -> None:
    try:
        import torch.distributed as dist

        from ..comm.all2all import SegmentLayout, all_to_all, exchange_segments
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
    from ..priority.policy import LinaConfig
    from ..priority.runtime.executor import GradScheduler

    params = [torch.nn.Parameter(torch.zeros(n, device=dev)) for n in (70_000, 3, 40_000, 1)]
    cfg = LinaConfig(microop_bytes=16 << 10)
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




# --------------------------------------------------------------------------- cuda tests
CUDA_MARK = "@pytest.mark.cuda"


def cuda_test_files(root: Path) -> list[str]:
    """The test files (relative to ``root``) that hold ``cuda``-marked tests: found by their
    text, so pytest collects only these, not the whole suite with its heavy imports."""
    tests = root / "tests"
    return sorted(str(p.relative_to(root)) for p in tests.rglob("test_*.py") if CUDA_MARK in p.read_text())


def cuda_tests_command(root: Path, quick: bool) -> list[str]:
    """pytest over :func:`cuda_test_files` and the ``cuda`` mark (``quick``: not the slow ones)."""
    marks = "cuda and not slow" if quick else "cuda"
    return [sys.executable, "-m", "pytest", "-q", "-m", marks, "-p", "no:cacheprovider", *cuda_test_files(root)]


def check_cuda_tests(device: torch.device, out: Path, timeout_s: float = 300, quick: bool = False) -> dict:
    """The test suite's ``cuda``-marked tests (a repository checkout only), in their own
    process group: past ``timeout_s`` the group is killed, pytest's pool children with it."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    has_suite = (root / "tests" / "conftest.py").exists()
    if device.type != "cuda":
        cmd = cuda_tests_command(root, quick)
        what = (f" (there: pytest -m '{cmd[cmd.index('-m', 2) + 1]}' over the {len(cuda_test_files(root))} "
                "files that hold them)") if has_suite else ""
        raise _Skip(f"the cuda-marked tests need a CUDA device{what}")
    if not has_suite:
        raise _Skip(f"no test suite beside the package ({root / 'tests'})")
    _needs("pytest")
    log = out / "cuda-tests.log"
    cmd = cuda_tests_command(root, quick)
    with open(log, "w") as f:
        rc = _run_in_own_group(cmd, timeout_s, cwd=root, stdout=f, stderr=subprocess.STDOUT)
    if rc is None:
        return {"status": "failed", "error": f"ran past its budget of {timeout_s:.0f} s (its process group "
                "was killed)", "log": str(log), "command": " ".join(cmd[1:])}
    tail = log.read_text().strip().splitlines()[-1:] or [""]
    return {"status": "ok" if rc == 0 else "failed", "summary": tail[0], "log": str(log),
            "command": " ".join(cmd[1:])}


# --------------------------------------------------------------------------- main
# Budgets, measured, not guessed. Each section's budget is its measured time times
# BUDGET_MARGIN, rounded up to 5 s; the budgets add up to 455 s, inside the 480 s deadline
# with 25 s left for the teardown joins of the sections' children, and section_budgets()
# hands a deadline out in their proportion. MEASURED_CPU_S: the slowest of four runs of
# `python -m commsched.bench.gpucheck --device cpu [--quick] --out DIR` (the full plan, procs
# 2,4; the quick plan for codec) on the development machine, 2 cores shared with other jobs
# at load averages 2.5-9, 2026-12-06:
#   codec      0.1 0.1 0.1 (full)  0.7 (quick, load 9)
#   nccl       4.3 10.8 4.7 5.7
#   paths      8.1 5.6 4.5 12.3 (child spawn + the 5 checks; the checks themselves take 0.2 s;
#              12.3 at load 8.7, the spawn's imports slowed by the load)
#   frontends  51.6 41.6    (the 8 runs, small sizes; 4.8-8.1 s each, mostly start-up)
#   shared     61.8 21.4 20.0 90.7 (2 and 4 processes; 90.7 at load 9)
# The CUDA-only sections cannot run there: MEASURED_CUDA_S are estimates from their work, to
# be replaced by the "seconds" of a GPU run's gpucheck.json: warm ~54 Triton specialisations
# at ~1 s each cold (the on-disk cache makes a second run take seconds); kernels 9-18
# bit-exact cases, warm; cuda_tests the "cuda and not slow" tests of the 7 files holding
# cuda marks (collection ~15 s, ~10 cases of 1-5 s).
MEASURED_CPU_S = {"codec": 0.7, "nccl": 10.8, "paths": 12.3, "frontends": 51.6, "shared": 90.7}
MEASURED_CUDA_S = {"warm": 60.0, "kernels": 5.0, "cuda_tests": 60.0}
BUDGET_MARGIN = 1.5
SECTIONS = ("warm", "kernels", "codec", "nccl", "paths", "frontends", "shared", "cuda_tests")
_MEASURED_S = {**MEASURED_CUDA_S, **MEASURED_CPU_S}
SECTION_BUDGET_S = {k: float(5 * -(-(BUDGET_MARGIN * _MEASURED_S[k]) // 5)) for k in SECTIONS}
DEADLINE_S = 480.0  # the whole check's default deadline (8 minutes); the budgets fit in it
# each section's share of a deadline: its budget over the default deadline (they add up to
# 455/480: one hang cannot overrun the total, and the children's teardown has its reserve)
SECTION_SHARES = {k: v / DEADLINE_S for k, v in SECTION_BUDGET_S.items()}


def section_budgets(deadline_s: float) -> dict[str, float]:
    """Seconds each section may take under an overall deadline: :data:`SECTION_BUDGET_S`
    scaled by ``deadline_s / DEADLINE_S`` (adding up to less than it: the reserve). Pure."""
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
        "warm": lambda b: _with_budget(lambda: warm_kernels(device, quick), b)(),
        "kernels": lambda b: _with_budget(lambda: check_kernels(device, quick), b)(),
        "codec": lambda b: _with_budget(lambda: check_codec(device, quick), b)(),
        "nccl": lambda b: check_nccl(device, timeout_s=b),
        "paths": lambda b: check_paths(device, quick, timeout_s=b),
        "frontends": lambda b: check_frontends(device, quick, out, timeout_s=b),
        "shared": lambda b: check_shared(device, procs, timeout_s=b),
        "cuda_tests": lambda b: check_cuda_tests(device, out, timeout_s=b, quick=quick),
    }
    assert tuple(table) == SECTIONS
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
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/gpucheck-<time>)")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="cuda")
    p.add_argument("--procs", default=None, help="process counts sharing the device (default 2,4; "
                   "2 with --quick on the CPU)")
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
    procs_arg = a.procs or ("2" if a.quick and device.type != "cuda" else "2,4")
    procs = tuple(int(x) for x in procs_arg.split(",") if x)
    out = a.out or Path("runs") / f"gpucheck-{time.strftime('%Y%m%d-%H%M%S')}"
    sections = tuple(a.sections.split(",")) if a.sections else None
    unknown = sorted(set(sections or ()) - set(SECTIONS))
    if unknown or not a.deadline > 0:
        print(f"gpucheck: unknown sections {unknown} (choose from {','.join(SECTIONS)})" if unknown
              else f"gpucheck: --deadline must be > 0, got {a.deadline}", file=sys.stderr)
        return 2
    res = run_check(out, device, procs=procs, quick=a.quick, sections=sections, deadline_s=a.deadline)
    print(json.dumps({k: v.get("status") for k, v in res.items() if isinstance(v, dict) and "status" in v}))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
