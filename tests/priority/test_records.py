"""The timeline records' pure figures: the per-exchange contention of the Lina paper."""

from __future__ import annotations

import pytest

from commsched.priority.runtime.records import OpRecord, contended_slowdowns


def _a2a(key: int, start: float, end: float) -> OpRecord:
    return OpRecord("a2a", key, 1 << 20, ready_s=start, start_s=start, end_s=end)


def _ar(key: int, start: float, end: float) -> OpRecord:
    return OpRecord("allreduce", key, 1 << 20, ready_s=start, start_s=start, end_s=end)


def test_only_exchanges_beside_an_allreduce_count_each_against_itself_alone():
    # exchange 0 alone in the step (forward), 1 wholly beside an allreduce, 2 a quarter beside one
    step = [_a2a(0, 0.0, 1.0), _a2a(1, 2.0, 4.0), _ar(0, 1.5, 4.5), _a2a(2, 5.0, 6.0), _ar(1, 5.75, 7.0)]
    alone = [_a2a(0, 0.0, 1.0), _a2a(1, 2.0, 3.0), _a2a(2, 4.0, 5.0)]
    assert contended_slowdowns(step, alone) == pytest.approx([2.0])
    # a lower bar admits the third exchange (slowed 1x: it took its time alone)
    assert contended_slowdowns(step, alone, min_overlap=0.25) == pytest.approx([2.0, 1.0])


def test_overlapping_allreduces_are_counted_once_and_queueing_is_left_out():
    # two allreduces over the same span cover the exchange once, not twice; the exchange
    # waited in the queue from 0 to 1 (ready to launch): only its time on the wire counts
    a = OpRecord("a2a", 0, 1, ready_s=0.0, start_s=1.0, end_s=4.0)
    step = [a, _ar(0, 1.0, 2.0), _ar(1, 1.0, 2.0), _ar(2, 2.0, 3.0)]
    assert contended_slowdowns(step, [_a2a(0, 0.0, 1.5)]) == pytest.approx([2.0])


def test_steps_whose_exchanges_do_not_pair_give_nothing():
    step = [_a2a(0, 0.0, 2.0), _ar(0, 0.0, 2.0)]
    assert contended_slowdowns(step, []) == []
    assert contended_slowdowns(step, [_a2a(0, 0.0, 1.0), _a2a(1, 1.0, 2.0)]) == []
    assert contended_slowdowns([], []) == []
