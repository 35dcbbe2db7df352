"""``torchrun --nproc_per_node N -m commsched.gnn.train ...``: distributed full-graph training.

Each rank trains on one partition of the graph. Without ``--partition-dir`` rank 0
loads (or generates) the graph, partitions it and hands every rank its part; with it,
each rank reads only its own part file. Rank 0 writes ``OUT/metrics.json`` (DESIGN.md
"Runs and results") and shows a progress bar (``COMMSCHED_PROGRESS=0`` hides it).
Runs without torchrun too (one process, world size 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any, Sequence

from ...agree import check_same_config
from ...cluster.topology import Topology
from ...config import read_env
from ...configurable import (
    Registry,
    add_arguments,
    cli_fields,
    config_of,
    flag_values,
    from_arguments,
    parse_args,
)
from ...dist import claim_run_folder, cli_main, init_distributed, long_work_done, scatter_object
from ...priority.policy import SCHEDULES
from ..exchange.modes import MODES, mode_config
from ..graph.data import GraphSource, load_source
from ..graph.flags import add_graph_args, graph_args_given, source_from_args
from ..graph.partition import (
    METHODS,
    PartData,
    halo_rows,
    inter_host_rows,
    load_part,
    make_parts,
    partition_nodes,
)
from .minibatch import run_minibatch
from .trainer import TrainConfig, run_training

CLI_DEFAULTS = {"device": "auto"}  # the flags' defaults that are not the config's


def build_parser(modes: Registry | None = None) -> argparse.ArgumentParser:
    """The parser; ``modes``: the mode registry (default :data:`MODES`) whose names are
    ``--mode``'s choices and whose configs give the mode options."""
    modes = modes if modes is not None else MODES
    p = argparse.ArgumentParser(prog="python -m commsched.gnn.train",
                                description="Distributed full-graph GNN training: Vanilla (exact) or AdaQP's "
                                            "quantized exchanges with overlap (see docs/adaqp.md).")
    add_graph_args(p)
    p.add_argument("--partition-dir", metavar="DIR",
                   help="a folder written by `commsched partition` (each rank loads its part)")
    p.add_argument("--partition-method", choices=METHODS, default="metis",
                   help="partitioner when no folder is given (default metis; metis-hosts: METIS, "
                        "then the parts given to ranks so that the heaviest cuts stay inside hosts)")
    p.add_argument("--partition-seed", type=int, default=0)
    t = p.add_argument_group("model and training")
    # flags, defaults, help and choices: TrainConfig's fields (--model from the layer
    # registry, --mode from MODES) and each mode config's fields
    add_arguments(t, TrainConfig, skip=("checkpoint_every",), defaults=CLI_DEFAULTS)
    next(x for x in t._group_actions if x.dest == "mode").choices = modes.names
    m = p.add_argument_group("mode options (each belongs to the modes whose config has it)")
    seen: set[str] = set()
    for cls in _mode_classes(modes):
        add_arguments(m, cls, skip=tuple(seen), only_given=True)
        seen.update(f.name for f in cli_fields(cls))
    g = p.add_argument_group("gradient schedule (each option belongs to the schedules whose config has it)")
    g.add_argument("--grad-schedule", default=TrainConfig().schedule.policy, choices=SCHEDULES.names,
                   help="the gradient reduction: a schedule of commsched.priority (default flat: one allreduce "
                        "after the backward pass; lina: held behind the backward halo exchanges; fifo: buckets "
                        "at once; serial: micro-ops after it; lina-overlap: lina, the tail in the next forward)")
    seen = set()
    for cls in dict.fromkeys(SCHEDULES.values()):
        add_arguments(g, cls, skip=tuple(seen), only_given=True)
        seen.update(f.name for f in cli_fields(cls))
    r = p.add_argument_group("run")
    r.add_argument("--out", default="runs/gnn", metavar="DIR", help="where metrics.json goes")
    add_arguments(r, TrainConfig, skip=tuple(f.name for f in cli_fields(TrainConfig)
                                             if f.name != "checkpoint_every"))
    r.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    r.add_argument("--overwrite", action="store_true",
                   help="replace the run already in OUT (else a folder holding metrics.json is refused)")
    return p


