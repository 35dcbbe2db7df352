"""Urgent operations beside background micro-ops (commsched.priority.transfer): a pipeline
send never waits behind more than the credit -- in the policy's simulator (ms) and on 2 gloo
ranks, read from the recorded timeline (no clock thresholds)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from commsched.priority import GradScheduler, ScheduleConfig, urgent
from commsched.priority.sim import AllToAll, Compute, Link, simulate
from tests.mp import assert_case, run_cases


# --------------------------------------------------------------------------- the pure policy
def _pipeline_stage_backward() -> list:
    """One pipeline stage's backward over 4 micro-batches: the data-parallel gradients of
    each micro-batch become ready, then the gradient of its input goes to the previous
    stage (an urgent send: the next stage is waiting for it). The simulator's AllToAll is
    its urgent, blocking kind of operation."""
    out: list = []
    for _ in range(4):
        out += [Compute(0.5, (8000,)), AllToAll(1000), Compute(0.2)]
    return out


def test_sim_pipeline_send_waits_behind_at_most_the_credit():
    link = Link(1000.0, 0.01)
    micro, credit = 500, 1500
    lina = simulate(_pipeline_stage_backward(), link, ScheduleConfig(policy="lina", microop_bytes=micro,
                                                                      credit_bytes=credit))
    assert len(lina.a2a) == 4 and len(lina.allreduce) == 4 * 8000 // micro
    assert any(len(lina.allreduce_during(s)) > 1 for s in lina.a2a)  # the credit was in use
    for s in lina.a2a:
        ahead = lina.allreduce_during(s)
        assert sum(o.nbytes for o in ahead) <= credit, (s, ahead)
        assert all(o.start_s < s.ready_s for o in ahead)  # none launched once the send came
        assert s.start_s == s.ready_s  # the send itself is launched at once
        assert s.end_s - s.ready_s <= link.alone_s(s.nbytes) + link.alone_s(credit) + 1e-9
    # the bound is not vacuous: fifo lets a send wait behind far more than the credit
    fifo = simulate(_pipeline_stage_backward(), link, ScheduleConfig(policy="fifo", bucket_bytes=2000))
    assert max(sum(o.nbytes for o in fifo.allreduce_during(s)) for s in fifo.a2a) > credit


def test_urgent_errors_speak():
    sched_like = object()
    with pytest.raises(TypeError, match="needs a function"):
        urgent(sched_like, torch.ones(2))
    with pytest.raises(ValueError, match="nbytes must be an int >= 0"):
        urgent(sched_like, print, nbytes=-1)
    with pytest.raises(TypeError, match="lacks a2a_begin, a2a_end"):
        urgent(sched_like, print)
    with pytest.raises(TypeError, match="got None"):
        urgent(None, print)


# --------------------------------------------------------------------------- 2 gloo ranks
MICRO, CREDIT_OPS, N_OPS = 1024, 4, 256


def _send_during_background(rank: int, world: int, credit_ops: int) -> dict:
    """A 1 MiB gradient (256 micro-ops of 1 KiB) reduced in the background on the default
    group while rank 0 sends a "pipeline" activation to rank 1 on its own group, urgently.
    Returns the background micro-ops in flight at the send's arrival, those launched while
    it was in flight, and those launched after it ended."""
    from commsched.dist import new_group

    pp = new_group([0, 1])
    w = torch.nn.Parameter(torch.zeros(N_OPS * MICRO // 4))
    cfg = ScheduleConfig(policy="lina", microop_bytes=MICRO, credit_bytes=credit_ops * MICRO)
    act = torch.arange(5000, dtype=torch.float32) if rank == 0 else torch.zeros(5000)
    with GradScheduler([(w, None)], cfg) as sched:
        sched.begin_step()
        (w * float(rank + 1)).sum().backward()  # the hook: every micro-op ready now
        if rank == 0:
            op = sched.urgent(dist.isend, act, 1, group=pp, nbytes=act.numel() * 4)
        else:
            op = sched.urgent(dist.irecv, act, 0, group=pp, nbytes=0)
        with op:
            pass  # leaving the block waits for the send
        assert op.is_completed()
        sched.finish()
        recs = sched.records
    assert torch.equal(act, torch.arange(5000, dtype=torch.float32))  # the send arrived
    assert torch.equal(w.grad, torch.full_like(w, 1.5))  # mean of 1 and 2: the background reduced
    (send,) = [r for r in recs if r.kind == "a2a"]
    ar = [r for r in recs if r.kind == "allreduce"]
    assert len(ar) == N_OPS and send.start_s >= send.ready_s >= 0
    return {"in_flight": sum(1 for r in ar if r.start_s <= send.ready_s < r.end_s),
            "launched_during": sum(1 for r in ar if send.ready_s <= r.start_s < send.end_s),
            "launched_after": sum(1 for r in ar if r.start_s >= send.end_s)}


def _urgent_send_within_credit(rank: int, world: int) -> None:
    lina = _send_during_background(rank, world, CREDIT_OPS)
    assert lina["in_flight"] <= CREDIT_OPS, lina
    assert lina["launched_during"] == 0, lina
    assert lina["launched_after"] > 0, lina  # the send came while background work was pending
    # not vacuous: with a credit of every micro-op all are launched at once, and the send
    # finds far more than CREDIT_OPS ahead of it
    loose = _send_during_background(rank, world, N_OPS)
    assert loose["in_flight"] > CREDIT_OPS, loose


@pytest.mark.slow
def test_pipeline_send_never_waits_behind_more_than_the_credit():
    res = run_cases(2, [("urgent_send_within_credit", _urgent_send_within_credit)], timeout_s=120)
    assert_case(res, "urgent_send_within_credit")
