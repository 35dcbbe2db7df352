"""MoE inference runtime: pure counting and policy on hand-worked examples, then the
distributed runtime against the single-process model on 2 and 4 gloo ranks (every
strategy, both drivers, emulated and real experts, a rank without tokens)."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np
import pytest
import torch

from commsched.moe.infer.placed import (
    own_split,
    placed_moe,
    placed_moe_local,
    recv_matrix,
    regroup_order,
    replica_share,
    send_order,
)
from commsched.moe.infer.policy import (
    STRATEGIES,
    default_slots,
    placement_digest,
    relabel,
)
from commsched.moe.placement import (
    Placement,
    eplb_placement,
    greedy_placement,
    split_offsets,
    split_tokens,
    static_placement,
)
from tests.mp import assert_case, run_cases


def layout(replicas, N, S) -> Placement:
    return Placement(tuple(tuple(r) for r in replicas), (0.0,) * N, S)


# --------------------------------------------------------------------------- counting (pure)
def test_replica_share_by_hand_and_brute_force():
    # positions 5..11 over 3 replicas: 5%3=2, 6->0, 7->1, 8->2, 9->0, 10->1, 11->2
    assert [int(replica_share(5, 7, 3, i)) for i in range(3)] == [2, 2, 3]
    assert int(replica_share(0, 0, 2, 1)) == 0
    for off, cnt, r in itertools.product(range(7), range(9), range(1, 5)):
        for i in range(r):
            want = sum(1 for j in range(off, off + cnt) if j % r == i)
            assert int(replica_share(off, cnt, r, i)) == want, (off, cnt, r, i)


@pytest.mark.parametrize("host_local, shares", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["flat", "host-local", "flat-shares", "host-local-shares"])
def test_recv_matrix_matches_what_senders_send(host_local, shares):
    """``shares``: placements with two shares of an expert on one device (the device appears
    twice in its replicas: it receives twice the rows of one share)."""
    rng = np.random.default_rng(3)
    dups = 0
    for _ in range(20):
        N, E = int(rng.integers(2, 5)), int(rng.integers(2, 9))
        S = default_slots(E, N)
        counts = rng.integers(0, 6, size=(N, E))
        hosts = tuple(d * 2 // N for d in range(N)) if host_local else None
        load = counts.sum(axis=0) + rng.random(E)
        if shares:  # EPLB's layout with its two-replicas-on-one-device kept
            q = eplb_placement(load, N, S).shares(load)
            p = Placement(q.replicas, q.device_load, S, hosts)
            dups += p.duplicates
        else:
            p = greedy_placement(load, N, S, device_host=hosts, cross_weight=0.5 if host_local else 0.0)
        assert p.device_host == hosts
        off = split_offsets(counts, p)
        sent = np.zeros((N, N, E), dtype=int)  # [source, device, expert]
        for src in range(N):
            ex = np.repeat(np.arange(E), counts[src])
            rng.shuffle(ex)  # any token order: the i-th token of e takes position off + i
            dev = split_tokens(ex, p, off[src], source=src)
            np.add.at(sent, (src, dev, ex), 1)
            if host_local:  # a host holding the expert keeps its tokens
                assert all(p.device_host[d] == p.device_host[src] for d, e in zip(dev, ex)
                           if p.device_host[src] in {p.device_host[x] for x in p.replicas[e]})
            order, send_N = send_order(ex, p, off[src], src)
            assert send_N.tolist() == sent[src].sum(axis=1).tolist()
            assert (np.diff(dev[order] * E + ex[order]) >= 0).all()  # grouped by device, then expert
        for d in range(N):
            experts, rows = recv_matrix(counts, p, d)
            assert experts == list(p.device_experts[d])
            assert rows.tolist() == sent[:, d, experts].tolist()
        # every token lands on exactly one device; replicas of e share it within one token
        tot = sent.sum(axis=0)  # [device, expert]
        assert tot.sum() == counts.sum()
        for e, devs in enumerate(p.replicas):
            if host_local or len(set(devs)) < len(devs):  # within each group of ranks that split
                continue                                  # over the same replicas; one share each
            got = tot[list(devs), e]
            assert got.max() - got.min() <= 1
    assert dups > 0 or not shares  # the shares case did put two shares on one device


def test_regroup_order_by_hand_and_brute_force():
    # sources 0, 1; experts a, b: received rows are [0a 0a | 0b | 1a | 1b 1b] = rows 0..5
    assert regroup_order(np.array([[2, 1], [1, 2]])).tolist() == [0, 1, 3, 2, 4, 5]
    assert regroup_order(np.zeros((3, 0), dtype=int)).tolist() == []
    rng = np.random.default_rng(5)
    for _ in range(30):
        rows = rng.integers(0, 4, size=(int(rng.integers(1, 5)), int(rng.integers(1, 5))))
        P, M = rows.shape
        tags = [(p, m) for p in range(P) for m in range(M) for _ in range(rows[p, m])]  # received order
        want = sorted(range(len(tags)), key=lambda i: (tags[i][1], tags[i][0], i))
        assert regroup_order(rows).tolist() == want


def test_own_split_by_hand():
    # own rows 3, 0, 4, 1 of experts 2, 5, 7, 9: half = 4 rows first, in expert order
    first, last = own_split([2, 5, 7, 9], [3, 0, 4, 1])
    assert first.tolist() == [3, 0, 1, 0] and last.tolist() == [0, 0, 3, 1]
    # expert 2 still loading: its rows wait for the second part
    first, last = own_split([2, 5, 7, 9], [3, 0, 4, 1], loading={2})
    assert first.tolist() == [0, 0, 4, 0] and last.tolist() == [3, 0, 0, 1]
    first, last = own_split([1, 2], [5, 2], share=1.0)  # everything first
    assert first.tolist() == [5, 2] and last.tolist() == [0, 0]
    first, last = own_split([1, 2], [5, 2], loading={1, 2})  # nothing resident: all last
    assert first.tolist() == [0, 0] and last.tolist() == [5, 2]
    assert [x.tolist() for x in own_split([], [])] == [[], []]
    with pytest.raises(ValueError, match="one count"):
        own_split([1, 2], [3])
    with pytest.raises(ValueError, match="share"):
        own_split([1], [3], share=1.5)


class _RecordingDevice:
    """An asynchronous device of the test: compute only records; wait() records too."""

    def __init__(self):
        self.log, self._n = [], 0

    def compute(self, experts, counts, x):
        self._n += 1
        self.log.append(("compute", tuple(experts), tuple(counts)))
        idx = torch.repeat_interleave(torch.tensor(list(experts), dtype=torch.int64),
                                      torch.tensor(list(counts), dtype=torch.int64))
        return x * (1.0 + idx.unsqueeze(1))

    def issued(self) -> float:
        return float(self._n)

    def reset(self) -> None:
        self.log, self._n = [], 0

    def wait(self, token: float) -> None:
        self.log.append(("wait", token))


def test_pipelined_one_device_order_of_work_and_result():
    # one rank holding every expert: all rows are its own. Pipelined: half of the own rows
    # (not of the loading expert 1) are computed first, the host work runs meanwhile, the
    # load is waited for, the rest is computed, and results are waited for before use
    torch.manual_seed(0)
    x = torch.randn(6, 3)
    ex = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [1, 2], [2, 0]])  # 4 rows per expert
    g = torch.rand(6, 2)
    p = layout([[0], [0], [0]], 1, 3)
    counts = np.bincount(ex.reshape(-1).numpy(), minlength=3)[None, :]
    dev = _RecordingDevice()
    ref = placed_moe_local(x, ex, g, dev.compute)
    dev.reset()
    y = placed_moe(x, ex, g, counts, p, dev.compute, rank=0, loading={1}, device=dev,
                   wait_loaded=lambda: dev.log.append(("loaded",)),
                   meanwhile=lambda: dev.log.append(("meanwhile",)))
    assert torch.equal(y, ref)
    # first part: 6 of 12 own rows, skipping expert 1 -> expert 0 (4 rows), expert 2 (2 rows)
    assert dev.log == [("compute", (0, 2), (4, 2)), ("meanwhile",), ("loaded",), ("compute", (), ()),
                       ("compute", (1, 2), (4, 2)), ("wait", 2.0), ("wait", 3.0)]
    dev.reset()
    y2 = placed_moe(x, ex, g, counts, p, dev.compute, rank=0, loading={1}, device=dev, pipelined=False,
                    wait_loaded=lambda: dev.log.append(("loaded",)),
                    meanwhile=lambda: dev.log.append(("meanwhile",)))
    assert torch.equal(y2, ref)
    assert dev.log == [("meanwhile",), ("loaded",), ("compute", (0, 1, 2), (4, 4, 4)), ("wait", 1.0)]


def test_emulated_device_is_an_async_stream():
    from commsched.moe.infer.banks import EmulatedBank

    bank = EmulatedBank(1, 4, 2, 3, us_per_row=1e6, load_ms=0.0, seed=0)  # 1 s per row: never waited for
    bank.ensure(0, [0, 1])
    run = bank.compute(0)
    before = bank.issued()
    y = run([0, 1], [2, 1], torch.ones(3, 2))  # returns at once, the rows' time is queued
    assert y.shape == (3, 2) and torch.equal(y, bank.reference(0)([0, 1], [2, 1], torch.ones(3, 2)))
    t1 = bank.issued()
    assert t1 - max(before, 0.0) >= 3.0
    run([1], [2], torch.ones(2, 2))  # queued behind the first: exactly 2 s later
    assert bank.issued() == pytest.approx(t1 + 2.0)
    bank.wait(0.0)  # a token in the past returns at once
    with pytest.raises(AssertionError, match="before it was loaded"):
        run([3], [1], torch.ones(1, 2))


def test_emulated_device_on_a_gpu_model_costs_the_ffns_gemms_times_k():
    from commsched.cluster.device import load_device_model
    from commsched.moe.infer.banks import EmulatedBank, ffn_kernels

    h100 = load_device_model("h100")
    D, H, k = 1024, 4096, 1000.0
    bank = EmulatedBank(1, 4, D, 3, us_per_row=1e6, load_ms=0.0, seed=0, device_model=h100,
                        dilation=k, hidden=H)
    plain = EmulatedBank(1, 4, D, 3, us_per_row=1e6, load_ms=0.0, seed=0)
    for b in (bank, plain):
        b.ensure(0, [0, 1])
    x = torch.randn(300, D)
    y = bank.compute(0)([0, 1], [256, 44], x)
    assert torch.equal(y, plain.compute(0)([0, 1], [256, 44], x))  # the same rows: only the time differs
    # each expert's rows: two GEMMs (2*n*D*H FLOPs each, weights + rows read, rows written) in bf16
    want = sum(h100.op_time("gemm", flops=f, bytes=b) for n in (256, 44) for f, b in ffn_kernels(n, D, H))
    assert bank.clock.kernels == 4 and bank.clock.busy_s == pytest.approx(k * want)
    assert ffn_kernels(256, D, H)[0] == (2.0 * 256 * D * H, 2.0 * (D * H + 256 * D + 256 * H))
    # 1024 rows of a 1024 x 4096 FFN are compute-bound on an H100: 4*n*D*H / (989.5 TFLOP/s * 0.7);
    # 64 rows are bound by reading the weights: 2 * 2*D*H bytes / (3.35 TB/s * 0.7)
    t = [sum(h100.op_time("gemm", flops=f, bytes=b) for f, b in ffn_kernels(n, D, H)) for n in (1024, 64)]
    assert t[0] == pytest.approx(2 * h100.launch_s + 4 * 1024 * D * H / (989.5e12 * 0.7))
    assert t[1] == pytest.approx(2 * h100.launch_s + 2 * 2 * (D * H + 64 * D + 64 * H) / (3.35e12 * 0.7))
    # the marginal row: its FLOPs on the roofline, times k
    assert bank.row_cost_s() == pytest.approx(k * 4 * D * H / (989.5e12 * 0.7))
    with pytest.raises(ValueError, match="--device-model"):
        EmulatedBank(1, 4, D, 3, us_per_row=1.0, load_ms=0.0, seed=0, dilation=2.0)
    with pytest.raises(ValueError, match="no peak for dtype"):
        EmulatedBank(1, 4, D, 3, us_per_row=1.0, load_ms=0.0, seed=0, device_model=h100, hidden=H,
                     dtype="fp8")


def test_infer_device_model_flags_reach_the_bank(tmp_path):
    from commsched.moe.infer.cli import build_parser, config_from_args
    from commsched.moe.infer.drivers import TraceDriver

    cfg = config_from_args(build_parser().parse_args(
        ["--device-model", "a100", "--dilation", "50", "--expert-hidden", "128", "--d-model", "32",
         "--batches", "2", "--warmup", "0", "--out", "x"]))
    assert (cfg.emulation.device_model, cfg.emulation.dilation) == ("a100", 50.0)
    bank = TraceDriver.from_config(cfg, 2, False, torch.device("cpu")).make_bank(cfg, 3, torch.device("cpu"))
    assert bank.clock.model.name == "a100" and bank.clock.dilation == 50.0 and bank.hidden == 128
    with pytest.raises(ValueError, match="unknown device model 'v100'.*a100, h100, h200"):
        config_from_args(build_parser().parse_args(["--device-model", "v100", "--out", "x"]))
    with pytest.raises(ValueError, match="give --device-model"):
        config_from_args(build_parser().parse_args(["--dilation", "4", "--out", "x"]))


def test_ffn_bank_loads_slots_and_computes_the_experts_ffn():
    from commsched.moe.infer.banks import FFNBank
    from commsched.moe.model.experts import ExpertFFN, expert_apply

    torch.manual_seed(0)
    ffn = ExpertFFN(5, 4, 6)
    with torch.no_grad():
        ffn.b1.normal_()
        ffn.b2.normal_()
    bank = FFNBank([ffn.params()], slots=2)
    assert bank.device is None and bank.measures_row_cost and bank.num_layers == 1
    assert bank.ensure(0, [3, 1]) == 2 and bank.ensure(0, [1, 3]) == 0  # resident: nothing to load
    x = torch.randn(5, 4)
    y = bank.compute(0)([1, 3], [2, 3], x)
    w = [t.detach()[[1, 3]] for t in ffn.params()]
    assert torch.equal(y, expert_apply(x, [2, 3], *w))  # the same arithmetic as the layer
    assert torch.equal(bank.reference(0)([1, 3], [2, 3], x), y)
    assert bank.ensure(0, [3, 4]) == 1 and bank.loaded_L == [3]  # 1 evicted, 4 loaded into its slot
    assert torch.equal(bank.compute(0)([4], [5], x), expert_apply(x, [5], *[t.detach()[[4]] for t in ffn.params()]))
    assert bank.compute(0)([], [], x[:0]).shape == (0, 4)
    with pytest.raises(ValueError, match="do not fit 2 slots"):
        bank.ensure(0, [0, 1, 2])
    assert bank.row_cost_s() > 0


def test_model_moe_call_seam_is_the_models_forward():
    from commsched.moe.infer.banks import FFNBank
    from commsched.moe.infer.runtime import model_forward, model_weights
    from commsched.moe.model.layer import MoELayer
    from commsched.moe.model.lm import ModelConfig, MoETransformerLM

    torch.manual_seed(0)
    model = MoETransformerLM(ModelConfig(d_model=16, n_heads=2, n_layers=4, seq_len=8, d_ff=24, expert_hidden=20,
                                         num_experts=4, k=2, moe_every=2)).eval()
    tokens = torch.randint(0, 256, (2, 8))
    seen = []

    def own(j, layer, h):
        seen.append((j, isinstance(layer, MoELayer), tuple(h.shape)))
        return layer(h)[0]

    with torch.no_grad():
        ref, aux = model(tokens)
        logits, none = model(tokens, moe_call=own)
        assert aux is not None and none is None
        assert torch.equal(logits, ref)
        assert seen == [(0, True, (2, 8, 16)), (1, True, (2, 8, 16))]
        bank = FFNBank(model_weights(model), slots=4)
        twin = model_forward(model, tokens, lambda j, h, e, g, keep: placed_moe_local(h, e, g, bank.reference(j), keep))
    assert torch.allclose(twin, ref, rtol=1e-5, atol=1e-6)


def test_infer_config_from_cli_is_nested():
    from commsched.moe.infer.cli import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(
        ["--placement", "oracle", "--slots", "5", "--us-per-row", "3", "--tokens-per-batch", "64",
         "--checkpoint", "lm.pt", "--batches", "4", "--warmup", "9", "--out", "x"]))
    assert (cfg.placement, cfg.slots, cfg.strategy) == ("oracle", 5, STRATEGIES["oracle"]())
    assert cfg.emulation.us_per_row == 3.0 and cfg.trace.tokens_per_batch == 64
    assert cfg.model.checkpoint == "lm.pt" and cfg.compute == "emulated" and cfg.warmup == 3
    with pytest.raises(ValueError, match="--profile-fraction"):
        config_from_args(build_parser().parse_args(["--profile-fraction", "1", "--out", "x"]))
    with pytest.raises(ValueError, match="use --compute real"):
        config_from_args(build_parser().parse_args(["--driver", "model", "--compute", "emulated", "--out", "x"]))


def test_infer_metrics_record_holds_the_documented_keys(tmp_path):
    import json

    from commsched.moe.infer import InferMetrics

    m = InferMetrics(placement="lina", latency_ms={"p50": 1.0, "p95": 2.0, "p99": 3.0, "mean": 1.5},
                     imbalance=1.25, estimation_accuracy=None, replans=[0.5, 1.0], extra={"world_size": 2})
    assert InferMetrics.field_names() == ("placement", "latency_ms", "imbalance", "estimation_accuracy", "replans")
    m.write(tmp_path / "metrics.json")
    back = json.loads((tmp_path / "metrics.json").read_text())
    assert back == m.to_dict() and back["replans"] == [0.5, 1.0] and back["world_size"] == 2
    with pytest.raises(ValueError, match="shadow"):
        InferMetrics("lina", {}, 1.0, None, [], extra={"imbalance": 2.0}).to_dict()


# --------------------------------------------------------------------------- policy (pure)
def test_relabel_keeps_experts_where_they_are():
    # planned devices hold {0,1}, {2}, {3}; the real devices currently hold {3}, {0, 1}, {2}
    p = layout([[0], [0], [1], [2]], 3, 2)
    q = relabel(p, [{3}, {0, 1}, {2}], load_E=[4.0, 2.0, 5.0, 1.0])
    assert q.replicas == ((1,), (1,), (2,), (0,))
    assert q.device_load == (1.0, 6.0, 5.0)
    # loads move with the experts; the max is unchanged
    p2 = greedy_placement([9.0, 1.0, 1.0, 5.0], 2, 3)
    q2 = relabel(p2, [set(p2.device_experts[1]), set(p2.device_experts[0])])
    assert q2.device_experts == (p2.device_experts[1], p2.device_experts[0])
    assert sorted(q2.device_load) == sorted(p2.device_load)


def strategy_class(name):
    return STRATEGIES[name].strategy


def _policy(strategy, historical_LE=None, **kw):
    """The strategy built from its options in ``kw`` (threshold 1.0 where it has one) and the
    run's inputs (E=4, N=2, L=2, k=1, S=3 unless ``kw`` says otherwise)."""
    sizes = dict(num_experts=4, num_devices=2, num_layers=2, k=1, slots=3, device_host=None)
    cls = STRATEGIES[strategy]
    own = {f.name for f in dataclasses.fields(cls)}
    opts = {"threshold": 1.0} if "threshold" in own else {}
    opts.update({k: v for k, v in kw.items() if k not in sizes})
    sizes.update({k: v for k, v in kw.items() if k in sizes})
    return cls(**opts).build(historical_LE=historical_LE, **sizes)


