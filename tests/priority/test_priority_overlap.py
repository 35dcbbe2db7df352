"""``lina-overlap``: the policy and the simulator (pure, ms). The reduction's tail runs into
the next forward pass in the order that forward needs the parameters, all-to-all first."""

from __future__ import annotations

import pytest

from commsched.priority.policy import OverlapPolicy, ScheduleConfig, make_policy
from commsched.priority.sim import (
    AllToAll,
    EndBackward,
    Link,
    Need,
    forward_script,
    moe_backward_script,
    simulate,
)

LINK = Link(1000.0)
LAYERS = ["dense", "moe", "dense", "moe"]
MICRO = 500


def _tensors_per_block(layers, router: bool = True) -> list[list[int]]:
    """Gradient tensor indices of every block (first block first), in the readiness order
    of moe_backward_script: the last block's FFN (or router), then its attention, ..."""
    per = {}
    t = 0
    for i in reversed(range(len(layers))):
        n = 2 if (layers[i] == "dense" or router) else 1
        per[i] = list(range(t, t + n))
        t += n
    return [per[i] for i in range(len(layers))]


def _step(**kw) -> list:
    """One backward pass, then the next step's forward pass (link-bound: the allreduce
    outlasts the backward pass)."""
    base = dict(a2a_bytes=2000, expert_s=0.5, dense_s=1.0, attn_s=0.8, dense_grad_bytes=6000,
                attn_grad_bytes=3000, router_grad_bytes=400, a2a_chunks=2)
    base.update(kw)
    fwd = dict(a2a_bytes=base["a2a_bytes"], expert_s=base["expert_s"], dense_s=base["dense_s"] / 2,
               attn_s=base["attn_s"] / 2, a2a_chunks=base["a2a_chunks"])
    return (moe_backward_script(LAYERS, **base) + [EndBackward()]
            + forward_script(LAYERS, tensors_per_block=_tensors_per_block(LAYERS), **fwd))


SCENARIOS = [dict(), dict(a2a_chunks=1, a2a_bytes=4000), dict(dense_grad_bytes=12000), dict(attn_s=0.2, dense_s=0.3)]


def _cfg(name: str, **kw) -> ScheduleConfig:
    return ScheduleConfig(policy=name, microop_bytes=MICRO, **{"credit_bytes": 3 * MICRO, **kw})


