"""Micro-op partitioning, the launch policies and the discrete-event simulator (pure, ms)."""

from __future__ import annotations

import math

import pytest

from commsched.configurable import config_of
from commsched.priority.microops import bucket, partition, split_equal
from commsched.priority.policy import (
    DEFAULT_CREDIT_MICROOPS,
    SCHEDULES,
    FifoConfig,
    FlatConfig,
    LinaConfig,
    MicroOpConfig,
    OverlapPolicy,
    Policy,
    SerialConfig,
    make_policy,
)
from commsched.priority.sim import (
    AllToAll,
    BlockBegin,
    BlockEnd,
    Compute,
    Link,
    moe_backward_script,
    simulate,
)
from tests.priority import sched_of


# --------------------------------------------------------------------------- partitioning
def test_split_equal_sizes_differ_by_at_most_one_element():
    assert split_equal(10, 4, 16) == [(0, 4), (4, 3), (7, 3)]
    assert split_equal(8, 4, 16) == [(0, 4), (4, 4)]
    assert split_equal(3, 4, 100) == [(0, 3)]
    assert split_equal(0, 4, 16) == []
    for n in (1, 7, 33, 1000):
        parts = split_equal(n, 2, 30)
        assert sum(k for _, k in parts) == n and max(k for _, k in parts) * 2 <= 30
        assert max(k for _, k in parts) - min(k for _, k in parts) <= 1


def test_partition_never_fuses_tensors_and_keeps_order():
    ops = partition([10, 3, 0, 5], 4, 16)
    assert [op.seq for op in ops] == list(range(len(ops)))
    assert [op.tensors for op in ops] == [(0,), (0,), (0,), (1,), (3,), (3,)]
    assert [op.nbytes for op in ops] == [16, 12, 12, 12, 12, 8]
    assert all(len(op.pieces) == 1 for op in ops)


def test_bucket_fuses_consecutive_tensors_up_to_the_size():
    ops = bucket([2, 2, 5, 1, 1], 4, 16)
    assert [op.tensors for op in ops] == [(0, 1), (2,), (3, 4)]
    assert [op.nbytes for op in ops] == [16, 20, 8]


def test_partition_errors_speak():
    with pytest.raises(ValueError, match="at least one element"):
        partition([4], 4, 2)
    with pytest.raises(ValueError, match=">= 0"):
        partition([-1], 4, 16)


# --------------------------------------------------------------------------- policy
def test_lina_policy_holds_for_a2a_block_and_credit():
    p = make_policy(LinaConfig(credit_bytes=100, hold_in_block=True))
    p.begin_step(5)
    p.allreduce_ready(1, 60)
    assert p.next_ops() == []  # fixed order: 0 first
    p.allreduce_ready(0, 60)
    p.a2a_waiting("x", 500)
    launched = p.next_ops()
    assert [(l.kind, l.key) for l in launched] == [("a2a", "x")]  # a2a first, allreduce held
    p.a2a_done("x")
    assert [(l.kind, l.key) for l in p.next_ops()] == [("allreduce", 0)]  # credit: 60 + 60 > 100
    p.allreduce_done(0)
    p.block_begin()
    assert p.next_ops() == []
    p.block_end()
    assert [l.key for l in p.next_ops()] == [1]
    p.allreduce_ready(2, 500)  # larger than the credit: waits until nothing is in flight
    assert p.next_ops() == []
    p.allreduce_done(1)
    assert [l.key for l in p.next_ops()] == [2]
    p.allreduce_done(2)
    p.end_backward()
    p.block_begin()  # ignored once the backward pass has ended
    p.allreduce_ready(3, 90)
    p.allreduce_ready(4, 90)
    assert [l.key for l in p.next_ops()] == [3, 4]  # no credit bound once the backward pass ended
    p.allreduce_done(3)
    p.allreduce_done(4)
    assert p.finished


def test_fifo_and_serial_policies():
    f = make_policy(FifoConfig())
    f.begin_step(2)
    f.a2a_waiting("a")
    f.allreduce_ready(0, 10)
    f.allreduce_ready(1, 10)
    assert [(l.kind, l.key) for l in f.next_ops()] == [("a2a", "a"), ("allreduce", 0), ("allreduce", 1)]
    s = make_policy(SerialConfig())
    s.begin_step(1)
    s.allreduce_ready(0, 10)
    assert s.next_ops() == []
    s.end_backward()
    assert [l.key for l in s.next_ops()] == [0]


