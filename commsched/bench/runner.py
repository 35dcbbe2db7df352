"""The side-by-side benchmark runner behind ``commsched bench WORKLOAD``.

A workload is a module of this package that defines ``WORKLOAD = Workload(...)``; the
table of them is :data:`commsched.bench.workloads.WORKLOADS`. A workload either

* lists ``Variant``s, each a ``torchrun``-launchable module run as its own process
  tree that writes ``metrics.json`` into the ``--out`` folder it is given, or
* runs ``inline`` in this process (single-process micro-benchmarks) and returns its
  metrics per variant.

Variants run one after another in the same environment, interleaved when repeated
(A B A B ...). The runner writes each run's ``metrics.json`` under
``DIR/<variant>/rep<k>/``, then ``DIR/summary.json`` and ``DIR/summary.md`` with the
medians of the workload's key metrics and the ratios between variants, and records the
machine, the emulated rate and the command. How variants are launched (plain torchrun,
or under the bandwidth emulator) is a :class:`RunContext`, built by
:func:`commsched.bench.emulation.bench_context`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .._lazy import require
from ..cluster.presets import CLUSTERS
from ..config import read_env
from ..configurable import to_arguments
from ..results import FAILED_MARKER, Progress, median, pick, write_json
from .plots import plot_breakdown


@dataclass(frozen=True)
class Variant:
    """One compared configuration, labelled ``name``: ``python -m module ARGV --out DIR``
    under torchrun, ARGV (:attr:`argv`) the flags of ``config`` (the module's config, a
    ``replace(...)`` of the bench's base run; :func:`~commsched.configurable.to_arguments`
    against the module parser's ``defaults`` where they differ from the fields'), then
    ``args``, the module's own flags outside its config (the graph, the partitioner)."""

    name: str
    module: str
    args: tuple[str, ...] = ()
    nproc: int | None = None  # None: the bench's --nproc
    config: Any = None
    defaults: Mapping[str, Any] | None = None

    @property
    def argv(self) -> tuple[str, ...]:
        own = to_arguments(self.config, defaults=self.defaults) if self.config is not None else ()
        return (*own, *self.args)


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
    # how concurrent collectives share an emulated loopback by default: "flow" (one tbf, per
    # TCP flow) or "collective" (htb classes; bench/emulation.py LINK_MODELS)
    default_link_model: str = "flow"
    # baseline_of(variant, all variant names) -> the variant it is compared with (None: not
    # compared); default: the first variant (a bench of several models compares within each)
    baseline_of: Callable[[str, list[str]], str | None] | None = None
    # cluster_defaults(preset) -> the workload's option defaults under ``--cluster NAME``
    # (its device model, k, model shapes; explicit options still win); None: no --cluster
    cluster_defaults: Callable[[Any], dict[str, Any]] | None = None


# --------------------------------------------------------------------------- helpers
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
    """The median over ``runs`` of the number at dotted ``key`` (missing values skipped)."""
    return median(v for v in (pick(r, key) for r in runs) if isinstance(v, (int, float)))


def torchrun_command(variant: Variant, nproc: int, out_dir: Path, *, nnodes: int = 1,
                     node_rank: int | str = 0, rdzv_endpoint: str | None = None,
                     local_addr: str | None = None, rdzv_conf: str | None = None) -> list[str]:
    """The command that runs one variant: ``--standalone`` on one node, c10d rendezvous
    at ``rdzv_endpoint`` across several (``local_addr``: this node's address;
    ``rdzv_conf``: e.g. ``is_host=1`` on the node that hosts the rendezvous store)."""
    if nnodes == 1 and rdzv_endpoint is None:
        launch = ["--standalone", f"--nproc_per_node={nproc}"]
    else:
        if rdzv_endpoint is None:
            raise ValueError("a multi-node run needs rdzv_endpoint (host:port of node 0)")
        launch = [f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint={rdzv_endpoint}", f"--node-rank={node_rank}",
                  "--rdzv-id=commsched"]
        if local_addr is not None:
            launch.append(f"--local-addr={local_addr}")
        if rdzv_conf is not None:
            launch.append(f"--rdzv-conf={rdzv_conf}")
    return [sys.executable, "-m", "torch.distributed.run", *launch,
            "-m", variant.module, *variant.argv, "--out", str(out_dir)]