def _prio_of(script, r, cfg):
    """Priority (block of the first Need) of every allreduce operation of the run."""
    from commsched.priority.policy import allreduce_ops

    grads = [b for it in script if hasattr(it, "grads") for b in it.grads]
    ops = allreduce_ops([b // 4 for b in grads], 4, cfg)
    first = {}
    for i, it in enumerate(it for it in script if isinstance(it, Need)):
        for t in it.tensors:
            first.setdefault(t, i)
    return {op.seq: min(first[t] for t in op.tensors) for op in ops}


# --------------------------------------------------------------------------- policy
def test_overlap_policy_is_lina_in_backward_then_the_tail_by_priority():
    p = make_policy(_cfg("lina-overlap", credit_bytes=100))
    assert isinstance(p, OverlapPolicy) and p.wants_agreement
    p.set_priorities([3, 2, 1, 0])  # op 3 is needed first, op 0 last
    p.begin_step(4)
    for s in range(4):
        p.allreduce_ready(s, 60)
    assert [l.key for l in p.next_ops()] == [0]  # lina: credit of 100 B, one 60 B op in flight
    p.end_backward()
    assert p.next_ops() == []  # nothing goes before the ranks agree
    with pytest.raises(ValueError, match="outside"):
        p.agree(0)  # below what this rank launched
    p.agree(2)  # another rank had launched 0 and 1: catch up with 1 first, then 3, then 2
    assert p.tail_order == (1, 3, 2)
    p.allreduce_done(0)
    assert [l.key for l in p.next_ops()] == [1]
    p.a2a_waiting("fwd", 10)  # the next forward pass's all-to-all: it goes, allreduce waits
    p.allreduce_done(1)
    assert [(l.kind, l.key) for l in p.next_ops()] == [("a2a", "fwd")]
    p.a2a_done("fwd")
    assert [l.key for l in p.next_ops()] == [3]
    p.allreduce_done(3)
    assert [l.key for l in p.next_ops()] == [2]
    p.allreduce_done(2)
    assert p.reduced and p.finished and p.allreduce_pending == 0
    with pytest.raises(ValueError, match="twice"):
        p.agree(4)


def test_overlap_policy_program_rule_agrees_by_itself_and_need_forces():
    p = make_policy(_cfg("lina-overlap", launch="program"))
    assert not p.wants_agreement and p.gap_budget == 3
    p.set_priorities([5, 4, 3, 2, 1, 0])
    p.begin_step(6)
    for s in range(6):
        p.allreduce_ready(s, MICRO)
    p.a2a_waiting("bwd")
    p.next_ops()
    p.end_backward()  # nothing launched in backward (an all-to-all was in flight)
    assert p.tail_order == (5, 4, 3, 2, 1, 0)
    assert [l.key for l in p.next_ops()] == []  # the all-to-all still holds them
    p.a2a_done("bwd")
    assert [l.key for l in p.next_ops()] == [5, 4, 3]  # the gap budget, completions or not
    p.need([1])  # the forward pass waits for op 1: everything before it in the order goes now
    assert [l.key for l in p.next_ops()] == [2, 1]
    with pytest.raises(ValueError, match="priorities"):
        p.set_priorities([0, 1])


def test_overlap_policy_keeps_the_sequence_without_priorities_and_checks_its_input():
    p = make_policy(_cfg("lina-overlap"))
    p.begin_step(3)
    with pytest.raises(ValueError, match="before end_backward"):
        p.agree(0)
    p.end_backward()
    p.agree(0)
    assert p.tail_order == (0, 1, 2)
    p.set_priorities([0, 1, 2])
    with pytest.raises(ValueError, match="3 priorities for 2 allreduce"):
        p.begin_step(2)
    assert ScheduleConfig(policy="lina-overlap").overlapped and not ScheduleConfig(policy="lina").overlapped
    assert not ScheduleConfig(policy="lina-overlap").fused  # micro-ops, as lina


# --------------------------------------------------------------------------- simulator
@pytest.mark.parametrize("kw", SCENARIOS, ids=range(len(SCENARIOS)))
def test_tail_goes_in_the_forward_order_and_the_forward_never_waits_for_less(kw):
    """After the backward pass the micro-ops start in the order of the block that needs
    them (catching up first with none: one rank); while the forward pass waits for a
    block's parameters the link is never idle and carries nothing needed later that started
    before one of that block's micro-ops."""
    script = _step(**kw)
    cfg = _cfg("lina-overlap")
    r = simulate(script, LINK, cfg)
    prio = _prio_of(script, r, cfg)
    tail = sorted((o for o in r.allreduce if o.start_s >= r.backward_end_s), key=lambda o: (o.start_s, o.key))
    assert tail and [prio[o.key] for o in tail] == sorted(prio[o.key] for o in tail)
    waited = [(i, a, b) for i, a, b in r.needs if b > a + 1e-9]
    assert waited  # link-bound: the forward pass does wait for some parameters
    for i, a, b in waited:
        busy = sorted((max(a, o.start_s), min(b, o.end_s)) for o in r.allreduce if o.start_s < b and o.end_s > a)
        assert busy and busy[0][0] <= a + 1e-9 and max(e for _, e in busy) >= b - 1e-9
        reach = a
        for s, e in busy:  # no gap inside [a, b]
            assert s <= reach + 1e-9, (i, busy)
            reach = max(reach, e)
        need = script[i]
        need_prio = {prio[o.key] for o in r.allreduce if any(t in need.tensors for t in _tensors_of(script, o.key))}
        later = [o for o in tail if prio[o.key] > max(need_prio) and o.start_s < b]
        first_needed = min(o.start_s for o in tail if prio[o.key] in need_prio) if any(
            prio[o.key] in need_prio for o in tail) else -1.0
        assert all(o.start_s >= first_needed for o in later), (i, later)


def _tensors_of(script, seq):
    from commsched.priority.policy import allreduce_ops

    grads = [b for it in script if hasattr(it, "grads") for b in it.grads]
    return allreduce_ops([b // 4 for b in grads], 4, _cfg("lina-overlap"))[seq].tensors


@pytest.mark.parametrize("kw", SCENARIOS, ids=range(len(SCENARIOS)))
@pytest.mark.parametrize("launch", ["completion", "program"])
def test_all_to_all_never_waits_behind_more_than_the_credit_forward_included(kw, launch):
    cfg = _cfg("lina-overlap", launch=launch)
    r = simulate(_step(**kw), LINK, cfg)
    fwd_a2a = [a for a in r.a2a if a.ready_s >= r.backward_end_s]
    assert fwd_a2a and len(r.needs) == len(LAYERS)
    limit = cfg.credit if launch == "completion" else cfg.gap_budget * MICRO
    for a in r.a2a:
        during = r.allreduce_during(a)
        assert sum(o.nbytes for o in during) <= limit, (a, during)
        assert all(o.start_s < a.ready_s for o in during)  # none launched once it arrived
    assert any(r.allreduce_during(a) for a in fwd_a2a)  # the tail did reach the forward pass


@pytest.mark.parametrize("kw", SCENARIOS, ids=range(len(SCENARIOS)))
def test_overlap_starts_the_next_forward_inside_the_tail_and_ends_sooner(kw):
    """lina waits for every gradient (its optimizer steps after the whole reduction), so its
    first block starts after the last micro-op; lina-overlap starts it inside the tail, the
    backward pass and the next forward pass end sooner, and ordering the tail matters."""
    script = _step(**kw)
    lina = simulate(script, LINK, _cfg("lina"))
    over = simulate(script, LINK, _cfg("lina-overlap"))
    last_ar = max(o.end_s for o in over.allreduce)
    assert lina.needs[0][2] == pytest.approx(max(o.end_s for o in lina.allreduce))
    assert over.needs[0][2] < last_ar - 1e-9  # the first block starts while the tail is on the link
    assert over.script_end_s < lina.script_end_s - 1e-9
    # the same schedule with the tail in sequence order (no forward order known): the first
    # block, whose gradients came last, starts later
    seq_order = simulate(script, LINK, _cfg("lina-overlap"), order_tail=False)
    assert over.needs[0][2] < seq_order.needs[0][2] - 1e-9


def test_sim_overlap_input_errors():
    with pytest.raises(ValueError, match="outside"):
        simulate([EndBackward(), Need((3,))], LINK, _cfg("lina-overlap"))
    with pytest.raises(ValueError, match="before EndBackward"):
        simulate([Need(())], LINK, _cfg("lina-overlap"))
    r = simulate([AllToAll(100), EndBackward(), Need(())], LINK, _cfg("lina-overlap"))
    assert r.needs == [(2, r.backward_end_s, r.backward_end_s)]
