"""NCCL's semantics on the CPU (tests/nccl_fake.py): the fake itself, then the ring pattern,
AdaQP's ring link probe, the direct pattern, the gradient executor (flat, overlapped and
hierarchical) run through it on 3 gloo ranks -- the world where a lone isend/irecv per
rank deadlocks NCCL (audit 2, item 1)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from commsched import SegmentLayout, all_to_all, all_to_all_async, exchange_segments
from tests.mp import assert_case, run_cases
from tests.nccl_fake import DeferredWork, LonePointToPoint, nccl_semantics


def _rows(src: int, n: int, d: int = 3) -> torch.Tensor:
    return torch.arange(n * d, dtype=torch.float32).reshape(n, d) + 1000 * src


def _counts(world: int) -> list[list[int]]:
    """C[src][dst] rows, uneven, with zeros (rank world-1 sends nothing to rank 0)."""
    C = [[(2 * s + d) % 4 + 1 for d in range(world)] for s in range(world)]
    C[world - 1][0] = 0
    return C


def _expected(rank: int, world: int, C, d: int = 3) -> torch.Tensor:
    parts = []
    for s in range(world):
        off = sum(C[s][:rank])
        parts.append(_rows(s, sum(C[s]), d)[off:off + C[s][rank]])
    return torch.cat(parts)


# --------------------------------------------------------------------------- the fake
def _case_fake_semantics(rank: int, world: int) -> None:
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    with nccl_semantics(delay_s=0.05) as fake:
        # a lone P2P on 3+ ranks is refused (NCCL's lazy two-rank communicator)
        with pytest.raises(LonePointToPoint, match="batch_isend_irecv"):
            dist.isend(torch.zeros(1), nxt)
        with pytest.raises(LonePointToPoint):
            dist.recv(torch.zeros(1), prv)
        # batched: allowed, deferred
        a, b = torch.full((2,), float(rank)), torch.zeros(2)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, nxt), dist.P2POp(dist.irecv, b, prv)])
        assert all(isinstance(w, DeferredWork) for w in works)
        for w in works:
            w.wait()
        assert torch.equal(b, torch.full((2,), float(prv)))
        # an async all_reduce: the future is done at once, the result lands at wait()
        t = torch.ones(3)
        w = dist.all_reduce(t, async_op=True)
        assert w.get_future().done() and not w.is_completed()
        assert torch.equal(t, torch.ones(3))  # not yet there
        w.wait()
        assert torch.equal(t, torch.full((3,), float(world))) and w.is_completed()
        assert fake.calls["batch_isend_irecv"] == 1
    assert dist.isend is fake.orig["isend"]  # restored


# --------------------------------------------------------------------------- exchanges
def _case_ring_pattern(rank: int, world: int) -> None:
    """The acceptance test of item 1: the ring pattern on 3 ranks under NCCL's rules."""
    C = _counts(world)
    x, want = _rows(rank, sum(C[rank])), _expected(rank, world, C)
    with nccl_semantics() as fake:
        assert torch.equal(all_to_all(x, C[rank], pattern="ring", transport="single"), want)
        h = all_to_all_async(x, C[rank], pattern="ring", transport="single")
        assert torch.equal(h.wait(), want)
        xg = x.clone().requires_grad_(True)
        out = all_to_all(xg, C[rank], pattern="ring", transport="single")
        out.sum().backward()
        assert torch.equal(xg.grad, torch.ones_like(xg))
        assert fake.calls["batch_isend_irecv"] > 0


def _case_ring_posted_at_once(rank: int, world: int) -> None:
    """The device path of the async ring (every round posted from the caller's thread, item 8),
    forced on the CPU."""
    import commsched.all2all as a2a

    C = _counts(world)
    x, want = _rows(rank, sum(C[rank])), _expected(rank, world, C)
    saved = a2a._posts_all_rounds
    a2a._posts_all_rounds = lambda device: True
    try:
        with nccl_semantics(delay_s=0.02):
            h = all_to_all_async(x, C[rank], pattern="ring", transport="single")
            assert h._raw._thread is None and len(h._raw._works) > 0
            assert torch.equal(h.wait(), want)
            segs = [[torch.full((rank + p + 1,), rank, dtype=torch.uint8)] for p in range(world)]
            layout = SegmentLayout(tuple((s + rank + 1,) for s in range(world)))
            got = exchange_segments(segs, layout, pattern="ring", async_op=True, transport="single").wait()
            assert all(bool((got[s][0] == s).all()) for s in range(world))
    finally:
        a2a._posts_all_rounds = saved


def _case_direct_pattern(rank: int, world: int) -> None:
    C = _counts(world)
    x, want = _rows(rank, sum(C[rank])), _expected(rank, world, C)
    with nccl_semantics(delay_s=0.02) as fake:
        assert torch.equal(all_to_all(x, C[rank], pattern="direct", transport="single"), want)
        assert torch.equal(all_to_all_async(x, C[rank], transport="single").wait(), want)
        assert fake.calls["all_to_all_single"] == 2


