"""Exchange throughput of ``all_to_all`` per pattern and message size (torchrun module).

Each rank sends ``size`` bytes to every peer; the reported throughput is the bytes that
cross between ranks (all ranks together) per second of the slowest rank. Rank 0 also
measures a plain TCP socket pair on loopback in the same run: the ceiling here.

    torchrun --standalone --nproc_per_node 4 -m commsched.bench_all2all --out DIR
    commsched bench all2all --nproc 4          # both patterns side by side
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .all2all import A2APlan, all_to_all
from .bench import Variant, Workload, median_of
from .dist import init_distributed

DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)


def loopback_socket_MBps(nbytes: int = 256 << 20, chunk: int = 1 << 20, host: str = "127.0.0.1") -> float:
    """Throughput of one TCP stream over loopback (send thread -> recv), MB/s."""
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    payload = b"\0" * chunk

    def sender() -> None:
        with socket.create_connection((host, port)) as c:
            sent = 0
            while sent < nbytes:
                c.sendall(payload)
                sent += chunk

    th = threading.Thread(target=sender, daemon=True)
    th.start()
    conn, _ = srv.accept()
    buf = bytearray(chunk)
    view = memoryview(buf)
    got = 0
    t0 = time.perf_counter()
    while got < nbytes:
        n = conn.recv_into(view)
        if n == 0:
            break
        got += n
    dt = time.perf_counter() - t0
    th.join()
    conn.close()
    srv.close()
    return got / dt / 1e6


def measure(pattern: str, size: int, min_time_s: float, max_iters: int) -> dict:
    P, me = dist.get_world_size(), dist.get_rank()
    rows = max(1, size // 4)
    counts = [rows] * P
    plan = A2APlan(tuple(counts), tuple(counts), me)
    x = torch.randn(rows * P, 1)
    all_to_all(x, plan, pattern=pattern)  # warm-up
    times = []
    t_start = time.perf_counter()
    for i in range(max_iters):
        dist.barrier()
        t = time.perf_counter()
        all_to_all(x, plan, pattern=pattern)
        times.append(time.perf_counter() - t)
        # all ranks agree on when to stop
        flag = torch.tensor([1 if time.perf_counter() - t_start > min_time_s and i >= 2 else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item():
            break
    tmax = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64)
    dist.all_reduce(tmax, op=dist.ReduceOp.MAX)
    cross = rows * 4 * (P - 1) * P  # bytes between distinct ranks, all ranks together
    return {"size_bytes": rows * 4, "time_s": tmax.item(), "iters": len(times),
            "throughput_MBps": cross / tmax.item() / 1e6}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--patterns", default="direct,ring")
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                   help="bytes each rank sends to each peer, comma-separated")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds per measurement")
    p.add_argument("--max-iters", type=int, default=50)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    patterns = a.patterns.split(",")
    init_distributed()
    me = dist.get_rank()
    loop = loopback_socket_MBps() if me == 0 else 0.0
    dist.barrier()
    results = {pat: [measure(pat, s, a.min_time, a.max_iters) for s in sizes] for pat in patterns}
    if me == 0:
        largest = {pat: results[pat][-1]["throughput_MBps"] for pat in patterns}
        m = {"world_size": dist.get_world_size(), "patterns": results, "loopback_MBps": loop,
             "throughput_MBps": max(largest.values()),
             "ratio_to_loopback": max(largest.values()) / loop if loop else None}
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "metrics.json").write_text(json.dumps(m, indent=2))
        for pat in patterns:
            for r in results[pat]:
                print(f"{pat:6s} {r['size_bytes']:>10d} B/peer  {r['throughput_MBps']:9.1f} MB/s  "
                      f"(loopback socket {loop:.0f} MB/s)", flush=True)
    dist.destroy_process_group()


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default=None, help="bytes per peer, comma-separated")
    p.add_argument("--min-time", type=float, default=1.0)


def _variants(args) -> list[Variant]:
    extra = (["--sizes", args.sizes] if args.sizes else []) + ["--min-time", str(args.min_time)]
    return [Variant(pat, "commsched.bench_all2all", ("--patterns", pat, *extra)) for pat in ("direct", "ring")]


def _summarize(runs: dict[str, list[dict]], args, out: Path) -> dict:
    lines = ["| pattern | bytes/peer | MB/s (median of repeats) | share of loopback |", "|---|---|---|---|"]
    for v, rs in runs.items():
        loop = median_of(rs, "loopback_MBps")
        for i, r in enumerate(rs[0]["patterns"][v]):
            tp = median_of([x["patterns"][v][i] for x in rs], "throughput_MBps")
            lines.append(f"| {v} | {r['size_bytes']} | {tp:.1f} | {tp / loop:.2f} |" if loop else
                         f"| {v} | {r['size_bytes']} | {tp:.1f} | - |")
    return {"extra_tables": {"Throughput per message size": "\n".join(lines)}}


WORKLOAD = Workload(
    name="all2all",
    description="all_to_all throughput per pattern and message size, beside loopback socket throughput",
    key_metrics=("throughput_MBps", "loopback_MBps", "ratio_to_loopback"),
    higher_is_better=("throughput_MBps", "loopback_MBps", "ratio_to_loopback"),
    add_arguments=_add_arguments,
    variants=_variants,
    summarize=_summarize,
)

if __name__ == "__main__":
    main()