@dataclass
class RunContext:
    """How variant commands are launched; the bandwidth emulator replaces ``wrap``.

    ``wrap`` turns the one-node torchrun command into the command actually run;
    ``launch`` (hosts mode), when set, builds the whole command from (variant, nproc per
    host, out_dir) instead. ``bandwidth`` is the emulated rate as text (None: unshaped),
    ``rate_bps`` the same in bits/s, ``hosts`` the emulated hosts (1: one machine),
    ``note`` a remark recorded in the summary, ``info`` details of the emulation,
    ``flags`` the bench options the emulator consumed (so the summary can quote them).
    """

    wrap: Callable[[list[str]], list[str]] = lambda cmd: cmd
    bandwidth: str | None = None
    note: str = ""
    env: dict[str, str] = field(default_factory=dict)
    hosts: int = 1
    delay_ms: float | None = None
    rate_bps: int | None = None
    launch: Callable[[Variant, int, Path], list[str]] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    link_model: str | None = None       # None: no shaped link; else "flow" or "collective"
    reduce_address: str | None = None   # "collective": the address the gradient reduction binds to
    cluster: Any = None                 # --cluster: the ClusterPreset (commsched.cluster.presets)

    def command(self, variant: Variant, nproc: int, out_dir: Path) -> list[str]:
        if self.launch is not None:
            return self.launch(variant, nproc, out_dir)
        return self.wrap(torchrun_command(variant, nproc, out_dir))


STOP_GRACE_S = 15.0  # SIGTERM -> SIGKILL: time for the emulator to remove its namespaces


def _stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Stop a variant's process tree politely (SIGTERM), so that a wrapper such as
    ``commsched netem`` can clean up, then SIGKILL what is left."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    # the group's other members (a torchrun's ranks, a shell's children) were signalled
    # too but may not have run yet on a loaded machine: return once none is left running
    deadline = time.monotonic() + grace_s
    while _group_running(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies waiting to be reaped
    do not count); from /proc where there is one, else whether the group exists."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # besides SIGINT, which raises already


class _StopSignals:
    """What :func:`_stop_signals_raise` yields: the state of its handler, and :meth:`held`."""

    def __init__(self, active: bool):
        self.active = active        # False off the main thread: nothing is installed
        self.raised = False         # the first stop signal raised; later ones are ignored
        self.holding = False
        self.pending: int | None = None

    def on_signal(self, signum: int, frame) -> None:
        if self.raised or self.pending is not None:
            return
        if self.holding:
            self.pending = signum  # raised when the held block ends
            return
        self.raised = True
        raise _stop_exception(signum)

    @contextlib.contextmanager
    def held(self):
        """Inside, a stop signal (SIGINT included) is only recorded; it is raised when the
        block ends, as it would have been inside it. For starting the variant: a signal that
        arrived after its process group existed but before ``Popen`` had returned (on a
        loaded machine the child can run, and be seen running, first) raised where no one
        could stop the group, so the variant outlived the bench."""
        if not self.active:
            yield
            return
        old_int = signal.signal(signal.SIGINT, self.on_signal)
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
            signal.signal(signal.SIGINT, old_int)
            if self.pending is not None and not self.raised:
                self.raised = True
                raise _stop_exception(self.pending)


def _stop_exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)