def _case_ring_probe(rank: int, world: int) -> None:
    """AdaQP's default link probe (``link_costs="ring"``) under NCCL's rules."""
    from commsched.costmodel import probe_link_costs

    with nccl_semantics() as fake:
        costs = probe_link_costs(sizes=(256, 4096), repeats=1)
    assert sorted(costs) == [p for p in range(world) if p != rank]
    assert fake.calls["batch_isend_irecv"] == 2 * 2 * (world - 1)


def _case_pair_probe(rank: int, world: int) -> None:
    """The topology's pair probe (one-way sends of disjoint pairs) under NCCL's rules."""
    from commsched.costmodel import probe_pair_costs

    rounds = [[(0, 1)], [(1, 2)], [(2, 0)]]
    with nccl_semantics():
        costs = probe_pair_costs(rounds, sizes=(256, 4096), repeats=1)
    assert sorted(costs) == [(0, 1), (1, 2), (2, 0)]


# --------------------------------------------------------------------------- executor
def _reduce_some_steps(sched_cls, cfg, rank: int, world: int, **kw) -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (700, 3, 400, 1)]
    with sched_cls([(p, None, 1.0 / world) for p in params], cfg, timeout_s=60, **kw) as s:
        for step in range(2):
            for p in params:
                p.grad = None
            s.begin_step()
            sum((i + 1) * (rank + 1 + step) * p.sum() for i, p in enumerate(params)).backward()
            s.finish()
            for i, p in enumerate(params):  # mean over ranks of (i + 1) * (r + 1 + step)
                want = (i + 1) * ((world + 1) / 2 + step)
                assert torch.allclose(p.grad, torch.full_like(p.grad, want)), (cfg.policy, i, step)


def _case_executor(rank: int, world: int) -> None:
    """Futures that fire at enqueue and results that land at wait(): finish() still hands
    back reduced gradients (it waits on every Work before the copy-back)."""
    from commsched.priority.executor import GradScheduler
    from commsched.priority.policy import ScheduleConfig

    # the completion launch rule (gloo's) launches from the executor thread after completions,
    # which NCCL's ordering check would flag: CUDA never runs it, so its order is not checked
    with nccl_semantics(delay_s=0.01, check=False):
        for policy in ("lina", "fifo", "serial"):
            for completion in ("callback", "poll"):
                cfg = ScheduleConfig(policy=policy, microop_bytes=512, bucket_bytes=2048)
                _reduce_some_steps(GradScheduler, cfg, rank, world, completion=completion)
    with nccl_semantics(delay_s=0.01):  # the program rule (CUDA's): every launch in program order
        for policy in ("lina", "fifo", "serial"):
            cfg = ScheduleConfig(policy=policy, microop_bytes=512, bucket_bytes=2048, launch="program")
            _reduce_some_steps(GradScheduler, cfg, rank, world, completion="poll")


def _case_overlap(rank: int, world: int) -> None:
    from commsched.priority.overlap import OverlapScheduler
    from commsched.priority.policy import ScheduleConfig

    params = [torch.nn.Parameter(torch.full((n,), 1.0)) for n in (300, 5)]
    cfg = ScheduleConfig(policy="lina-overlap", microop_bytes=512)
    with nccl_semantics(delay_s=0.01, check=False):  # the completion rule: see _case_executor
        with OverlapScheduler([(p, None, 1.0 / world) for p in params], cfg, timeout_s=60) as s:
            for step in range(2):
                for p in params:
                    p.grad = None
                s.begin_step()
                sum((i + 1) * (rank + 1) * p.sum() for i, p in enumerate(params)).backward()
                s.end_backward_async()
                s.wait_params(range(len(params)))
                for i, p in enumerate(params):
                    want = (i + 1) * (world + 1) / 2
                    assert torch.allclose(p.grad, torch.full_like(p.grad, want)), (i, step)
                s.complete()


def _case_hier_chained(rank: int, world: int) -> None:
    """The CUDA form of the hierarchical reduction (all three phases issued at the launch,
    chained; priority/hier.py), forced on the CPU under NCCL's rules."""
    from commsched.priority.executor import GradScheduler
    from commsched.priority.hier import make_hier
    from commsched.priority.policy import ScheduleConfig

    hier = make_hier([f"h{r // 2}" for r in range(world)])  # 2 hosts x 2 ranks
    assert hier is not None

    class Chained(GradScheduler):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._chained = True

    cfg = ScheduleConfig(policy="lina", microop_bytes=512, hier_reduce=True, hier_min_bytes=0)
    with nccl_semantics(delay_s=0.01, check=False):  # the completion rule: see _case_executor
        _reduce_some_steps(Chained, cfg, rank, world, hier=hier, completion="poll")


CASES = [("fake_semantics", _case_fake_semantics), ("ring_pattern", _case_ring_pattern),
         ("ring_posted_at_once", _case_ring_posted_at_once), ("direct_pattern", _case_direct_pattern),
         ("ring_probe", _case_ring_probe), ("pair_probe", _case_pair_probe),
         ("executor", _case_executor), ("overlap", _case_overlap)]


