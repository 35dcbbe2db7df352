"""The gradient reduction alone, flat against hierarchical, on the job's hosts.

    commsched netem --rate 267mbit --hosts 2 -- .venv/bin/python -m torch.distributed.run \\
        --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint={addr0}:29400 \\
        --local-addr={addr} --rdzv-conf=is_host={is_host0} --node-rank={host} --rdzv-id=hier \\
        -m commsched.bench.hier_check --out /tmp/hier-check

Every rank registers the same gradients (``--big`` tensors of ``--big-kib`` KiB and
``--small`` of ``--small-kib`` KiB: by default 8 MiB and 32 small ones, about the 8.68 MiB
and 68 micro-ops of the moe-train model's non-expert gradients) with a
:class:`~commsched.priority.executor.GradScheduler` under ``lina`` with no all-to-all, so
nothing holds the reduction back, and times a backward pass plus ``finish()`` (the
slowest rank's time) for the flat and the hierarchical reduction, interleaved,
``--repeats`` times after one warm-up each. The hosts come from ``Topology.from_env``.
Rank 0 prints one JSON line and writes ``OUT/hier_check.json``: the medians, their ratio,
and every repeat.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..dist import all_gather_object, barrier, init_distributed, new_group
from ..priority.executor import GradScheduler
from ..priority.hier import make_hier
from ..priority.policy import ScheduleConfig
from ..results import median, write_json
from ..topology import Topology


def _time_once(params, cfg: ScheduleConfig, group, hier) -> float:
    with GradScheduler([(p, group) for p in params], cfg, hier=hier) as s:
        barrier("lining up before a timed reduction")
        t0 = time.perf_counter()
        s.begin_step()
        sum(p.sum() for p in params).backward()
        s.finish()
        took = time.perf_counter() - t0
    for p in params:
        p.grad = None
    return max(all_gather_object(took, "gathering the reduction times"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--big", type=int, default=8)
    p.add_argument("--big-kib", type=int, default=1024)
    p.add_argument("--small", type=int, default=32)
    p.add_argument("--small-kib", type=int, default=4)
    p.add_argument("--microop-bytes", type=int, default=ScheduleConfig().microop_bytes)
    p.add_argument("--threads", type=int, default=8, help="gloo worker threads of every group")
    p.add_argument("--hier-min-bytes", type=int, default=ScheduleConfig().hier_min_bytes,
                   help="operations below this stay flat under the hierarchy (0: none)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    init_distributed(device="cpu")
    torch.set_num_threads(1)
    hosts_P = Topology.from_env().hosts_P
    hier = make_hier(hosts_P, threads=a.threads)
    if hier is None:
        raise SystemExit("hier_check needs several hosts with several ranks each (see the line above)")
    group = new_group(list(range(dist.get_world_size())), threads=a.threads)
    sizes = [a.big_kib * 256] * a.big + [a.small_kib * 256] * a.small  # float32 elements
    params = [torch.nn.Parameter(torch.ones(n)) for n in sizes]
    flat_cfg = ScheduleConfig(policy="lina", microop_bytes=a.microop_bytes)
    hier_cfg = dataclasses.replace(flat_cfg, hier_reduce=True, hier_min_bytes=a.hier_min_bytes)
    times: dict[str, list[float]] = {"flat": [], "hier": []}
    for rep in range(a.repeats + 1):
        for mode, cfg, h in (("flat", flat_cfg, None), ("hier", hier_cfg, hier)):
            t = _time_once(params, cfg, group, h)
            if rep:  # the first of each is a warm-up
                times[mode].append(t)
    res = {"hosts": len(set(hosts_P)), "world_size": len(hosts_P), "grad_bytes": 4 * sum(sizes),
           "microop_bytes": a.microop_bytes, "hier_min_bytes": a.hier_min_bytes, "flat_s": median(times["flat"]), "hier_s": median(times["hier"]),
           "repeats_s": times}
    res["flat_over_hier"] = res["flat_s"] / res["hier_s"]
    if dist.get_rank() == 0:
        print(json.dumps({k: v for k, v in res.items() if k != "repeats_s"}), flush=True)
        if a.out is not None:
            write_json(a.out / "hier_check.json", res)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