def _mode_classes(modes: Registry) -> list[type]:
    """The config classes of the registered modes, each once, in registration order."""
    return list(dict.fromkeys(modes.values()))


def config_from_args(a: argparse.Namespace, modes: Registry | None = None) -> TrainConfig:
    """The TrainConfig of the parsed flags (``modes``: the registry :func:`build_parser`
    was given); a mode (or schedule) option given to a mode (or schedule) whose config lacks it
    is refused, naming those that take it (:func:`commsched.configurable.config_of`)."""
    modes = modes if modes is not None else MODES
    values = {f.name: getattr(a, f.name) for cls in _mode_classes(modes) for f in cli_fields(cls)
              if hasattr(a, f.name)}
    sched = {f.name: getattr(a, f.name) for cls in SCHEDULES.values() for f in cli_fields(cls) if hasattr(a, f.name)}
    return from_arguments(TrainConfig, a, exchange=mode_config(a.mode, given=True, modes=modes, **values),
                          schedule=config_of(SCHEDULES, a.grad_schedule, sched, given=True, selector="--grad-schedule"))


def obtain_part(src: GraphSource | None, rank: int, world: int, *, partition_dir: str | None,
                method: str, seed: int, group=None,
                hosts_P: Sequence[str] | None = None) -> tuple[PartData, dict]:
    """This rank's part: from a folder, or partitioned on the fly by rank 0 and scattered.
    ``hosts_P`` (the host of every rank; needed by ``metis-hosts``) adds the halo rows
    that cross hosts to the partition's info (``inter_host_rows``, ``halo_rows``)."""
    info: dict = {}
    if partition_dir:
        t = time.perf_counter()
        part = load_part(partition_dir, rank, world,
                         source_id=src.identity() if src is not None else None)
        info["load_time_s"] = time.perf_counter() - t
        info["partition"] = {"dir": str(partition_dir)}
        return part, info
    parts_list: list = [None] * world
    err = None
    if rank == 0:
        try:
            t = time.perf_counter()
            g = load_source(src if src is not None else GraphSource())
            t1 = time.perf_counter()
            owner = partition_nodes(g, world, method, seed, hosts_P=hosts_P)
            t2 = time.perf_counter()
            parts_list = make_parts(g, owner, world)
            info.update(load_time_s=t1 - t, partition_time_s=t2 - t1,
                        book_time_s=time.perf_counter() - t2)
            info["partition"] = {"method": method, "seed": seed,
                                 "edge_cut": int((owner[g.edge_index_2E[0].numpy()]
                                                  != owner[g.edge_index_2E[1].numpy()]).sum())}
            if hosts_P is not None and world > 1:
                rows = halo_rows(g, owner, world)
                info["partition"].update(halo_rows=int(rows.sum()),
                                         inter_host_rows=inter_host_rows(rows, hosts_P))
            info["graph"] = g.summary()
            del g
        except ValueError as e:
            err = str(e)
            parts_list = [None] * world
    if world == 1:
        if err:
            raise ValueError(err)
        return parts_list[0], info
    # a large graph takes rank 0 longer to load and cut than the collective timeout
    long_work_done("loading and partitioning the graph on rank 0")
    payload = [(err, p, info) for p in parts_list] if rank == 0 else None
    err, part, info0 = scatter_object(payload, "scattering the partitions", 0, group)
    if err:
        raise ValueError(err)
    return part, info0


