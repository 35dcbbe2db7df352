"""A small torchrun-launchable check: one uneven ``all_to_all`` across every rank.

Each rank sends ``count(src, dst)`` rows to every rank (zero included), each row holding
a value that names its source, destination and index, so the receiver checks every
element. Rank 0 writes ``metrics.json`` with the verdict, the IPv4 addresses each rank
found on its interfaces (which shows the ranks were spread over emulated hosts), the
exchange time, and a measured time breakdown (``init``, ``comm``, ``verify``).

    torchrun --standalone --nproc_per_node 2 -m commsched.bench.micro.netem_check --out DIR
    commsched netem --rate 200mbit --hosts 2 -- torchrun --nnodes 2 ... -m commsched.bench.micro.netem_check --out DIR

``--duplex-bytes N`` (2 ranks) also times N bytes one way, then both ways at once, over
gloo (on one group, and as ``all_to_all``'s duplex transport sends them: each direction on
its own connection) and over two plain TCP connections, which shows how well the transport
(gloo over TCP) uses a full-duplex link. The TCP probe listens on the loopback, or, inside
``commsched netem --hosts``, on the emulated host's private address; ``--duplex-bind
ADDR`` asks for another.

Legend: R rows, D row width.
"""

from __future__ import annotations

import argparse
import fcntl
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from ...cluster.netem import HOST_IFNAME, SUBNET_PREFIX
from ...comm.all2all import A2APlan, all_to_all
from ...config import read_env
from ...dist import CommError, all_gather_object, barrier, comm_guard, init_distributed, new_group
from ...results import write_json

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def rows_between(src: int, dst: int, scale: int) -> int:
    """Rows rank ``src`` sends to rank ``dst``: uneven, zero for some pairs."""
    return ((src * 7 + dst * 3) % 4) * scale


def row_values_RD(src: int, dst: int, scale: int, dim: int) -> torch.Tensor:
    """The rows ``src`` sends to ``dst``: row j holds src*1e6 + dst*1e3 + j (float64, exact)."""
    n = rows_between(src, dst, scale)
    base = src * 1_000_000 + dst * 1_000
    return (base + torch.arange(n, dtype=torch.float64)).unsqueeze(1).repeat(1, dim)


def interface_ipv4_addresses() -> dict[str, str]:
    """{interface: IPv4 address} of this network namespace, loopback excluded."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address on this interface
            addr = socket.inet_ntoa(raw[20:24])
            if not addr.startswith("127."):
                out[name] = addr
    return out


def local_ipv4_addresses() -> list[str]:
    """IPv4 addresses of this network namespace's interfaces, loopback excluded."""
    return sorted(interface_ipv4_addresses().values())


def probe_bind_address(addrs: dict[str, str], gloo_ifnames: Sequence[str],
                       asked: str | None = None) -> str:
    """Where the TCP duplex probe listens: ``asked`` (``--duplex-bind``) if given; the
    emulated host's address when this process runs inside one of ``commsched netem
    --hosts`` namespaces (gloo sent over its link ``cs0``, which holds an address of the
    emulator's private subnet, reachable only from the other emulated hosts); otherwise
    the loopback. Nothing listens beyond the loopback unless asked. Pure."""
    if asked:
        return asked
    a = addrs.get(HOST_IFNAME, "")
    if HOST_IFNAME in gloo_ifnames and a.startswith(SUBNET_PREFIX):
        return a
    return "127.0.0.1"


