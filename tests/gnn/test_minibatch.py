"""``--mode minibatch``: the neighbour sampler on hand-worked graphs, one rank with every
fan-out -1 and one batch equal to full-graph vanilla training, two ranks training in step,
and the command line / the time-to-accuracy bench accepting the mode."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from commsched.gnn.exchange.modes import MiniBatchConfig
from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
from commsched.gnn.graph.partition import make_parts, partition_nodes
from commsched.gnn.graph.sample import (
    InNeighbours,
    default_fanouts,
    epoch_batches,
    num_batches,
    parse_fanouts,
    sample_neighbours,
    subgraph_book,
)
from commsched.gnn.train.minibatch import run_minibatch
from commsched.gnn.train.trainer import TrainConfig, run_training
from tests.mp import run_ranks

SYN = SyntheticSpec(num_nodes=300, num_edges=1500, num_features=8, num_classes=3,
                    communities_per_class=2, signal=0.5, seed=3)

# a path 0 <- 1 <- 2 <- 3 and a star 4 <- {5, 6, 7, 8} (edges source -> target)
EDGES = np.array([[1, 0], [2, 1], [3, 2], [5, 4], [6, 4], [7, 4], [8, 4]])


def _adj():
    return InNeighbours.from_edges(EDGES[:, 0], EDGES[:, 1], 9)


def test_full_fanout_takes_every_in_neighbour_hop_by_hop():
    s = sample_neighbours(_adj(), np.array([0, 4]), (-1, -1), np.random.default_rng(0))
    # seeds first, then hop 1's new nodes (sorted), then hop 2's
    assert s.node_ids.tolist() == [0, 4, 1, 5, 6, 7, 8, 2]
    assert s.num_seeds == 2 and s.num_expanded == 7
    edges = {(int(s.node_ids[a]), int(s.node_ids[b])) for a, b in zip(s.edge_src, s.edge_dst)}
    assert edges == {(1, 0), (5, 4), (6, 4), (7, 4), (8, 4), (2, 1)}
    assert list(zip(s.edge_dst, s.edge_src)) == sorted(zip(s.edge_dst, s.edge_src))
    book = subgraph_book(s, _adj().in_degree)
    # expanded nodes: the subgraph's in-degree; the last hop's node 2: the graph's (1)
    assert book.in_degree.tolist() == [1, 4, 1, 0, 0, 0, 0, 1]
    assert book.num_owned == 8 and book.num_remote == 0


def test_a_fanout_keeps_that_many_distinct_neighbours():
    adj = _adj()
    seen = set()
    for seed in range(20):
        s = sample_neighbours(adj, np.array([4]), (2,), np.random.default_rng(seed))
        srcs = sorted(int(s.node_ids[a]) for a in s.edge_src)
        assert len(srcs) == 2 and len(set(srcs)) == 2 and set(srcs) <= {5, 6, 7, 8}
        seen.add(tuple(srcs))
        assert subgraph_book(s, adj.in_degree).in_degree[0] == 2  # the mean of the sampled two
    assert len(seen) > 1  # the draws vary with the generator
    with pytest.raises(ValueError, match="distinct"):
        sample_neighbours(adj, np.array([4, 4]), (2,), np.random.default_rng(0))


def test_batches_agree_across_ranks_and_options_are_checked():
    assert num_batches([5, 2, 0], 2) == 3
    b = epoch_batches(np.array([10, 11, 12]), 2, 3, np.random.default_rng(0))
    assert [len(x) for x in b] == [2, 1, 2] and sorted(np.concatenate(b[:2]).tolist()) == [10, 11, 12]
    assert [len(x) for x in epoch_batches(np.zeros(0, np.int64), 2, 2, np.random.default_rng(0))] == [0, 0]
    assert default_fanouts(2) == (25, 10) and default_fanouts(3) == (15, 10, 5)
    assert parse_fanouts("-1,5") == (-1, 5)
    for bad in ("a,b", "0,3"):
        with pytest.raises(ValueError, match="--fanouts"):
            parse_fanouts(bad)
    with pytest.raises(ValueError, match="--batch-size"):
        MiniBatchConfig(batch_size=0)
    with pytest.raises(ValueError, match="--layers 3"):
        MiniBatchConfig(fanouts="5,5").fanouts_for(3)


def _part1(g):
    return make_parts(g, partition_nodes(g, 1, "metis", 0), 1)[0]


@pytest.mark.parametrize("model,layer_norm", [("gcn", True), ("sage", False)])
def test_one_rank_one_full_batch_equals_vanilla(model, layer_norm):
    g = synthetic_graph(SYN)
    part = _part1(g)
    base = TrainConfig(model=model, layers=2, hidden=8, epochs=4, dtype="float64", seed=2,
                       dropout=0.3, layer_norm=layer_norm)
    ref, tr_ref = run_training(base, part)
    mb = base.replace(mode="minibatch", exchange=MiniBatchConfig(fanouts="-1,-1", batch_size=10_000))
    got, tr = run_minibatch(mb, part, graph=g)
    assert got["mode"] == "minibatch" and got["minibatch"]["steps_per_epoch"] == 1
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-10)
    for (_, p), (_, q) in zip(tr_ref.model.named_parameters(), tr.model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11)
    assert got["val_acc"] == ref["val_acc"] and got["test_acc"] == ref["test_acc"]


def test_minibatch_refuses_what_it_cannot_train():
    g = synthetic_graph(SYN)
    part = _part1(g)
    cfg = TrainConfig(layers=2, hidden=8, epochs=1, mode="minibatch")
    with pytest.raises(ValueError, match="run_minibatch"):
        run_training(cfg, part)
    with pytest.raises(ValueError, match="replicated"):
        run_minibatch(cfg, part, graph=None)
    with pytest.raises(ValueError, match="own layers"):
        run_minibatch(cfg.replace(model="gat"), part, graph=g)
    with pytest.raises(ValueError, match="--fanouts"):
        TrainConfig(mode="vanilla", exchange=MiniBatchConfig(fanouts="5,5"))


def _two_ranks(rank: int, world: int) -> dict:
    g = synthetic_graph(SYN)
    part = make_parts(g, partition_nodes(g, world, "metis", 0), world)[rank]
    cfg = TrainConfig(model="sage", layers=2, hidden=16, epochs=6, lr=0.02, seed=1, dropout=0.0,
                      mode="minibatch", exchange=MiniBatchConfig(fanouts="5,3", batch_size=16))
    m, tr = run_minibatch(cfg, part, graph=g)
    return {"loss": m["loss"], "params": [p.detach().clone() for p in tr.model.parameters()],
            "steps": tr.steps_per_epoch, "seeds": len(tr.seeds), "val": m["val_acc"]}


@pytest.mark.slow
def test_two_ranks_train_in_step():
    r0, r1 = run_ranks(2, _two_ranks, timeout_s=60)
    assert r0["steps"] == r1["steps"] == -(-max(r0["seeds"], r1["seeds"]) // 16) > 1
    assert r0["loss"] == r1["loss"]
    assert r0["loss"][-1] < 0.8 * r0["loss"][0]
    for p, q in zip(r0["params"], r1["params"]):
        assert torch.equal(p, q)


def test_cli_and_time_to_accuracy_bench_accept_the_mode(tmp_path, monkeypatch, capsys):
    """The bench's variants of ``--modes vanilla,minibatch`` run through the training command
    line (in this process, one rank) and its time-to-accuracy summary takes them."""
    import argparse

    from commsched.bench.gnn import compare as bench
    from commsched.gnn.train.cli import main

    monkeypatch.setenv("COMMSCHED_PROGRESS", "0")
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    a = p.parse_args(["--metric", "time-to-acc", "--modes", "vanilla,minibatch", "--models", "sage",
                      "--syn-nodes", "200", "--syn-edges", "800", "--epochs", "2", "--hidden", "8",
                      "--layers", "2"])
    a.bandwidth = "none"
    runs = {}
    for v in bench.variants(a):
        out = tmp_path / v.name
        argv = [*v.argv, "--syn-features", "8", "--syn-classes", "3", "--device", "cpu", "--out", str(out)]
        if v.config.mode == "minibatch":
            argv += ["--fanouts", "5,5", "--batch-size", "32"]
        assert main(argv) == 0, capsys.readouterr().err
        runs[v.name] = [json.loads((out / "metrics.json").read_text())]
    m = runs["sage-minibatch"][0]
    assert m["mode"] == "minibatch" and m["minibatch"]["fanouts"] == [5, 5]
    assert m["minibatch"]["feature_store_bytes_per_rank"] > 200 * 8 * 4
    assert len(m["val_acc_per_eval"]) == 2
    s = bench.summarize(runs, a, tmp_path)
    assert "sage-minibatch" in s["time_to_acc"]["rows"] and "Time to accuracy" in s["extra_tables"]
    # a minibatch option given to another mode: one line, exit 2
    capsys.readouterr()
    assert main(["--syn-nodes", "200", "--syn-edges", "800", "--mode", "vanilla", "--fanouts", "5,5",
                 "--device", "cpu", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "--mode minibatch" in err and "Traceback" not in err


def test_resumed_run_draws_and_trains_as_the_uninterrupted_one(tmp_path):
    g = synthetic_graph(SYN)
    part = _part1(g)
    cfg = TrainConfig(model="sage", layers=2, hidden=8, epochs=4, dtype="float64", seed=3,
                      mode="minibatch", exchange=MiniBatchConfig(fanouts="4,2", batch_size=40))
    whole, _ = run_minibatch(cfg, part, graph=g)
    run_minibatch(cfg.replace(epochs=2, checkpoint_every=1), part, graph=g, out_dir=tmp_path)
    resumed, _ = run_minibatch(cfg.replace(checkpoint_every=1), part, graph=g, out_dir=tmp_path, resume=True)
    assert whole["minibatch"]["steps_per_epoch"] > 1
    assert resumed["loss"] == whole["loss"]