@contextlib.contextmanager
def _stop_signals_raise():
    """Inside: SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` in the main thread, as
    SIGINT raises KeyboardInterrupt, so that a bench stopped by either still stops its
    running variant's process group (and the emulator below it removes its namespaces)
    instead of leaving it orphaned. Later signals are ignored while the
    clean-up runs. Yields a :class:`_StopSignals` whose ``held()`` defers them across the
    start of the variant. Elsewhere than the main thread (where handlers cannot be set) a
    no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield _StopSignals(active=False)
        return
    state = _StopSignals(active=True)
    old = {s: signal.signal(s, state.on_signal) for s in STOP_SIGNALS}
    try:
        yield state
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_variant(variant: Variant, nproc: int, out_dir: Path, ctx: RunContext,
                timeout_s: float, tick: Callable[[float], None] | None = None) -> dict:
    """Run one variant to completion and return its metrics (its ``metrics.json``).

    The command runs in its own process group with output in ``out_dir/log.txt``;
    ``tick(elapsed_s)`` is called about once a second while it runs. On timeout or
    interruption (SIGINT, SIGTERM, SIGHUP) the group gets SIGTERM, then SIGKILL after
    :data:`STOP_GRACE_S`.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    # a repeat's folder may hold an earlier invocation's run: this one replaces it (the
    # front-ends refuse a folder holding metrics.json), and no stale file is read back
    for stale in ("metrics.json", FAILED_MARKER):
        (out_dir / stale).unlink(missing_ok=True)
    cmd = ctx.command(variant, nproc, out_dir)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               COMMSCHED_PROGRESS="0", **ctx.env)
    log = out_dir / "log.txt"
    t0 = time.perf_counter()
    cpu0 = _children_cpu_s()
    with open(log, "w") as f, _stop_signals_raise() as stops:
        f.write("# " + shlex.join(cmd) + "\n")
        f.flush()
        proc = None
        try:
            with stops.held():  # a stop signal during the start is raised here, once proc exists
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            while True:
                try:
                    proc.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    pass
                elapsed = time.perf_counter() - t0
                if tick is not None:
                    tick(elapsed)
                if elapsed > timeout_s:
                    _stop(proc)
                    raise RuntimeError(f"variant {variant.name} ran past {timeout_s:.0f} s; log: {log}")
        except BaseException:
            if proc is not None:
                _stop(proc)
            raise
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-15:]
        raise RuntimeError(f"variant {variant.name} failed (exit {proc.returncode}); log: {log}\n"
                           + "\n".join(tail))
    mpath = out_dir / "metrics.json"
    if not mpath.exists():
        raise RuntimeError(f"variant {variant.name} wrote no metrics.json; log: {log}")
    m = json.loads(mpath.read_text())
    wall = time.perf_counter() - t0
    m.setdefault("bench_wall_s", wall)
    # the whole run's CPU (every process of it, start-up included) over its wall time: the
    # cores it kept busy on this machine
    m.setdefault("bench_cpu_share", (_children_cpu_s() - cpu0) / wall if wall > 0 else None)
    return m


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's waited-for descendants so far."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def summarize_runs(workload: Workload, runs: dict[str, list[dict]]) -> dict:
    """Medians of the key metrics per variant, and ratios of each variant to its baseline:
    the first variant, or ``workload.baseline_of`` (``baseline`` is then a dict)."""
    names = list(runs)
    med = {v: {k: median_of(runs[v], k) for k in workload.key_metrics} for v in names}
    ratios: dict[str, dict[str, float | None]] = {}
    first = names[0] if names else None
    bases = {v: (workload.baseline_of(v, names) if workload.baseline_of else first) for v in names}
    for v in names:
        base = bases[v]
        if base is None or base == v or base not in med:
            continue
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
    base = first if workload.baseline_of is None else {v: b for v, b in bases.items() if v in ratios}
    return {"baseline": base, "median": med, "speedup_vs_baseline": ratios,
            "repeats": {v: len(runs[v]) for v in names}}


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def breakdown_medians(runs: dict[str, list[dict]], key: str = "breakdown_s") -> dict[str, dict[str, float]]:
    """Per variant, the median over repeats of each part of its ``breakdown_s`` dict
    (seconds). Variants without one are left out; parts are kept in first-seen order."""
    out: dict[str, dict[str, float]] = {}
    for v, rs in runs.items():
        parts: list[str] = []
        for r in rs:
            b = r.get(key)
            if isinstance(b, dict):
                parts += [k for k, x in b.items() if k not in parts and isinstance(x, (int, float))]
        if parts:
            out[v] = {k: median_of(rs, f"{key}.{k}") or 0.0 for k in parts}
    return out


