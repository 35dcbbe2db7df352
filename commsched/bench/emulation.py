"""Bench glue for the bandwidth emulator: ``--bandwidth/--hosts/--host-rate/--delay`` and
``--link-model`` of ``commsched bench`` become a :class:`~commsched.bench.runner.RunContext`
whose commands run under :mod:`commsched.cluster.netem` (the emulator itself knows nothing of
benchmarks).

Link models (``--link-model``, :data:`LINK_MODELS`; the loopback and the hosts layouts):

* ``flow`` -- one ``tbf`` on the shared loopback: concurrent collectives share the rate
  per TCP flow, so an all-to-all of P ranks (P (P - 1) flows) keeps most of it against a
  ring allreduce (P flows).
* ``collective`` -- the loopback's ``htb`` gives the traffic from or to
  :data:`REDUCE_CLASS_ADDRESS` its own equal share and all other traffic another
  (``commsched netem --classes``); workloads bind their gradient reduction to that address
  (``args.reduce_address``), so the allreduce and the all-to-all share the link per
  collective, as two NCCL communicators' channels do. It models the link's share only:
  not the SMs two NCCL kernels contend for, nor NVLink inside a node. On emulated hosts
  (``--hosts K``) every host link carries the classes in both directions (``commsched
  netem --host-classes 1``) and the reduction binds to the host's address in the class
  subnet (:data:`REDUCE_CLASS_PLACEHOLDER`, filled in per host).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Callable, Sequence

from ..cluster import netem
from ..cluster.netem import (
    MAX_HOSTS,
    RDZV_PORT,
    Emulation,
    NetemError,
    NetSpec,
    check_requirements,
    format_rate,
    parse_optional_rate,
    parse_rate,
)
from ..cluster.presets import ClusterPreset, load_preset
from .runner import RunContext, Workload, torchrun_command

# run this file's main() without importing the commsched package: python -c _STANDALONE PATH ARGS...
_STANDALONE = ("import importlib.util as u, sys; s = u.spec_from_file_location('_commsched_netem', sys.argv[1]); "
               "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m); "
               "sys.exit(m.main(sys.argv[2:]))")


def delay_supported() -> bool:
    """Whether this kernel has the netem qdisc (probed in a throwaway namespace; root)."""
    spec = NetSpec(rate_bps=None, hosts=1, delay_ms=1.0, tag=f"probe{os.getpid()}")
    try:
        with Emulation(spec):
            return True
    except NetemError:
        return False


LINK_MODELS = ("collective", "flow")
REDUCE_CLASS_ADDRESS = "127.0.0.2"   # the gradient reduction's link class (loopback namespace only)
REDUCE_CLASS_PLACEHOLDER = "{caddr1}"  # hosts layout: each host's address in link class 1


class EmulationUnavailable(NetemError):
    """A bench asked for emulation that this machine cannot provide."""


def netem_prefix(rate_bps: int | None, hosts: int = 1, delay_ms: float | None = None,
                 python: str = sys.executable, host_rate_bps: int | None = None,
                 classes: Sequence[str] = (), host_classes: int = 0) -> list[str]:
    """The ``commsched netem ... --`` prefix that runs a command under this emulation.

    It loads the emulator's file on its own (:data:`_STANDALONE`) rather than
    ``-m commsched.cluster.netem``: importing the package may import torch, seconds per run on a
    busy machine, and the emulator needs only the standard library.
    """
    cmd = [python, "-c", _STANDALONE, os.path.abspath(netem.__file__),
           "--rate", "none" if rate_bps is None else f"{rate_bps}bit"]
    if delay_ms:
        cmd += ["--delay", f"{delay_ms:g}"]
    if hosts > 1:
        cmd += ["--hosts", str(hosts)]
    if host_rate_bps is not None:
        cmd += ["--host-rate", f"{host_rate_bps}bit"]
    if classes:
        cmd += ["--classes", ",".join(classes)]
    if host_classes:
        cmd += ["--host-classes", str(host_classes)]
    return cmd + ["--"]


def _torch_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_possible(device: str, gpus: int, nproc: int) -> bool:
    """Whether variants run with ``--device device`` and ``nproc`` ranks per machine may use
    NCCL, so that tc cannot shape them (``auto`` picks CUDA only when every local rank has
    its own GPU, see :func:`commsched.dist.choose_device`)."""
    return device == "cuda" or (device == "auto" and 0 < nproc <= gpus)


def bench_context(workload: Workload | None, argv: Sequence[str], *, euid: int | None = None,
                  which: Callable[[str], str | None] = shutil.which,
                  probe_delay: Callable[[], bool] | None = None,
                  gpus: int | None = None):
    """Take ``--bandwidth RATE``, ``--hosts K``, ``--host-rate RATE`` (the limit between
    ranks of one emulated host) and ``--delay MS`` out of a bench command line; return
    ``(RunContext, remaining argv)``.

    ``workload`` is the workload the options are for (None: not known yet). Explicit
    emulation that this machine cannot provide raises :class:`EmulationUnavailable`
    (never a silent unshaped run). Without ``--bandwidth``, a workload's
    ``default_bandwidth`` is used when emulation is available; otherwise the run is
    unshaped and the context's note says so. ``--bandwidth none`` asks for no shaping.
    In hosts mode ``--nproc`` is the number of processes per host. Emulation needs the
    variants on gloo: with ``--device cuda`` (or ``auto`` where CUDA is present) it is
    refused, and a default regime does not apply. ``gpus`` overrides the GPU count torch
    reports (for tests).
    """
    wl = workload
    name = wl.name if wl is not None else "WORKLOAD"
    ns, rest, device, nproc = _emulation_options(argv, name)
    cluster = _apply_cluster(ns, rest, wl, nproc) if ns.cluster is not None else None
    if cluster is not None:
        rest = rest if _has_flag(rest, "--nproc") else [*rest, "--nproc", str(cluster.ranks_per_host)]
        nproc = cluster.ranks_per_host
    nccl = nccl_possible(device, _torch_gpus() if gpus is None else gpus, nproc)
    flags = tuple(a for k, v in (("--cluster", ns.cluster), ("--bandwidth", None if cluster else ns.bandwidth), ("--hosts", None if cluster else ns.hosts),
                                 ("--delay", ns.delay), ("--host-rate", None if cluster else ns.host_rate),
                                 ("--link-model", ns.link_model))
                  if v is not None for a in (k, str(v)))
    rate = parse_optional_rate(ns.bandwidth)
    hosts = 1 if ns.hosts is None else ns.hosts
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"--hosts must be in 1..{MAX_HOSTS}, got {hosts}")
    if ns.delay is not None and not ns.delay >= 0:
        raise ValueError(f"--delay must be >= 0 ms, got {ns.delay}")
    host_rate = parse_optional_rate(ns.host_rate)
    if host_rate is not None and hosts < 2:
        raise ValueError("--host-rate limits traffic between ranks of one emulated host: it needs "
                         "--hosts K >= 2 (with one host, --bandwidth limits the shared loopback)")
    problem = check_requirements(os.geteuid() if euid is None else euid, which)
    inline = wl is not None and wl.inline is not None
    notes = []
    if ns.bandwidth is None and wl is not None and wl.default_bandwidth:
        rate, note = _default_regime(wl.default_bandwidth, device, nccl=nccl, inline=inline, problem=problem)
        notes.append(note)
    wanted = rate is not None or hosts > 1 or bool(ns.delay)
    link_model = _link_model(ns.link_model, wl, rate, hosts, ns.delay, notes)
    if not wanted:
        return RunContext(note="; ".join(notes), flags=flags), rest
    _check_can_emulate(name, device, inline=inline, nccl=nccl, problem=problem,
                       delay_probe=(probe_delay or delay_supported) if ns.delay else None)
    per_collective = link_model == "collective"
    classes = (REDUCE_CLASS_ADDRESS,) if per_collective and hosts == 1 else ()
    host_classes = 1 if per_collective and hosts > 1 else 0
    prefix = netem_prefix(rate, hosts, ns.delay, host_rate_bps=host_rate, classes=classes,
                          host_classes=host_classes)
    info = {"mode": "hosts" if hosts > 1 else "loopback", "hosts": hosts, "link_model": link_model,
            "link_classes": list(classes) or ([REDUCE_CLASS_PLACEHOLDER] if host_classes else []),
            "rate_bps": rate, "delay_ms": ns.delay, "host_rate_bps": host_rate,
            "nproc_meaning": "processes per host" if hosts > 1 else "processes (ranks)",
            "layout": _layout_text(hosts, host_rate, classes, host_classes, link_model)}
    if cluster is not None:
        info["cluster"] = cluster.name
        info["cluster_description"] = cluster.describe()
    if hosts == 1:
        return RunContext(wrap=lambda cmd: prefix + list(cmd), bandwidth=format_rate(rate) if rate else None,
                          note="; ".join(notes), hosts=1, delay_ms=ns.delay, rate_bps=rate,
                          info=info, flags=flags, link_model=link_model,
                          reduce_address=classes[0] if classes else None, cluster=cluster), rest

    def launch(variant, nproc: int, out_dir) -> list[str]:
        return prefix + torchrun_command(variant, nproc, out_dir, nnodes=hosts, node_rank="{host}",
                                         rdzv_endpoint=f"{{addr0}}:{RDZV_PORT}", local_addr="{addr}",
                                         rdzv_conf="is_host={is_host0}")

    return RunContext(bandwidth=format_rate(rate) if rate else None, note="; ".join(notes), hosts=hosts,
                      delay_ms=ns.delay, rate_bps=rate, launch=launch, info=info, flags=flags,
                      link_model=link_model, cluster=cluster,
                      reduce_address=REDUCE_CLASS_PLACEHOLDER if host_classes else None), rest


def _has_flag(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _apply_cluster(ns: argparse.Namespace, rest: list[str], wl: Workload | None, nproc_seen: int) -> ClusterPreset:
    """``--cluster NAME``: the preset's hosts, NIC rate (``--bandwidth``) and intra-host
    rate (``--host-rate``), dilated (:mod:`commsched.cluster.presets`), written into ``ns``.
    Refuses the options the preset sets, a ``--nproc`` other than its ranks per host, and a
    workload without cluster defaults."""
    preset = load_preset(ns.cluster)
    if wl is not None and wl.cluster_defaults is None:
        raise ValueError(f"commsched bench {wl.name} has no --cluster presets (they apply to moe-train, gnn "
                         "and moe-infer)")
    given = [f for f, v in (("--bandwidth", ns.bandwidth), ("--hosts", ns.hosts), ("--host-rate", ns.host_rate))
             if v is not None]
    if given:
        raise ValueError(f"--cluster {preset.name} sets {', '.join(given)} (its links, dilated by k = "
                         f"{preset.dilation:g}); drop them, or drop --cluster to set the links yourself")
    if _has_flag(rest, "--nproc") and nproc_seen != preset.ranks_per_host:
        raise ValueError(f"--cluster {preset.name} runs {preset.ranks_per_host} ranks per host; drop --nproc "
                         f"{nproc_seen}")
    ns.bandwidth = f"{preset.nic_emulated_bps}bit"
    ns.hosts = preset.hosts
    ns.host_rate = f"{preset.intra_carried_bps}bit"
    return preset


def _check_can_emulate(name: str, device: str, *, inline: bool, nccl: bool, problem: str | None,
                       delay_probe: Callable[[], bool] | None) -> None:
    """Refuse an emulation asked for that cannot run (``delay_probe``: whether the kernel can
    delay, asked last, only when a delay is asked for)."""
    if inline:
        raise ValueError(f"workload {name!r} runs inline in this process; --bandwidth, --hosts and "
                         "--delay apply only to workloads whose variants run under torchrun")
    if nccl:
        raise EmulationUnavailable(
            f"bandwidth emulation shapes gloo's TCP traffic only, and --device {device} may run "
            "NCCL (NVLink, shared memory or InfiniBand, which tc cannot shape): add --device cpu "
            "to emulate a link, or drop --bandwidth/--hosts/--delay")
    if problem:
        raise EmulationUnavailable(f"{problem}. commsched bench refuses --bandwidth/--hosts/--delay "
                                   "rather than run unshaped; drop them for an unshaped run")
    if delay_probe is not None and not delay_probe():
        raise EmulationUnavailable("--delay is not supported on this machine: the kernel has no "
                                   "netem qdisc (sch_netem); run without --delay")


def _emulation_options(argv: Sequence[str], name: str) -> tuple[argparse.Namespace, list[str], str, int]:
    """(the emulation options taken out of a bench command line, the rest of it, the workload's
    own ``--device`` and ``--nproc``, read but left in place: tc shapes gloo's TCP only)."""
    p = argparse.ArgumentParser(prog=f"commsched bench {name}", add_help=False, allow_abbrev=False)
    p.add_argument("--bandwidth", default=None)
    p.add_argument("--hosts", type=int, default=None)
    p.add_argument("--delay", type=float, default=None)
    p.add_argument("--host-rate", default=None)
    p.add_argument("--link-model", default=None)
    p.add_argument("--cluster", default=None)
    ns, rest = p.parse_known_args(list(argv))
    if ns.link_model is not None and ns.link_model not in LINK_MODELS:
        raise ValueError(f"--link-model must be one of {', '.join(LINK_MODELS)}, got {ns.link_model!r}")
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    peek.add_argument("--device", default="auto")
    peek.add_argument("--nproc", type=int, default=1)
    seen = peek.parse_known_args(rest)[0]
    return ns, rest, seen.device, seen.nproc


def _default_regime(bandwidth: str, device: str, *, nccl: bool, inline: bool,
                    problem: str | None) -> tuple[int | None, str]:
    """The rate of a workload's default regime ``bandwidth`` where it applies here (else None)
    and the note that says so."""
    if nccl:
        return None, (f"the workload's default regime ({bandwidth}) does not apply: "
                      f"--device {device} may run NCCL, which the emulator cannot shape")
    if inline:
        return None, f"the workload's default regime ({bandwidth}) does not apply: it runs inline in this process"
    if problem is None:
        return parse_rate(bandwidth), (f"rate {bandwidth} is this workload's default regime "
                                       "(--bandwidth none runs unshaped)")
    return None, f"the workload's default regime ({bandwidth}) was NOT emulated ({problem}); this run is unshaped"


def _layout_text(hosts: int, host_rate: int | None, classes: tuple[str, ...], host_classes: int,
                 link_model: str | None) -> str:
    """The emulated layout in words (the run's ``info["layout"]``)."""
    collective = ", in equal-weight htb classes: the gradient reduction (bound to {}) and everything else " \
                 "(link model 'collective')"
    flow = ", shared per TCP flow (link model 'flow')"
    if hosts == 1:
        return ("one namespace; all ranks share one loopback limited to the rate"
                + (collective.format(classes[0]) if classes else flow))
    share = collective.format("each host's address in 10.213.1.0/24") if host_classes else flow if link_model else ""
    return (f"{hosts} host namespaces on a bridge, each link limited to the rate in both directions{share}"
            "; between ranks of one host " + (f"{format_rate(host_rate)}, shared" if host_rate else "unlimited"))


def _link_model(asked: str | None, wl: Workload | None, rate: int | None, hosts: int, delay: float | None,
                notes: list[str]) -> str | None:
    """The link model in force (None: no shaped loopback to model). An explicit
    ``collective`` that cannot apply is a ValueError; the workload's default falls back to
    ``flow`` with a note."""
    default = wl.default_link_model if wl is not None else "flow"
    model = asked or default
    if rate is None:
        if asked is not None:
            raise ValueError("--link-model needs a shaped link: give --bandwidth RATE (or drop --link-model)")
        return None
    why = "link classes cannot be combined with --delay" if delay else None
    if model == "collective" and why:
        if asked is not None:
            raise ValueError(f"--link-model collective: {why}; use --link-model flow")
        notes.append(f"link model 'flow' (per TCP flow): {why}")
        return "flow"
    if asked is None and wl is not None and wl.default_link_model == "collective":
        notes.append("link model 'collective' (the gradient reduction and the all-to-all share the link per "
                     "collective) is this workload's default (--link-model flow: per TCP flow)")
    return model


# --cluster: a run is host-bound when its ranks together keep more than this share of the
# machine's cores busy; per rank: CPU_SHARE_OF_CORES * cores / ranks (process CPU time over
# wall time of the timed steps)
CPU_SHARE_OF_CORES = 0.5


def host_cpu_limit(cores: int, ranks: int) -> float:
    """The host CPU share a rank may keep (pure): half of its fair share of the cores."""
    return CPU_SHARE_OF_CORES * cores / max(ranks, 1)


def cluster_table(records: dict[str, dict], *, cluster: ClusterPreset | None, dilation: float, ranks: int, cores: int,
                  unit: str = "step") -> tuple[str, dict]:
    """The ``--cluster`` summary table (pure): per variant its measured ``time_s`` (median
    per ``unit``), the predicted time on the real cluster (measured / k), its ranks' host CPU
    shares against :func:`host_cpu_limit` (flagged when one exceeds it), memory per rank
    (``peak_rss_mib``) and start-up (``startup_s``). ``records``: {variant: {"time_s",
    "host_cpu_share": [per rank], "peak_rss_mib": [per rank], "startup_s"}}. Returns the
    markdown and {variant: {"predicted_s", "host_cpu_share_max", "host_bound"}}, plus
    ``"host_cpu_limit"`` and ``"dilation"``. ``cluster``: the preset (None: ``--compute
    emulated`` without one, at time dilation ``dilation`` on ``ranks`` ranks)."""
    k = dilation

    def predicted(t):
        return None if t is None else t / k
    limit = host_cpu_limit(cores, ranks)
    head = cluster.describe() if cluster is not None else f"no cluster preset; {ranks} ranks, k = {k:g}"
    lines = [f"{head}.", "",
             f"| variant | measured {unit} (s) | predicted on the cluster (s, / k = {k:g}) | host CPU share per rank "
             f"(max; limit {limit:.3g}) | ranks over the limit (all repeats) | memory per rank (MiB, max) | start-up (s) | "
             "the run's processes: cores busy |",
             "|---|---|---|---|---|---|---|---|"]
    out: dict = {"host_cpu_limit": limit, "dilation": k}
    for v, r in records.items():
        shares = [x for x in r.get("host_cpu_share") or [] if isinstance(x, (int, float))]
        rss = [x for x in r.get("peak_rss_mib") or [] if isinstance(x, (int, float))]
        over = sum(x > limit for x in shares)
        t = r.get("time_s")
        out[v] = {"predicted_s": predicted(t), "host_cpu_share_max": max(shares, default=None),
                  "host_bound": over > 0, "peak_rss_mib_max": max(rss, default=None)}

        def f(x, fmt=".4g"):
            return "-" if x is None else format(x, fmt)
        lines.append(f"| {v} | {f(t)} | {f(predicted(t))} | {f(max(shares, default=None), '.3f')} | "
                     f"{over}/{len(shares)}{' **host-bound**' if over else ''} | {f(max(rss, default=None), '.0f')} | "
                     f"{f(r.get('startup_s'), '.3g')} | {f(r.get('run_cpu_share'), '.3g')} |")
    lines += ["", f"Host CPU share: process CPU time over wall time per rank; the limit is {CPU_SHARE_OF_CORES} x "
                  f"{cores} cores / {ranks} ranks (the ranks together at most half the machine), above "
                  "which a run is flagged host-bound (its times then measure this machine's CPU, not the "
                  "emulated cluster). The last column: CPU seconds of all the run's processes (start-up, the "
                  "launcher and the emulator included) over its wall time."]
    return "\n".join(lines), out


__all__ = ["CPU_SHARE_OF_CORES", "EmulationUnavailable", "cluster_table", "host_cpu_limit", "LINK_MODELS", "REDUCE_CLASS_ADDRESS", "REDUCE_CLASS_PLACEHOLDER", "bench_context",
           "netem_prefix"]
