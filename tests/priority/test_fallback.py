"""The measured A/B against fifo's launching (priority/fallback.py): the pure probe on
hand-worked times, then GradStep driving it with a scripted clock (no process group), so
the switch of the policy's holds and of lina-overlap's overlap is checked in milliseconds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from commsched.priority import make_grad_step
from commsched.priority.fallback import FallbackProbe
from commsched.priority.policy import FifoConfig, LinaConfig
from tests.priority import sched_of
from tests.priority.test_step import DoneWork, FakeGroup, _batch, _net, _reference


def test_probe_modes_and_decision_hand_worked():
    pr = FallbackProbe(warmup=1, probes=2)
    # P F F P: a steady trend (the first steps slower) favours neither
    assert [pr.fallback_at(s) for s in range(6)] == [False, False, True, True, False, False]
    assert pr.decide_at == 5 and pr.probing(1) and pr.probing(4) and not pr.probing(5)
    # two ranks; per step the slower rank counts: primary (1.0 + 1.2) / 2, fallback (0.9 + 1.1) / 2
    d = pr.decide([[1.0, 0.9, 1.1, 1.2], [0.7, 0.8, 0.6, 1.1]])
    assert d.fallback and d.primary_s == pytest.approx(1.1) and d.fallback_s == pytest.approx(1.0)
    trend = FallbackProbe(warmup=0, probes=2)  # equal modes under a falling trend: a tie
    assert not trend.decide([[4.0, 3.0, 2.0, 1.0]]).fallback
    assert [FallbackProbe(0, 4).fallback_at(s) for s in range(8)] == [False, True, True, False] * 2
    assert all(pr.fallback_at(s) for s in range(5, 9))
    assert "falls back" in d.message("lina", 1, 4)
    tie = FallbackProbe(1, 1)
    assert not tie.decide([[1.0, 1.0]]).fallback and not tie.fallback_at(3)  # ties keep the schedule
    with pytest.raises(ValueError, match="probe-step times"):
        FallbackProbe(1, 2).decide([[1.0, 2.0]])
    off = FallbackProbe(1, 0)
    assert not off.enabled and not any(off.fallback_at(s) for s in range(5))


def test_probe_of_an_overlapped_schedule_skips_the_steps_after_a_switch():
    """lina-overlap's tail: the F step after a P step waits for P's reduction (2.0 s), the P
    step after an F step leaves its tail uncounted (0.5 s). Counting every step keeps the
    schedule on that bias; counting only the steps in the mode of the step before (the first
    P, the second F) compares the steady states, 1.0 against 0.9 s."""
    times = [[1.0, 2.0, 0.9, 0.5]]
    biased = FallbackProbe(0, 2).decide(times)
    assert not biased.fallback and biased.primary_s == pytest.approx(0.75) and biased.fallback_s == pytest.approx(1.45)
    fair = FallbackProbe(0, 2, skip_switches=True).decide(times)
    assert fair.fallback and fair.primary_s == pytest.approx(1.0) and fair.fallback_s == pytest.approx(0.9)
    # three pairs, P F F P P F: counted P at 0 and 4, F at 2 (1 and 3 follow a switch, 5 too)
    six = FallbackProbe(0, 3, skip_switches=True).decide([[1.0, 9.0, 3.0, 9.0, 2.0, 9.0]])
    assert six.primary_s == pytest.approx(1.5) and six.fallback_s == pytest.approx(3.0) and not six.fallback
    # one pair, P F: the F step follows a switch, but it is the only one, so it counts
    one = FallbackProbe(0, 1, skip_switches=True).decide([[1.0, 0.8]])
    assert one.fallback and one.primary_s == pytest.approx(1.0) and one.fallback_s == pytest.approx(0.8)


class ScriptedClock:
    """perf_counter for step.py: every call after the first step adds the next duration."""

    def __init__(self, durations):
        self.t, self.durations = 0.0, list(durations)

    def __call__(self) -> float:
        t = self.t
        if self.durations:
            self.t += self.durations.pop(0)
        return t


@pytest.mark.parametrize("policy", ["lina", "lina-overlap"])
@pytest.mark.parametrize("fallback_faster", [True, False])
def test_grad_step_keeps_the_faster_mode(capsys, policy, fallback_faster):
    fast, slow = 1.0, 1.5
    # step k's duration is the gap between before_forward k and k+1: steps 0-1 warm-up,
    # 2-5 probe (P F F P), decided from step 6 on
    prim, fb = (slow, fast) if fallback_faster else (fast, slow)
    steps = 9
    net = _net()
    cfg = sched_of(policy, microop_bytes=64, fallback_probes=2)
    entries = [(p, FakeGroup(), 1.0) for p in reversed(list(net.parameters()))]
    gs = make_grad_step(net, entries, cfg, lambda ps: torch.optim.Adam(ps, lr=1e-2),
                        launch=lambda flat, group: DoneWork())
    gs._now = ScriptedClock([2.0, 2.0, prim, fb, fb, prim] + [1.0] * 10)
    modes: list[bool] = []
    gs.on_mode(modes.append)  # what else the fallback switches hears every step's mode
    holds, overlaps = [], []
    with gs:
        base = gs.scheduler._holds
        assert base[0] is True  # lina holds allreduce for the all-to-all
        for step in range(steps):
            x, y = _batch(step)
            gs.before_forward()
            loss = nn.functional.cross_entropy(net(x), y)
            gs.before_backward()
            holds.append(gs.scheduler._policy.hold_for_a2a)
            overlaps.append(getattr(gs.optimizer, "overlap", None))
            loss.backward()
            gs.after_backward(sync=step + 1 == steps)
    # warm-up, then the probe's P F F P; from step 6 on the decided mode
    assert holds[:6] == [True, True, True, False, False, True]
    assert holds[6:] == [not fallback_faster] * 3
    assert modes == [not h for h in holds]
    assert gs.fallen_back is fallback_faster
    # only lina-overlap's reduction runs into the next step: its probe skips the steps after a switch
    assert gs.probe.skip_switches is (policy == "lina-overlap")
    if policy == "lina-overlap":
        assert overlaps[:6] == [True, True, True, False, False, True] and overlaps[6:] == [not fallback_faster] * 3
    err = capsys.readouterr().err
    assert err.count("commsched: ") == 1 and ("falls back" in err) is fallback_faster
    # either mode steps exactly as the plain optimizer does
    ref = _reference(steps)
    for k, v in net.state_dict().items():
        torch.testing.assert_close(v, ref[k])


@pytest.mark.parametrize("policy", ["lina", "lina-overlap"])
def test_fallback_buckets_reduce_in_fifos_buckets_with_the_same_result(policy):
    """``fallback_buckets``: in fallback steps the scheduler reduces in fifo's buckets (fewer,
    larger operations), in the others in the schedule's micro-ops; either way the step equals
    the plain optimizer's."""
    net = _net()
    cfg = sched_of(policy, microop_bytes=64, fallback_probes=2)
    entries = [(p, FakeGroup(), 1.0) for p in reversed(list(net.parameters()))]
    gs = make_grad_step(net, entries, cfg, lambda ps: torch.optim.Adam(ps, lr=1e-2),
                        launch=lambda flat, group: DoneWork(), fallback_buckets=True)
    gs._now = ScriptedClock([2.0, 2.0, 1.5, 1.0, 1.0, 1.5] + [1.0] * 10)  # the fallback is faster
    steps, n_ops = 9, []
    with gs:
        for step in range(steps):
            x, y = _batch(step)
            gs.before_forward()
            loss = nn.functional.cross_entropy(net(x), y)
            gs.before_backward()
            loss.backward()
            n_ops.append(gs.scheduler.num_ops)
            gs.after_backward(sync=step + 1 == steps)
    micro, fused = max(n_ops), min(n_ops)
    assert fused < micro
    # warm-up, P F F P, then the fallback chosen: fifo's buckets in every fallback step
    assert n_ops == [micro, micro, micro, fused, fused, micro, fused, fused, fused]
    ref = _reference(steps)
    for k, v in net.state_dict().items():
        torch.testing.assert_close(v, ref[k])