def duplex_probe(nbytes: int, repeats: int = 2) -> dict[str, float]:
    """Two ranks: ``nbytes`` from rank 0 to rank 1 alone, then both ways at once
    (isend + irecv on each side, one group), then both ways as ``all_to_all(...,
    transport="duplex")`` sends them (each direction on its own connection); the median
    rate per direction of each, bits/s."""
    me = dist.get_rank()
    peer = 1 - me
    x = torch.zeros(max(1, nbytes // 4))
    y = torch.empty_like(x)
    n = x.numel()
    plan = A2APlan((0, n) if me == 0 else (n, 0), (0, n) if me == 0 else (n, 0), me, agreed=True)
    rates: dict[str, list[float]] = {"one_way_bps": [], "both_ways_bps": [],
                                     "both_ways_two_connections_bps": []}
    all_to_all(x, plan, transport="duplex")  # connects the reverse group outside the timing
    for _ in range(repeats):
        for mode in rates:
            barrier("aligning the duplex probe")
            t = time.monotonic()
            reqs = []
            with comm_guard(f"duplex probe ({mode})"):
                if mode == "both_ways_two_connections_bps":
                    all_to_all(x, plan, transport="duplex")
                else:
                    if mode == "both_ways_bps" or me == 0:
                        reqs.append(dist.isend(x, peer))
                    if mode == "both_ways_bps" or me == 1:
                        reqs.append(dist.irecv(y, peer))
                for q in reqs:
                    q.wait()
            barrier("ending the duplex probe")
            rates[mode].append(x.numel() * 4 * 8 / (time.monotonic() - t))
    return {k: sorted(v)[len(v) // 2] for k, v in rates.items()}


def tcp_stream(srv: socket.socket, peer: tuple[str, int], nbytes: int, chunk: int = 1 << 20, *,
               from_first_byte: bool = False) -> tuple[int, float]:
    """Send ``nbytes`` to ``peer`` from a thread while receiving on ``srv``'s first connection
    (``nbytes`` at most); (bytes received, seconds from the accept, or from the first bytes'
    arrival with ``from_first_byte``). Closes ``srv``."""
    payload = b"\0" * chunk

    def send() -> None:
        with socket.create_connection(peer) as c:
            left = nbytes
            while left > 0:
                c.sendall(payload[:min(left, chunk)])
                left -= min(left, chunk)

    th = threading.Thread(target=send, daemon=True)
    th.start()
    conn, _ = srv.accept()
    view = memoryview(bytearray(chunk))
    got = conn.recv_into(view) if from_first_byte else 0
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
    return got, dt


def socket_duplex_probe(nbytes: int, host: str = "127.0.0.1") -> float:
    """Two ranks, plain TCP beside gloo: each listens on ``host`` (see
    :func:`probe_bind_address`), connects to the other's and sends ``nbytes`` while
    receiving the peer's on the other connection (both directions at once, one connection
    each). Returns the bits/s this rank received."""
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen(1)
    where = all_gather_object((host, srv.getsockname()[1]), "exchanging TCP probe addresses")
    barrier("starting the TCP probe")
    got, dt = tcp_stream(srv, where[1 - dist.get_rank()], nbytes, from_first_byte=True)
    return got * 8 / dt


def contention_probe(nbytes: int, *, reduce_address: str | None, repeats: int = 5, microop_bytes: int = 256 << 10,
                     in_flight: int = 8, threads: int = 8) -> dict[str, float]:
    """The link's contention alone, without compute: an even ``all_to_all`` of ``nbytes``
    per rank (the default group, as an MoE layer's exchange), timed ``repeats`` times alone
    and ``repeats`` times while every rank keeps ``in_flight`` allreduce micro-ops of
    ``microop_bytes`` going on a gradient group of its own (``threads`` gloo worker threads,
    bound to ``reduce_address`` when given: ``commsched netem --classes``'s class). Medians
    of the slowest rank's times; ``contention`` = contended / alone (the Lina paper's
    median for an all-to-all under a concurrent allreduce: 1.83x on NCCL)."""

    if in_flight < 1 or repeats < 1:
        raise ValueError(f"contention_probe needs in_flight >= 1 and repeats >= 1, got {in_flight} and {repeats}")
    world = dist.get_world_size()
    grad_group = new_group(list(range(world)), threads=threads, address=reduce_address)
    x = torch.zeros(max(world, nbytes // 4 // world * world), dtype=torch.float32)
    out = torch.empty_like(x)

    def timed() -> float:
        barrier("aligning ranks before a timed all-to-all")
        t = time.perf_counter()
        with comm_guard("the contention probe's all_to_all"):
            dist.all_to_all_single(out, x)
        el = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        with comm_guard("taking the slowest rank's all-to-all time"):
            dist.all_reduce(el, op=dist.ReduceOp.MAX)
        return el.item()

    timed()  # connections made, caches warm
    alone = sorted(timed() for _ in range(repeats))
    stop = threading.Event()
    grad = torch.zeros(max(1, microop_bytes // 4))
    errors: list[BaseException] = []

    def background() -> None:
        # The ranks stop after the same batch: each rank's own ``stop`` is set at a slightly
        # different moment, so a loop that tested it alone could start one more batch on one
        # rank than on the other, whose allreduces then waited for a peer that had left
        # (a gloo timeout). Instead the first micro-op of every batch carries each rank's
        # flag in its element 0 (the payload is zeros, the sum exact): every rank reads the
        # same sum after the batch and they leave together, after the first batch begun
        # once any rank asked to stop.
        try:
            while True:
                works = []
                for i in range(in_flight):
                    t = grad.clone()
                    if i == 0:
                        t[0] = 1.0 if stop.is_set() else 0.0
                        asked = t
                    works.append(dist.all_reduce(t, group=grad_group, async_op=True))
                for w in works:
                    w.wait()
                if asked[0].item() > 0:  # some rank asked: all leave after this batch
                    return
        except BaseException as e:  # reported by the caller
            errors.append(e)

    barrier("starting the background allreduce")
    th = threading.Thread(target=background, name="contention-allreduce", daemon=True)
    th.start()
    try:
        time.sleep(0.2)  # the allreduce is on the link before the first exchange
        contended = sorted(timed() for _ in range(repeats))
    finally:
        stop.set()
    th.join(timeout=60)
    if th.is_alive():
        raise CommError(f"rank {dist.get_rank()}: the contention probe's background allreduce did not end "
                        "within 60 s of the stop (a peer out of step or gone)")
    if errors:
        raise errors[0]
    flag = torch.ones(1)  # every rank's background loop has ended before the group goes
    with comm_guard("ending the contention probe"):
        dist.all_reduce(flag)
    a, c = alone[len(alone) // 2], contended[len(contended) // 2]
    return {"a2a_bytes_per_rank": float(x.numel() * 4), "alone_s": a, "contended_s": c, "contention": c / a,
            "alone_all_s": alone, "contended_all_s": contended}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=16, help="rows per unit of the uneven count pattern")
    p.add_argument("--dim", type=int, default=8, help="row width D")
    p.add_argument("--pattern", default="direct", choices=("direct", "ring"))
    p.add_argument("--duplex-bytes", type=int, default=0,
                   help="with 2 ranks: also time this many bytes one way, then both ways at once")
    p.add_argument("--duplex-bind", metavar="ADDR", default=None,
                   help="address the TCP probe listens on (default: the emulated host's inside "
                        "`commsched netem --hosts`, else 127.0.0.1)")
    p.add_argument("--contention-bytes", type=int, default=0,
                   help="also time an even all-to-all of this many bytes per rank alone and under a "
                        "concurrent allreduce (contention_probe)")
    p.add_argument("--reduce-address", default=None, metavar="ADDR",
                   help="--contention-bytes: bind the allreduce's group to ADDR (commsched netem --classes ADDR)")
    p.add_argument("--repeats", type=int, default=5, help="--contention-bytes: timed exchanges per case")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    me, world, _ = init_distributed(device="cpu")  # a check of gloo through the emulator
    t_init = time.perf_counter() - t0
    x_RD = torch.cat([row_values_RD(me, d, a.scale, a.dim) for d in range(world)])
    counts = [rows_between(me, d, a.scale) for d in range(world)]
    barrier("aligning ranks before the exchange")
    t = time.perf_counter()
    y_RD = all_to_all(x_RD, counts, pattern=a.pattern)
    t_comm = time.perf_counter() - t
    t = time.perf_counter()
    want_RD = torch.cat([row_values_RD(s, me, a.scale, a.dim) for s in range(world)])
    ok = y_RD.shape == want_RD.shape and bool(torch.equal(y_RD, want_RD))
    t_verify = time.perf_counter() - t
    info = {"ok": ok, "addresses": local_ipv4_addresses(),
            "times": [t_init, t_comm, t_verify], "bytes_sent": int(x_RD.numel() * 8)}
    if a.duplex_bytes and world != 2:
        raise ValueError(f"--duplex-bytes needs exactly 2 ranks, got {world}")
    duplex = duplex_probe(a.duplex_bytes) if a.duplex_bytes else None
    if duplex:
        host = probe_bind_address(interface_ipv4_addresses(), read_env().gloo_ifnames, a.duplex_bind)
        got = torch.tensor([socket_duplex_probe(a.duplex_bytes, host)], dtype=torch.float64)
        with comm_guard("taking the slower side's TCP rate"):
            dist.all_reduce(got, op=dist.ReduceOp.MIN)
        duplex["tcp_both_ways_bps"] = got.item()
    contention = (contention_probe(a.contention_bytes, reduce_address=a.reduce_address, repeats=a.repeats)
                  if a.contention_bytes else None)
    gathered = all_gather_object(info, "gathering the check's results")
    if me == 0:
        m = {"world_size": world, "pattern": a.pattern,
             "ok": all(g["ok"] for g in gathered),
             "bad_ranks": [r for r, g in enumerate(gathered) if not g["ok"]],
             "addresses_by_rank": [g["addresses"] for g in gathered],
             "a2a_time_s": max(g["times"][1] for g in gathered),
             "bytes_sent_total": sum(g["bytes_sent"] for g in gathered),
             "breakdown_s": {k: max(g["times"][i] for g in gathered)
                             for i, k in enumerate(("init", "comm", "verify"))}}
        if duplex:
            m["duplex"] = duplex
            print(f"netem_check: gloo one way {duplex['one_way_bps'] / 1e6:.0f} Mbit/s, gloo both ways at "
                  f"once {duplex['both_ways_bps'] / 1e6:.0f} Mbit/s per direction on one group, "
                  f"{duplex['both_ways_two_connections_bps'] / 1e6:.0f} on two (all_to_all duplex), "
                  f"plain TCP both ways "
                  f"at once {duplex['tcp_both_ways_bps'] / 1e6:.0f} Mbit/s per direction (slower side)",
                  flush=True)
        if contention:
            m["contention"] = contention
            print(f"netem_check: all-to-all of {contention['a2a_bytes_per_rank'] / 2**20:.2f} MiB per rank alone "
                  f"{contention['alone_s']:.3f} s, under a concurrent allreduce {contention['contended_s']:.3f} s: "
                  f"contention {contention['contention']:.2f}x (the Lina paper's median 1.83x)", flush=True)
        write_json(a.out / "metrics.json", m)
        print(f"netem_check: world {world}, ok={m['ok']}, addresses {m['addresses_by_rank']}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