def test_policy_errors_speak():
    with pytest.raises(ValueError, match="--schedule lifo is not known"):
        make_policy(SCHEDULES["lifo"]())
    p = Policy(credit_bytes=10)
    p.begin_step(1)
    with pytest.raises(ValueError, match="outside"):
        p.allreduce_ready(3, 1)
    with pytest.raises(ValueError, match="never launched"):
        p.allreduce_done(0)
    with pytest.raises(ValueError, match="never launched"):
        p.a2a_done("nope")


# --------------------------------------------------------------------------- simulator: hand-worked
def _sched(policy: str, *, microop_bytes: int, credit_bytes: int | None = None, hold_in_block: bool = False,
           **kw) -> MicroOpConfig:
    """The schedule the cases below were worked out for: the simulator's former defaults, a
    credit of one micro-op and no hold in expert blocks, unless a case says otherwise."""
    return sched_of(policy, microop_bytes=microop_bytes,
                          credit_bytes=microop_bytes if credit_bytes is None else credit_bytes,
                          hold_in_block=hold_in_block, **kw)


LINK = Link(bandwidth_Bps=1000.0)
HAND = [Compute(1.0, (200,)), AllToAll(500), Compute(1.0, (100,))]


def test_sim_hand_worked_lina():
    r = simulate(HAND, LINK, _sched("lina", microop_bytes=100))
    a2a = r.a2a[0]
    assert (a2a.ready_s, a2a.start_s, a2a.end_s) == (1.0, 1.0, 1.5)  # alone on the link
    ar = sorted(r.allreduce, key=lambda o: o.key)
    assert [x for o in ar for x in (o.start_s, o.end_s)] == pytest.approx([1.5, 1.6, 1.6, 1.7, 2.5, 2.6])
    assert r.compute_end_s == pytest.approx(2.5) and r.step_s == pytest.approx(2.6)


def test_sim_hand_worked_fifo_shares_the_link():
    r = simulate(HAND, LINK, _sched("fifo", microop_bytes=100, bucket_bytes=200))
    a2a = r.a2a[0]
    # bucket 0 (200 B) and the a2a share 1000 B/s: bucket done at 1.4, a2a at 1.7
    assert a2a.end_s == pytest.approx(1.7)
    spans = sorted((o.start_s, o.end_s) for o in r.allreduce)
    assert [x for sp in spans for x in sp] == pytest.approx([1.0, 1.4, 2.7, 2.8])
    assert r.step_s == pytest.approx(2.8)


def test_sim_hand_worked_serial():
    r = simulate(HAND, LINK, _sched("serial", microop_bytes=100))
    assert r.a2a[0].end_s == pytest.approx(1.5)
    assert all(o.start_s == pytest.approx(2.5) for o in r.allreduce)
    assert r.step_s == pytest.approx(2.8)  # three 100 B ops sharing the link from 2.5


# --------------------------------------------------------------------------- simulator: scenarios
_EXPERT_S = 1.0


def _scenario(**kw):
    base = dict(a2a_bytes=4000, expert_s=_EXPERT_S, dense_s=2.0, attn_s=1.5, dense_grad_bytes=6000,
                attn_grad_bytes=3000, router_grad_bytes=400)
    base.update(kw)
    return moe_backward_script(["dense", "moe"] * 3, **base)


SCENARIOS = [
    dict(),
    dict(a2a_chunks=3),
    dict(attn_s=0.2, dense_s=0.3),          # little compute to hide allreduce behind
    dict(dense_grad_bytes=20000),           # allreduce much larger than the all-to-all
]


@pytest.mark.parametrize("kw", SCENARIOS, ids=range(len(SCENARIOS)))
@pytest.mark.parametrize("latency", [0.0, 0.05])
def test_no_a2a_waits_behind_more_than_one_micro_op(kw, latency):
    link = Link(1000.0, latency)
    micro = 500
    r = simulate(_scenario(**kw), link, _sched("lina", microop_bytes=micro))
    assert r.a2a and r.allreduce
    for a in r.a2a:
        during = r.allreduce_during(a)
        assert len(during) <= 1, (a, during)
        assert all(o.start_s < a.ready_s for o in during)  # none launched after the a2a came
        assert a.start_s == a.ready_s
        assert a.end_s - a.ready_s <= link.alone_s(a.nbytes) + link.alone_s(micro) + 1e-9


