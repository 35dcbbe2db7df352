"""Exchange throughput of ``all_to_all`` per pattern and message size (torchrun module).

Each rank sends ``size`` bytes to every peer; the reported throughput is the bytes that
cross between ranks (all ranks together) per second of the exchange's span (first rank
starting to last rank finishing, median over iterations). Rank 0 also
measures a plain TCP socket pair on loopback in the same run: the ceiling here.

Under ``commsched bench --bandwidth RATE`` (one shaped loopback shared by all ranks) every
cross-rank byte passes the one limit, so ``ratio_to_rate`` = throughput / RATE. Under
``--hosts K`` the ranks' hosts come from :meth:`commsched.Topology.from_env` and the bytes
on each link from :func:`commsched.predict_exchange`; ``uplink_MBps`` is the busiest host's
outgoing link and ``ratio_to_rate`` = uplink / RATE (traffic between ranks of one host
stays on that host's unshaped loopback). ``--transport`` picks the all-to-all transport
(``commsched.comm.all2all.TRANSPORTS``); the bench's ``--transports single,auto`` runs both
side by side (variants ``direct-single``, ``ring-single`` beside ``direct``, ``ring``).

    torchrun --standalone --nproc_per_node 4 -m commsched.bench.micro.all2all --out DIR
    commsched bench all2all --nproc 4          # both patterns side by side
    commsched bench all2all --bandwidth 1gbit --hosts 2 --nproc 1 --sizes 8388608 \
        --transports single,auto --repeat 5    # one connection per pair against two
"""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ...clock import Clock
from ...cluster.topology import SWITCH, Topology, predict_exchange
from ...comm.all2all import TRANSPORTS, A2APlan, all_to_all
from ...dist import (
    DEVICE_CHOICES,
    barrier,
    comm_guard,
    control_device,
    init_distributed,
)
from ...results import write_json
from ..runner import Variant, Workload, median_of
from .netem_check import tcp_stream

DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)


def loopback_socket_MBps(nbytes: int = 256 << 20, chunk: int = 1 << 20, host: str = "127.0.0.1") -> float:
    """Throughput of one TCP stream over loopback (send thread -> recv), MB/s."""
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen(1)
    got, dt = tcp_stream(srv, (host, srv.getsockname()[1]), nbytes, chunk)
    return got / dt / 1e6


def inter_host_bytes(topo: Topology, nbytes: int) -> tuple[int, int]:
    """For an all-to-all of ``nbytes`` per ordered rank pair on ``topo``: (bytes crossing
    between hosts in total, bytes leaving the busiest host), read off the NIC links of
    :func:`commsched.predict_exchange`."""
    P = topo.world_size
    pred = predict_exchange(topo, [[0 if a == b else nbytes for b in range(P)] for a in range(P)])
    out_of = [int(pred.link_bytes.get((("nic", h), SWITCH), 0)) for h in topo.hosts]
    return sum(out_of), max(out_of, default=0)


