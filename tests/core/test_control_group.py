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
    assert cs_dist.control_group([0, 1], timeout_s=7) == "g"
    (ranks, kw), = calls
    assert ranks == [0, 1] and kw["backend"] == "gloo" == cs_dist.CONTROL_BACKEND
    assert kw["timeout"].total_seconds() == 7
    with pytest.raises(ValueError, match="threads or backend"):
        cs_dist.new_group([0, 1], threads=2, backend="gloo")


def _overlap_ctrl(rank: int, world: int) -> dict:
    """An OverlapScheduler's control group: how it was made, its backend, and a two-step run
    whose end-of-backward agreement goes over it (gradients: the ranks' mean)."""
    from commsched.priority.overlap import OverlapOptimizer, OverlapScheduler
    from commsched.priority.policy import ScheduleConfig
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
    with OverlapScheduler(entries, ScheduleConfig(policy="lina-overlap", microop_bytes=64)) as sched, stepper.bind(sched):
        ctrl = sched._ctrl
        asked = [b for b, g in made if g is ctrl]
        for step in range(2):
            x, y = _batch(step, rank)
            stepper.begin_backward()
            torch.nn.functional.cross_entropy(net(x, step, rank), y).backward()
            stepper.end_backward()
        stats = stepper.synchronize()
    stepper.close()
    return {"asked": asked, "backend": str(dist.get_backend(ctrl)), "reduced": stats["allreduce_count"] > 0,
            "params": [p.detach().clone() for p in net.parameters()]}


def test_lina_overlap_agrees_over_a_gloo_control_group():
    res = run_ranks(2, _overlap_ctrl, timeout_s=120)
    for r in res:
        assert r["asked"] == ["gloo"] and r["backend"] == "gloo" and r["reduced"], r
    # the agreement worked: both ranks stepped on the same reduced gradients
    for a, b in zip(res[0]["params"], res[1]["params"]):
        assert torch.equal(a, b)