@pytest.mark.parametrize("kw", SCENARIOS, ids=range(len(SCENARIOS)))
def test_a2a_waits_behind_at_most_the_credit(kw):
    """With a credit of several micro-ops (the executor's default), an all-to-all waits
    behind at most the credit's bytes, all launched before it arrived."""
    micro, credit = 500, 1500
    r = simulate(_scenario(**kw), LINK, _sched("lina", microop_bytes=micro, credit_bytes=credit))
    assert r.a2a and r.allreduce
    assert any(len(r.allreduce_during(a)) > 1 for a in r.a2a)  # more than one micro-op did wait
    for a in r.a2a:
        during = r.allreduce_during(a)
        assert sum(o.nbytes for o in during) <= credit, (a, during)
        assert all(o.start_s < a.ready_s for o in during)
        assert a.end_s - a.ready_s <= LINK.alone_s(a.nbytes) + LINK.alone_s(credit) + 1e-9


@pytest.mark.parametrize("kw", SCENARIOS, ids=range(len(SCENARIOS)))
def test_allreduce_never_starves_once_a2a_finish(kw):
    r = simulate(_scenario(**kw), LINK, _sched("lina", microop_bytes=500))
    last_a2a = max(o.end_s for o in r.a2a)
    assert r.link_idle_with_allreduce_pending(last_a2a) == pytest.approx(0.0, abs=1e-9)
    assert all(math.isfinite(o.end_s) for o in r.allreduce)
    total = sum(o.nbytes for o in r.allreduce)
    assert total == sum(b for it in _scenario(**kw) if isinstance(it, Compute) for b in it.grads)


def test_fifo_violates_what_lina_guarantees():
    """The properties above are not vacuous: fifo breaks them in the same scenario."""
    r = simulate(_scenario(), LINK, _sched("fifo", microop_bytes=500, bucket_bytes=8000))
    assert any(r.a2a[i].end_s - r.a2a[i].ready_s > LINK.alone_s(r.a2a[i].nbytes) + LINK.alone_s(500) + 1e-9
               for i in range(len(r.a2a)))


@pytest.mark.parametrize("kw", SCENARIOS, ids=range(len(SCENARIOS)))
def test_lina_all_to_all_runs_at_its_alone_time_and_step_not_slower(kw):
    script = _scenario(**kw)
    lina = simulate(script, LINK, _sched("lina", microop_bytes=500))
    fifo = simulate(script, LINK, _sched("fifo", microop_bytes=500, bucket_bytes=8000))
    serial = simulate(script, LINK, _sched("serial", microop_bytes=500))
    alone = sum(LINK.alone_s(o.nbytes) for o in serial.a2a)
    assert serial.a2a_time_s == pytest.approx(alone)
    assert lina.a2a_time_s <= alone + len(lina.a2a) * LINK.alone_s(500) + 1e-9
    assert fifo.a2a_time_s > lina.a2a_time_s
    assert lina.step_s <= serial.step_s + 1e-9
    if kw in (SCENARIOS[0], SCENARIOS[1]):  # enough compute to hide the allreduce behind
        assert lina.step_s < fifo.step_s
    else:
        # bandwidth-bound: lina leaves the link idle during expert compute (its price for
        # keeping the next all-to-all clear); it loses at most that much to fifo
        expert_s = 3 * _EXPERT_S  # three MoE blocks
        assert lina.step_s <= fifo.step_s + expert_s + 1e-9


