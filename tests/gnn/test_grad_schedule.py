"""``TrainConfig.schedule``: the GNN gradient reduction through the core's step interface
(``make_grad_step``, as MoE training). On 2 and 3 gloo ranks every schedule trains exactly
as the flat allreduce (2 ranks: bit for bit; 3: to float32 rounding), the backward halo
exchanges reach the scheduler as its all-to-alls, and under ``lina`` no micro-op is on
the wire while one of them is."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from commsched.gnn.train.trainer import TrainConfig
from commsched.priority.policy import SCHEDULES as REGISTERED
from commsched.priority.policy import FifoConfig, FlatConfig, LinaConfig
from tests.mp import run_ranks

SCHEDULES = [s for s in REGISTERED if s != "flat"]


def test_grad_schedule_is_checked_and_on_the_command_line():
    from commsched.gnn.train.cli import build_parser, config_from_args

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--grad-schedule", "lifo"])
    with pytest.raises(TypeError, match="schedule must be a config of SCHEDULES"):
        TrainConfig(schedule="lina")
    a = build_parser().parse_args(["--grad-schedule", "lina-overlap", "--credit-bytes", "4096"])
    assert config_from_args(a).schedule == REGISTERED["lina-overlap"](credit_bytes=4096)
    assert TrainConfig().schedule == FlatConfig() and config_from_args(build_parser().parse_args([])).schedule == FlatConfig()
    with pytest.raises(ValueError, match="--credit-bytes belongs to --grad-schedule lina, lina-overlap, not to "
                                         "--grad-schedule fifo"):
        config_from_args(build_parser().parse_args(["--grad-schedule", "fifo", "--credit-bytes", "1"]))

    from commsched.bench.gnn.compare import bench_run
    from commsched.gnn.exchange.modes import mode_config

    assert bench_run("vanilla-lina") == (TrainConfig(mode="vanilla", schedule=LinaConfig()),
                                         ("--grad-schedule", "lina"))
    assert bench_run("adaqp-hp-fifo") == (TrainConfig(mode="adaqp", schedule=FifoConfig(), exchange=mode_config(
        "adaqp")), ("--partition-method", "metis-hosts", "--grad-schedule", "fifo"))


def _train(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
    from commsched.gnn.graph.partition import make_parts, partition_nodes
    from commsched.gnn.train.trainer import Trainer, run_training

    g = synthetic_graph(SyntheticSpec(num_nodes=300, num_edges=1500, num_features=24, num_classes=3, seed=2))
    part = make_parts(g, partition_nodes(g, world, "metis", 0), world)[rank]
    base = TrainConfig(layers=3, hidden=32, epochs=4, seed=3)
    out: dict = {}
    for sched in REGISTERED:
        cfg = dataclasses.replace(base, schedule=REGISTERED[sched]())
        m, tr = run_training(cfg, part)
        out[sched] = {"loss": m["loss"], "params": [p.detach().clone() for p in tr.model.parameters()]}
    # one epoch by hand under lina: what the scheduler saw
    tr = Trainer(dataclasses.replace(base, schedule=LinaConfig()), part)
    try:
        tr.train_epoch()
        st, recs = tr.last_schedule, tr.grad_step.records
    finally:
        tr.close()
    a2a = [(r.start_s, r.end_s) for r in recs if r.kind == "a2a"]
    ar = [(r.start_s, r.end_s) for r in recs if r.kind == "allreduce"]
    out["lina_seen"] = {"a2a_count": st["a2a_count"], "allreduce_count": st["allreduce_count"],
                        "ar_started_during_a2a": sum(any(s < x < e for s, e in a2a) for x, _ in ar),
                        "ar_bytes": sum(r.nbytes for r in recs if r.kind == "allreduce")}
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in tr.model.parameters())
    dist.barrier()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_schedule_trains_as_the_flat_allreduce(world):
    res = run_ranks(world, _train, timeout_s=300)
    for rank, out in enumerate(res):
        ref = out["flat"]
        for sched in SCHEDULES:
            got = out[sched]
            if world == 2:  # a + b, whatever the cut: bit for bit
                assert got["loss"] == ref["loss"], (sched, rank)
                assert all(torch.equal(a, b) for a, b in zip(got["params"], ref["params"])), (sched, rank)
            else:
                np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5, err_msg=sched)
                for a, b in zip(got["params"], ref["params"]):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        seen = out["lina_seen"]
        # 3 layers: the backward exchanges of layers 2 and 1 (the input layer's rows need none)
        assert seen["a2a_count"] == 2, seen
        assert seen["ar_bytes"] == out["param_bytes"] and seen["allreduce_count"] >= 2, seen
        assert seen["ar_started_during_a2a"] == 0, seen


# --------------------------------------------------------------------------- --grad-bits
def test_grad_bits_is_checked_and_on_the_command_line():
    from commsched.bench.gnn.compare import bench_run
    from commsched.gnn.exchange.modes import mode_config
    from commsched.gnn.train.cli import build_parser

    assert TrainConfig().grad_bits == 32
    with pytest.raises(ValueError, match="--grad-bits must be one of 32, 16, 8, 4, 2"):
        TrainConfig(grad_bits=12)
    assert TrainConfig(grad_bits=8, schedule=LinaConfig()).grad_bits == 8  # with every schedule
    assert build_parser().parse_args(["--grad-bits", "8"]).grad_bits == 8
    assert TrainConfig(grad_bits=8).record()["grad_bits"] == 8  # the ranks compare it
    assert bench_run("adaptive-g8") == (TrainConfig(mode="adaptive", grad_bits=8), ())
    assert bench_run("adaptive-wsign-g16") == (TrainConfig(mode="adaptive", grad_bits=16, exchange=mode_config(
        "adaptive", warmup="sign")), ())
    # the compressed reduction with a schedule: both flags on the training command
    cfg, own = bench_run("vanilla-lina-g8")
    assert cfg == TrainConfig(mode="vanilla", grad_bits=8, schedule=LinaConfig()) and own == ("--grad-schedule", "lina")


def _train_bits(rank: int, world: int) -> dict:
    from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
    from commsched.gnn.graph.partition import make_parts, partition_nodes
    from commsched.gnn.train.trainer import run_training

    g = synthetic_graph(SyntheticSpec(num_nodes=300, num_edges=1500, num_features=24, num_classes=3, seed=2))
    part = make_parts(g, partition_nodes(g, world, "metis", 0), world)[rank]
    out = {}
    for bits, sched in ((32, FlatConfig()), (16, FlatConfig()), (8, FlatConfig()), ("lina-8", LinaConfig())):
        cfg = TrainConfig(layers=2, hidden=32, epochs=6, seed=3, grad_bits=8 if bits == "lina-8" else bits, schedule=sched)
        m, tr = run_training(cfg, part)
        out[bits] = {"loss": m["loss"], "params": [p.detach().clone() for p in tr.model.parameters()]}
    return out


@pytest.mark.slow
def test_compressed_gradient_allreduce_keeps_the_replicas_in_step():
    res = run_ranks(2, _train_bits, timeout_s=300)
    for bits in (16, 8, "lina-8"):  # --grad-bits under the flat allreduce and a schedule
        # the same parameters on both ranks after 6 updates from compressed sums
        assert all(torch.equal(a, b) for a, b in zip(res[0][bits]["params"], res[1][bits]["params"])), bits
        exact, got = res[0][32], res[0][bits]
        assert got["loss"][0] == pytest.approx(exact["loss"][0], rel=1e-6)  # the loss is summed exactly
        # close to the exact run's training, not equal to it
        np.testing.assert_allclose(got["loss"], exact["loss"], rtol=0.05)
        assert not all(torch.equal(a, b) for a, b in zip(got["params"], exact["params"])), bits
