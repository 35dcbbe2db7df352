"""all_to_all against a slow point-to-point reference, on 2, 3 and 4 gloo ranks, over both
transports (one connection per pair; the duplex one with a reverse group), on the world
and on sub-groups."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import commsched
from commsched import (
    A2APlan,
    CommError,
    CommStats,
    SegmentLayout,
    all_to_all,
    all_to_all_async,
    exchange_segments,
)
from commsched.comm.all2all import TRANSPORTS
from tests.mp import assert_case, run_cases, run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.uint8)


def _counts(world: int, seed: int) -> list[list[int]]:
    """Count matrix C[src][dst] with zeros, and rank world-1 sending nothing."""
    g = torch.Generator().manual_seed(seed)
    C = torch.randint(0, 5, (world, world), generator=g)
    C[world - 1, :] = 0  # one rank sends nothing
    C[0, world - 1] = 0  # a zero-size split inside a non-empty send
    return C.tolist()


def _rows(src: int, n: int, d: int, dtype: torch.dtype, tag: int) -> torch.Tensor:
    base = torch.arange(n * d, dtype=torch.float32).reshape(n, d) + 1000 * src + 100000 * tag
    if dtype == torch.uint8:
        return (base % 251).to(torch.uint8)
    return (base / 7.0).to(dtype)


def _reference(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """Slow reference: blocking send/recv of each (src, dst) pair in one global order."""
    P, me = dist.get_world_size(), dist.get_rank()
    so = [0]
    for c in send:
        so.append(so[-1] + c)
    parts = []
    for src in range(P):
        part = x.new_empty((recv[src], *x.shape[1:]))
        parts.append(part)
    for src in range(P):
        for dst in range(P):
            if src == dst:
                if src == me:
                    parts[me].copy_(x[so[me]:so[me + 1]])
                continue
            if src == me and send[dst] > 0:
                dist.send(x[so[dst]:so[dst + 1]].contiguous(), dst)
            if dst == me and recv[src] > 0:
                dist.recv(parts[src], src)
    return torch.cat(parts)


def _case_exchange(rank: int, world: int) -> None:
    for seed in range(2):
        C = _counts(world, seed)
        send = C[rank]
        recv = [C[p][rank] for p in range(world)]
        for dtype in DTYPES:
            for d in (1, 5):
                x = _rows(rank, sum(send), d, dtype, seed)
                ref = _reference(x, send, recv)
                # auto is duplex here; the one-connection transport on a subset (same code path)
                trs = ("auto", "single") if seed == 0 and d == 5 else ("auto",)
                for pattern, tr in [(p, t) for p in ("direct", "ring") for t in trs]:
                    got = all_to_all(x, send, pattern=pattern, transport=tr)
                    assert got.dtype == dtype and got.shape == ref.shape, (got.shape, ref.shape)
                    assert torch.equal(got, ref), (pattern, tr, dtype, d)
                    h = all_to_all_async(x, send, pattern=pattern, transport=tr)
                    assert torch.equal(h.wait(), ref), ("async", pattern, tr, dtype, d)


def _case_backward(rank: int, world: int) -> None:
    C = _counts(world, 7)
    send = C[rank]
    recv = [C[p][rank] for p in range(world)]
    for pattern in ("direct", "ring"):
        for use_async, tr in ((False, "single"), (False, "duplex"), (True, "auto")):
            x = _rows(rank, sum(send), 3, torch.float32, 1).requires_grad_(True)
            w = _rows(rank + 10, sum(recv), 3, torch.float32, 2)
            out = all_to_all_async(x, send, pattern=pattern, transport=tr).wait() if use_async \
                else all_to_all(x, send, pattern=pattern, transport=tr)
            (out * w).sum().backward()
            expected = _reference(w, recv, send)  # gradient = reverse exchange of w
            assert torch.equal(x.grad, expected), (pattern, use_async, tr)


def _case_plan_reuse_and_stats(rank: int, world: int) -> None:
    C = _counts(world, 3)
    send = C[rank]
    recv = [C[p][rank] for p in range(world)]
    plan = A2APlan(tuple(send), tuple(recv), rank)
    stats = CommStats(world)
    x = _rows(rank, sum(send), 4, torch.float32, 3)
    ref = _reference(x, send, recv)
    for pattern in ("direct", "ring"):
        assert torch.equal(all_to_all(x, plan, pattern=pattern, stats=stats), ref)
    assert stats.calls == 2
    for p in range(world):
        if p != rank:
            assert stats.bytes_sent[p] == 2 * send[p] * 4 * 4
            assert stats.bytes_recv[p] == 2 * recv[p] * 4 * 4
    assert stats.bytes_sent[rank] == 0
    assert stats.time_s > 0 and len(stats.round_time_s) == world


def _case_segments(rank: int, world: int) -> None:
    # peer p gets segments of sizes (rank + p) % 3 and 2 * p + rank: both sides derive them
    def sizes(src: int, dst: int) -> tuple[int, int]:
        return ((src + dst) % 3, 2 * dst + src)

    send = [[torch.full((b,), (rank * 16 + p * 4 + s) % 256, dtype=torch.uint8)
             for s, b in enumerate(sizes(rank, p))] for p in range(world)]
    layout = SegmentLayout(tuple(sizes(p, rank) for p in range(world)))
    for pattern in ("direct", "ring"):
        for async_op in (False, True):
            got = exchange_segments(send, layout, pattern=pattern, async_op=async_op,
                                    validate=not async_op)
            if async_op:
                got = got.wait()
            for p in range(world):
                for s, b in enumerate(sizes(p, rank)):
                    assert got[p][s].numel() == b
                    assert bool((got[p][s] == (p * 16 + rank * 4 + s) % 256).all())


def _case_sub_groups(rank: int, world: int) -> None:
    """Expert-group style sub-groups: the reverse group of a sub-group is made by its members
    alone (the other ranks are elsewhere: here doing nothing), and exchanges on two sub-groups
    at once stay exact."""
    from commsched.dist import new_group

    halves = [list(range(world // 2)), list(range(world // 2, world))]
    groups = [new_group(h) for h in halves]  # every rank, in the same order
    mine = 0 if rank in halves[0] else 1
    g, members = groups[mine], halves[mine]
    sub_rank, P = members.index(rank), len(members)
    send = [sub_rank + p + 1 for p in range(P)]  # rows to each member; member q sends q + me + 1
    recv = [q + sub_rank + 1 for q in range(P)]
    x = _rows(rank, sum(send), 2, torch.float32, 5)
    expected = []
    for q in range(P):  # member q's rows for this rank, rebuilt from its deterministic input
        xq = _rows(members[q], sum(q + p + 1 for p in range(P)), 2, torch.float32, 5)
        off = sum(q + p + 1 for p in range(sub_rank))
        expected.append(xq[off:off + recv[q]])
    expected = torch.cat(expected)
    if mine == 0 and P > 1:  # the first half's first duplex exchange while the rest wait
        assert torch.equal(all_to_all(x, send, group=g, transport="duplex"), expected)
    dist.barrier()
    for pattern in ("direct", "ring"):
        got = all_to_all_async(x, send, group=g, pattern=pattern).wait()
        assert torch.equal(got, expected), (pattern, halves[mine])


def _case_bad_counts(rank: int, world: int) -> None:
    x = torch.zeros(world, 2)
    send = [1] * world if rank != 1 else [1] * (world - 1)  # rank 1 gives too few
    with pytest.raises(ValueError, match="rank 1 gave"):
        all_to_all(x if rank != 1 else torch.zeros(world - 1, 2), send)
    # rows that do not match the counts, on one rank only
    with pytest.raises(ValueError, match="sum to a different number of rows"):
        all_to_all(torch.zeros(world + (rank == 0), 2), [1] * world)


def _case_bad_dtype_shape(rank: int, world: int) -> None:
    dtype = torch.float32 if rank else torch.float64
    with pytest.raises(ValueError, match="different dtypes"):
        all_to_all(torch.zeros(world, 2, dtype=dtype), [1] * world)
    with pytest.raises(ValueError, match="different sizes"):
        all_to_all(torch.zeros(world, 2 + rank), [1] * world)
    with pytest.raises(TypeError):
        all_to_all([1, 2], [1] * world)  # type: ignore[arg-type]


def _case_ring_refuses_device_rows_on_gloo(rank: int, world: int) -> None:
    """Audit 2, item 14: CUDA rows over gloo's send/recv are refused (CUDA itself is not needed
    to check the rule, only the device of the rows)."""
    from commsched.comm.transport import check_ring_device

    with pytest.raises(ValueError, match="ring pattern cannot carry rows on cuda"):
        check_ring_device("ring", torch.device("cuda", 0), None)
    check_ring_device("direct", torch.device("cuda", 0), None)  # gloo's all_to_all_single takes them
    check_ring_device("ring", torch.device("cpu"), None)


CASES = [("exchange", _case_exchange), ("ring_refuses_device_rows_on_gloo", _case_ring_refuses_device_rows_on_gloo), ("backward", _case_backward),
         ("plan_reuse_and_stats", _case_plan_reuse_and_stats), ("segments", _case_segments),
         ("sub_groups", _case_sub_groups),
         ("bad_counts", _case_bad_counts), ("bad_dtype_shape", _case_bad_dtype_shape)]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"world{w}")
def results(request):
    return run_cases(request.param, CASES, timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c, _ in CASES])
def test_all_to_all(results, case):
    assert_case(results, case)


def _dead_peer(rank: int, world: int) -> str | None:
    dist.barrier()
    if rank == 1:
        os._exit(0)  # dies without a word
    try:
        all_to_all(torch.zeros(world, 3), [1] * world)
    except CommError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_dead_peer_gives_clear_error():
    res = run_ranks(2, _dead_peer, allow_missing=[1], pg_timeout_s=5, timeout_s=60,
                    env={"COMMSCHED_TIMEOUT_S": "5"})
    msg = res[0]
    assert msg is not None and msg.startswith("rank 0:"), msg
    assert "all_to_all" in msg
    assert "rank 1 stopped answering" in msg, msg


def test_transport_is_checked():
    plan = A2APlan((1, 1), (1, 1), 0)
    with pytest.raises(ValueError, match="transport must be one of"):
        all_to_all(torch.zeros(2, 1), plan, transport="tcp")
    assert TRANSPORTS == ("auto", "single", "duplex")


def test_plan_offsets_and_reverse():
    p = A2APlan((2, 0, 3), (1, 4, 0), 1)
    assert p.send_offsets == (0, 2, 2, 5) and p.recv_offsets == (0, 1, 5, 5)
    assert p.total_send == 5 and p.total_recv == 5
    r = p.reversed()
    assert r.send_counts == (1, 4, 0) and r.recv_counts == (2, 0, 3)
    assert p.ring_rounds() == [(2, 0), (0, 2)]
    with pytest.raises(ValueError):
        A2APlan((1, -1), (0, 0), 0)
    with pytest.raises(ValueError):
        A2APlan((1,), (0, 0), 0)
    with pytest.raises(ValueError):
        A2APlan((1, 1), (0, 0), 2)


def test_segment_layout_validation():
    with pytest.raises(ValueError):
        SegmentLayout(((1, -2),))
    assert SegmentLayout(((1, 2), (3,))).peer_totals() == (3, 3)


def test_commstats_defers_device_intervals_until_settled():
    from commsched.comm.all2all import CommStats

    class FakeEvent:  # the part of torch.cuda.Event that CommStats uses
        def __init__(self, ms):
            self.ms, self.synced = ms, False

        def synchronize(self):
            self.synced = True

        def elapsed_time(self, other):
            return other.ms - self.ms

    st = CommStats(3)
    st.add_time(None, 1.0, 1.5)  # host marks: added at once
    st.add_time(2, 0.25, 0.5)
    assert st.time_s == 0.5 and st.round_time_s == [0.0, 0.0, 0.25]
    a, b = FakeEvent(10.0), FakeEvent(30.0)
    st.add_time(0, a, b)  # device marks: recorded, not waited for
    assert st.round_time_s[0] == 0.0 and not b.synced
    d = st.as_dict()  # settles first
    assert b.synced and d["round_time_s"] == [0.02, 0.0, 0.25]
    assert st.settle().round_time_s[0] == 0.02  # settled once


def test_control_device_is_the_cpu_on_gloo():
    from commsched.dist import control_device

    assert control_device().type == "cpu"  # no process group: the CPU


def test_bench_inter_host_bytes_from_the_topology():
    from commsched import Topology
    from commsched.bench.micro.all2all import inter_host_bytes

    # 2 hosts x 2 ranks, 10 B per ordered pair: 8 pairs cross hosts; each host sends 2 x 2 x 10
    assert inter_host_bytes(Topology.grid(2, 2), 10) == (80, 40)
    # 3 ranks on host a, 1 on host b: a sends 3 x 1 x 10, b sends 1 x 3 x 10
    assert inter_host_bytes(Topology.from_hosts(["a", "a", "a", "b"]), 10) == (60, 30)
    # 4 hosts x 1 rank: 12 crossing pairs, 3 x 10 out of each host
    assert inter_host_bytes(Topology.grid(4, 1), 10) == (120, 30)
    assert inter_host_bytes(Topology.grid(1, 2), 10) == (0, 0)


def test_bench_variants_per_transport():
    import argparse

    from commsched.bench.micro.all2all import WORKLOAD

    def names(transports: str) -> list[tuple[str, tuple]]:
        a = argparse.Namespace(sizes=None, min_time=1.0, device="cpu", transports=transports)
        return [(v.name, v.args) for v in WORKLOAD.variants(a)]

    got = names("single,auto")
    assert [n for n, _ in got] == ["direct-single", "ring-single", "direct", "ring"]
    assert got[0][1][:4] == ("--patterns", "direct", "--transport", "single")
    assert [n for n, _ in names("auto")] == ["direct", "ring"]
    with pytest.raises(ValueError, match="--transports: 'tcp' is not a transport"):
        names("auto,tcp")


def _disagreeing_plans(rank: int, world: int) -> None:
    """Plans built on each rank, rows or counts that disagree between ranks: the same
    ValueError on every rank (never an abort inside the backend, nor a peer left waiting),
    and the ranks stay in step for the next exchange."""
    ones = A2APlan((1, 1), (1, 1), rank)
    dtype = torch.float64 if rank == 1 else torch.float32
    with pytest.raises(ValueError, match=r"different dtypes on different ranks: \{0: 'torch.float32', 1: 'torch.float64'\}"):
        all_to_all(torch.zeros(2, 4, dtype=dtype), ones)
    with pytest.raises(ValueError, match=r"rows have different sizes .*\[4, 8\]"):
        all_to_all_async(torch.zeros(2, 4 + 4 * rank), ones).wait()
    lie = A2APlan((1, 1), (1, 2), 0) if rank == 0 else ones  # rank 0 expects 2 rows from rank 1
    with pytest.raises(ValueError, match=r"rank 0 expects to receive \(1, 2\) rows but its peers send \(1, 1\)"):
        all_to_all(torch.zeros(2, 3), lie)
    with pytest.raises(ValueError, match=r"rank 1's send counts sum to a different number of rows than its tensor has \(3\)"):
        all_to_all(torch.zeros(2 + rank, 3), ones)  # rows that do not match the plan, on one rank
    with pytest.raises(ValueError, match="rank 1 passed a plan made for rank 0"):
        all_to_all(torch.zeros(2, 3), A2APlan((1, 1), (1, 1), 0))
    with pytest.raises(ValueError, match="rank 0's send count for rank 0 is not a whole number of rows"):
        all_to_all(torch.zeros(2, 3), [1.7, 0.3] if rank == 0 else [1, 1])
    x = torch.zeros(2, 3, device="meta") if rank == 1 else torch.zeros(2, 3)
    for counts in ([1, 1], ones):
        with pytest.raises(ValueError, match="rank 1 passed a tensor on the meta device"):
            all_to_all(x, counts)
    # a plan made for float32 rows of 3 refuses others before anything is sent
    bound = commsched.make_plan([1, 1], rows=2, dtype=torch.float32, row_numel=3)
    with pytest.raises(ValueError, match="made for torch.float32 rows of 3 elements, got torch.float64 rows of 3"):
        all_to_all(torch.zeros(2, 3, dtype=torch.float64), bound)
    # a plan made without dtype or row width: its first use checks the rows on every rank
    free = commsched.make_plan([1, 1], rows=2)
    with pytest.raises(ValueError, match="different dtypes on different ranks"):
        all_to_all(torch.zeros(2, 3, dtype=dtype), free)
    all_to_all(torch.zeros(2, 5), free)  # agreed: bound to float32 rows of 5
    with pytest.raises(ValueError, match="made for torch.float32 rows of 5 elements, got torch.float32 rows of 3"):
        all_to_all(torch.zeros(2, 3), free)
    all_to_all(torch.zeros(2, 5), free.reversed())  # the reverse exchange: rows of the same kind
    with pytest.raises(ValueError, match="made for torch.float32 rows of 5 elements, got torch.float64 rows of 5"):
        all_to_all(torch.zeros(2, 5, dtype=torch.float64), free.reversed())
    x = torch.arange(6.0).view(2, 3) + 10 * rank
    want = torch.stack([torch.arange(3.0) + 3 * rank, torch.arange(3.0) + 3 * rank + 10])
    assert torch.equal(all_to_all(x, ones), want)
    assert torch.equal(all_to_all(x, bound), want)


def test_disagreeing_plans_raise_the_same_error_on_every_rank():
    run_ranks(2, _disagreeing_plans, timeout_s=60, pg_timeout_s=20)


def test_plan_counts_must_be_whole_numbers():
    with pytest.raises(ValueError, match=r"send_counts\[0\] is 1.7: counts are whole numbers"):
        A2APlan((1.7, 2), (1, 2), 0)
    assert A2APlan((2.0, 1), (1, 2), 0).send_counts == (2, 1)