HIST = np.array([[4.0, 3.0, 2.0, 1.0], [1.0, 1.0, 1.0, 5.0]])


def test_static_and_eplb_are_fixed_and_load_once():
    st = _policy("static")
    p, loads = st.phase1(0)
    assert p.replicas == ((0,), (0,), (1,), (1,)) and loads == ((0, 1), (2, 3))
    d = st.decide(0, p, [1, 1, 1, 9])
    assert d.placement.device_load == (2.0, 10.0) and not d.replanned
    assert st.phase1(0)[1] == ((), ())  # second batch: already resident
    ep = _policy("eplb", HIST)
    p, _ = ep.phase1(1)
    assert p.share_counts[3] == 2  # the historically hot expert is replicated
    assert ep.decide(1, p, [0, 0, 0, 8]).placement.device_load == (4.0, 4.0)
    with pytest.raises(ValueError, match="historical load"):
        _policy("lina")


def test_oracle_plans_from_actual_and_relabels_to_save_loads():
    o = _policy("oracle")
    assert o.phase1(0) == (None, ((), ()))
    a = [1.0, 1.0, 1.0, 9.0]
    d1 = o.decide(0, None, a)
    assert d1.replanned and d1.placement.max_load == greedy_placement(a, 2, 3).max_load
    assert sum(len(x) for x in d1.loads_N) == sum(len(x) for x in d1.placement.device_experts)
    d2 = o.decide(0, None, a)  # same load again: same layout, nothing to load
    assert d2.placement.replicas == d1.placement.replicas and d2.loads_N == ((), ())


