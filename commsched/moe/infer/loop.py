"""The run loop of an inference run (:mod:`commsched.moe.infer`): build a rank's
:class:`~commsched.moe.infer.drivers.Setup`, feed the driver's batches through the
:class:`~commsched.moe.infer.runtime.Runtime` (steps 2-5 of the module docstring of
:mod:`commsched.moe.infer`), gather every rank's records and summarize them
(:mod:`~commsched.moe.infer.metrics`).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ... import dist as cdist
from ...agree import check_same_config
from ...clock import Clock
from ...cluster.device import HostCPU, peak_rss_mib
from ...cluster.topology import Topology
from ...config import read_env
from ...results import Progress
from .config import InferConfig, job_device
from .drivers import build
from .metrics import summarize
from .runtime import Runtime, row_cost


def run(cfg: InferConfig, out: Path | None = None, *, group=None, device: torch.device | None = None,
        return_outputs: bool = False, flags: dict | None = None) -> dict:
    """Run inference on the initialised process group; every rank returns the metrics
    (the dict ``metrics.json`` holds). ``device``: where this rank computes (default:
    :func:`job_device`; the CLI passes the device ``init_distributed`` chose).
    ``return_outputs`` adds this rank's final outputs per batch under ``"outputs"`` (on
    the device; tests compare them with the single-process model). ``flags``: the command
    line (:func:`commsched.configurable.flag_values`), whose differing flags a configuration
    that differs between ranks names first."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    check_same_config(dataclasses.asdict(cfg), group, what="inference configuration", flags=flags)
    dev = torch.device(device) if device is not None else job_device(cfg, group)
    t_wall = time.perf_counter()
    topo = Topology.from_env(group)  # the hosts of the ranks (one all_gather of host names)
    host_P = tuple(topo.hosts.index(h) for h in topo.hosts_P)
    s = build(cfg, rank, world, dev)
    bank, drv = s.bank, s.driver
    row_cost_s = row_cost(bank, rank, world, group)
    # the strategy, from the run's sizes, profile and hosts, and what a node-aware weight is
    # measured from: the topology, the row size on the wire (float32 rows) and the row cost
    strategy = cfg.strategy.build(num_experts=drv.E, num_devices=world, num_layers=drv.L, k=drv.k, slots=s.slots,
                                  profile=drv.profile, device_host=host_P, topology=topo,
                                  row_bytes=4.0 * drv.row_width, row_cost_s=row_cost_s, resident=s.resident,
                                  load_cost_s=bank.load_cost_s())
    rt = Runtime(strategy, bank, pipelined=cfg.exchange == "pipelined", rank=rank, world=world, group=group,
                 device=dev)
    clock = Clock(dev)  # batch latency: CUDA events on a GPU, the host clock on the CPU
    outputs = []
    bar = Progress(cfg.batches, f"moe-infer {cfg.placement}", "batch",
                   enabled=read_env().progress and rank == 0 and out is not None)
    # no garbage collection inside a timed batch: a collection pass on one rank stalls
    # every rank at the next exchange; collect between batches instead
    gc.collect()
    gc.freeze()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    startup_s = time.perf_counter() - t_wall  # set-up: the topology, the driver, the bank, the row cost
    host = HostCPU().__enter__()  # the serving loop's CPU time over its wall time
    try:
        with torch.inference_mode():
            for b in range(cfg.batches):
                gc.collect()
                inputs, T = s.driver.batch(b, rank, dev)
                rt.begin_batch(b, T)
                cdist.barrier("aligning ranks before a batch", group)
                t0 = clock.mark()
                y = s.driver.forward(inputs, rt.moe)
                rt.end_batch(clock.seconds(t0, clock.mark()))
                if return_outputs:
                    outputs.append(y.clone())
                bar.update(1)
    finally:
        host.__exit__(None, None, None)
        if gc_was_enabled:
            gc.enable()
        gc.unfreeze()
        rt.close()
        bar.close()
    mine = rt.records if rank == 0 else [{k: v for k, v in r.items() if k != "layers"} for r in rt.records]
    gathered = cdist.all_gather_object({"records": mine, "loaded": sum(bank.loaded_L), "host_cpu_share": host.share,
                                        "peak_rss_mib": peak_rss_mib(), "startup_s": startup_s},
                                       "gathering the inference records", group)
    metrics = summarize(cfg, strategy, gathered, row_cost_s, wall_clock_s=time.perf_counter() - t_wall,
                        device=dev.type, host_P=host_P)
    if out is not None and rank == 0:
        metrics.write(Path(out) / "metrics.json")
    m = metrics.to_dict()
    if return_outputs:
        m["outputs"] = outputs
    return m


run_inference = run  # the name exported by commsched.moe

__all__ = ["run", "run_inference"]
