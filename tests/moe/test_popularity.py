"""Routing traces (file format, generator), the popularity estimator and the phase-2 rule."""

from __future__ import annotations

import numpy as np
import pytest

from commsched.moe.infer.popularity import (
    DEFAULT_REPLAN_THRESHOLD,
    PopularityEstimator,
    estimation_accuracy,
    phase2_decision,
    topk_experts,
    topk_overlap,
)
from commsched.moe.record.traces import (
    RoutingTrace,
    SyntheticTraceConfig,
    load_trace,
    save_trace,
    synthetic_trace,
    trace_stats,
)


def trace_from_top1(top1_TL, E, seq=None) -> RoutingTrace:
    return RoutingTrace(np.asarray(top1_TL)[:, :, None], E, "test", seq)


# --------------------------------------------------------------------------- traces
def test_loads_batches_split():
    ex = np.array([[[0, 1], [2, 0]],
                   [[0, 2], [2, 1]],
                   [[1, 0], [0, 2]]])  # [T=3, L=2, k=2]
    tr = RoutingTrace(ex, 3, "hand", np.array([0, 0, 1]))
    assert tr.num_tokens == 3 and tr.num_layers == 2 and tr.k == 2
    assert tr.loads().tolist() == [[3, 2, 1], [2, 1, 3]]
    assert tr.top1.tolist() == [[0, 2], [0, 2], [1, 0]]
    b = tr.batches(2)
    assert [x.num_tokens for x in b] == [2]  # sequence 0 (2 tokens); the rest is dropped
    assert [x.num_tokens for x in tr.batches(1)] == [2, 1]
    a, c = tr.split(0.5)
    assert a.num_tokens == 2 and c.num_tokens == 1 and c.seq_ids.tolist() == [1]
    with pytest.raises(ValueError, match="strictly between"):
        tr.split(1.0)


@pytest.mark.parametrize("experts, E, seq, match", [
    (np.zeros((3, 2), np.int64), 2, None, r"\[T, L, k\]"),
    (np.zeros((3, 2, 1), np.float32), 2, None, "integer expert ids"),
    (np.full((3, 2, 1), 5), 4, None, "outside 0..3"),
    (np.array([[[1, 1]]]), 4, None, "repeats an expert.*token 0 at layer 0"),
    (np.zeros((2, 1, 3), np.int64), 2, None, "fewer than k=3"),
    (np.zeros((3, 1, 1), np.int64), 2, np.array([0, 1]), "seq_ids' must have shape"),
    (np.zeros((3, 1, 1), np.int64), 2, np.array([1, 0, 2]), "non-decreasing"),
    (np.zeros((3, 0, 1), np.int64), 2, None, "at least one layer"),
])
def test_trace_validation(experts, E, seq, match):
    with pytest.raises(ValueError, match=match):
        RoutingTrace(experts, E, "x", seq)


def test_trace_file_round_trip(tmp_path):
    tr = synthetic_trace(SyntheticTraceConfig(num_tokens=300, num_layers=3, seq_len=50), seed=3)
    path = tmp_path / "t.npz"
    save_trace(path, tr)
    back = load_trace(path)
    assert np.array_equal(back.experts, tr.experts) and back.num_experts == tr.num_experts
    assert np.array_equal(back.seq_ids, tr.seq_ids) and back.source == tr.source
    assert back.source.startswith("synthetic:") and "seed=3" in back.source
    plain = RoutingTrace(tr.experts[:5], tr.num_experts)
    save_trace(tmp_path / "p.npz", plain)
    assert load_trace(tmp_path / "p.npz").seq_ids is None


def _write(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)


GOOD = dict(experts=np.zeros((4, 2, 1), np.int64), num_experts=np.int64(3),
            num_layers=np.int64(2), k=np.int64(1), source=np.str_("x"),
            format_version=np.int64(1))


@pytest.mark.parametrize("change, match", [
    (dict(experts=None), "missing key 'experts'"),
    (dict(format_version=np.int64(2)), "format_version 2 is not supported"),
    (dict(num_layers=np.int64(3)), "'num_layers' is 3 but 'experts' has 2"),
    (dict(k=np.int64(2)), "'k' is 2 but 'experts' has 1"),
    (dict(num_experts=np.array([3, 3])), "'num_experts' must be an integer scalar"),
    (dict(experts=np.full((4, 2, 1), 3)), "outside 0..2"),
    (dict(seq_ids=np.array([0, 1, 0, 1])), "non-decreasing"),
])
def test_malformed_trace_files(tmp_path, change, match):
    arrays = {**GOOD, **change}
    arrays = {k: v for k, v in arrays.items() if v is not None}
    path = tmp_path / "bad.npz"
    _write(path, **arrays)
    with pytest.raises(ValueError, match=match) as info:
        load_trace(path)
    assert str(path) in str(info.value)