def test_lina_keeps_phase1_when_estimate_is_right_and_replans_otherwise():
    pol = _policy("lina", HIST, k=1)
    est = np.array([0.0, 0.0, 1.0, 9.0])
    p1, loads = pol.phase1(1, est)
    assert p1.share_counts[3] == 2 and sum(len(x) for x in loads) == sum(len(h) for h in p1.device_experts)
    keep = pol.decide(1, p1, [0, 1, 2, 8], est)  # top-2 {3, 2} as estimated
    assert not keep.replanned and keep.overlap == 1.0 and keep.loads_N == ((), ())
    assert keep.placement.replicas == p1.replicas
    swap = pol.decide(1, p1, [9, 1, 0, 0], est)  # top-2 {0, 1}: overlap 0 -> re-plan
    assert swap.replanned and swap.overlap == 0.0
    assert swap.placement.share_counts[0] == 2 and swap.placement.max_load <= 5.0
    never = _policy("lina", HIST, k=1, threshold=0.0)
    q, _ = never.phase1(1, est)
    assert not never.decide(1, q, [9, 1, 0, 0], est).replanned
    # layer 0 has no path: phase 1 plans from the historical load
    p0, _ = pol.phase1(0)
    assert p0.share_counts[0] >= 1 and placement_digest(p0) == placement_digest(p0.with_load([1, 1, 1, 1]))


