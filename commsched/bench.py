"""The side-by-side benchmark runner behind ``commsched bench WORKLOAD``.

A workload is a module that defines ``WORKLOAD = Workload(...)``; the table
``WORKLOADS`` names where each lives (strings, imported only when asked for, so the core
never imports a front-end at import time). A workload either

* lists ``Variant``s, each a ``torchrun``-launchable module run as its own process
  tree that writes ``metrics.json`` into the ``--out`` folder it is given, or
* runs ``inline`` in this process (single-process micro-benchmarks) and returns its
  metrics per variant.

Variants run one after another in the same environment, interleaved when repeated
(A B A B ...). The runner writes each run's ``metrics.json`` under
``DIR/<variant>/rep<k>/``, then ``DIR/summary.json`` and ``DIR/summary.md`` with the
medians of the workload's key metrics and the ratios between variants, and records the
machine, the emulated rate and the command.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

WORKLOADS: dict[str, str] = {
    "all2all": "commsched.bench_all2all",
    "quant": "commsched.quant.bench",
    "assign": "commsched.quant.bench_assign",
    "gnn": "commsched.gnn.bench",
    "moe-train": "commsched.moe.bench_train",
    "moe-infer": "commsched.moe.bench_infer",
}


@dataclass(frozen=True)
class Variant:
    """One compared configuration: ``python -m module *args --out DIR`` under torchrun."""

    name: str
    module: str
    args: tuple[str, ...] = ()
    nproc: int | None = None  # None: the bench's --nproc


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    # the metrics tabulated and compared (lower is better unless listed in higher_is_better)
    key_metrics: tuple[str, ...]
    add_arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None
    variants: Callable[[argparse.Namespace], list[Variant]] | None = None
    # inline(args, out_dir, progress) -> {variant: metrics dict}; for single-process benches
    inline: Callable[[argparse.Namespace, Path, Callable[[str], None]], dict[str, dict]] | None = None
    # extra summary / plots after all runs: (runs, args, out_dir) -> extra summary entries
    summarize: Callable[[dict[str, list[dict]], argparse.Namespace, Path], dict] | None = None
    higher_is_better: tuple[str, ...] = ()
    default_bandwidth: str | None = None  # the documented default regime, if any


def load_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    try:
        mod = importlib.import_module(WORKLOADS[name])
    except ModuleNotFoundError as e:
        raise ValueError(f"workload {name!r} is not available in this build ({e})") from None
    wl = getattr(mod, "WORKLOAD", None)
    if not isinstance(wl, Workload):
        raise ValueError(f"{WORKLOADS[name]} does not define WORKLOAD = Workload(...)")
    return wl


# --------------------------------------------------------------------------- helpers
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    return {"hostname": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}


def median_of(runs: Sequence[dict], key: str) -> float | None:
    vals = [_get(r, key) for r in runs]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def _get(d: dict, dotted: str) -> Any:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def torchrun_command(variant: Variant, nproc: int, out_dir: Path, *, nnodes: int = 1,
                     node_rank: int = 0, rdzv_endpoint: str | None = None) -> list[str]:
    """The command that runs one variant: ``--standalone`` on one node, c10d rendezvous
    at ``rdzv_endpoint`` across several."""
    if nnodes == 1 and rdzv_endpoint is None:
        launch = ["--standalone", f"--nproc_per_node={nproc}"]
    else:
        if rdzv_endpoint is None:
            raise ValueError("a multi-node run needs rdzv_endpoint (host:port of node 0)")
        launch = [f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint={rdzv_endpoint}", f"--node-rank={node_rank}",
                  "--rdzv-id=commsched"]
    return [sys.executable, "-m", "torch.distributed.run", *launch,
            "-m", variant.module, *variant.args, "--out", str(out_dir)]


@dataclass
class RunContext:
    """How variant commands are launched; the bandwidth emulator replaces ``wrap``."""

    wrap: Callable[[list[str]], list[str]] = lambda cmd: cmd
    bandwidth: str | None = None
    note: str = ""
    env: dict[str, str] = field(default_factory=dict)


def run_variant(variant: Variant, nproc: int, out_dir: Path, ctx: RunContext,
                timeout_s: float) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = ctx.wrap(torchrun_command(variant, nproc, out_dir))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               COMMSCHED_PROGRESS="0", **ctx.env)
    log = out_dir / "log.txt"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"variant {variant.name} ran past {timeout_s:.0f} s; log: {log}") from None
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-15:]
        raise RuntimeError(f"variant {variant.name} failed (exit {proc.returncode}); log: {log}\n"
                           + "\n".join(tail))
    mpath = out_dir / "metrics.json"
    if not mpath.exists():
        raise RuntimeError(f"variant {variant.name} wrote no metrics.json; log: {log}")
    m = json.loads(mpath.read_text())
    m.setdefault("bench_wall_s", time.perf_counter() - t0)
    return m


def summarize_runs(workload: Workload, runs: dict[str, list[dict]]) -> dict:
    """Medians of the key metrics per variant, and ratios of each variant to the first."""
    names = list(runs)
    med = {v: {k: median_of(runs[v], k) for k in workload.key_metrics} for v in names}
    ratios: dict[str, dict[str, float | None]] = {}
    base = names[0] if names else None
    for v in names[1:]:
        r = {}
        for k in workload.key_metrics:
            a, b = med[base][k], med[v][k]
            if a is None or b is None or a == 0 or b == 0:
                r[k] = None
            elif k in workload.higher_is_better:
                r[k] = b / a
            else:
                r[k] = a / b  # > 1 means the variant is faster / smaller than the baseline
        ratios[v] = r
    return {"baseline": base, "median": med, "speedup_vs_baseline": ratios,
            "repeats": {v: len(runs[v]) for v in names}}


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def summary_markdown(workload: Workload, summary: dict, meta: dict) -> str:
    keys = workload.key_metrics
    lines = [f"# commsched bench {workload.name}", "",
             f"- command: `{meta['command']}`",
             f"- machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores",
             f"- emulated rate: {meta.get('bandwidth') or 'none (unshaped)'}",
             f"- repeats: {meta['repeat']} (interleaved)"]
    if meta.get("note"):
        lines.append(f"- note: {meta['note']}")
    lines += ["", "| variant | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for v, m in summary["median"].items():
        lines.append(f"| {v} | " + " | ".join(_fmt(m[k]) for k in keys) + " |")
    if summary["speedup_vs_baseline"]:
        lines += ["", f"Ratios against `{summary['baseline']}` (> 1: better than the baseline):", "",
                  "| variant | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for v, r in summary["speedup_vs_baseline"].items():
            lines.append(f"| {v} | " + " | ".join(_fmt(r[k]) + ("x" if r[k] else "") for k in keys) + " |")
    for title, table in summary.get("extra_tables", {}).items():
        lines += ["", f"## {title}", "", table]
    for p in summary.get("plots", []):
        lines += ["", f"![{Path(p).stem}]({Path(p).name})"]
    return "\n".join(lines) + "\n"


def build_parser(workload: Workload) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"commsched bench {workload.name}", description=workload.description)
    p.add_argument("--nproc", type=int, default=4, help="processes (ranks) per run (default 4)")
    p.add_argument("--repeat", type=int, default=1, help="interleaved repetitions of every variant")
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/bench-<workload>-<time>)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per variant run")
    p.add_argument("--variants", default=None, help="comma-separated subset of variants to run")
    workload.add_arguments(p)
    return p


def run_bench(name: str, argv: Sequence[str], ctx: RunContext | None = None,
              progress: Callable[[str], None] | None = None) -> dict:
    """Parse ``argv`` for workload ``name``, run its variants, write the summary; return it."""
    workload = load_workload(name)
    args = build_parser(workload).parse_args(list(argv))
    if args.nproc < 1 or args.repeat < 1:
        raise ValueError("--nproc and --repeat must be >= 1")
    ctx = ctx or RunContext()
    out = args.out or Path("runs") / f"bench-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda s: print(s, file=sys.stderr, flush=True))
    runs: dict[str, list[dict]] = {}
    t0 = time.perf_counter()
    if workload.inline is not None:
        for rep in range(args.repeat):
            say(f"[bench {name}] repeat {rep + 1}/{args.repeat}")
            res = workload.inline(args, out / f"rep{rep}", say)
            for v, m in res.items():
                d = out / v / f"rep{rep}"
                d.mkdir(parents=True, exist_ok=True)
                (d / "metrics.json").write_text(json.dumps(m, indent=2))
                runs.setdefault(v, []).append(m)
    else:
        assert workload.variants is not None
        variants = workload.variants(args)
        if args.variants:
            keep = args.variants.split(",")
            unknown = set(keep) - {v.name for v in variants}
            if unknown:
                raise ValueError(f"unknown variants {sorted(unknown)}; this workload has "
                                 f"{[v.name for v in variants]}")
            variants = [v for v in variants if v.name in keep]
        total = len(variants) * args.repeat
        k = 0
        for rep in range(args.repeat):
            for v in variants:
                k += 1
                say(f"[bench {name}] run {k}/{total}: {v.name} (repeat {rep + 1}) "
                    f"elapsed {time.perf_counter() - t0:.0f} s")
                m = run_variant(v, v.nproc or args.nproc, out / v.name / f"rep{rep}", ctx, args.timeout)
                runs.setdefault(v.name, []).append(m)
    summary = summarize_runs(workload, runs)
    if workload.summarize is not None:
        summary.update(workload.summarize(runs, args, out))
    meta = {"workload": name, "command": "commsched bench " + name + " " + shlex.join(list(argv)),
            "machine": machine_info(), "bandwidth": ctx.bandwidth, "note": ctx.note,
            "repeat": args.repeat, "nproc": args.nproc, "wall_s": time.perf_counter() - t0,
            "args": {k: str(v) for k, v in vars(args).items()}}
    summary["meta"] = meta
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "summary.md").write_text(summary_markdown(workload, summary, meta))
    say(f"[bench {name}] done in {meta['wall_s']:.0f} s; summary: {out / 'summary.md'}")
    return summary


__all__ = ["RunContext", "Variant", "Workload", "WORKLOADS", "load_workload", "run_bench",
           "summarize_runs", "summary_markdown", "torchrun_command", "machine_info"]