def test_unreadable_trace_files(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_trace(tmp_path / "none.npz")
    (tmp_path / "junk.npz").write_text("not a zip")
    with pytest.raises(ValueError, match="not a readable npz"):
        load_trace(tmp_path / "junk.npz")


def test_synthetic_trace_is_seeded_and_valid():
    cfg = SyntheticTraceConfig(num_tokens=500, num_layers=4, num_experts=8, k=3, seq_len=32)
    a, b, c = synthetic_trace(cfg, 1), synthetic_trace(cfg, 1), synthetic_trace(cfg, 2)
    assert a.experts.shape == (500, 4, 3)
    assert np.array_equal(a.experts, b.experts) and not np.array_equal(a.experts, c.experts)
    assert a.seq_ids.tolist() == (np.arange(500) // 32).tolist()
    # distinct top-k is checked by RoutingTrace itself; the expert range too
    assert a.experts.min() >= 0 and a.experts.max() < 8


def test_synthetic_stickiness_parameter():
    base = dict(num_tokens=2000, num_layers=4, num_experts=8, k=2)
    always = synthetic_trace(SyntheticTraceConfig(stickiness=1.0, **base), 0)
    assert (always.top1 == always.top1[:, :1]).all()  # the same expert all the way
    perm = synthetic_trace(SyntheticTraceConfig(stickiness=1.0, related="permuted", **base), 0)
    for l in range(1, 4):  # the top-1 follows a fixed bijection from layer to layer
        pairs = set(zip(perm.top1[:, l - 1].tolist(), perm.top1[:, l].tolist()))
        assert len(pairs) == len({p for p, _ in pairs}) == len({n for _, n in pairs})
    never = trace_stats(synthetic_trace(SyntheticTraceConfig(stickiness=0.0, **base), 0))
    some = trace_stats(synthetic_trace(SyntheticTraceConfig(stickiness=0.5, **base), 0))
    assert some["stickiness"] > never["stickiness"] + 0.3


def test_synthetic_defaults_match_lina_figures():
    """Busiest expert 4-5.6x the mean load; ~42% top-1 same-expert stickiness."""
    st = trace_stats(synthetic_trace(SyntheticTraceConfig(num_tokens=16384), 0), 512)
    assert 4.0 <= st["max_over_mean"] <= 5.6
    assert 4.0 <= st["batch_max_over_mean"] <= 5.6
    assert 0.38 <= st["stickiness"] <= 0.46


@pytest.mark.parametrize("kw, match", [
    (dict(k=20), "exceeds num_experts"),
    (dict(popularity="pareto"), "popularity must be one of"),
    (dict(related="other"), "related must be one of"),
    (dict(stickiness=1.5), "probability"),
    (dict(num_tokens=0), "num_tokens must be a positive int"),
    (dict(cluster_concentration=0.0), "cluster_concentration must be > 0"),
    (dict(zipf_s=float("nan")), "zipf_s must be >= 0"),
])
def test_synthetic_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        SyntheticTraceConfig(**kw)


def test_lognormal_popularity_runs():
    tr = synthetic_trace(SyntheticTraceConfig(popularity="lognormal", num_tokens=400), 0)
    assert trace_stats(tr)["max_over_mean"] > 1.0


# --------------------------------------------------------------------------- estimator
def test_estimator_hand_worked_tables_and_backoff():
    # E=3, L=2, k=1. Layer-0 expert 0 -> next 1, 1, 2 (3 tokens); expert 1 -> next 0.
    top1 = np.array([[0, 1], [0, 1], [0, 2], [1, 0]])
    est = PopularityEstimator.fit(trace_from_top1(top1, 3), max_path=1)
    np.testing.assert_allclose(est.marginal_LE, [[0.75, 0.25, 0.0], [0.25, 0.5, 0.25]])
    dist, used = est.token_distribution(np.array([[0], [1], [2]]), 1, return_used=True)
    np.testing.assert_allclose(dist, [[0, 2 / 3, 1 / 3], [1, 0, 0], [0.25, 0.5, 0.25]])
    assert used.tolist() == [1, 1, 0]  # path (2) was never seen: the layer's marginal
    np.testing.assert_allclose(est.estimate_load(np.array([[0], [0], [1]]), 1), [1, 4 / 3, 2 / 3])
    # layer 0 has no history: T x marginal
    np.testing.assert_allclose(est.estimate_load(np.zeros((2, 0), np.int64), 0), [1.5, 0.5, 0])


def test_backoff_to_shorter_paths_and_min_count():
    # L=3: path (0, 1) at layer 2 seen twice, (1, 1) once
    top1 = np.array([[0, 1, 2], [0, 1, 2], [1, 1, 0], [2, 0, 1]])
    est = PopularityEstimator.fit(trace_from_top1(top1, 3), max_path=2)
    _, used = est.token_distribution(np.array([[0, 1], [2, 1], [2, 2]]), 2, return_used=True)
    assert used.tolist() == [2, 1, 0]  # (2,1) unseen -> path (1); (2,2) and (2) unseen
    d = est.token_distribution(np.array([[2, 1]]), 2)
    np.testing.assert_allclose(d, [[1 / 3, 0, 2 / 3]])  # next after "1": 2, 2, 0
    strict = PopularityEstimator.fit(trace_from_top1(top1, 3), max_path=2, min_count=2)
    _, used = strict.token_distribution(np.array([[0, 1], [1, 1]]), 2, return_used=True)
    assert used.tolist() == [2, 1]  # (1,1) seen once < 2: backs off to (1), seen 3 times


def _xor_trace(T, seed):
    """Layer 2 = (layer0 + layer1) mod 4: known from a path of 2, not from a path of 1."""
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, 4, T), rng.integers(0, 4, T)
    return trace_from_top1(np.stack([a, b, (a + b) % 4], axis=1), 4)


def test_deterministic_paths_are_estimated_exactly():
    est = PopularityEstimator.fit(_xor_trace(400, 0), max_path=2)
    test = _xor_trace(64, 1)
    actual = test.loads()[2]
    np.testing.assert_allclose(est.estimate_load(test.top1, 2, path_length=2), actual)
    acc = estimation_accuracy(est, [test.select(slice(i, i + 16)) for i in range(0, 64, 16)],
                              [1, 2], top=1, layers=[2])
    assert acc[2] == 1.0 and acc[1] < 1.0
    # at layer 1 (only one layer of history) a path of 2 backs off to 1
    _, used = est.token_distribution(test.top1, 1, 2, return_used=True)
    assert (used == 1).all()


def test_accuracy_grows_with_path_length_on_sticky_traces():
    tr = synthetic_trace(SyntheticTraceConfig(num_tokens=24576, num_layers=8), seed=0)
    prof, test = tr.split(0.75)
    est = PopularityEstimator.fit(prof, max_path=4)
    batches = test.batches(512)
    acc = estimation_accuracy(est, batches, [1, 2, 4], top=2 * tr.k)
    assert acc[1] < acc[2] < acc[4]
    # and a path beats the layer's marginal (the historical mean, eplb's input)
    marg = np.mean([topk_overlap(est.marginal_LE[j], b.loads()[j], 2 * tr.k)
                    for b in batches for j in range(1, b.num_layers)])
    assert acc[1] > marg


def test_estimator_errors():
    tr = trace_from_top1(np.array([[0, 1, 2]]), 3)
    est = PopularityEstimator.fit(tr, max_path=2)
    with pytest.raises(ValueError, match="path_length must lie in 1..2"):
        est.estimate_load(np.array([[0, 1]]), 2, path_length=3)
    with pytest.raises(ValueError, match="needs the top-1 experts of layers 0..1"):
        est.estimate_load(np.array([[0]]), 2)
    with pytest.raises(ValueError, match="outside 0..2"):
        est.estimate_load(np.array([[0, 7]]), 2)
    with pytest.raises(ValueError, match="layer must lie in 0..2"):
        est.estimate_load(np.array([[0, 1, 2]]), 3)
    with pytest.raises(ValueError, match="empty trace"):
        PopularityEstimator.fit(RoutingTrace(np.zeros((0, 2, 1), np.int64), 3))
    with pytest.raises(ValueError, match="64-bit"):
        PopularityEstimator.fit(RoutingTrace(np.zeros((1, 2, 1), np.int64), 2 ** 20), max_path=4)
    with pytest.raises(ValueError, match="max_path must be a positive int"):
        PopularityEstimator.fit(tr, max_path=0)
    with pytest.raises(TypeError, match="RoutingTrace"):
        PopularityEstimator.fit(np.zeros((1, 2, 1)))


# --------------------------------------------------------------------------- streaming
def _tables_equal(a: PopularityEstimator, b: PopularityEstimator) -> None:
    assert a.num_tokens == b.num_tokens and np.array_equal(a.marginal_LE, b.marginal_LE)
    assert a._tables.keys() == b._tables.keys()
    for key, ta in a._tables.items():
        tb = b._tables[key]
        assert np.array_equal(ta.codes_U, tb.codes_U), key
        assert np.array_equal(ta.count_U, tb.count_U) and np.array_equal(ta.sum_UE, tb.sum_UE), key


def test_update_equals_fit_on_the_concatenation_exactly():
    tr = synthetic_trace(SyntheticTraceConfig(num_tokens=3000, num_layers=5, num_experts=8, k=2), 0)
    whole = PopularityEstimator.fit(tr, max_path=3)
    cuts = [0, 1, 100, 613, 1000, 1999, 2500, 3000]  # uneven batches, one of one token
    parts = [tr.select(slice(a, b)) for a, b in zip(cuts, cuts[1:])]
    stream = PopularityEstimator(8, 5, 2, max_path=3, max_entries=None)
    for i, b in enumerate(parts):  # RoutingTraces and plain arrays, mixed
        stream.update(b if i % 2 else b.experts)
    _tables_equal(stream, whole)
    hist = synthetic_trace(SyntheticTraceConfig(num_tokens=200, num_layers=5, num_experts=8, k=2), 1)
    for j in range(5):
        assert np.array_equal(stream.estimate_load(hist.top1, j), whole.estimate_load(hist.top1, j))
    # the default cap (4096 paths per table) is not reached here: the same tables
    capped = PopularityEstimator(8, 5, 2, max_path=3)
    for b in parts:
        capped.update(b)
    _tables_equal(capped, whole)


def test_update_accepts_a_torch_tensor_and_checks_it():
    torch = pytest.importorskip("torch")
    ex = torch.tensor([[[0, 1], [2, 0]], [[0, 2], [2, 1]]])  # [T=2, L=2, k=2]
    est = PopularityEstimator(3, 2, 2, max_path=1).update(ex)
    np.testing.assert_allclose(est.marginal_LE, [[1, 0.5, 0.5], [0.5, 0.5, 1]])
    np.testing.assert_allclose(est.estimate_load(torch.tensor([[0]]), 1), [0.5, 0.5, 1])
    with pytest.raises(ValueError, match="built for E=3, L=2, k=2"):
        est.update(np.zeros((4, 3, 2), np.int64) + np.arange(2))
    with pytest.raises(ValueError, match="outside 0..2"):
        est.update(np.full((1, 2, 2), 3) - np.arange(2) + 1)
    with pytest.raises(ValueError, match=r"\[T, L, k\]"):
        est.update(np.zeros((4, 2), np.int64))
    with pytest.raises(ValueError, match="seen no tokens"):
        PopularityEstimator(3, 2, 2).estimate_load(np.zeros((1, 1), np.int64), 1)
    for kw, match in ((dict(decay=0.0), r"decay .* in \(0, 1\]"), (dict(decay=1.5), "decay"),
                      (dict(max_entries=0), "max_entries must be a positive int"),
                      (dict(min_count=0), "min_count must be a positive number")):
        with pytest.raises(ValueError, match=match):
            PopularityEstimator(3, 2, 2, **kw)


def test_decay_forgets_an_old_pattern():
    """E=3, L=2, k=1. First 10 batches send path (0) to expert 1 at layer 1, then 3
    batches send it to expert 2. Without decay the old pattern (10 batches) still wins;
    with decay 0.5 after 3 new batches the old one weighs 10-ish * 0.5**3 < 1.25 batches
    against 1 + 0.5 + 0.25 = 1.75 new ones: expert 2 takes over."""
    old = trace_from_top1(np.array([[0, 1]] * 8), 3)
    new = trace_from_top1(np.array([[0, 2]] * 8), 3)
    keep = PopularityEstimator(3, 2, 1, max_path=1)
    fade = PopularityEstimator(3, 2, 1, max_path=1, decay=0.5)
    for _ in range(10):
        keep.update(old), fade.update(old)
    for est in (keep, fade):
        assert topk_experts(est.estimate_load(np.array([[0]]), 1), 1).tolist() == [1]
    for _ in range(3):
        keep.update(new), fade.update(new)
    assert topk_experts(keep.estimate_load(np.array([[0]]), 1), 1).tolist() == [1]
    d = fade.token_distribution(np.array([[0]]), 1)[0]
    w_old = sum(0.5 ** i for i in range(3, 13))  # batch weights: newest 1, then halving
    w_new = 1 + 0.5 + 0.25
    np.testing.assert_allclose(d, [0, w_old / (w_old + w_new), w_new / (w_old + w_new)])
    assert d[2] > d[1]
    assert fade.num_tokens == pytest.approx(8 * (w_old + w_new))
    # a decayed path that falls under min_count backs off to the marginal
    strict = PopularityEstimator(3, 2, 1, max_path=1, decay=0.5, min_count=4)
    strict.update(trace_from_top1(np.array([[1, 0]] * 4 + [[0, 1]] * 8), 3))
    for _ in range(2):
        strict.update(new)
    _, used = strict.token_distribution(np.array([[1], [0]]), 1, return_used=True)
    assert used.tolist() == [0, 1]  # path (1): 4 * 0.25 = 1 < 4 tokens; path (0) still held


def test_max_entries_keeps_the_heaviest_paths():
    # layer 1 of E=4, k=1: path (0) 5 tokens, (1) 3, (2) 2, (3) 1; a cap of 2 keeps 0 and 1
    top1 = np.array([[0, 1]] * 5 + [[1, 2]] * 3 + [[2, 3]] * 2 + [[3, 0]])
    est = PopularityEstimator(4, 2, 1, max_path=1, max_entries=2).update(trace_from_top1(top1, 4))
    assert est.num_paths() == {(1, 1): 2}
    assert est._tables[(1, 1)].codes_U.tolist() == [0, 1]
    _, used = est.token_distribution(np.array([[0], [1], [2], [3]]), 1, return_used=True)
    assert used.tolist() == [1, 1, 0, 0]  # dropped paths back off to the marginal
    # the marginal itself keeps every token
    np.testing.assert_allclose(est.marginal_LE[1] * 11, [1, 5, 3, 2])
    # memory stays bounded however many distinct paths stream in
    tr = synthetic_trace(SyntheticTraceConfig(num_tokens=4000, num_layers=4, num_experts=16), 2)
    big = PopularityEstimator(16, 4, 2, max_path=3, max_entries=50)
    for b in tr.batches(500):
        big.update(b)
    assert max(big.num_paths().values()) == 50
    assert PopularityEstimator.fit(tr, max_path=3).num_paths()[(3, 3)] > 50


def test_replan_threshold_default_is_the_named_constant():
    import commsched.moe as moe
    from commsched.moe.infer import InferConfig
    from commsched.moe.infer.policy import STRATEGIES

    assert moe.DEFAULT_REPLAN_THRESHOLD is DEFAULT_REPLAN_THRESHOLD
    assert InferConfig().strategy.threshold == DEFAULT_REPLAN_THRESHOLD
    assert STRATEGIES["lina-node"]().threshold == DEFAULT_REPLAN_THRESHOLD
    est, half = [10, 9, 8, 7, 1, 1, 1, 1], [10, 9, 0, 0, 8, 7, 0, 0]
    assert phase2_decision(est, half, k=2) == phase2_decision(est, half, 2, DEFAULT_REPLAN_THRESHOLD)


# --------------------------------------------------------------------------- phase 2
def test_topk_and_overlap():
    assert topk_experts([1, 5, 5, 0], 2).tolist() == [1, 2]  # tie: lower id first
    assert topk_experts([3, 1], 5).tolist() == [0, 1]
    assert topk_overlap([9, 8, 1, 0], [0, 8, 9, 1], 2) == 0.5
    assert topk_overlap([1, 2, 3], [1, 2, 3], 3) == 1.0
    with pytest.raises(ValueError, match="differ in shape"):
        topk_overlap([1, 2], [1, 2, 3], 1)
    with pytest.raises(ValueError, match="load vectors are empty"):
        topk_overlap([], [], 2)


def test_phase2_rule():
    est = [10, 9, 8, 7, 1, 1, 1, 1]
    same = [12, 7, 9, 8, 0, 0, 2, 0]     # top-4 {0,1,2,3}: overlap 1
    half = [10, 9, 0, 0, 8, 7, 0, 0]     # top-4 {0,1,4,5}: overlap 0.5
    none = [0, 0, 0, 0, 5, 5, 5, 5]      # overlap 0
    d = phase2_decision(est, same, k=2, threshold=0.75)
    assert d.overlap == 1.0 and not d.replan
    d = phase2_decision(est, half, k=2, threshold=0.75)
    assert d.overlap == 0.5 and d.replan
    assert not phase2_decision(est, half, k=2, threshold=0.5).replan  # equal: keep
    assert not phase2_decision(est, none, k=2, threshold=0.0).replan  # 0: never re-plan
    assert phase2_decision(est, half, k=2, threshold=1.0).replan
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        phase2_decision(est, same, k=2, threshold=1.2)
    with pytest.raises(ValueError, match="k \\(experts per token\\)"):
        phase2_decision(est, same, k=0, threshold=0.5)
