"""The one step interface of commsched/priority/step.py without a process group: a fake
reduction (an identity Work) stands in for the allreduce, so both implementations
(reduce-then-step, lina-overlap) must step exactly as a plain optimizer on the local
gradients, and report through the same calls."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from commsched.priority import GradStep, OverlapStep, ReduceThenStep, make_grad_step
from commsched.priority.policy import ScheduleConfig


class FakeGroup:
    def size(self) -> int:
        return 2


class DoneWork:
    """A reduction that leaves the buffer as it is (one rank's sum), complete at once."""

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _reference(steps: int) -> dict:
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = _batch(step)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return net.state_dict()


@pytest.mark.parametrize("policy", ["lina", "fifo", "serial", "lina-overlap"])
def test_every_schedule_steps_through_one_interface(policy):
    steps = 4
    net = _net()
    cfg = ScheduleConfig(policy=policy, microop_bytes=64)
    g = FakeGroup()
    entries = [(p, g, 1.0) for p in reversed(list(net.parameters()))]
    gs = make_grad_step(net, entries, cfg, lambda ps: torch.optim.Adam(ps, lr=1e-2),
                        launch=lambda flat, group: DoneWork())
    assert isinstance(gs, OverlapStep if policy == "lina-overlap" else ReduceThenStep)
    assert isinstance(gs, GradStep)
    timings = []
    with gs:
        for step in range(steps):
            x, y = _batch(step)
            gs.before_forward()
            loss = nn.functional.cross_entropy(net(x), y)
            prev = gs.before_backward()
            if prev is not None:
                timings.append(prev)
            loss.backward()
            st = gs.after_backward(sync=step + 1 == steps)
            if st is not None:
                timings.append(st)
                assert any(r.kind == "allreduce" for r in gs.records)
    # every step reported its timings once, through the same calls
    assert len(timings) == steps
    assert all({"a2a_blocked_s", "allreduce_time_s", "allreduce_wait_s", "allreduce_in_backward_share"}
               <= set(t) for t in timings)
    want = _reference(steps)
    got = net.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # the state is the optimizer's own (a checkpoint is what it was before the interface)
    sd = gs.state_dict()
    assert ("optimizers" in sd) == (policy == "lina-overlap")
    gs.load_state_dict(sd)


def test_the_scheduler_exists_only_while_open():
    net = _net()
    gs = make_grad_step(net, [(p, FakeGroup(), 1.0) for p in net.parameters()], ScheduleConfig(policy="lina"),
                        lambda ps: torch.optim.SGD(ps, lr=0.1), launch=lambda flat, group: DoneWork())
    with pytest.raises(RuntimeError, match="not open"):
        _ = gs.scheduler
    with gs:
        assert gs.scheduler.num_ops > 0
    with pytest.raises(RuntimeError, match="not open"):
        _ = gs.scheduler