def startup_check(cfg: TrainConfig, src: GraphSource | None, group=None, *,
                  flags: dict[str, object] | None = None, **run: object) -> None:
    """Stop every rank with one clear ValueError when the ranks were started with different
    training configurations, graphs or run options (collective); ``flags``: the command
    line (:func:`commsched.configurable.flag_values`), whose differing flags are named first."""
    check_same_config({"train": cfg.record(),
                       "graph": dataclasses.asdict(src) if src is not None else None, **run},
                      group=group, what="training configuration", flags=flags)


PROG = "commsched.gnn.train"


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = parse_args(p, list(sys.argv[1:] if argv is None else argv))
    # the run folder once made (a FAILED marker goes there, not before) and rank 0's lock on it
    ready: dict[str, Any] = {}
    try:
        return cli_main(PROG, lambda: _run(a, ready, flag_values(p, a)), out=lambda: ready.get("out"))
    finally:
        if ready.get("lock") is not None:  # the folder is free for the next run
            ready["lock"].release()


def _run(a: argparse.Namespace, ready: dict[str, Any], flags: dict[str, object] | None = None) -> int:
    cfg = config_from_args(a)
    src = source_from_args(a) if (graph_args_given(a) or not a.partition_dir) else None
    di = init_distributed(device="cpu" if cfg.emulated else cfg.device)  # ValueError: --device cuda without (enough) GPUs
    rank, world, device = di.rank, di.world_size, di.device
    # the run folder is made (or refused) before any work
    # made (or refused) before any work, and held: one run per folder at a time
    ready["lock"] = claim_run_folder(a.out, overwrite=a.overwrite, resume=a.resume)
    ready["out"] = a.out
    if cfg.exchange.timing_only and rank == 0:
        print("commsched.gnn.train: --mode nocomm is TIMING ONLY: remote rows are replaced by "
              "zeros, so the model trained is wrong; it measures the no-communication limit",
              file=sys.stderr)
    startup_check(cfg, src, flags=flags, partition_dir=a.partition_dir, partition_method=a.partition_method,
                  partition_seed=a.partition_seed, resume=a.resume, out=a.out)
    # the host of every rank (one all_gather): metis-hosts and the bytes per link class
    hosts_P = Topology.from_env().hosts_P if world > 1 else None
    part, info = obtain_part(src, rank, world, partition_dir=a.partition_dir,
                             method=a.partition_method, seed=a.partition_seed, hosts_P=hosts_P)
    check_same_config({"fingerprint": part.fingerprint, "num_parts": part.book.num_parts},
                      what="graph partition")
    # metrics.json's "partition" is the per-rank books; how they were made goes beside it
    extra = {k: v for k, v in info.items() if k != "partition"}
    extra["partitioning"] = info["partition"]
    run, graph = run_training, {}
    if cfg.exchange.sampled:  # a replicated feature store: every rank loads the whole graph
        if src is None:
            raise ValueError(f"--mode {cfg.mode} keeps the whole graph on every rank: give the graph "
                             "(--dataset, --graph or the synthetic flags) beside --partition-dir")
        run, graph = run_minibatch, {"graph": load_source(src)}
    metrics, _ = run(cfg, part, out_dir=a.out, resume=a.resume, progress=read_env().progress,
                     dataset=part.name, extra=extra, device=device, hosts_P=hosts_P, **graph)
    if rank == 0:
        print(f"{metrics['mode']} {metrics['model']} on {metrics['dataset']} x{metrics['world_size']}: "
              f"loss {metrics['loss'][-1] if metrics['loss'] else float('nan'):.4f}, "
              f"val {metrics['val_acc']}, test {metrics['test_acc']} (best epoch {metrics['best_epoch']}), "
              + (f"ROC AUC val {metrics['val_auc']:.4f}, test {metrics['test_auc']:.4f}, "
                 if metrics.get("val_auc") is not None and metrics.get("test_auc") is not None else "") +
              f"{metrics['epoch_time_s']:.3f} s/epoch, {metrics['bytes_sent_per_epoch'] / 1e6:.2f} MB/epoch; "
              f"wrote {a.out}/metrics.json")
    return 0