def test_no_probe_for_fifo_or_when_off():
    for cfg in (FifoConfig(), LinaConfig(fallback_probes=0)):
        gs = make_grad_step(_net(), [(p, FakeGroup(), 1.0) for p in _net().parameters()], cfg,
                            lambda ps: torch.optim.Adam(ps, lr=1e-2), launch=lambda flat, group: DoneWork())
        assert not gs.probe.enabled


def _modes_of(gs, steps: range, modes: list) -> None:
    with gs:
        for step in steps:
            x, y = _batch(step)
            gs.before_forward()
            loss = nn.functional.cross_entropy(_NET(x), y)
            gs.before_backward()
            modes.append(gs.scheduler._policy.hold_for_a2a)
            loss.backward()
            gs.after_backward(sync=True)


_NET = _net()


def _gs(durations):
    cfg = LinaConfig(microop_bytes=64, fallback_probes=2)
    entries = [(p, FakeGroup(), 1.0) for p in reversed(list(_NET.parameters()))]
    gs = make_grad_step(_NET, entries, cfg, lambda ps: torch.optim.Adam(ps, lr=1e-2),
                        launch=lambda flat, group: DoneWork())
    gs._now = ScriptedClock(durations)
    return gs


@pytest.mark.parametrize("cut", [1, 3, 5, 6, 8])
def test_probe_state_resumes_the_probe_where_it_stopped(cut):
    """A run stopped after step ``cut`` (a checkpoint) and carried on from
    ``probe_state()`` runs every later step in the mode the whole run does, and decides from
    the same number of probe times: in the warm-up, inside the probe (3: step 3 timed up to
    the checkpoint), on its last step (5), at the decision (6) and after it (8)."""
    durations = [2.0, 2.0, 1.5, 1.0, 1.0, 1.5] + [1.0] * 10  # the fallback is faster
    whole: list[bool] = []
    g = _gs(list(durations))
    _modes_of(g, range(10), whole)
    assert whole[6:] == [False] * 4 and g.fallen_back  # lina falls back from step 6 on
    first: list[bool] = []
    a = _gs(list(durations))
    _modes_of(a, range(cut + 1), first)
    st = a.probe_state()
    assert st["step"] == cut and (st["decided"] is not None) is (cut >= 6)
    assert len(st["times"]) == max(0, min(cut - 1, 4))
    import json

    st = json.loads(json.dumps(st))  # it is what a checkpoint holds
    b = _gs(durations[cut + 1:])  # the steps it runs take what they take in the whole run
    b.load_probe_state(st)
    rest: list[bool] = []
    _modes_of(b, range(cut + 1, 10), rest)
    assert first + rest == whole
    assert b.fallen_back is True