def test_policy_config_errors_speak():
    with pytest.raises(ValueError, match="--placement round-robin is not known"):
        _policy("round-robin")
    with pytest.raises(ValueError, match="raise --slots"):
        _policy("lina", slots=1)
    with pytest.raises(ValueError, match="threshold"):
        _policy("lina", threshold=1.5)
    with pytest.raises(ValueError, match="planner"):
        _policy("lina", online_planner="magic")


# one test per strategy class: its properties, phase 1 and decision on a hand-worked layer
def test_static_strategy_class():
    from commsched.moe.infer.policy import StaticPlacement

    assert strategy_class("static") is StaticPlacement
    assert (StaticPlacement.needs_profile, StaticPlacement.loads_online, StaticPlacement.estimates_paths) == (
        False, False, False)
    st = _policy("static", HIST)  # a profile is accepted and ignored
    assert st.historical_LE is None and st.planned_from(0, np.ones(4)) is None
    p, loads = st.phase1(1, np.array([0.0, 0.0, 0.0, 9.0]))  # an estimate changes nothing
    assert p.replicas == ((0,), (0,), (1,), (1,)) and loads == ((0, 1), (2, 3))
    d = st.decide(1, p, [0, 0, 0, 8])
    assert d.placement.device_load == (0.0, 8.0) and not d.replanned and d.overlap is None


def test_eplb_strategy_class():
    from commsched.moe.infer.policy import EplbPlacement

    assert strategy_class("eplb") is EplbPlacement
    assert (EplbPlacement.needs_profile, EplbPlacement.loads_online, EplbPlacement.estimates_paths) == (
        True, False, False)
    ep = _policy("eplb", HIST)
    # layer 0 (load 4, 3, 2, 1 over 2 x 3 slots): the full planner balances 5 / 5
    p0, _ = ep.phase1(0)
    assert max(p0.device_load) == pytest.approx(5.0) and ep.planned_from(0, None).tolist() == HIST[0].tolist()
    d = ep.decide(0, p0, [1, 1, 1, 1])
    assert d.placement.replicas == p0.replicas and not d.replanned and d.loads_N == ((), ())
    with pytest.raises(ValueError, match=r"\[L, E\] = \[2, 4\]"):
        _policy("eplb", HIST[:1])


def test_lina_strategy_class():
    from commsched.moe.infer.policy import LinaPlacement

    assert strategy_class("lina") is LinaPlacement
    assert (LinaPlacement.needs_profile, LinaPlacement.loads_online, LinaPlacement.estimates_paths) == (
        True, True, True)
    pol = _policy("lina", HIST, k=1, threshold=0.5)
    est = np.array([0.0, 0.0, 1.0, 9.0])
    assert pol.planned_from(1, est).tolist() == est.tolist()
    assert pol.planned_from(0, None).tolist() == HIST[0].tolist()  # layer 0: the historical load
    p1, _ = pol.phase1(1, est)
    half = pol.decide(1, p1, [0, 9, 0, 8], est)  # top-2 {1, 3} vs {3, 2}: overlap 0.5, not below 0.5
    assert not half.replanned and half.overlap == 0.5