def test_a_new_schedule_is_one_class_one_entry():
    """Adding a gradient schedule: one config class, one SCHEDULES entry; then the
    simulator, the training CLI's --schedule and the option rule take the name."""
    from commsched.moe.train.cli import build_parser
    from tests.priority.test_new_schedule import EagerConfig  # both training CLIs run it there

    script = _scenario()
    with SCHEDULES.registered("eager", EagerConfig):
        cfg = config_of(SCHEDULES, "eager", {"microop_bytes": 500})
        assert type(cfg) is EagerConfig and cfg.policy == "eager" and not isinstance(cfg.build(), OverlapPolicy)
        assert cfg.build().name == "eager" and not make_policy(cfg).hold_for_a2a
        with pytest.raises(ValueError, match="--schedule nope is not known .*eager"):
            SCHEDULES["nope"]
        with pytest.raises(ValueError, match="--credit-bytes belongs to --schedule lina, lina-overlap, not to "
                                             "--schedule eager"):
            config_of(SCHEDULES, "eager", {"credit_bytes": 1})
        eager = simulate(script, LINK, cfg)
        assert eager.schedule == "eager"
        assert build_parser().parse_args(["--schedule", "eager", "--out", "o"]).schedule == "eager"
    lina = simulate(script, LINK, _sched("lina", microop_bytes=500))
    # the same micro-ops as lina, launched at once: the all-to-alls share the link with them
    assert sorted(o.nbytes for o in eager.allreduce) == sorted(o.nbytes for o in lina.allreduce)
    assert any(eager.allreduce_during(a) for a in eager.a2a)
    assert eager.a2a_time_s > lina.a2a_time_s
    assert "eager" not in SCHEDULES and [SCHEDULES[n].name for n in SCHEDULES] == list(SCHEDULES)
    with pytest.raises(ValueError, match="--schedule eager is not known"):
        SCHEDULES["eager"]


def _block_windows(script, r):
    """(arrival of a block's first a2a, end of its last a2a) of every expert block."""
    blocks, idx, start = [], 0, None
    for it in script:
        if isinstance(it, BlockBegin):
            start = r.a2a[idx].ready_s
        elif isinstance(it, AllToAll):
            idx += 1
        elif isinstance(it, BlockEnd):
            blocks.append((start, r.a2a[idx - 1].end_s))
    return blocks


def test_lina_policy_without_hold_in_block_runs_allreduce_during_expert_compute():
    p = make_policy(LinaConfig(credit_bytes=100, hold_in_block=False))
    p.begin_step(1)
    p.allreduce_ready(0, 60)
    p.block_begin()
    assert [l.key for l in p.next_ops()] == [0]  # no all-to-all on the wire: the gap is used
    p.a2a_waiting("y", 10)
    p.allreduce_done(0)
    assert [(l.kind, l.key) for l in p.next_ops()] == [("a2a", "y")]


def test_allreduce_fills_expert_compute_unless_held():
    script = _scenario(a2a_chunks=2)
    free = simulate(script, LINK, _sched("lina", microop_bytes=500))
    held = simulate(script, LINK, _sched("lina", microop_bytes=500, hold_in_block=True))
    blocks = _block_windows(script, free)
    assert any(s < o.start_s < e for s, e in blocks for o in free.allreduce)
    assert free.step_s <= held.step_s + 1e-9


def test_no_allreduce_starts_inside_an_expert_block():
    script = _scenario()
    r = simulate(script, LINK, _sched("lina", microop_bytes=500, hold_in_block=True))
    blocks = _block_windows(script, r)
    assert len(blocks) == 3
    for s, e in blocks:
        assert not any(s < o.start_s < e for o in r.allreduce), (s, e)


def test_sim_is_deterministic_and_validates():
    a = simulate(_scenario(), LINK, _sched("lina", microop_bytes=500))
    b = simulate(_scenario(), LINK, _sched("lina", microop_bytes=500))
    assert [(o.kind, o.key, o.start_s, o.end_s) for o in a.ops] == [(o.kind, o.key, o.start_s, o.end_s) for o in b.ops]
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0.0)
    with pytest.raises(ValueError, match="multiples"):
        simulate([Compute(1.0, (3,))], LINK, _sched("lina", microop_bytes=100))
    with pytest.raises(ValueError, match="--schedule random is not known"):
        simulate(HAND, LINK, _sched("random", microop_bytes=100))


# --------------------------------------------------------------------------- one schedule config
def test_policies_table_builds_every_policy_from_the_config():
    assert tuple(SCHEDULES) == ("lina", "fifo", "serial", "lina-overlap", "flat")
    cfg = LinaConfig()
    assert (cfg.policy, cfg.credit, cfg.hold_in_block) == ("lina", DEFAULT_CREDIT_MICROOPS * (256 << 10), True)
    for name in SCHEDULES:
        p = make_policy(sched_of(name, microop_bytes=1024))
        assert p.name == name
    lina = make_policy(LinaConfig(microop_bytes=1024, hold_in_block=False))
    assert (lina.credit_bytes, lina.hold_in_block, lina.hold_for_a2a) == (DEFAULT_CREDIT_MICROOPS * 1024, False, True)
    assert make_policy(FifoConfig()).credit_bytes is None
    assert make_policy(SerialConfig()).defer_to_end
    assert make_policy(FlatConfig()).defer_to_end and len(FlatConfig().allreduce_ops([3, 0, 5], 4)) == 1
    with pytest.raises(ValueError, match="at least one element"):
        LinaConfig(microop_bytes=2)
    with pytest.raises(ValueError, match="credit_bytes"):
        LinaConfig(credit_bytes=0)