def test_a_damaged_probe_state_is_refused():
    gs = _gs([1.0] * 5)
    for bad in ({}, {"step": 1, "times": "x", "decided": None}, {"step": 1, "times": [], "decided": {"fallback": 1}},
                {"step": "a", "times": [], "decided": None}):
        with pytest.raises(ValueError, match="probe state is damaged"):
            gs.load_probe_state(bad)
    with pytest.raises(ValueError, match="does not fit this schedule"):
        gs.load_probe_state({"step": 3, "times": [1.0] * 5, "decided": None})


def test_one_stalled_probe_step_does_not_decide():
    """A rank stopped for 4 s in one probe step (a GC pause, a co-tenant, a checkpoint
    write): the step is left out as a stall and each mode's median decides, on every rank
    alike (the same gathered times). The undisturbed run measured 0.072 s as lina against
    0.041 s with fifo's launching and fell back; so must the stalled one."""
    steady = [[0.072, 0.041, 0.041, 0.072], [0.070, 0.040, 0.039, 0.071]]
    assert FallbackProbe(0, 2).decide(steady).fallback
    in_fallback = [[0.072, 0.041, 4.05, 0.072], [0.070, 0.040, 0.039, 0.071]]  # P F F P, rank 0 stalls in step 2
    d = FallbackProbe(0, 2).decide(in_fallback)
    assert d.fallback and d.fallback_s == pytest.approx(0.041) and d.primary_s == pytest.approx(0.072)
    assert d.stalls == ((2, 4.05),)
    msg = d.message("lina", 2, 5)
    assert "falls back" in msg and "step 4 (4.050 s)" in msg and "0.072 s" in msg and "0.041 s" in msg
    in_primary = [[0.072, 0.041, 0.041, 0.072], [4.06, 0.040, 0.039, 0.071]]  # rank 1 stalls in step 0
    d = FallbackProbe(0, 2).decide(in_primary)
    assert d.fallback and d.primary_s == pytest.approx(0.072) and d.stalls == ((0, 4.06),)
    # a mode that is really several times slower is a mode, not a stall
    for p, f in ((1.0, 0.2), (0.2, 1.0)):
        d = FallbackProbe(0, 2).decide([[p, f, f, p]])
        assert d.fallback is (f < p) and not d.stalls
    # an overlapped schedule's counted steps (the first P, the second F) alike
    d = FallbackProbe(0, 4, skip_switches=True).decide([[0.07, 9, 0.04, 9, 0.07, 9, 5.0, 9]])
    assert d.fallback and d.stalls == ((6, 5.0),)