def test_oracle_strategy_class():
    from commsched.moe.infer.policy import OraclePlacement

    assert strategy_class("oracle") is OraclePlacement
    assert (OraclePlacement.needs_profile, OraclePlacement.loads_online, OraclePlacement.estimates_paths) == (
        False, True, False)
    o = _policy("oracle")
    assert o.phase1(1, np.ones(4)) == (None, ((), ())) and o.planned_from(1, np.ones(4)) is None
    d = o.decide(1, None, [0.0, 0.0, 0.0, 6.0])
    assert d.replanned and d.overlap is None and d.placement.share_counts[3] == 2
    assert d.placement.device_load == (3.0, 3.0)


def test_a_new_strategy_and_planner_are_one_class_one_entry(monkeypatch):
    """Adding a placement strategy or a planner: one class, one registry entry (then
    the strategy configs and --placement / --planner accept the name)."""
    from commsched.moe.infer.policy import STRATEGIES, LayerDecision, OraclePlacement
    from commsched.moe.placement.registry import PLANNERS, Planner

    class HalfPlacement(OraclePlacement):  # re-planned on odd layers, static on the others
        name = "half"

        def decide(self, layer, phase1, actual_E, estimated_E=None, actual_PE=None):
            if layer % 2:
                return super().decide(layer, phase1, actual_E, estimated_E, actual_PE)
            p = static_placement(self.num_experts, self.num_devices, slots_per_device=self.slots)
            return LayerDecision(p.with_load(np.asarray(actual_E, float)), False, None, self._commit(layer, p))

    class StaticPlanner(Planner):  # the static layout, whatever the load
        name = "static"
        node_aware = False

        def plan(self, load_E, num_devices, slots_per_device, **kw):
            return static_placement(len(load_E), num_devices, slots_per_device=slots_per_device)

    monkeypatch.setitem(STRATEGIES._entries, "half", HalfPlacement.Config)
    monkeypatch.setitem(PLANNERS._entries, "static", StaticPlanner())
    h = _policy("half", online_planner="static")
    assert not h.decide(0, None, [0.0, 0.0, 0.0, 6.0]).replanned
    d = h.decide(1, None, [0.0, 0.0, 0.0, 6.0])
    assert d.replanned and d.placement.replicas == static_placement(4, 2, slots_per_device=3).replicas
    with pytest.raises(ValueError, match="must be 'full' or 'greedy', got 'static'"):
        _policy("lina-node", HIST, online_planner="static")
    with pytest.raises(ValueError, match="--placement nope is not known .*half"):
        strategy_class("nope")


def test_eplb_hier_strategy_class():
    from commsched.moe.infer.policy import EplbHierPlacement

    assert strategy_class("eplb-hier") is EplbHierPlacement
    assert (EplbHierPlacement.needs_profile, EplbHierPlacement.loads_online) == (True, False)
    assert not [f.name for f in dataclasses.fields(EplbHierPlacement.Config)]  # no options: EPLB on the hosts
    hist = np.array([[8.0, 1.0, 1.0, 6.0], [1.0, 1.0, 1.0, 1.0]])
    ep = _policy("eplb-hier", hist, num_devices=4, slots=2, device_host=(0, 0, 1, 1))
    p0, _ = ep.phase1(0)
    # experts packed onto the hosts by load first (8 + 1 | 6 + 1), then replicated inside
    # each host (EPLB gives expert 0 three slots of host 0, two on one device: merged)
    assert p0.replicas == ((0, 1), (3,), (1,), (2, 3)) and p0.device_load == (4.0, 5.0, 3.0, 4.0)
    flat = _policy("eplb-hier", hist, num_devices=4, slots=2)  # one host: EPLB's global policy
    assert flat.phase1(0)[0].replicas == _policy("eplb", hist, num_devices=4, slots=2, planner="eplb"
                                                ).phase1(0)[0].replicas
    with pytest.raises(ValueError, match="consecutive devices"):
        _policy("eplb-hier", hist, num_devices=4, slots=2, device_host=(0, 1, 0, 1))


def test_lina_node_strategy_class():
    from commsched.moe.infer.policy import LinaNodePlacement, cross_host_weight

    assert strategy_class("lina-node") is LinaNodePlacement
    assert LinaNodePlacement.estimates_paths
    assert _policy("lina-node", HIST, device_host=(0, 1), cross_weight=0.1).cross_weight == 0.1  # node-aware
    hosts = (0, 1)
    pol = _policy("lina-node", HIST, k=1, threshold=0.5, device_host=hosts, cross_weight=0.1)
    p, loads = pol.phase1(0)  # layer 0 (historical 4, 3, 2, 1): expert 0 on both hosts, 5 | 5
    assert p.device_host == hosts and p.replicas == ((0, 1), (0,), (1,), (1,)) and p.device_load == (5.0, 5.0)
    assert loads == ((0, 1), (0, 2, 3))
    # the hand-worked case of test_moe_placement: experts 0 and 1 on both hosts
    d = pol.decide(1, pol.phase1(1, np.array([6.0, 2.0, 2.0, 2.0]))[0], [6, 2, 2, 2],
                   np.array([6.0, 2.0, 2.0, 2.0]))
    assert not d.replanned and d.placement.device_host == hosts
    assert d.placement.replicas == ((0, 1), (0, 1), (0,), (1,))
    flat = _policy("lina", HIST, k=1, threshold=0.5)
    one = _policy("lina-node", HIST, k=1, threshold=0.5, device_host=(0, 0), cross_weight=0.1)
    assert one.phase1(1, HIST[1])[0] == flat.phase1(1, HIST[1])[0]  # one host: lina exactly
    with pytest.raises(ValueError, match="eplb-hier"):
        _policy("lina-node", HIST, online_planner="eplb", device_host=hosts)
    from commsched import Topology
    from commsched.cluster.costmodel import LinkCost

    t = Topology.from_hosts(["a", "a", "b", "b"], intra=LinkCost(0.0, 1e-10), inter=LinkCost(0.0, 8e-9))
    # 2 exchanges x 256 B x (8e-9 - 1e-10) s/B over 100 us of compute per row
    assert cross_host_weight(t, 256, 100e-6) == pytest.approx(2 * 256 * (8e-9 - 1e-10) / 100e-6)
    assert cross_host_weight(Topology.from_hosts(["a", "a"]), 256, 100e-6) == 0.0
    # without --cross-weight the strategy's build measures it: the topology (its inter-host
    # class at --inter-rate when given), the row size and the row cost the run timed
    t2 = Topology.from_hosts(["a", "b"], intra=LinkCost(0.0, 1e-10), inter=LinkCost(0.0, 8e-9))
    run = dict(num_experts=4, num_devices=2, num_layers=2, k=1, slots=3, historical_LE=HIST, device_host=hosts,
               topology=t2, row_bytes=256, row_cost_s=100e-6)
    assert STRATEGIES["lina-node"]().build(**run).cross_weight == cross_host_weight(t2, 256, 100e-6)
    assert STRATEGIES["lina-node"](inter_rate="1gbit").build(**run).cross_weight == pytest.approx(
        2 * 256 * 8e-9 / 100e-6)


