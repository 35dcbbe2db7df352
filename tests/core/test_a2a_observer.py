"""The observer argument of ``commsched.all_to_all`` / ``all_to_all_async``: what it reports,
in which order, in both directions (one-rank plans, ms), and a user's own expert-parallel
layer trained on 2 gloo ranks under the gradient scheduler (lina = fifo = serial = a plain
allreduce; lina never launches an allreduce while an exchange of that layer is on the wire)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import commsched
from commsched.all2all import A2APlan
from commsched.observe import A2AEvents
from commsched.priority import LOCAL, GradScheduler, ScheduleConfig
from tests.mp import assert_case, run_cases


class _Log:
    """An observer that writes down every report (blocked times as "blocked")."""

    def __init__(self):
        self.log: list = []
        self._n = 0

    def a2a_begin(self, nbytes: int) -> object:
        self._n += 1
        self.log.append(("begin", nbytes))
        return self._n

    def a2a_end(self, token: object) -> None:
        self.log.append(("end", token))

    def block_begin(self) -> None:
        self.log.append("block_begin")

    def block_end(self) -> None:
        self.log.append("block_end")

    def a2a_blocked(self, seconds: float) -> None:
        assert seconds >= 0.0
        self.log.append("blocked")


ONE = A2APlan((3,), (3,), 0)  # a one-rank exchange: a local copy, no process group needed


def test_all_to_all_reports_forward_and_backward_in_order():
    for block, opens, closes in ((None, [], []), ("begin", ["block_begin"], []), ("end", [], ["block_end"])):
        obs = _Log()
        x = torch.randn(3, 2, requires_grad=True)
        y = commsched.all_to_all(x, ONE, observer=obs, backward_block=block)
        # a one-rank exchange sends nothing to peers: 0 bytes
        assert obs.log == [("begin", 0), "blocked", ("end", 1)]
        (y * 2).sum().backward()
        assert torch.equal(x.grad, torch.full((3, 2), 2.0))
        assert obs.log[3:] == opens + [("begin", 0), "blocked", ("end", 2)] + closes, block
    # no gradient wanted: the forward exchange alone is reported
    obs = _Log()
    commsched.all_to_all(torch.randn(3, 2), ONE, observer=obs, backward_block="begin")
    assert obs.log == [("begin", 0), "blocked", ("end", 1)]


def test_all_to_all_async_reports_its_end_at_wait():
    obs = _Log()
    x = torch.randn(3, 4, requires_grad=True)
    h = commsched.all_to_all_async(x, ONE, observer=obs, backward_block="end")
    assert obs.log == [("begin", 0)]  # begun, not ended until wait()
    y = h.wait()
    assert h.wait() is y and obs.log == [("begin", 0), "blocked", ("end", 1)]  # reported once
    y.sum().backward()
    assert obs.log[3:] == [("begin", 0), "blocked", ("end", 2), "block_end"]
    assert torch.equal(x.grad, torch.ones(3, 4))


def test_observer_argument_errors_speak():
    x = torch.randn(3, 2)
    with pytest.raises(TypeError, match="lacks a2a_begin, a2a_end"):
        commsched.all_to_all(x, ONE, observer=object())
    with pytest.raises(ValueError, match=r"backward_block must be one of \('begin', 'end'\)"):
        commsched.all_to_all_async(x, ONE, backward_block="middle")

    class NoBlocks:
        def a2a_begin(self, n):
            return 0

        def a2a_end(self, t):
            pass
    commsched.all_to_all(x, ONE, observer=NoBlocks())  # enough without a backward_block
    with pytest.raises(TypeError, match="lacks block_begin, block_end"):
        commsched.all_to_all(x, ONE, observer=NoBlocks(), backward_block="begin")
    obs = _Log()
    with pytest.raises(ValueError, match="has 2 rows"):  # refused before anything is reported
        commsched.all_to_all(torch.randn(2, 2), ONE, observer=obs)
    assert obs.log == []


# --------------------------------------------------------------------------- a user's own layer
class UserEPLayer(nn.Module):
    """What a user writes: top-1 routing to one expert per rank, the rows sent to their
    expert's rank and back through commsched.all_to_all with ``observer=``. No autograd
    function of its own."""

    def __init__(self, d: int, world: int, observer=None):
        super().__init__()
        self.world, self.observer = world, observer
        self.router = nn.Linear(d, world, bias=False)
        self.expert = nn.Linear(d, d)  # this rank's expert

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        gate_TE = torch.softmax(self.router(x_TD), dim=-1)
        e_T = gate_TE.argmax(dim=-1)
        order = torch.sort(e_T, stable=True).indices
        plan = commsched.make_plan(torch.bincount(e_T, minlength=self.world).tolist(), rows=x_TD.shape[0])
        got = commsched.all_to_all(x_TD[order], plan, observer=self.observer, backward_block="end")
        back = commsched.all_to_all(self.expert(got), plan.reversed(), observer=self.observer,
                                    backward_block="begin")
        y_TD = torch.zeros_like(x_TD).index_copy(0, order, back)
        return y_TD * gate_TE.gather(1, e_T[:, None])


class UserModel(nn.Module):
    def __init__(self, d: int, world: int, rank: int, observer=None):
        super().__init__()
        torch.manual_seed(0)  # the data-parallel weights: the same on every rank
        self.inp, self.moe, self.out = nn.Linear(d, d), UserEPLayer(d, world, observer), nn.Linear(d, 1)
        with torch.no_grad():  # each rank's expert its own
            g = torch.Generator().manual_seed(100 + rank)
            self.moe.expert.weight.copy_(torch.randn(d, d, generator=g) / d ** 0.5)

    def forward(self, x):
        return self.out(torch.relu(self.moe(torch.tanh(self.inp(x))))).pow(2).mean()

    def sched_params(self):
        """Data-parallel weights averaged over the world; the expert stays on its rank."""
        return [(p, None) for n, p in self.named_parameters() if not n.startswith("moe.expert.")] + \
               [(p, LOCAL) for p in self.moe.expert.parameters()]


D, T, STEPS = 16, 24, 3


def _train(rank: int, world: int, schedule: str | None, launch: str | None = None) -> tuple[dict, list, list]:
    """STEPS of SGD; ``schedule`` None: no scheduler, a plain allreduce after backward;
    ``launch``: the launch rule (None: the device's default, ``completion`` here)."""
    events = A2AEvents()
    model = UserModel(D, world, rank, events)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log, records = _Log(), []
    sched = None
    if schedule is not None:
        # 64-byte micro-ops: 16 of the 1 KiB input weight, credit of 2
        cfg = ScheduleConfig(policy=schedule, microop_bytes=64, credit_bytes=128, bucket_bytes=256, launch=launch)
        sched = GradScheduler(model.sched_params(), cfg)
        events.register(sched)
    events.register(log)
    try:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(10 * rank + step)
            x = torch.randn(T, D, generator=g)
            if sched is not None:
                sched.begin_step()
            model(x).backward()
            if sched is not None:
                st = sched.finish()
                records.append(list(sched.records))
                assert st["a2a_count"] == 4 and st["allreduce_count"] == sched.num_ops
            else:
                for n, p in model.named_parameters():
                    if not n.startswith("moe.expert."):
                        dist.all_reduce(p.grad)
                        p.grad /= world
            opt.step()
            opt.zero_grad()
    finally:
        if sched is not None:
            sched.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, log.log, records


def _user_layer_trains_alike(rank: int, world: int) -> None:
    ref, ref_log, _ = _train(rank, world, None)
    torch.manual_seed(0)
    init = UserModel(D, world, rank).state_dict()
    assert not torch.equal(init["inp.weight"], ref["inp.weight"])  # training moved the weights
    # lina under both launch rules ("program" is CUDA's default: it counts launches per gap)
    for schedule, launch in (("lina", None), ("lina", "program"), ("fifo", None), ("serial", None)):
        got, log, records = _train(rank, world, schedule, launch)
        for n in ref:
            assert torch.allclose(got[n], ref[n], rtol=1e-6, atol=1e-7), (schedule, n)
        # every step: forward dispatch + combine, then backward combine (opening the expert
        # block), dispatch (closing it); each begun, blocked on, ended
        fwd = [("begin", "blocked", "end")] * 2
        per_step = fwd + ["block_begin", ("begin", "blocked", "end"), ("begin", "blocked", "end"), "block_end"]
        flat = []
        for it in per_step:
            flat += list(it) if isinstance(it, tuple) else [it]
        shape = [e if isinstance(e, str) else e[0] for e in log]
        assert shape == flat * STEPS, (schedule, shape)
        if schedule == "lina":
            for recs in records:
                a2a = [r for r in recs if r.kind == "a2a"]
                ar = [r for r in recs if r.kind == "allreduce"]
                assert len(a2a) == 4 and len(ar) > 16
                for r in ar:  # none launched while an exchange of the layer waited or moved
                    assert not any(a.ready_s < r.start_s < a.end_s for a in a2a), (r, a2a)
    # the logging observer alone (no scheduler) saw the same reports
    assert [e if isinstance(e, str) else e[0] for e in ref_log] == shape


@pytest.mark.slow
def test_user_expert_parallel_layer_trains_under_lina():
    res = run_cases(2, [("user_layer_trains_alike", _user_layer_trains_alike)], timeout_s=120)
    assert_case(res, "user_layer_trains_alike")