def test_simulator_defaults_are_the_executors():
    """With no config the simulator runs what the executor runs by default: the credit of
    DEFAULT_CREDIT_MICROOPS micro-ops and the hold inside expert blocks."""
    script = _scenario()
    r = simulate(script, LINK, LinaConfig(microop_bytes=500))
    assert r.schedule == "lina"
    for s, e in _block_windows(script, r):
        assert not any(s < o.start_s < e for o in r.allreduce), (s, e)
    for a in r.a2a:
        assert sum(o.nbytes for o in r.allreduce_during(a)) <= DEFAULT_CREDIT_MICROOPS * 500
    default = simulate(HAND, LINK)
    assert default.schedule == "lina" and len(default.allreduce) == 2  # 200 B and 100 B, each one micro-op


# --------------------------------------------------------------------------- the 'program' launch rule (CUDA's)
def test_program_rule_budget_per_gap_ignores_completions():
    """Under 'program' at most gap_budget micro-ops go out per gap between all-to-alls, and
    a completion never launches anything (it is not a point every rank shares)."""
    cfg = LinaConfig(microop_bytes=100, credit_bytes=200, hold_in_block=False, launch="program")
    assert cfg.gap_budget == 2
    p = make_policy(cfg)
    assert p.gap_budget == 2
    p.begin_step(6)
    for s in range(4):
        p.allreduce_ready(s, 100)
    assert [l.key for l in p.next_ops()] == [0, 1]  # the budget of this gap
    p.allreduce_done(0)
    p.allreduce_done(1)
    assert p.next_ops() == []  # completions free no budget
    p.a2a_waiting("a")
    assert [l.kind for l in p.next_ops()] == ["a2a"]
    p.a2a_done("a")  # a new gap
    assert [l.key for l in p.next_ops()] == [2, 3]
    p.allreduce_ready(4, 100)
    p.allreduce_ready(5, 100)
    assert p.next_ops() == []
    p.end_backward()
    assert [l.key for l in p.next_ops()] == [4, 5]  # nothing is held after the backward pass
    for s in (2, 3, 4, 5):
        p.allreduce_done(s)
    assert p.finished


def test_launch_rule_follows_the_device_unless_set():
    cfg = LinaConfig()
    assert (cfg.launch_rule("cpu"), cfg.launch_rule("cuda")) == ("completion", "program")
    assert make_policy(cfg).gap_budget is None                       # the simulator's and gloo's
    assert make_policy(cfg, "cuda").gap_budget == DEFAULT_CREDIT_MICROOPS  # the executor's on CUDA
    assert LinaConfig(launch="completion").launch_rule("cuda") == "completion"
    assert make_policy(FifoConfig(), "cuda").gap_budget is None  # fifo never depends on completions
    with pytest.raises(ValueError, match="--launch must be one of completion, program, got 'eager'"):
        LinaConfig(launch="eager")


@pytest.mark.parametrize("kw", SCENARIOS, ids=range(len(SCENARIOS)))
def test_sim_program_rule_bounds_launches_per_gap_and_finishes(kw):
    """The simulator runs the executor's CUDA rule from the same config: every allreduce is
    done, none starts inside an all-to-all, and between two all-to-alls of the backward
    pass at most gap_budget micro-ops start."""
    script = _scenario(**kw)
    cfg = LinaConfig(microop_bytes=500, credit_bytes=1500, hold_in_block=False, launch="program")
    r = simulate(script, LINK, cfg)
    assert all(math.isfinite(o.end_s) for o in r.allreduce)
    assert sum(o.nbytes for o in r.allreduce) == sum(b for it in script if isinstance(it, Compute) for b in it.grads)
    a2a = sorted(r.a2a, key=lambda o: o.ready_s)
    for a in a2a:
        assert not any(a.ready_s < o.start_s < a.end_s for o in r.allreduce)
    for prev, nxt in zip(a2a, a2a[1:]):
        started = [o for o in r.allreduce if prev.end_s <= o.start_s < nxt.ready_s]
        assert len(started) <= cfg.gap_budget, (prev, nxt, started)
