"""Expert loads of the inference runtime: resident experts as a cache (keep_resident), the
load time from a GPU model's host link, and online plans weighed against their loads
(plan_cost). Pure functions and the strategies on hand-made loads; no processes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from commsched.cluster.device import load_device_model
from commsched.moe.infer.banks import EmulatedBank, expert_bytes
from commsched.moe.infer.policy import STRATEGIES, keep_resident, plan_cost
from commsched.moe.placement import greedy_placement


def test_keep_resident_by_hand():
    # held first (ascending), then the others most recent first, cut at the capacity
    assert keep_resident((), [2, 0], 3) == ((0, 2), (0, 2))
    assert keep_resident((0, 2), [1], 3) == ((1, 0, 2), (1,))
    assert keep_resident((1, 0, 2), [3, 2], 3) == ((2, 3, 1), (3,))  # 0 least recently held: evicted
    assert keep_resident((2, 3, 1), [1, 2, 3], 3) == ((1, 2, 3), ())  # all resident: nothing loaded
    # capacity = the held set: exactly the held experts stay (the runtime's old behaviour)
    assert keep_resident((0, 1), [1, 2], 2) == ((1, 2), (2,))
    with pytest.raises(ValueError, match="3 experts do not fit 2"):
        keep_resident((), [0, 1, 2], 2)


def test_plan_cost_is_the_busiest_device_with_its_loads():
    # device 0: 10 rows, 2 loads; device 1: 12 rows, none
    assert plan_cost([10, 12], [(1, 2), ()], 1.0, 0.0) == 12.0
    assert plan_cost([10, 12], [(1, 2), ()], 1.0, 1.5) == 13.0
    assert plan_cost([10, 12], [(1, 2), ()], 0.5, 4.0) == 13.0
    with pytest.raises(ValueError, match="2 device loads but loads for 1"):
        plan_cost([1, 2], [()], 1.0, 1.0)
    with pytest.raises(ValueError, match="non-negative"):
        plan_cost([1, 2], [(), ()], -1.0, 1.0)


def _oracle(**kw):
    sizes = dict(num_experts=4, num_devices=2, num_layers=1, k=1, slots=3)
    sizes.update(kw)
    return STRATEGIES["oracle"]().build(**sizes)


def test_a_plan_not_worth_its_loads_is_not_taken():
    a = np.array([9.0, 1.0, 1.0, 1.0])
    b = np.array([1.0, 1.0, 9.0, 1.0])  # the hot expert moves to one held by a single device
    # without costs (the default) every plan is taken: the second batch loads experts
    free = _oracle()
    free.decide(0, None, a)
    d = free.decide(0, None, b)
    assert d.replanned and d.placement.max_load == greedy_placement(b, 2, 3).max_load
    assert sum(len(x) for x in d.loads_N) > 0
    # a load costs 100 rows: the new plan saves fewer rows than its loads cost, so it is kept
    dear = _oracle(row_cost_s=1e-3, load_cost_s=0.1)
    first = dear.decide(0, None, a)
    assert first.replanned  # nothing to keep yet: the first plan is taken
    assert first.placement.with_load(b).max_load > greedy_placement(b, 2, 3).max_load  # a re-plan would balance
    d = dear.decide(0, None, b)
    assert not d.replanned and d.loads_N == ((), ())
    assert d.placement.replicas == first.placement.replicas
    assert d.placement.device_load == first.placement.with_load(b).device_load
    # a cheap load (a tenth of a row): the balance is worth it
    cheap = _oracle(row_cost_s=1e-3, load_cost_s=1e-4)
    cheap.decide(0, None, a)
    d = cheap.decide(0, None, b)
    assert d.replanned and d.placement.max_load < first.placement.with_load(b).max_load


def test_lina_phase2_weighs_the_replan_against_phase1():
    hist = np.array([[4.0, 3.0, 2.0, 1.0]])
    est = np.array([0.0, 0.0, 1.0, 9.0])
    actual = [9.0, 1.0, 0.0, 0.0]  # top-2 overlap 0: phase 2 would re-plan
    sizes = dict(num_experts=4, num_devices=2, num_layers=1, k=1, slots=3, historical_LE=hist)
    dear = STRATEGIES["lina"](threshold=1.0).build(row_cost_s=1e-3, load_cost_s=1.0, **sizes)
    p1, _ = dear.phase1(0, est)
    d = dear.decide(0, p1, actual, est)
    assert not d.replanned and d.overlap == 0.0 and d.loads_N == ((), ())
    free = STRATEGIES["lina"](threshold=1.0).build(**sizes)
    p1, _ = free.phase1(0, est)
    assert free.decide(0, p1, actual, est).replanned


def test_every_expert_resident_means_no_loads_after_the_first():
    rng = np.random.default_rng(0)
    batches = [rng.permutation([9.0, 3.0, 1.0, 1.0]) for _ in range(12)]

    def loads(**kw):
        o = _oracle(**kw)
        return [sum(len(x) for x in o.decide(0, None, b).loads_N) for b in batches], o

    cached, o = loads(resident=4)  # R = E: every expert of the layer fits, preloaded: no loads at all
    assert o.preloaded and cached == [0] * len(batches)
    assert all(sorted(r) == [0, 1, 2, 3] for r in o.resident[0])
    assert all(d.replanned for d in (o.decide(0, None, b) for b in batches[:3]))  # nothing stops a re-plan
    evicting, o3 = loads()  # R = S = 3: experts are evicted and loaded again
    assert not o3.preloaded and sum(evicting) > 4
    with pytest.raises(ValueError, match="resident experts per layer"):
        _oracle(resident=2)  # fewer than the slots


def test_emulated_bank_loads_the_experts_bytes_over_the_host_link():
    a100 = load_device_model("a100")
    D, H, k = 768, 3072, 200.0
    assert expert_bytes(D, H) == 2 * (2 * D * H + H + D)
    assert expert_bytes(D, H, 4) == 2 * expert_bytes(D, H)
    with pytest.raises(ValueError, match="d, hidden and dtype_bytes"):
        expert_bytes(0, H)
    bank = EmulatedBank(1, 4, D, 3, us_per_row=0.0, load_ms=None, seed=0, device_model=a100, dilation=k, hidden=H)
    assert bank.load_ms == pytest.approx(1e3 * a100.h2d_time(expert_bytes(D, H)))
    assert bank.load_cost_s() == pytest.approx(k * a100.h2d_time(expert_bytes(D, H)))
    assert 0.3 < bank.load_ms < 0.4  # ~9.4 MB over ~25.6 GB/s, not a set 1 ms
    # an explicit load time wins over the link
    assert EmulatedBank(1, 4, D, 3, us_per_row=0.0, load_ms=2.0, seed=0, device_model=a100, dilation=k,
                        hidden=H).load_cost_s() == pytest.approx(2e-3 * k)
    with pytest.raises(ValueError, match="--load-ms.*--device-model"):
        EmulatedBank(1, 4, D, 3, us_per_row=1.0, load_ms=None, seed=0)
    # the bank is a cache of 3 slots, as the strategies count it
    small = EmulatedBank(1, 4, 2, 3, us_per_row=0.0, load_ms=0.0, seed=0)
    assert [small.ensure(0, h) for h in ([0, 1], [2], [1, 2], [3])] == [2, 1, 0, 1]
    assert small.order[0] == (3, 1, 2) and small.resident[0] == {1, 2, 3}
    small.compute(0)([1, 2], [1, 1], torch.ones(2, 2))  # 1 and 2 are still resident
    with pytest.raises(ValueError, match="4 experts do not fit 3 slots"):
        small.preload(0)
    # every expert fits: preloaded at start-up without a load counted or slept
    slow = EmulatedBank(2, 4, 2, 4, us_per_row=0.0, load_ms=1e4, seed=0)
    slow.preload(1)
    assert slow.resident[1] == {0, 1, 2, 3} and slow.loaded_L == [0, 0]
    assert slow.ensure(1, [3, 0]) == 0 and slow.resident[1] == {0, 1, 2, 3}  # nothing evicted


def test_build_preloads_when_every_expert_fits():
    from commsched.moe.infer.cli import build_parser, config_from_args
    from commsched.moe.infer.drivers import build

    def setup(*flags):
        cfg = config_from_args(build_parser().parse_args(
            ["--experts", "8", "--layers", "2", "--batches", "2", "--warmup", "0", "--out", "x", *flags]))
        return build(cfg, 0, 4, "cpu")

    s = setup("--resident", "20")  # more than E: every expert, preloaded
    assert (s.slots, s.resident) == (4, 8) and s.bank.resident == [set(range(8))] * 2
    assert s.bank.loaded_L == [0, 0]
    s = setup()  # R = S = 4 < 8: nothing resident before the first plan
    assert (s.slots, s.resident) == (4, 4) and s.bank.resident == [set(), set()]
    with pytest.raises(ValueError, match="at least the slots per device \\(4\\)"):
        setup("--resident", "3")


def test_a_model_file_without_a_host_link_needs_load_ms(tmp_path):
    from commsched.moe.infer.cli import build_parser, config_from_args

    d = load_device_model("a100").to_dict()
    del d["host_link_bw"]
    p = tmp_path / "nolink.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="no host_link_bw.*--load-ms"):
        config_from_args(build_parser().parse_args(["--device-model", str(p), "--out", "x"]))
    cfg = config_from_args(build_parser().parse_args(["--device-model", str(p), "--load-ms", "0.4", "--out", "x"]))
    assert cfg.emulation.load_ms == 0.4
    with pytest.raises(ValueError, match="--resident \\(2\\) must be at least --slots \\(3\\)"):
        config_from_args(build_parser().parse_args(["--slots", "3", "--resident", "2", "--out", "x"]))
    with pytest.raises(ValueError, match="--resident must be an int >= 1"):
        config_from_args(build_parser().parse_args(["--resident", "0", "--out", "x"]))
