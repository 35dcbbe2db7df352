"""Groups that carry only CPU control tensors are gloo groups (audit 3, item 10): made with
the default backend, a CUDA job's group inherits the bound device and gets an NCCL
communicator it never uses. lina-overlap's agreement group is one; it still agrees."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from commsched import dist as cs_dist
from tests.mp import run_ranks


def test_control_group_asks_for_gloo_whatever_the_default_backend(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: calls.append((list(ranks), kw)) or "g")
    assert cs_dist.RunGroups().control([0, 1], timeout_s=7) == "g"
    (ranks, kw), = calls
    assert ranks == [0, 1] and kw["backend"] == "gloo" == cs_dist.CONTROL_BACKEND
    assert kw["timeout"].total_seconds() == 7
    with pytest.raises(ValueError, match="threads or backend"):
        cs_dist.new_group([0, 1], threads=2, backend="gloo")
    # one gloo factory makes the threaded groups and the bound ones
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    cs_dist.new_group([0, 1], threads=4)
    cs_dist.new_group([0, 1], address="127.0.0.2")
    assert [kw["backend"] for _, kw in calls[1:]] == [cs_dist.GLOO_GROUP] * 2
    assert [kw["pg_options"] for _, kw in calls[1:]] == [
        cs_dist.GlooGroupOptions(4), cs_dist.GlooGroupOptions(cs_dist.DEFAULT_GLOO_THREADS, "127.0.0.2")]


def test_run_groups_keep_every_group_and_destroy_each_once(monkeypatch):
    made, destroyed = [], []
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append((list(ranks), kw)) or f"g{len(made)}")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", destroyed.append)
    monkeypatch.setattr(dist.distributed_c10d, "_world", type("W", (), {"pg_map": {"g1": 0, "g2": 0}}))
    with cs_dist.RunGroups() as run:
        assert run.new([0, 1]) == "g1" and run.control(range(2)) == "g2" and run.new([1]) == "g3"
    assert [r for r, _ in made] == [[0, 1], [0, 1], [1]] and made[1][1]["backend"] == "gloo"
    assert destroyed == ["g2", "g1"]  # the newest first; g3, gone with the default group, is left alone
    run.close()
    assert destroyed == ["g2", "g1"]


def _overlap_ctrl(rank: int, world: int) -> dict:
    """An OverlapScheduler's control group: how it was made, its backend, and a two-step run
    whose end-of-backward agreement goes over it (gradients: the ranks' mean)."""
    from commsched.priority.policy import LinaOverlapConfig
    from commsched.priority.runtime.overlap import OverlapOptimizer, OverlapScheduler
    from tests.priority.test_overlap import OPTIMIZERS, _batch, _Net

    made = []
    real = dist.new_group

    def spy(ranks=None, **kw):
        g = real(ranks, **kw)
        made.append((kw.get("backend"), g))
        return g

    dist.new_group = spy  # the forked rank's own module state: gone with it
    torch.manual_seed(0)
    net = _Net()
    entries = [(p, None) for p in reversed(list(net.parameters()))]
    stepper = OverlapOptimizer(net, OPTIMIZERS["sgd"])
    with OverlapScheduler(entries, LinaOverlapConfig(microop_bytes=64)) as sched, stepper.bind(sched):
        ctrl = sched._ctrl
        asked = [b for b, g in made if g is ctrl]
        backend = str(dist.get_backend(ctrl))  # read while it lives: the scheduler destroys it at close
        for step in range(2):
            x, y = _batch(step, rank)
            stepper.begin_backward()
            torch.nn.functional.cross_entropy(net(x, step, rank), y).backward()
            stepper.end_backward()
        stats = stepper.synchronize()
    stepper.close()
    return {"asked": asked, "backend": backend, "reduced": stats["allreduce_count"] > 0,
            "params": [p.detach().clone() for p in net.parameters()]}


def test_lina_overlap_agrees_over_a_gloo_control_group():
    res = run_ranks(2, _overlap_ctrl, timeout_s=120)
    for r in res:
        assert r["asked"] == ["gloo"] and r["backend"] == "gloo" and r["reduced"], r
    # the agreement worked: both ranks stepped on the same reduced gradients
    for a, b in zip(res[0]["params"], res[1]["params"]):
        assert torch.equal(a, b)


def _local_after_uneven_groups(rank: int, world: int) -> dict:
    """Groups [0, 1, 2] and [0, 1] made by every rank (rank 2 is outside the second, so it
    holds one group fewer), then a local group of [0, 1, 2] on its members only, used by an
    all-reduce; rank 3 makes nothing more."""
    from commsched.dist import new_group

    g3, g2 = new_group([0, 1, 2]), new_group([0, 1])
    out = {"sum": None}
    if rank < 3:
        own = new_group([0, 1, 2], local=True)
        again = new_group([0, 1, 2], local=True)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=own)
        out = {"sum": t.item(), "kept": own is again, "distinct": own is not g3}
    del g2
    return out


def test_local_group_meets_when_members_hold_different_group_counts():
    res = run_ranks(4, _local_after_uneven_groups, timeout_s=90, pg_timeout_s=20)
    assert [r["sum"] for r in res[:3]] == [6.0] * 3 and res[3]["sum"] is None
    assert all(r["kept"] and r["distinct"] for r in res[:3])
