"""The planner as a drop-in EPLB policy (``rebalance_experts``): the properties serving
engines rely on, the errors, DeepSeek's published example, and EPLB's own maximum GPU
load as a bound on random instances."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from commsched.moe.placement import eplb_placement, plan_slots, rebalance_experts
from commsched.moe.placement.planner import fill_slots
from commsched.moe.placement.search import ShareSearch
from commsched.moe.placement.types import matrix_loads
from tests.moe.placement_reference import reference_step

# DeepSeek EPLB's README (github.com/deepseek-ai/EPLB, "Interface and Example"): 2 layers x
# 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs, and the phy2log it prints
README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def gpu_loads(weight, phy2log, num_gpus) -> np.ndarray:
    """[L, num_gpus] load of each GPU: each slot carries its expert's load over its replicas."""
    w = np.asarray(weight, dtype=np.float64)
    p = np.asarray(phy2log)
    cnt = np.stack([np.bincount(row, minlength=w.shape[1]) for row in p])
    share = np.take_along_axis(w / cnt, p, axis=1)
    return share.reshape(p.shape[0], num_gpus, -1).sum(axis=2)


def check_output(weight, R, G, M, N, out) -> None:
    """Everything an engine reads from EPLB's result, and the hierarchical locality."""
    phy2log, log2phy, logcnt = out
    L, E = np.asarray(weight).shape
    for t in out:
        assert isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.device.type == "cpu"
    X = int(logcnt.max())
    assert phy2log.shape == (L, R) and log2phy.shape == (L, E, X) and logcnt.shape == (L, E)
    p, l2p, c = phy2log.numpy(), log2phy.numpy(), logcnt.numpy()
    assert ((p >= 0) & (p < E)).all()  # every physical slot of every GPU holds an expert
    assert (c >= 1).all() and (c.sum(axis=1) == R).all()
    for layer in range(L):
        assert (np.bincount(p[layer], minlength=E) == c[layer]).all()
        for e in range(E):
            slots = np.flatnonzero(p[layer] == e)
            assert (l2p[layer, e, :c[layer, e]] == slots).all()
            assert (l2p[layer, e, c[layer, e]:] == -1).all()
    if G % M == 0:  # each group on one node only, G/M groups a node
        size, per_node = E // G, R // M
        for layer in range(L):
            groups = p[layer].reshape(M, per_node) // size
            node_groups = [set(g.tolist()) for g in groups]
            assert all(len(s) == G // M for s in node_groups)
            assert set().union(*node_groups) == set(range(G))


def eplb_max(weight, R, G, M, N) -> np.ndarray:
    """[L] EPLB's maximum GPU load per layer (the package's rewrite of its algorithm)."""
    return np.array([eplb_placement(row, N, R // N, num_nodes=M, num_groups=G).max_load
                     for row in np.asarray(weight, dtype=np.float64)])


def test_readme_example_is_no_worse_than_eplbs_printed_result():
    # the reference rewrite prints exactly EPLB's README output ...
    for row, printed in zip(README_WEIGHT, README_PHY2LOG):
        slots = eplb_placement(row, 8, 2, num_nodes=2, num_groups=4).slots
        assert [e for s in slots for e in s] == printed
    out = rebalance_experts(torch.tensor(README_WEIGHT), 16, 4, 2, 8)
    check_output(README_WEIGHT, 16, 4, 2, 8, out)
    # ... and no GPU is busier than the busiest of that output, layer by layer (156, 179.5)
    ours = gpu_loads(README_WEIGHT, out[0], 8).max(axis=1)
    theirs = gpu_loads(README_WEIGHT, README_PHY2LOG, 8).max(axis=1)
    assert theirs.tolist() == [156.0, 179.5]
    assert (ours <= theirs + 1e-9).all()
    # the global policy (4 groups do not split over 3 nodes): no worse than EPLB's global one
    out = rebalance_experts(torch.tensor(README_WEIGHT), 16, 4, 3, 8)
    check_output(README_WEIGHT, 16, 4, 3, 8, out)
    assert (gpu_loads(README_WEIGHT, out[0], 8).max(axis=1) <= eplb_max(README_WEIGHT, 16, 4, 3, 8) + 1e-9).all()


def test_random_instances_never_worse_than_eplb():
    rng = np.random.default_rng(3)
    wins = 0
    for trial in range(240):
        M = int(rng.choice([1, 2]))
        N = M * int(rng.choice([1, 2, 3]))
        G = M * int(rng.choice([1, 2])) if trial % 3 else 3  # every third: 3 groups (global when M=2)
        E = G * int(rng.choice([1, 2, 3]))
        S = -(-E // N) + int(rng.integers(0, 3))
        w = (rng.lognormal(0, 1.5, (1, E)) * 100 if trial % 2 else rng.integers(0, 50, (1, E))).astype(np.float32)
        out = rebalance_experts(torch.from_numpy(w), N * S, G, M, N)
        check_output(w, N * S, G, M, N, out)
        ours, theirs = gpu_loads(w, out[0], N).max(axis=1), eplb_max(w, N * S, G, M, N)
        assert (ours <= theirs * (1 + 1e-9)).all(), (trial, ours, theirs)
        wins += int((ours < theirs * (1 - 1e-9)).any())
    assert wins > 60  # the planner's search, not EPLB's layout handed back


@pytest.mark.parametrize("args, match", [
    ((16, 4, 2, 6), "multiple of num_gpus"),          # 16 replicas over 6 GPUs
    ((10, 4, 2, 2), "cannot hold 12 logical experts"),
    ((15, 5, 5, 5), "must divide the 12 logical experts"),  # hierarchical: 5 groups of 12
    ((12, 4, 4, 6), "multiple of num_nodes"),         # hierarchical: 4 nodes of 6 GPUs
])
def test_impossible_shapes_are_value_errors(args, match):
    w = torch.tensor(README_WEIGHT)
    with pytest.raises(ValueError, match=match):
        rebalance_experts(w, *args)


def test_other_bad_inputs():
    w = torch.tensor(README_WEIGHT)
    rebalance_experts(w, 12, 4, 3, 6)  # groups that do not split over nodes: global, as EPLB
    with pytest.raises(ValueError, match=r"\[layers, num_logical_experts\]"):
        rebalance_experts(w[0], 16, 4, 2, 8)
    with pytest.raises(ValueError, match="finite"):
        rebalance_experts(torch.tensor([[1.0, float("nan")]]), 2, 1, 1, 1)
    with pytest.raises(ValueError, match=">= 0"):
        rebalance_experts(torch.tensor([[1.0, -2.0]]), 2, 1, 1, 1)
    with pytest.raises(ValueError, match="num_gpus must be at least 1"):
        rebalance_experts(w, 16, 4, 2, 0)
    with pytest.raises(TypeError, match="num_replicas must be an int"):
        rebalance_experts(w, 16.0, 4, 2, 8)


def test_plan_slots_fills_every_slot_and_zero_loads():
    C = plan_slots([0.0, 0.0, 0.0], 2, 2)  # no load: EPLB's layout, every slot filled
    assert (C.sum(axis=0) == 2).all() and (C.sum(axis=1) >= 1).all()
    out = rebalance_experts(torch.zeros(1, 3), 4, 1, 1, 2)
    check_output(np.zeros((1, 3)), 4, 1, 1, 2, out)


def test_fill_slots_hand_worked():
    # device 1 has a free slot: a second share of the heavy expert 0 there halves it
    load = np.array([10.0, 4.0, 3.0])
    C = np.array([[1, 0], [1, 0], [0, 1]])
    F = fill_slots(C, load, 2)
    assert F.tolist() == [[1, 1], [1, 0], [0, 1]] and matrix_loads(F, load).tolist() == [9.0, 8.0]
    # device 1 is the busy one: a second share of expert 2 (all of it on device 1) changes
    # no load, where any other share would move load onto device 1
    load = np.array([1.0, 1.0, 10.0])
    F = fill_slots(C, load, 2)
    assert F.tolist() == [[1, 0], [1, 0], [0, 2]] and matrix_loads(F, load).tolist() == [2.0, 10.0]


def test_physical_search_step_equals_its_reference_and_keeps_slots():
    """With a slot per share the vectorised step makes the twin's moves, and no device ever
    holds more than S shares."""
    rng = np.random.default_rng(7)
    moves: set[str] = set()
    for trial in range(30):
        E = int(rng.choice([4, 6, 8]))
        N = int(rng.choice([2, 3, 4]))
        S = -(-E // N) + int(rng.integers(0, 3))
        load = rng.lognormal(0, 1.5, E) * 100 if trial % 2 else rng.integers(0, 50, E).astype(float)
        full = np.zeros((E, N), dtype=np.int64)
        for d, row in enumerate(eplb_placement(load, N, S).slots):
            np.add.at(full[:, d], list(row), 1)
        sparse = np.zeros((E, N), dtype=np.int64)  # one share each, round robin: free slots
        sparse[np.arange(E), np.arange(E) % N] = 1
        for C in (full, sparse):
            a, b = ShareSearch([C], load, S, physical=True), C.copy()
            for _ in range(200):
                (ma,), mb = a.step(), reference_step(b, load, S, physical=True)
                assert ma == mb and (a.C[0] == b).all()
                assert (b.sum(axis=0) <= S).all() and (b.sum(axis=1) >= 1).all()
                if ma is None:
                    break
                moves.add(ma[0])
    assert moves >= {"transfer", "swap", "retarget"}
