"""The gradient reduction on groups bound to an address of its own (priority/bind.py):
over real gloo ranks the reduction equals the plain one, its connections use the address,
and an address this machine does not have is refused with a message."""

from __future__ import annotations

import pytest
import torch

from commsched.priority.bind import check_address
from tests.mp import run_ranks
from tests.priority import sched_of


def _tcp_local_addresses() -> set[str]:
    """IPv4 addresses of this process's established TCP sockets (/proc/net/tcp, local side)."""
    import os

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[9] in inodes:
                hexaddr = cols[1].split(":")[0]
                out.add(".".join(str(int(hexaddr[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return out


def _reduce_bound(rank: int, world: int, schedule: str, address: str | None):
    import torch.distributed as dist

    from commsched.dist import new_group
    from commsched.priority.runtime.executor import GradScheduler

    torch.manual_seed(0)
    group = new_group(list(range(world)), threads=3)
    before = _tcp_local_addresses()
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (5000, 70000, 3)]
    cfg = sched_of(schedule, microop_bytes=64 << 10, reduce_address=address)
    with GradScheduler([(p, group) for p in ps], cfg, device="cpu") as sched:
        used = list({id(g): g for g in sched._groups}.values())
        threads = [g._get_backend(torch.device("cpu")).options._threads for g in used]
        sched.begin_step()
        sum(((p + 1.0) * float(rank + 1) * (i + 1)).sum() for i, p in enumerate(ps)).backward()
        sched.finish()
    after = _tcp_local_addresses()
    # the twins the scheduler made are destroyed with it; the caller's group is the caller's
    alive = [g in dist.distributed_c10d._world.pg_map for g in used + [group]]
    dist.barrier()
    return [p.grad.clone() for p in ps], sorted(after - before), threads, alive


@pytest.mark.parametrize("schedule", ["fifo", "lina"])
def test_reduction_on_bound_groups_equals_the_plain_one(schedule):
    plain = run_ranks(2, _reduce_bound, schedule, None)
    bound = run_ranks(2, _reduce_bound, schedule, "127.0.0.2")
    for (g_plain, _, _, alive_plain), (g_bound, new_addrs, threads, alive) in zip(plain, bound):
        for a, b in zip(g_plain, g_bound):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert "127.0.0.2" in new_addrs, new_addrs  # the twins' connections use the address
        assert threads == [3]  # the twin keeps the group's gloo worker threads
        assert alive == [False, True] and alive_plain == [True, True]
    assert all("127.0.0.2" not in addrs for _, addrs, _, _ in plain)


def test_an_address_not_on_this_machine_is_refused():
    with pytest.raises(ValueError, match="not an address of this machine"):
        check_address("192.0.2.77")  # TEST-NET-1: never a local address
    with pytest.raises(ValueError, match="local IPv4 address"):
        check_address("")
    assert check_address("127.0.0.2") == "127.0.0.2"