def summary_markdown(workload: Workload, summary: dict, meta: dict) -> str:
    keys = workload.key_metrics
    lines = [f"# commsched bench {workload.name}", "",
             f"- command: `{meta['command']}`",
             f"- machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores",
             f"- emulated rate: {meta.get('bandwidth') or 'none (unshaped)'}"]
    emu = meta.get("emulation") or {}
    if emu:
        lines.append(f"- emulated network: {emu.get('layout')}"
                     + (f", one-way delay {emu['delay_ms']:g} ms" if emu.get("delay_ms") else ""))
    hosts = meta.get("hosts", 1)
    lines.append(f"- processes: {meta['nproc']}" + (f" per host x {hosts} hosts = {meta['nproc'] * hosts} ranks"
                                                    if hosts > 1 else ""))
    lines.append(f"- repeats: {meta['repeat']} (interleaved)")
    if emu.get("cluster_description"):
        lines.append(f"- cluster: {emu['cluster_description']}")
    if meta.get("note"):
        lines.append(f"- note: {meta['note']}")
    lines += ["", "| variant | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for v, m in summary["median"].items():
        lines.append(f"| {v} | " + " | ".join(_fmt(m[k]) for k in keys) + " |")
    if summary["speedup_vs_baseline"]:
        per = isinstance(summary["baseline"], dict)
        head = ("Ratios against each variant's baseline (> 1: better than the baseline):" if per else
                f"Ratios against `{summary['baseline']}` (> 1: better than the baseline):")
        lines += ["", head, "", "| variant | " + ("baseline | " if per else "") + " | ".join(keys) + " |",
                  "|---" * (len(keys) + 1 + per) + "|"]
        for v, r in summary["speedup_vs_baseline"].items():
            lines.append(f"| {v} | " + (f"{summary['baseline'][v]} | " if per else "")
                         + " | ".join(_fmt(r[k]) + ("x" if r[k] else "") for k in keys) + " |")
    for title, table in summary.get("extra_tables", {}).items():
        lines += ["", f"## {title}", "", table]
    for p in summary.get("plots", []):
        lines += ["", f"![{Path(p).stem}]({Path(p).name})"]
    return "\n".join(lines) + "\n"


def build_parser(workload: Workload) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"commsched bench {workload.name}", description=workload.description,
        epilog="Emulation (handled before these options; needs root, ip and tc): --bandwidth RATE "
               "(e.g. 1gbit; 'none' for unshaped), --hosts K (K emulated hosts; --nproc is then per "
               "host), --delay MS (needs the netem qdisc), --link-model collective|flow (on the shared "
               "loopback: concurrent collectives share the rate per collective, in equal htb classes, or "
               "per TCP flow, one tbf), --cluster NAME (a cluster preset of commsched.cluster.presets: "
               "its hosts, ranks per host and links dilated by its k, and the workload's device model and "
               f"model shapes; every variant on the emulated device; one of {', '.join(CLUSTERS)})."
               + (f" Default regime of this workload: {workload.default_bandwidth}" if workload.default_bandwidth else "")
               + (f", link model {workload.default_link_model}." if workload.default_bandwidth else ""))
    p.add_argument("--nproc", type=int, default=4,
                   help="processes (ranks) per run; with --hosts K, processes per host (default 4)")
    p.add_argument("--repeat", type=int, default=1, help="interleaved repetitions of every variant")
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/bench-<workload>-<time>)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per variant run")
    p.add_argument("--variants", default=None, help="comma-separated subset of variants to run")
    workload.add_arguments(p)
    return p


class _RunProgress(Progress):
    """The bench's bar over its runs; without a bar each run start is one line."""

    def __init__(self, total: int, name: str, say: Callable[[str], None] | None, enabled: bool):
        super().__init__(total, f"bench {name}", "run", enabled=enabled and say is None, say=say)
        self.current = ""

    def start(self, line: str, short: str = "") -> None:
        """A run begins: ``line`` for line-mode progress, ``short`` beside the bar."""
        self.current = short or line
        if self.active:
            self.postfix(self.current)
        else:
            self.write(line)

    def tick(self, elapsed_s: float) -> None:
        self.postfix(f"{self.current} ({elapsed_s:.0f} s)")


def parse_workload_args(workload: Workload, argv: Sequence[str], cluster=None) -> argparse.Namespace:
    """``argv`` parsed by the workload's bench parser; under a cluster preset its defaults
    are the workload's ``cluster_defaults(cluster)`` and ``args.cluster`` is the preset."""
    p = build_parser(workload)
    if cluster is not None:
        if workload.cluster_defaults is None:
            raise ValueError(f"commsched bench {workload.name} has no --cluster presets")
        p.set_defaults(**workload.cluster_defaults(cluster))
    args = p.parse_args(list(argv))
    args.cluster = cluster
    return args


