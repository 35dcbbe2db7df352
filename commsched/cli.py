"""The ``commsched`` command: ``bench``, ``netem``, ``partition``, ``datasets``, ``topology``,
``calibrate``, ``demo``, ``scaling``, ``results``.

Command-line parsing lives here and in the ``__main__`` modules only.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Sequence

from ._lazy import MissingExtra

USAGE = """usage: commsched COMMAND [ARGS...]

commands:
  bench WORKLOAD [--nproc N] [--bandwidth RATE] [--hosts K] [--repeat R] --out DIR
                  run a workload's variants side by side and write a summary
                  (workloads: {workloads})
  netem --rate RATE [--delay MS] [--hosts K [--host-rate RATE]] -- COMMAND...
                  run COMMAND under an emulated link (needs root, ip and tc)
  partition ...   write a graph partition folder (see `commsched partition -h`)
  datasets [--data-root DIR] [--download NAME]
                  list the named GNN data sets and whether each is in the data root;
                  --download fetches one there
  topology (--file F | --hosts K --nproc N | --probe) [--out DIR]
                  show a topology: table, picture (DIR/topology.png), file (DIR/topology.json);
                  --probe measures the links under torchrun
  calibrate [--device auto|cpu|cuda] [--base h100] [--out FILE]
                  time each op class on this device and write a device model file
                  (the emulated device's efficiencies; on the CPU it calibrates the CPU)
  demo            the main job on the embedded default (what `make demo` runs)
  scaling RUN... --out DIR [--baseline V]
                  the scaling table and plot of bench runs on emulated clusters of
                  different sizes (one run folder per size)
  results [--from-summary SUMMARY_JSON --row ID] [--check]
                  render docs/results.md and the README's results table from
                  docs/results/headlines.json (see `commsched results -h`)

`commsched COMMAND -h` describes each command.
"""

# entry points, imported when their command runs
_COMMANDS = {
    "netem": "commsched.cluster.netem:main",
    "partition": "commsched.gnn.graph.cli:partition_main",
    "datasets": "commsched.gnn.graph.cli:datasets_main",
    "demo": "commsched.bench.demo:main",
    "results": "commsched.bench.results_page:main",
    "scaling": "commsched.bench.plots:scaling_main",
}


def _load(spec: str) -> Callable[[Sequence[str]], int | None]:
    mod, fn = spec.split(":")
    return getattr(importlib.import_module(mod), fn)


def _bench(argv: Sequence[str]) -> int:
    from .bench.workloads import WORKLOADS, run_bench

    if not argv or argv[0] in ("-h", "--help"):
        print("usage: commsched bench WORKLOAD [options]\nworkloads: " + ", ".join(sorted(WORKLOADS))
              + "\n`commsched bench WORKLOAD -h` lists a workload's options.")
        return 0 if argv else 2
    name, rest = argv[0], list(argv[1:])
    try:
        run_bench(name, rest)  # --bandwidth / --hosts / --delay go to the emulator
    except ValueError as e:
        print(f"commsched bench: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"commsched bench: {e}", file=sys.stderr)
        return 1
    return 0


TOPOLOGY_HELP = """\
usage: commsched topology --file FILE.json [--out DIR]
       commsched topology --hosts K --nproc N [--intra-rate R] [--intra-latency-us X]
                          [--inter-rate R] [--inter-latency-us X] [--out DIR]
       torchrun --nproc-per-node N -m commsched.cli topology --probe [--device D]
                          [--sizes B,B,...] [--repeats R] [--out DIR]

Prints the topology's hosts, link classes and (probed) per-pair costs; with --out, writes
DIR/topology.png (the graph of ranks, host fabrics, NICs and the switch) and
DIR/topology.json (the file form, readable with --file). --hosts K --nproc N lays out K
hosts of N ranks each; rates are tc style (100gbit, 25gbps), latencies in microseconds.
--probe measures every pair on the job's process group (a collective: run it on every
rank), alone, at each of --sizes bytes (default 4 KiB, 1, 4, 16 MiB), --repeats times
(default 3); rank 0 prints and writes. See docs/topology.md.
"""


def _topology(argv: Sequence[str]) -> int:
    import argparse

    from .dist import DEVICE_CHOICES

    if any(a in ("-h", "--help") for a in argv):
        print(TOPOLOGY_HELP)
        return 0
    p = argparse.ArgumentParser(prog="commsched topology", add_help=False, allow_abbrev=False)
    p.add_argument("--file")
    p.add_argument("--hosts", type=int)
    p.add_argument("--nproc", type=int)
    p.add_argument("--probe", action="store_true")
    p.add_argument("--device", default="cpu", choices=DEVICE_CHOICES)
    p.add_argument("--sizes")
    p.add_argument("--repeats", type=int)
    p.add_argument("--out")
    for cls in ("intra", "inter"):
        p.add_argument(f"--{cls}-rate")
        p.add_argument(f"--{cls}-latency-us", type=float)
    try:
        a, extra = p.parse_known_args(list(argv))
    except SystemExit:
        print(TOPOLOGY_HELP, file=sys.stderr)
        return 2
    try:
        if extra:
            raise ValueError(f"unknown arguments {extra}; see `commsched topology -h`")
        topo = _build_topology(a)
    except ValueError as e:
        from .dist import cli_error

        return cli_error("commsched topology", e)
    if topo is None:  # a rank other than 0 of a probe
        return 0
    print(topo.table())
    if a.out:
        from pathlib import Path

        out = Path(a.out)
        json_path = topo.save(out / "topology.json")
        png = topo.draw(out / "topology.png")
        print(f"\nwrote {png} and {json_path}")
    return 0


def _build_topology(a):
    """The topology the parsed ``commsched topology`` arguments ask for (None on ranks
    other than 0 of a probe); ValueError for a wrong combination."""
    from .cluster.topology import DEFAULT_INTER, DEFAULT_INTRA, Topology

    layout = a.hosts is not None or a.nproc is not None
    given = [n for n, on in (("--file", a.file is not None), ("--hosts/--nproc", layout),
                             ("--probe", a.probe)) if on]
    if len(given) != 1:
        raise ValueError("give exactly one of --file FILE, --hosts K --nproc N, or --probe (under "
                         f"torchrun); got {' and '.join(given) if given else 'none'}")
    link_flags = [f"--{c}-{k}" for c in ("intra", "inter") for k in ("rate", "latency-us")
                  if getattr(a, f"{c}_{k.replace('-', '_')}") is not None]
    probe_flags = [f for f, v in (("--sizes", a.sizes), ("--repeats", a.repeats)) if v is not None]
    if probe_flags and not a.probe:
        raise ValueError(f"{probe_flags[0]} applies to --probe only")
    if link_flags and not layout:
        raise ValueError(f"{link_flags[0]} applies to a hand-built layout (--hosts K --nproc N) only")
    if a.file is not None:
        return Topology.load(a.file)
    if layout:
        if a.hosts is None or a.nproc is None:
            raise ValueError("a hand-built layout needs both --hosts K and --nproc N (ranks per host)")
        from .cluster.costmodel import LinkCost
        from .cluster.netem import parse_optional_rate

        def cost(cls: str, default: LinkCost) -> LinkCost:
            rate, lat = getattr(a, f"{cls}_rate"), getattr(a, f"{cls}_latency_us")
            theta = default.theta
            if rate is not None:
                try:
                    bps = parse_optional_rate(rate)
                except ValueError as e:
                    raise ValueError(f"--{cls}-rate: {e}") from None
                theta = 0.0 if bps is None else 8.0 / bps
            if lat is not None and not lat >= 0:
                raise ValueError(f"--{cls}-latency-us must be >= 0, got {lat}")
            return LinkCost(gamma=default.gamma if lat is None else lat * 1e-6, theta=theta)

        for flag, v in (("--hosts", a.hosts), ("--nproc", a.nproc)):
            if v < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {v}")
        return Topology.grid(a.hosts, a.nproc, intra=cost("intra", DEFAULT_INTRA),
                             inter=cost("inter", DEFAULT_INTER))
    from .cluster.topology import PROBE_SIZES
    from .dist import group_device, init_distributed

    try:
        sizes = PROBE_SIZES if a.sizes is None else tuple(int(x) for x in a.sizes.split(","))
    except ValueError:
        raise ValueError(f"--sizes must be byte counts separated by commas, got {a.sizes!r}") from None
    if len(set(sizes)) < 2 or min(sizes) < 1:
        raise ValueError(f"--sizes needs two or more distinct sizes >= 1 byte, got {a.sizes!r}")
    repeats = 3 if a.repeats is None else a.repeats
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    rank = init_distributed(device=a.device).rank
    topo = Topology.probe(sizes=sizes, repeats=repeats, device=group_device(a.device))
    return topo if rank == 0 else None


def _calibrate(argv: Sequence[str]) -> int:
    # the codec's quantize is timed as the quant class; the cluster room does not import it
    from .cluster.calibrate import main as calibrate_main

    return calibrate_main(argv, quantize=_load("commsched.quant.codec:quantize"))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except MissingExtra as e:  # an optional dependency the command needs: one line, the extra
        print(f"commsched {argv[0] if argv else ''}: {e}", file=sys.stderr)
        return 2


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        from .bench.workloads import WORKLOADS

        print(USAGE.format(workloads=", ".join(sorted(WORKLOADS))))
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        return _bench(rest)
    if cmd == "topology":
        return _topology(rest)
    if cmd == "calibrate":
        return _calibrate(rest)
    if cmd in _COMMANDS:
        rc = _load(_COMMANDS[cmd])(rest)
        return int(rc or 0)
    print(f"commsched: unknown command {cmd!r}\n" + USAGE.format(workloads="..."), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