def test_relabel_stays_within_hosts():
    p = Placement(((0,), (1,), (2,), (3,)), (0.0,) * 4, 1, (0, 0, 1, 1))
    # expert 0 is resident on device 3 (another host): it may not move there
    q = relabel(p, [set(), {1}, set(), {0}])
    assert q.device_host == p.device_host
    assert all(p.device_host[p.replicas[e][0]] == q.device_host[q.replicas[e][0]] for e in range(4))
    assert q.replicas[1] == (1,)


def test_strategy_table_is_the_cli_choice_list():
    from commsched.moe.infer import InferConfig
    from commsched.moe.infer.cli import build_parser

    assert list(STRATEGIES) == ["static", "eplb", "lina", "oracle", "eplb-hier", "lina-node"]
    assert all(c.strategy.name == n for n, c in STRATEGIES.items())
    choices = next(a.choices for a in build_parser()._actions if "--placement" in a.option_strings)
    assert tuple(choices) == tuple(STRATEGIES)
    with pytest.raises(ValueError, match="--placement must be one of"):
        InferConfig(placement="round-robin")
    with pytest.raises(ValueError, match="--cross-weight"):
        STRATEGIES["lina-node"](cross_weight=-1.0)
    with pytest.raises(ValueError, match="rate"):
        STRATEGIES["lina-node"](inter_rate="fast")
    with pytest.raises(ValueError, match="device_host"):
        _policy("lina-node", HIST, slots=3, device_host=(0, 2))


def test_a_strategy_option_belongs_to_its_strategies_only():
    """Each strategy's config holds its own options; one given to another strategy is
    refused naming the strategies that take it (exit 2 on the command line)."""
    from commsched.moe.infer import InferConfig
    from commsched.moe.infer.cli import build_parser, config_from_args

    def cfg(*argv):
        return config_from_args(build_parser().parse_args(["--out", "x", *argv]))

    assert cfg("--placement", "lina", "--threshold", "0.1").strategy == STRATEGIES["lina"](threshold=0.1)
    assert cfg("--placement", "static").strategy == STRATEGIES["static"]()
    assert cfg("--placement", "lina-node", "--cross-weight", "2").strategy.cross_weight == 2.0
    for argv, owners in ((("--placement", "static", "--threshold", "0.1"), "lina, lina-node"),
                         (("--placement", "lina", "--planner", "full"), "eplb"),
                         (("--placement", "oracle", "--inter-rate", "1gbit"), "lina-node")):
        with pytest.raises(ValueError, match=f"is an option of --placement {owners}, not of --placement {argv[1]}"):
            cfg(*argv)
    with pytest.raises(TypeError, match="options of --placement static"):
        InferConfig(placement="static", strategy=STRATEGIES["lina"]())
    assert [f.name for f in dataclasses.fields(STRATEGIES["lina"])] == ["online_planner", "threshold", "path_length"]
    with pytest.raises(TypeError):  # options and the run's inputs are keyword-only
        STRATEGIES["lina"](0.5)
    with pytest.raises(TypeError):
        STRATEGIES["static"]().build(4, 2, 2, 1, 3)


def test_placed_local_twin_is_the_dense_sum():
    torch.manual_seed(0)
    x = torch.randn(5, 3)
    ex = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    g = torch.rand(5, 2)
    scale = torch.tensor([1.0, 2.0, 3.0])

    def comp(experts, counts, rows):
        idx = torch.repeat_interleave(torch.tensor(experts), torch.tensor(counts))
        return rows * scale[idx].unsqueeze(1)

    y = placed_moe_local(x, ex, g, comp)
    ref = torch.stack([sum(g[t, j] * scale[ex[t, j]] * x[t] for j in range(2)) for t in range(5)])
    assert torch.allclose(y, ref)


# --------------------------------------------------------------------------- distributed == local
def _trace_cfg(placement: str, compute: str, tokens_per_batch: int = 96, exchange: str = "pipelined"):
    from commsched.moe.infer import EmulationConfig, InferConfig, TraceDriverConfig
    from commsched.moe.record.traces import SyntheticTraceConfig

    syn = SyntheticTraceConfig(num_experts=8, num_layers=4, k=2, num_tokens=4096, seq_len=16)
    return InferConfig(placement=placement, compute=compute, batches=3, warmup=1,
                       emulation=EmulationConfig(us_per_row=0.0, load_ms=0.0),
                       trace=TraceDriverConfig(synthetic=syn, tokens_per_batch=tokens_per_batch, d_model=8,
                                               expert_hidden=12), seed=1,
                       exchange=exchange)


def _local_layer(bank, j, h, e, g, keep):
    from commsched.moe.infer.placed import placed_moe_local

    return placed_moe_local(h, e, g, bank.reference(j), keep)


