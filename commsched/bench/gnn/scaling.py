"""Scaling: full-graph training on synthetic power-law graphs of growing size.
``python -m commsched.bench.gnn.scaling --nodes 200000,1000000,2000000 --edges-per-node 10 --nproc 4 --hidden 128 --modes vanilla,adaptive --epochs 3 --out runs/gnn-scaling``

Per size N (the synthetic generator, ``--edges-per-node`` x N undirected edge pairs): one
``commsched partition`` process generates the graph, cuts it with METIS and writes a
partition folder (``OUT/nN/partition``); then every mode trains on it under torchrun with
``--partition-dir``, so each rank loads only its own part (no stage holds the whole graph
on every rank; the partition step is one process). Measured per size: generation and
partition time, the partition step's peak memory, load time per rank, peak memory (RSS)
per rank and over all ranks, the median epoch time and bytes per epoch of each mode, and
the degree skew of the graph (max / mean degree, Hill's tail exponent). Writes
``OUT/summary.json``, ``OUT/summary.md`` and ``OUT/scaling.png`` (memory and epoch time
against nodes, log-log, with a linear reference through the smallest size), rewritten
after every size so an interrupted run keeps what it measured; ``--collect`` rebuilds them
from the size folders without running anything. The summary's growth exponents compare
the largest size with the smallest (1.0 is linear) and name the steepest step between
neighbouring sizes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from ...results import write_json
from ..plots import pyplot, save_figure

# a growth exponent up to this much above 1 still counts as linear (measurement noise)
LINEAR_SLACK = 0.1
DEFAULT_NODES = "200000,1000000,2000000"
MIB = 1024 * 1024


def growth(n0: float, y0: float, n1: float, y1: float) -> dict:
    """How ``y`` grew from ``(n0, y0)`` to ``(n1, y1)``: ``exponent`` = log(y1/y0) /
    log(n1/n0) (1.0: linear, 2.0: quadratic), ``per_node_ratio`` = (y1/n1) / (y0/n0) (1.0:
    linear) and ``linear`` (the exponent is at most 1 + :data:`LINEAR_SLACK`)."""
    if not (n1 > n0 > 0 and y0 > 0 and y1 > 0):
        raise ValueError(f"growth needs 0 < n0 < n1 and positive figures, got n {n0} -> {n1}, "
                         f"figure {y0} -> {y1}")
    e = math.log(y1 / y0) / math.log(n1 / n0)
    return {"exponent": e, "per_node_ratio": (y1 / n1) / (y0 / n0), "linear": e <= 1.0 + LINEAR_SLACK}


def size_record(nodes: int, meta: dict, runs: dict[str, dict]) -> dict:
    """One size's figures from its partition folder's ``meta.json`` and each mode's
    ``metrics.json`` (``runs``: {mode: metrics})."""
    t = meta.get("times_s") or {}
    rec = {"nodes": nodes, "directed_edges": meta["graph"]["num_edges"],
           "generate_s": t.get("load"), "partition_s": t.get("partition"), "write_s": t.get("write"),
           "partition_peak_rss_mib": meta.get("peak_rss_mib"), "degrees": meta.get("degrees") or {},
           "edge_cut": meta.get("edge_cut"), "modes": {}}
    for mode, m in runs.items():
        rss = m.get("peak_rss_mib_per_rank") or []
        load = [x for x in (m.get("load_time_s_per_rank") or []) if isinstance(x, (int, float))]
        rec["modes"][mode] = {"epoch_time_s": m.get("epoch_time_s"),
                              "bytes_per_epoch_MB": (m.get("bytes_sent_per_epoch") or 0) / 1e6,
                              "peak_rss_mib_per_rank": rss, "peak_rss_mib_max": max(rss) if rss else None,
                              "peak_rss_mib_total": sum(rss) if rss else None,
                              "load_s_per_rank": load, "load_s_max": max(load) if load else None,
                              "test_acc": m.get("test_acc"), "loaded_part_only": bool(
                                  (m.get("partitioning") or {}).get("dir"))}
    return rec


GROWTH_FIGURES = (("peak_rss_mib_max", "peak memory per rank"), ("peak_rss_mib_total", "peak memory, all ranks"),
                  ("epoch_time_s", "epoch time"))


def summarize(records: Sequence[dict]) -> dict:
    """The summary of the sizes measured (``records`` from :func:`size_record`): the records
    sorted by size and, per mode and figure, its growth from the smallest to the largest size
    (:func:`growth`; absent with fewer than two sizes or a missing figure)."""
    recs = sorted(records, key=lambda r: r["nodes"])
    out: dict = {"sizes": recs, "growth": {}}
    if len(recs) < 2:
        return out
    a, b = recs[0], recs[-1]

    def add(name: str, what: str, fig) -> None:  # fig(record) -> the figure or None
        if not (fig(a) and fig(b)):
            return
        g = growth(a["nodes"], fig(a), b["nodes"], fig(b))
        # the steepest step between neighbouring sizes: a bend the end points average away
        steps = [growth(r["nodes"], fig(r), q["nodes"], fig(q))["exponent"]
                 for r, q in zip(recs, recs[1:]) if fig(r) and fig(q)]
        out["growth"][name] = {"what": what, **g, "steepest_step": max(steps) if steps else None}

    for key, what in (("generate_s", "generation time"), ("partition_s", "partition time"),
                      ("partition_peak_rss_mib", "partition step's peak memory")):
        add(key, what, lambda r, k=key: r.get(k))
    for mode in a["modes"]:
        for key, what in GROWTH_FIGURES:
            add(f"{mode}:{key}", f"{mode}: {what}", lambda r, m=mode, k=key: (r["modes"].get(m) or {}).get(k))
    out["from_nodes"], out["to_nodes"] = a["nodes"], b["nodes"]
    return out


def _f(x, fmt: str = "{:.3g}") -> str:
    return "-" if x is None else fmt.format(x)


def summary_markdown(s: dict) -> str:
    """The size table, one row per size and mode, then the growth exponents."""
    lines = ["| nodes | directed edges | max/mean degree | tail exponent | generate s | partition s | "
             "partition peak GiB | mode | load s (max rank) | peak GiB per rank (max) | peak GiB all ranks | "
             "s/epoch | MB/epoch |", "|---" * 13 + "|"]
    for r in s["sizes"]:
        d = r.get("degrees") or {}
        first = True
        for mode, m in (r["modes"] or {"-": {}}).items():
            head = [f"{r['nodes']:,}", f"{r['directed_edges']:,}", _f(d.get("max_over_mean"), "{:.0f}"),
                    _f(d.get("tail_exponent"), "{:.2f}"), _f(r.get("generate_s"), "{:.1f}"),
                    _f(r.get("partition_s"), "{:.1f}"), _f(_gib(r.get("partition_peak_rss_mib")), "{:.2f}")] \
                if first else [""] * 7
            first = False
            lines.append("| " + " | ".join([*head, mode, _f(m.get("load_s_max"), "{:.2f}"),
                                            _f(_gib(m.get("peak_rss_mib_max")), "{:.2f}"),
                                            _f(_gib(m.get("peak_rss_mib_total")), "{:.2f}"),
                                            _f(m.get("epoch_time_s")), _f(m.get("bytes_per_epoch_MB"), "{:.1f}")])
                         + " |")
    lines.append("")
    if s.get("growth"):
        lines += [f"Growth from {s['from_nodes']:,} to {s['to_nodes']:,} nodes (exponent 1.0: linear; "
                  f"per-node ratio: figure per node at the largest size over the smallest):", "",
                  "| figure | growth exponent | per-node ratio | no faster than linear | steepest step |",
                  "|---|---|---|---|---|"]
        for g in s["growth"].values():
            lines.append(f"| {g['what']} | {g['exponent']:.2f} | {g['per_node_ratio']:.2f} | "
                         f"{'yes' if g['linear'] else 'no'} | {_f(g.get('steepest_step'), '{:.2f}')} |")
        lines.append("")
    return "\n".join(lines)


def _gib(mib: float | None) -> float | None:
    return None if mib is None else mib / 1024.0


def plot_scaling(s: dict, path: Path) -> Path:
    """Two log-log panels against nodes: peak memory (per rank, max; all ranks) and epoch
    time per mode, each with a dotted linear reference through its smallest size."""
    plt = pyplot()
    recs = s["sizes"]
    n = [r["nodes"] for r in recs]
    modes = list(dict.fromkeys(m for r in recs for m in r["modes"]))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = ((axes[0], (("peak_rss_mib_max", "per rank (max)"), ("peak_rss_mib_total", "all ranks")),
               "peak memory (GiB)", 1 / 1024.0),
              (axes[1], (("epoch_time_s", ""),), "epoch time (s, median)", 1.0))
    for ax, keys, ylabel, scale in panels:
        for mode in modes:
            for key, label in keys:
                pts = [(r["nodes"], r["modes"][mode][key] * scale) for r in recs
                       if mode in r["modes"] and r["modes"][mode].get(key)]
                if not pts:
                    continue
                line, = ax.plot(*zip(*pts), "o-", label=f"{mode} {label}".strip())
                x0, y0 = pts[0]
                ax.plot([x0, max(n)], [y0, y0 * max(n) / x0], ":", color=line.get_color(), linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # one label per size measured
        ax.set_xticks(n, [f"{x / 1e6:g}M" if x >= 100_000 else f"{x:,}" for x in n])
        ax.set_xlabel("nodes")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small", title="dotted: linear from the smallest", title_fontsize="x-small")
    return save_figure(fig, path)


def write_outputs(records: Sequence[dict], out: Path, meta: dict) -> dict:
    s = summarize(records)
    s["meta"] = meta
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "summary.json", s, indent=1)
    (out / "summary.md").write_text(f"# GNN scaling\n\n`{meta.get('command', '')}`\n\n" + summary_markdown(s))
    if s["sizes"]:
        s["plots"] = [str(plot_scaling(s, out / "scaling.png"))]
    return s


def _partition(nodes: int, a: argparse.Namespace, folder: Path) -> dict:
    """Run ``commsched partition`` for this size (one process) and return its meta.json."""
    if (folder / "meta.json").is_file() and a.reuse:
        return json.loads((folder / "meta.json").read_text())
    cmd = [sys.executable, "-m", "commsched.cli", "partition", *_graph_flags(nodes, a),
           "--parts", str(a.nproc), "--out", str(folder)]
    folder.mkdir(parents=True, exist_ok=True)
    log = folder.parent / "partition.log"
    with open(log, "w") as f:
        f.write("# " + shlex.join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=a.timeout,
                            env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))).returncode
    if rc != 0:
        tail = "\n".join(log.read_text().strip().splitlines()[-5:])
        raise RuntimeError(f"partitioning {nodes} nodes failed (exit {rc}); log: {log}\n{tail}")
    return json.loads((folder / "meta.json").read_text())


def _graph_flags(nodes: int, a: argparse.Namespace) -> list[str]:
    return ["--syn-nodes", str(nodes), "--syn-edges", str(int(round(a.edges_per_node * nodes))),
            "--syn-features", str(a.features), "--syn-seed", str(a.syn_seed)]


def _train(nodes: int, mode: str, a: argparse.Namespace, pdir: Path, out: Path) -> dict:
    from ...gnn.train.cli import CLI_DEFAULTS
    from ...gnn.train.trainer import TrainConfig
    from ..runner import RunContext, Variant, run_variant
    from .compare import bench_run

    base = TrainConfig(epochs=a.epochs, eval_every=a.epochs, hidden=a.hidden, seed=a.seed, dropout_rng="local",
                       device=a.device)
    cfg, own = bench_run(mode, base)
    v = Variant(mode, "commsched.gnn.train", (*own, "--partition-dir", str(pdir), *_graph_flags(nodes, a)),
                config=cfg, defaults=CLI_DEFAULTS)
    return run_variant(v, a.nproc, out, RunContext(), a.timeout)


def parse_nodes(text: str) -> list[int]:
    """``200000,1000000`` -> [200000, 1000000] (distinct, each >= 2)."""
    try:
        sizes = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--nodes takes comma-separated node counts, e.g. 200000,1000000; got {text!r}") from None
    if not sizes or len(set(sizes)) != len(sizes) or min(sizes) < 2:
        raise ValueError(f"--nodes needs distinct node counts of at least 2, got {text!r}")
    return sorted(sizes)


def build_parser() -> argparse.ArgumentParser:
    from ...dist import DEVICE_CHOICES

    p = argparse.ArgumentParser(prog="python -m commsched.bench.gnn.scaling", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default=DEFAULT_NODES, help=f"comma-separated graph sizes (default {DEFAULT_NODES})")
    p.add_argument("--edges-per-node", type=float, default=10.0, help="undirected edge pairs per node (default 10)")
    p.add_argument("--features", type=int, default=64, help="feature width (default 64)")
    p.add_argument("--syn-seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=4, help="ranks (= parts)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--modes", default="vanilla,adaptive")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per step (partition or training run)")
    p.add_argument("--reuse", action="store_true", help="keep a size's partition folder when it is there")
    p.add_argument("--collect", action="store_true", help="only rebuild the summary from OUT/n*/")
    p.add_argument("--out", type=Path, default=Path("runs/gnn-scaling"))
    return p


def _collected(out: Path, modes: Sequence[str] = ()) -> list[dict]:
    """The sizes measured under ``out`` (``OUT/nN/``), their modes in the order of ``modes``."""
    recs = []
    for d in sorted(out.glob("n*")):
        meta = d / "partition" / "meta.json"
        if not meta.is_file() or not d.name[1:].isdigit():
            continue
        found = sorted(d.glob("*/metrics.json"), key=lambda m: (list(modes).index(m.parent.name)
                                                                 if m.parent.name in modes else len(modes), m))
        runs = {m.parent.name: json.loads(m.read_text()) for m in found}
        recs.append(size_record(int(d.name[1:]), json.loads(meta.read_text()), runs))
    return recs


def main(argv: Sequence[str] | None = None) -> int:
    from ...dist import cli_main

    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    return cli_main("commsched.bench.gnn.scaling", lambda: _run(a, argv))


def _run(a: argparse.Namespace, argv: list[str]) -> int:
    sizes = parse_nodes(a.nodes)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if a.nproc < 1 or a.epochs < 1 or a.edges_per_node <= 0:
        raise ValueError("--nproc and --epochs must be >= 1 and --edges-per-node > 0")
    meta = {"command": shlex.join(["python", "-m", "commsched.bench.gnn.scaling", *argv]), "nproc": a.nproc,
            "hidden": a.hidden, "epochs": a.epochs, "edges_per_node": a.edges_per_node, "features": a.features}
    if a.collect:
        s = write_outputs(_collected(a.out, modes), a.out, meta)
        print(summary_markdown(s))
        return 0
    from .compare import bench_run

    for m in modes:
        bench_run(m)  # an unknown mode is refused before any work
    records = [r for r in _collected(a.out, modes) if r["nodes"] not in sizes]  # sizes measured before
    for nodes in sizes:
        d = a.out / f"n{nodes}"
        t0 = time.perf_counter()
        print(f"[scaling] {nodes:,} nodes: partitioning", file=sys.stderr, flush=True)
        pmeta = _partition(nodes, a, d / "partition")
        runs = {}
        for mode in modes:
            print(f"[scaling] {nodes:,} nodes: training {mode} on {a.nproc} ranks", file=sys.stderr, flush=True)
            runs[mode] = _train(nodes, mode, a, d / "partition", d / mode)
        records.append(size_record(nodes, pmeta, runs))
        write_outputs(records, a.out, meta)
        print(f"[scaling] {nodes:,} nodes done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    s = write_outputs(records, a.out, meta)
    print(summary_markdown(s))
    print(f"plot: {a.out / 'scaling.png'}")
    return 0


__all__ = ["GROWTH_FIGURES", "LINEAR_SLACK", "growth", "parse_nodes", "plot_scaling", "size_record",
           "summarize", "summary_markdown"]

if __name__ == "__main__":
    sys.exit(main())