@pytest.fixture(scope="module")
def results():
    return run_cases(3, CASES, timeout_s=240, pg_timeout_s=30)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c, _ in CASES])
def test_under_nccl_semantics(results, case):
    assert_case(results, case)


@pytest.mark.slow
def test_hierarchical_reduction_chained_under_nccl_semantics():
    assert_case(run_cases(4, [("hier_chained", _case_hier_chained)], timeout_s=240, pg_timeout_s=30),
                "hier_chained")


# --------------------------------------------------------------------------- the order checker
def _log(*ops) -> list:
    from tests.nccl_fake import Entry

    return [Entry(g, op, n, "float32", "MainThread", i) for i, (g, op, n) in enumerate(ops)]


def test_order_checker_reports_a_cross_group_reorder():
    from tests.nccl_fake import order_violations

    A, B = (0, 1, 2), (0, 1)
    # every group alone sees the same sequence on every member, but ranks 0 and 1 (both in
    # A and B) interleave them the other way round: NCCL's rule for two communicators
    logs = [_log((A, "all_reduce", 8), (B, "all_to_all_single", 4)),
            _log((B, "all_to_all_single", 4), (A, "all_reduce", 8)),
            _log((A, "all_reduce", 8))]
    v = order_violations(logs)
    assert len(v) == 1 and "interleaved differently" in v[0] and "(0, 1) and (0, 1, 2)" in v[0], v
    # the same order everywhere passes; so does a group that shares only one rank
    ok = [_log((A, "all_reduce", 8), (B, "all_to_all_single", 4)),
          _log((A, "all_reduce", 8), (B, "all_to_all_single", 4)),
          _log((A, "all_reduce", 8))]
    assert order_violations(ok) == []
    C = (1, 2)
    assert order_violations([_log((A, "all_reduce", 8), (B, "all_reduce", 1)),
                             _log((C, "barrier", 0), (B, "all_reduce", 1), (A, "all_reduce", 8)),
                             _log((A, "all_reduce", 8), (C, "barrier", 0))]) != []  # B/A swapped on rank 1
    assert order_violations([_log((A, "all_reduce", 8), (B, "all_reduce", 1)),
                             _log((C, "barrier", 0), (A, "all_reduce", 8), (B, "all_reduce", 1)),
                             _log((C, "barrier", 0), (A, "all_reduce", 8))]) == []  # A/C share 2 ranks: same order
    # (a) one group, two sequences; numels of uneven exchanges may differ, a sum's may not
    v = order_violations([_log((B, "all_reduce", 8)), _log((B, "all_reduce", 9))])
    assert len(v) == 1 and "op 0 differs" in v[0]
    assert order_violations([_log((B, "all_to_all_single(splits)", 8)),
                             _log((B, "all_to_all_single(splits)", 9))]) == []
    v = order_violations([_log((B, "all_reduce", 8), (B, "barrier", 0)), _log((B, "all_reduce", 8))])
    assert "nothing (it issued 1 ops)" in v[0]
    assert order_violations([[], []], [["group (0, 1) used by two threads"], []]) == \
        ["rank 0: group (0, 1) used by two threads"]


def _case_order_checked(rank: int, world: int) -> None:
    """On 3 ranks with groups A (all) and B (0, 1): a consistent order passes the check at
    the block's exit; ranks 0 and 1 issuing A and B the other way round are reported on every
    rank; a group used by two threads at once is reported too."""
    import threading

    from tests.nccl_fake import OrderViolation

    A = dist.new_group([0, 1, 2])
    B = dist.new_group([0, 1])

    def issue(first_b: bool) -> None:
        ws = []
        t, u = torch.ones(4), torch.ones(2)
        for g, x in ([(B, u), (A, t)] if first_b else [(A, t), (B, u)]):
            if g is B and rank == 2:
                continue
            ws.append(dist.all_reduce(x, group=g, async_op=True))  # async: gloo progresses both
        for w in ws:
            w.wait()

    with nccl_semantics() as fake:
        issue(False)
        dist.barrier(group=A)
        obj = [None] * world
        dist.all_gather_object(obj, rank)
    assert [e.op for e in fake.log] == ["all_reduce"] * (2 if rank < 2 else 1) + ["barrier", "all_gather_object"]
    with pytest.raises(OrderViolation, match=r"groups \(0, 1\) and \(0, 1, 2\) .*interleaved differently"):
        with nccl_semantics():
            issue(rank == 1)
    # two threads on one group, one's Work outstanding (never waited) while the other calls
    with pytest.raises(OrderViolation, match="two threads on one communicator"):
        with nccl_semantics(delay_s=5.0) as fake:
            w = dist.all_reduce(torch.ones(1), group=A, async_op=True)
            th = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1), group=A), name="worker")
            th.start()
            th.join(30)
            w.wait()


def test_order_is_checked_across_ranks():
    assert_case(run_cases(3, [("order_checked", _case_order_checked)], timeout_s=120, pg_timeout_s=30),
                "order_checked")