def _trace_equals_local(rank: int, world: int) -> None:
    import os

    from commsched.moe.infer import build, run
    from commsched.moe.infer.runtime import trace_forward

    # pipelined (the default) and the sequential twin; 16 tokens: one sequence, the other ranks idle;
    # "hosts" (4 ranks): two hosts of two ranks told apart by torchrun's node index (GROUP_RANK), as
    # emulated hosts are, with the host-local split of lina-node's placements
    for compute, placement, tpb, exchange in [
            ("emulated", "static", 96, "pipelined"), ("emulated", "eplb", 96, "pipelined"),
            ("emulated", "lina", 96, "pipelined"), ("emulated", "oracle", 96, "pipelined"),
            ("real", "lina", 96, "pipelined"), ("real", "oracle", 96, "pipelined"),
            ("emulated", "lina", 16, "pipelined"), ("emulated", "lina", 96, "sequential"),
            ("emulated", "oracle", 16, "sequential")] + [("emulated", "lina-node", 96, "hosts")] * (world == 4):
        hosts = exchange == "hosts"
        if hosts:
            os.environ["GROUP_RANK"] = str(rank * 2 // world)
            exchange = "pipelined"
        cfg = _trace_cfg(placement, compute, tpb, exchange)
        if placement == "lina-node":
            cfg = dataclasses.replace(cfg, strategy=STRATEGIES["lina-node"](cross_weight=1.0))
        try:
            m = run(cfg, return_outputs=True)
        finally:
            os.environ.pop("GROUP_RANK", None)
        if hosts:
            assert m["hosts"] == 2 and m["host_of_rank"] == [r * 2 // world for r in range(world)]
            assert m["inter_host_bytes_per_batch"] > 0
        elif world > 1:  # one host: nothing crosses, and the row exchanges counted what they sent
            assert m["hosts"] == 1 and m["inter_host_bytes_per_batch"] == 0
            assert m["intra_host_bytes_per_batch"] > 0 or tpb == 16
        if placement == "lina-node":  # the weight reached the planner
            assert m["cross_weight"] == 1.0
        setup = build(cfg, rank, world)
        drv, bank = setup.driver, setup.bank
        what = (compute, placement, tpb, exchange)
        for b, y in enumerate(m["outputs"]):
            x, ex, gate = drv.inputs(b, rank, cfg.trace.d_model)
            ref = trace_forward(x, ex, gate, functools.partial(_local_layer, bank))
            assert y.shape == ref.shape, what
            if compute == "emulated":  # row-wise arithmetic: bit-exact whatever the placement
                assert torch.equal(y, ref), (what, (y - ref).abs().max())
            else:  # matmuls over other row groupings (bit-exact on the reference machine)
                assert torch.allclose(y, ref, rtol=1e-5, atol=1e-6), (what, (y - ref).abs().max())
        assert m["placement"] == placement and len(m["replans"]) == 4
        if placement == "oracle":
            assert m["replans"] == [1.0] * 4
        if placement == "static":
            assert m["replan_rate"] == 0.0 and m["expert_loads_per_batch"] == 0.0
        if tpb == 16 and rank >= 1:
            assert m["outputs"][0].shape[0] == 0
        assert m["latency_ms"]["p95"] > 0 and m["imbalance"] >= 1.0
        # every rank's host figures (the cluster table's), no device model: no prediction
        h = m["host"]
        assert len(h["host_cpu_share"]) == len(h["peak_rss_mib"]) == world and h["startup_s"] > 0
        assert all(0.0 <= x for x in h["host_cpu_share"]) and all(x > 0 for x in h["peak_rss_mib"])
        assert m["predicted_latency_ms"] is None
        # the phase-1 planning window (own rows computed while the dispatch runs) and its use
        assert m["planning_window_ms"]["p50"] >= 0.0 and m["phase1_ms"]["p50"] >= 0.0
        if placement == "static":
            assert m["phase1_ms"]["p95"] == 0.0
        # the metadata exchange split: the wait for the last rank to send, and the rest
        bd = m["breakdown_s"]
        assert bd["meta_wait"] >= 0.0 and bd["meta"] >= 0.0
        if world == 1:
            assert bd["meta_wait"] == 0.0


def _model_equals_local(ckpt: str, rank: int, world: int) -> None:
    from commsched.moe.infer import InferConfig, ModelDriverConfig, run
    from commsched.moe.model.data import load_corpus
    from commsched.moe.record.recorder import load_checkpoint

    model, _ = load_checkpoint(ckpt)
    corpus = load_corpus(None)
    for placement in ("lina", "oracle"):
        cfg = InferConfig(placement=placement, driver="model", compute="real", batches=2,
                          warmup=0, model=ModelDriverConfig(checkpoint=ckpt, batch_size=2, profile_tokens=1024),
                          seed=2)
        m = run(cfg, return_outputs=True)
        for b, logits in enumerate(m["outputs"]):
            tokens, _ = corpus.batch(2, model.cfg.seq_len, seed=2, step=b, rank=rank, split="val")
            with torch.no_grad():
                ref, _ = model(tokens)
            assert torch.allclose(logits, ref, rtol=1e-5, atol=1e-5), (placement, (logits - ref).abs().max())
        assert m["estimation_accuracy"] is not None or placement != "lina"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from commsched.moe.model.lm import ModelConfig, MoETransformerLM
    from commsched.moe.record.recorder import save_checkpoint

    torch.manual_seed(0)
    model = MoETransformerLM(ModelConfig(d_model=16, n_heads=2, n_layers=3, seq_len=16, d_ff=24, expert_hidden=20,
                                         num_experts=4, k=2, moe_every=1))
    path = tmp_path_factory.mktemp("ckpt") / "lm.pt"
    save_checkpoint(path, model, {"trained": False})
    return str(path)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request, checkpoint):
    cases = [("trace_equals_local", _trace_equals_local),
             ("model_equals_local", functools.partial(_model_equals_local, checkpoint))]
    return run_cases(request.param, cases, timeout_s=300, env={"COMMSCHED_PROGRESS": "0"})


@pytest.mark.slow
@pytest.mark.parametrize("case", ["trace_equals_local", "model_equals_local"])
def test_infer_mp(results, case):
    assert_case(results, case)


def test_static_layout_helper_matches_default_slots():
    assert default_slots(16, 4) == 6 and static_placement(16, 4, slots_per_device=6).max_load == 0.0


# --------------------------------------------------------------------------- recorder, checkpoints, bench
def test_record_trace_and_checkpoint_round_trip(tmp_path):
    from commsched.moe.model.data import Corpus
    from commsched.moe.model.lm import ModelConfig, MoETransformerLM
    from commsched.moe.record.recorder import load_checkpoint, record_trace, save_checkpoint
    from commsched.moe.record.traces import load_trace, save_trace

    torch.manual_seed(1)
    model = MoETransformerLM(ModelConfig(d_model=16, n_heads=2, n_layers=2, seq_len=8, d_ff=16, expert_hidden=8,
                                         num_experts=4, k=2, moe_every=1))
    data = torch.arange(400, dtype=torch.uint8)
    corpus = Corpus(train=data[:300], val=data[300:], source="counting bytes")
    tr = record_trace(model.eval(), corpus, 30, source="unit")  # 30 tokens -> 4 windows of 8
    assert (tr.num_tokens, tr.num_layers, tr.k, tr.num_experts) == (32, 2, 2, 4)
    assert tr.seq_ids.tolist() == [i // 8 for i in range(32)]
    with torch.no_grad():  # the recorded choices are the router's on the first window
        model(corpus.val[:8].long().view(1, 8))
    assert tr.experts[:8, 1].tolist() == model.moe_layers()[1].last_routing.expert_TK.tolist()
    save_trace(tmp_path / "t.npz", tr)
    assert "model:unit" in load_trace(tmp_path / "t.npz").source
    save_checkpoint(tmp_path / "m.pt", model, {"note": 1})
    back, info = load_checkpoint(tmp_path / "m.pt")
    assert info == {"note": 1} and back.cfg == model.cfg
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
    with pytest.raises(ValueError, match="no such file"):
        load_checkpoint(tmp_path / "missing.pt")
    torch.save({"format": "other"}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="not a commsched MoE LM checkpoint"):
        load_checkpoint(tmp_path / "x.pt")
    with pytest.raises(ValueError, match="fewer than the"):
        record_trace(model, corpus, 1000)


def _metrics(p95: float, rows: float, imb: float, series: list[float]) -> dict:
    L, E, N = 2, 4, 2
    return {"latency_ms": {"p50": p95 * 0.9, "p95": p95, "p99": p95}, "critical_rows": {"p95": rows},
            "imbalance": imb, "latency_ms_per_batch": series, "breakdown_s": {"a2a": 0.1, "expert": 0.5},
            "expert_load_share": [[0.25] * E] * L, "replicas": [[1.0] * E] * L,
            "device_rows_share": [[0.5] * N] * L}


def test_bench_variants_summary_and_heatmap(tmp_path):
    from commsched.bench import build_parser
    from commsched.bench.moe.infer import WORKLOAD

    a = build_parser(WORKLOAD).parse_args(["--lina-thresholds", "0,0.75", "--threshold", "0.5", "--batches", "5"])

    from commsched.moe.infer.cli import build_parser as infer_parser
    from commsched.moe.infer.cli import config_from_args

    variants = WORKLOAD.variants(a)
    for v in variants:  # a variant is a label and a config; its command line gives the config back
        assert config_from_args(infer_parser().parse_args([*v.argv, "--out", "x"])) == v.config, v.name
    vs = {v.name: v.argv for v in variants}
    cs = {v.name: v.config for v in variants}
    assert list(vs) == ["static", "eplb", "lina", "oracle", "lina@0", "lina@0.75"]
    assert cs["lina"].placement == "lina" and cs["lina"].strategy.threshold == 0.5
    assert vs["lina@0"].count("--threshold") == 1 and cs["lina@0"].strategy.threshold == 0.0
    assert "--threshold" not in vs["static"] + vs["eplb"] + vs["oracle"]  # each strategy gets its own options
    with pytest.raises(ValueError, match="outside"):
        WORKLOAD.variants(build_parser(WORKLOAD).parse_args(["--lina-thresholds", "2"]))
    h = build_parser(WORKLOAD).parse_args(["--batches", "5"])
    h.hosts, h.rate_bps = 2, 1_000_000_000  # what the runner sets under --hosts 2 --bandwidth 1gbit
    hv = {v.name: v.argv for v in WORKLOAD.variants(h)}
    assert list(hv) == ["static", "eplb", "eplb-hier", "lina", "lina-node", "oracle"]
    i = hv["lina-node"].index("--inter-rate")
    assert hv["lina-node"][i + 1] == "1000000000bit" and "--inter-rate" not in hv["lina"]
    assert "--inter-rate" not in hv["eplb-hier"]
    runs = {"static": [_metrics(200, 100, 1.6, [190, 200, 210])] * 2,
            "lina": [_metrics(120, 60, 1.1, [110, 120, 125])] * 2,
            "oracle": [_metrics(110, 58, 1.0, [105, 110, 112])] * 2}
    out = WORKLOAD.summarize(runs, a, tmp_path)
    g = out["goals"]
    assert g["lina_p95_speedup_vs_static"]["measured"] == pytest.approx(200 / 120)
    assert g["lina_p95_speedup_vs_static"]["met"] and g["lina_mean_imbalance"]["met"]
    assert g["lina_p95_over_oracle"]["measured"] == pytest.approx(120 / 110)
    assert g["model_latency_p95_speedup_vs_static"]["measured"] == pytest.approx(100 / 60)
    assert out["latency_ms_batch_median_over_repeats"]["lina"]["p50"] == pytest.approx(120)
    assert (tmp_path / "heatmap.png").stat().st_size > 1000
    from commsched.bench.moe.infer import hosts_table

    for v, b in (("static", 4e6), ("lina", 1e6)):  # on hosts: the bytes table, medians of the repeats
        for m in runs[v]:
            m.update(hosts=2, inter_host_bytes_per_batch=b, intra_host_bytes_per_batch=2e6)
    table, ib = hosts_table({v: runs[v] for v in ("static", "lina")})
    assert "| lina | 120 | 1.100 | 1.00 | 2.00 | 0.250 |" in table and ib == {"static": 4e6, "lina": 1e6}


def test_placed_layer_times_its_parts_with_the_device_clock(monkeypatch):
    """Audit 2, item 12: the a2a / expert / other parts are ``Clock`` marks on the rows' device
    (CUDA events on a GPU, not enqueue times), kept unresolved until ``settle()``."""
    import commsched.moe.infer.placed as placed
    from commsched.moe.infer.placed import PlacedTimes

    class Ev:
        waits = 0

        def __init__(self, ms):
            self.ms = ms

        def synchronize(self):
            Ev.waits += 1

        def elapsed_time(self, other):
            return other.ms - self.ms

    class EventClock:  # every mark 10 ms after the last
        t = 0.0

        def __init__(self, device):
            pass

        def mark(self, stream=None):
            EventClock.t += 10.0
            return Ev(EventClock.t)

    monkeypatch.setattr(placed, "Clock", EventClock)
    torch.manual_seed(0)
    x, g = torch.randn(6, 3), torch.rand(6, 2)
    ex = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [1, 2], [2, 0]])
    p = layout([[0], [0], [0]], 1, 3)
    counts = np.bincount(ex.reshape(-1).numpy(), minlength=3)[None, :]
    dev = _RecordingDevice()
    times = PlacedTimes()
    placed_moe(x, ex, g, counts, p, dev.compute, rank=0, times=times, pipelined=False)
    assert Ev.waits == 0 and times.a2a == 0.0 and len(times._pending) == 1  # nothing resolved yet
    times.settle()
    # marks: t0, a2a (2), expert (2), a2a (2), end -> each part 10 ms, the layer 70 ms
    assert times.a2a == pytest.approx(0.02) and times.expert == pytest.approx(0.01)
    assert times.other == pytest.approx(0.07 - 0.03) and Ev.waits > 0 and times._pending == []