def measure(pattern: str, size: int, min_time_s: float, max_iters: int,
            topo: Topology | None = None, rate_bps: int | None = None, *,
            device: torch.device | str = "cpu", transport: str = "auto") -> dict:
    """Exchange time and throughputs for ``size`` bytes per ordered rank pair.

    ``time_s`` is the median over iterations of the exchange's span: from the first rank
    starting to the last rank finishing (all ranks run on one machine, so they share the
    monotonic clock). ``rank_time_s`` is the older, looser figure: each rank's median own
    time, max over ranks; a rank that starts late finds data already delivered, so for
    small messages it flatters the link. ``topo`` (the ranks' hosts) adds the
    inter-host figures, ``rate_bps`` the ratio to the emulated rate. The rows live on
    ``device``; on CUDA each exchange is timed up to a device synchronisation (NCCL returns
    at enqueue), and the stop flag and stamps stay on the CPU (gloo's side of the group).
    """
    P, me = dist.get_world_size(), dist.get_rank()
    rows = max(1, size // 4)
    counts = [rows] * P
    plan = A2APlan(tuple(counts), tuple(counts), me, agreed=True)
    clock, ctl = Clock(device), control_device()
    x = torch.randn(rows * P, 1).to(device)
    all_to_all(x, plan, pattern=pattern, transport=transport)  # warm-up
    stamps = []  # (start, end) of each exchange on this rank, monotonic clock
    t_start = time.perf_counter()
    for i in range(max_iters):
        barrier(f"aligning ranks before a {pattern} exchange")
        t = time.monotonic()
        all_to_all(x, plan, pattern=pattern, transport=transport)
        clock.sync()
        stamps.append((t, time.monotonic()))
        # all ranks agree on when to stop
        flag = torch.tensor([1 if time.perf_counter() - t_start > min_time_s and i >= 2 else 0],
                            device=ctl)
        with comm_guard("agreeing when to stop measuring"):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item():
            break
    st_I2 = torch.tensor(stamps, dtype=torch.float64, device=ctl)
    everyone = [torch.empty_like(st_I2) for _ in range(P)]
    with comm_guard("gathering the exchange timestamps"):
        dist.all_gather(everyone, st_I2)
    st_PI2 = torch.stack(everyone).cpu()
    span_I = st_PI2[:, :, 1].max(dim=0).values - st_PI2[:, :, 0].min(dim=0).values
    t = span_I.median().item()
    rank_t = (st_PI2[:, :, 1] - st_PI2[:, :, 0]).median(dim=1).values.max().item()
    cross = rows * 4 * (P - 1) * P  # bytes between distinct ranks, all ranks together
    r = {"size_bytes": rows * 4, "time_s": t, "rank_time_s": rank_t, "iters": len(stamps),
         "throughput_MBps": cross / t / 1e6}
    hosts = len(topo.hosts) if topo is not None else 1
    if hosts > 1:
        inter, uplink = inter_host_bytes(topo, rows * 4)
        r["inter_host_MBps"] = inter / t / 1e6
        r["uplink_MBps"] = uplink / t / 1e6  # the busiest host's link, one direction
    if rate_bps:
        # one shared loopback: every cross-rank byte passes the one limit; hosts: each link
        r["ratio_to_rate"] = (r["uplink_MBps"] if hosts > 1 else r["throughput_MBps"]) * 8e6 / rate_bps
    return r


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--patterns", default="direct,ring")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="the all-to-all transport; results of another than auto are keyed "
                        "PATTERN-TRANSPORT")
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                   help="bytes each rank sends to each peer, comma-separated")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds per measurement")
    p.add_argument("--max-iters", type=int, default=50)
    p.add_argument("--rate-bps", type=int, default=None,
                   help="the emulated link rate (bits/s), to report the achieved share of it")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    patterns = a.patterns.split(",")
    try:
        device = init_distributed(device=a.device).device
    except ValueError as e:
        raise SystemExit(f"commsched.bench.micro.all2all: {e}") from None
    me = dist.get_rank()
    topo = Topology.from_env()
    host_P = [topo.hosts.index(h) for h in topo.hosts_P]
    loop = loopback_socket_MBps() if me == 0 else 0.0
    barrier("aligning ranks after the loopback probe")
    label = (lambda pat: pat) if a.transport == "auto" else (lambda pat: f"{pat}-{a.transport}")
    results = {label(pat): [measure(pat, s, a.min_time, a.max_iters, topo, a.rate_bps,
                                    device=device, transport=a.transport) for s in sizes]
               for pat in patterns}
    if me == 0:
        best = max((rs[-1] for rs in results.values()), key=lambda r: r["throughput_MBps"])
        m = {"world_size": dist.get_world_size(), "hosts": len(set(host_P)), "host_of_rank": host_P,
             "rate_bps": a.rate_bps, "patterns": results, "loopback_MBps": loop,
             "throughput_MBps": best["throughput_MBps"],
             "ratio_to_loopback": best["throughput_MBps"] / loop if loop else None,
             "uplink_MBps": best.get("uplink_MBps"), "ratio_to_rate": best.get("ratio_to_rate")}
        write_json(a.out / "metrics.json", m)
        for pat in results:
            for r in results[pat]:
                extra = (f"  uplink {r['uplink_MBps']:.1f} MB/s" if "uplink_MBps" in r else "") + (
                    f"  {r['ratio_to_rate']:.3f} of the rate" if "ratio_to_rate" in r else "")
                print(f"{pat:13s} {r['size_bytes']:>10d} B/peer  {r['throughput_MBps']:9.1f} MB/s  "
                      f"(loopback socket {loop:.0f} MB/s){extra}", flush=True)
    dist.destroy_process_group()


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default=None, help="bytes per peer, comma-separated")
    p.add_argument("--min-time", type=float, default=1.0)
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="where the exchanged rows live (each variant's --device)")
    p.add_argument("--transports", default="auto",
                   help=f"all-to-all transports to compare, comma-separated, of {TRANSPORTS} "
                        "(another than auto names its variants PATTERN-TRANSPORT)")


def _variants(args) -> list[Variant]:
    extra = ((["--sizes", args.sizes] if args.sizes else [])
             + ["--min-time", str(args.min_time), "--device", args.device])
    if getattr(args, "rate_bps", None):
        extra += ["--rate-bps", str(args.rate_bps)]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad or not transports:
        raise ValueError(f"--transports: {bad[0] if bad else args.transports!r} is not a transport; "
                         f"give a comma-separated list of {TRANSPORTS}")
    return [Variant(pat if tr == "auto" else f"{pat}-{tr}", "commsched.bench.micro.all2all",
                    ("--patterns", pat, "--transport", tr, *extra))
            for tr in transports for pat in ("direct", "ring")]


def _summarize(runs: dict[str, list[dict]], args, out: Path) -> dict:
    hosts = max((r.get("hosts", 1) for rs in runs.values() for r in rs), default=1)
    rated = any(r.get("rate_bps") for rs in runs.values() for r in rs)
    head = ["pattern", "bytes/peer", "MB/s all ranks (median of repeats)", "share of loopback"]
    if hosts > 1:
        head.append("MB/s busiest host link, one way")
    if rated:
        head.append("share of the emulated rate")
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for v, rs in runs.items():
        loop = median_of(rs, "loopback_MBps")
        for i, r in enumerate(rs[0]["patterns"][v]):
            per = [x["patterns"][v][i] for x in rs]
            tp = median_of(per, "throughput_MBps")
            cells = [v, str(r["size_bytes"]), f"{tp:.1f}", f"{tp / loop:.2f}" if loop else "-"]
            if hosts > 1:
                up = median_of(per, "uplink_MBps")
                cells.append(f"{up:.1f}" if up is not None else "-")
            if rated:
                rr = median_of(per, "ratio_to_rate")
                cells.append(f"{rr:.3f}" if rr is not None else "-")
            lines.append("| " + " | ".join(cells) + " |")
    return {"extra_tables": {"Throughput per message size": "\n".join(lines)}}


WORKLOAD = Workload(
    name="all2all",
    description="all_to_all throughput per pattern and message size, beside loopback socket throughput",
    key_metrics=("throughput_MBps", "loopback_MBps", "ratio_to_loopback", "ratio_to_rate"),
    higher_is_better=("throughput_MBps", "loopback_MBps", "ratio_to_loopback", "ratio_to_rate"),
    add_arguments=_add_arguments,
    variants=_variants,
    summarize=_summarize,
)

if __name__ == "__main__":
    main()