def run_workload(workload: Workload, argv: Sequence[str], ctx: RunContext,
                 progress: Callable[[str], None] | None = None) -> dict:
    """Parse ``argv`` (emulation options already taken out into ``ctx``) for ``workload``,
    run its variants, write the summary; return it. ``progress`` receives progress lines
    (default: a tqdm bar on stderr, unless COMMSCHED_PROGRESS=0).
    :func:`commsched.bench.run_bench` is the entry point that resolves both.
    """
    name = workload.name
    argv = list(argv)
    args = parse_workload_args(workload, argv, ctx.cluster)
    if args.nproc < 1 or args.repeat < 1:
        raise ValueError("--nproc and --repeat must be >= 1")
    if workload.inline is not None and (ctx.bandwidth or ctx.hosts > 1 or ctx.delay_ms):
        raise ValueError(f"workload {name!r} runs inline in this process; it cannot run under an "
                         "emulated network (drop --bandwidth/--hosts/--delay)")
    require("matplotlib", f"the summary of bench {name} (its figures)")  # before any run
    # what the workload may read when building its variants
    args.hosts, args.bandwidth, args.rate_bps = ctx.hosts, ctx.bandwidth, ctx.rate_bps
    args.link_model, args.reduce_address = ctx.link_model, ctx.reduce_address
    out = args.out or Path("runs") / f"bench-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    show = read_env().progress
    runs: dict[str, list[dict]] = {}
    commands: dict[str, str] = {}
    t0 = time.perf_counter()
    if ctx.note:
        (progress or (lambda s: print(s, file=sys.stderr, flush=True)))(f"[bench {name}] note: {ctx.note}")
    if workload.inline is not None:
        bar = _RunProgress(args.repeat, name, progress, show)
        try:
            for rep in range(args.repeat):
                bar.start(f"[bench {name}] repeat {rep + 1}/{args.repeat}", f"repeat {rep + 1}")
                res = workload.inline(args, out / f"rep{rep}", bar.write)
                for v, m in res.items():
                    d = out / v / f"rep{rep}"
                    d.mkdir(parents=True, exist_ok=True)
                    write_json(d / "metrics.json", m)
                    runs.setdefault(v, []).append(m)
                bar.update()
        finally:
            bar.close()
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
        bar = _RunProgress(total, name, progress, show)
        k = 0
        try:
            for rep in range(args.repeat):
                for v in variants:
                    k += 1
                    bar.start(f"[bench {name}] run {k}/{total}: {v.name} (repeat {rep + 1}) "
                              f"elapsed {time.perf_counter() - t0:.0f} s", f"{v.name} rep {rep + 1}")
                    d = out / v.name / f"rep{rep}"
                    commands.setdefault(v.name, shlex.join(ctx.command(v, v.nproc or args.nproc, d)))
                    m = run_variant(v, v.nproc or args.nproc, d, ctx, args.timeout, tick=bar.tick)
                    runs.setdefault(v.name, []).append(m)
                    bar.update()
        finally:
            bar.close()
    summary = summarize_runs(workload, runs)
    if workload.summarize is not None:
        summary.update(workload.summarize(runs, args, out))
    bd = breakdown_medians(runs)
    if bd:
        png = plot_breakdown(bd, out / "breakdown.png", title=f"{name}: time breakdown (median)")
        summary["breakdown_s"] = bd
        summary.setdefault("plots", []).append(str(png))
    meta = {"workload": name,
            "command": "commsched bench " + name + " " + shlex.join([*ctx.flags, *argv]),
            "variant_commands": commands,
            "machine": machine_info(), "bandwidth": ctx.bandwidth, "rate_bps": ctx.rate_bps,
            "hosts": ctx.hosts, "delay_ms": ctx.delay_ms, "emulation": ctx.info, "link_model": ctx.link_model, "note": ctx.note,
            "repeat": args.repeat, "nproc": args.nproc,
            "nproc_meaning": "processes per host" if ctx.hosts > 1 else "processes (ranks)",
            "wall_s": time.perf_counter() - t0,
            "args": {k: str(v) for k, v in vars(args).items()}}
    summary["meta"] = meta
    write_json(out / "summary.json", summary)
    (out / "summary.md").write_text(summary_markdown(workload, summary, meta))
    (progress or (lambda s: print(s, file=sys.stderr, flush=True)))(
        f"[bench {name}] done in {meta['wall_s']:.0f} s; summary: {out / 'summary.md'}")
    if summary.get("regressions"):  # a workload's own floor: the summary is written first
        raise BenchRegression(f"bench {name}: below its regression floor: "
                              + "; ".join(summary["regressions"]) + f" (see {out / 'summary.md'})")
    return summary


class BenchRegression(RuntimeError):
    """A bench measured a figure below the floor its workload sets (``summary["regressions"]``):
    ``commsched bench`` exits 1 after writing the summary."""


__all__ = ["BenchRegression", "RunContext", "Variant", "Workload", "breakdown_medians", "build_parser",
           "machine_info", "median_of", "parse_workload_args", "run_variant", "run_workload", "summarize_runs",
           "summary_markdown", "torchrun_command"]
