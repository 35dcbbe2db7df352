"""``--resume`` is bitwise in every mode: a run stopped after 3 epochs (its checkpoint) and
resumed to 6 ends with the parameters and losses of an uninterrupted 6-epoch run, on 2
gloo ranks. Each mode's exchange keeps state across epochs (rounding counters,
error-feedback residuals, stale rows, width assignments and a re-assignment in flight):
the checkpoint holds every rank's, and the resumed run continues it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from commsched.gnn.exchange.modes import make_exchange, mode_config
from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
from commsched.gnn.graph.partition import make_parts, partition_nodes
from commsched.gnn.train.trainer import TrainConfig, run_training
from tests.mp import run_ranks

SPEC = SyntheticSpec(num_nodes=160, num_edges=700, num_features=8, num_classes=3,
                     communities_per_class=2, seed=11)
# period 2: assignments (or redraws) at epochs 2 and 4, so the checkpoint after epoch 3
# lies between two; adaqp at lam 0 and adaptive under a loose error budget take the
# cheapest widths (2 bits; signs), and the link probe is replaced by fixed costs
# (_fixed_links), so the uninterrupted run itself is reproducible; adaptive's solve of
# epoch 2 is still in flight at the checkpoint (applied at epoch 3)
MODES = {
    "uniform": {"bits": 4},
    "adaqp": {"period": 2, "lam": 0.0, "group_size": 8},
    "random": {"period": 2},
    "adaptive": {"period": 2, "group_size": 8, "techniques": "sign,2", "warmup": "2", "error_budget": 1e6,
                 "link_costs": "ring", "joint_solver": "greedy"},
    "onebit": {},
    "pipegcn": {},
    "bns": {"rate": 0.5},
}


def _fixed_links() -> None:
    """The link probe (timings of a shared machine: another answer each run) replaced, in
    this forked rank only, by fixed costs."""
    from commsched.cluster import costmodel

    def probe(group=None, sizes=(), repeats=1, device=None):
        me, world = dist.get_rank(group), dist.get_world_size(group)
        return {p: costmodel.LinkCost(gamma=1e-4, theta=1e-9) for p in range(world) if p != me}

    costmodel.probe_link_costs = probe


def _resume_case(tmp: str, mode: str, rank: int, world: int) -> dict:
    _fixed_links()
    g = synthetic_graph(SPEC)
    part = make_parts(g, partition_nodes(g, world, "metis", 0), world)[rank]
    cfg = TrainConfig(mode=mode, exchange=mode_config(mode, **MODES[mode]), model="gcn", layers=2,
                      hidden=8, epochs=6, seed=5, checkpoint_every=3, dropout=0.2)
    full_m, full = run_training(cfg.replace(checkpoint_every=0), part)
    d = os.path.join(tmp, mode)
    run_training(cfg.replace(epochs=3), part, out_dir=d)
    m, resumed = run_training(cfg, part, out_dir=d, resume=True)
    return {"loss": (m["loss"], full_m["loss"]),
            "params": all(torch.equal(a, b) for a, b in zip(full.model.parameters(), resumed.model.parameters()))}


@pytest.mark.parametrize("mode", list(MODES))
def test_resume_is_bitwise(tmp_path, mode):
    import functools

    got = run_ranks(2, functools.partial(_resume_case, str(tmp_path), mode), timeout_s=120)
    for r in got:
        loss, ref = r["loss"]
        assert loss == ref, (mode, loss, ref)
        assert r["params"], mode


def test_exchange_state_is_refused_by_another_mode():
    g = synthetic_graph(SPEC)
    book = make_parts(g, partition_nodes(g, 1, "metis", 0), 1)[0].book
    vanilla, onebit = make_exchange("vanilla", book), make_exchange("onebit", book)
    assert vanilla.state_dict() == {}
    with pytest.raises(ValueError, match="exchange state"):
        vanilla.load_state_dict({"errors": []})
    with pytest.raises(ValueError, match="exchange state"):
        onebit.load_state_dict({"calls": 3})


def test_adaptive_state_round_trips_exactly():
    """Everything the adaptive exchange carries (AdaQP's part included: counter, widths,
    traces, measured ratios, probed costs and topology, residuals) comes back as it was."""
    import numpy as np

    from commsched.cluster.costmodel import LinkCost
    from commsched.cluster.topology import Topology

    g = synthetic_graph(SPEC)
    book = make_parts(g, partition_nodes(g, 1, "metis", 0), 1)[0].book
    a = make_exchange("adaptive", book, norm="gcn")
    a._calls, a.period_index, a._ratios = 7, 2, [1.25, 0.5]
    a.assigned = {(0, "forward"): {(0, 1): np.array([1, 32, 2])}}
    a.link_costs, a.ref_link_costs = {1: (1e-9 / 3, 1e-4)}, {1: (2e-9, 3e-5)}
    a.topology = Topology(hosts_P=("h", "h"), links={"intra": LinkCost(1e-5 / 3, 1e-10 / 7)},
                          pairs={(0, 1): LinkCost(1.1e-5, 3.3e-10)}, source="probe")
    a.errors = {(1, "backward"): (torch.tensor([0, 2]), torch.randn(2, 3))}
    a._stats = {(0, "forward"): (torch.rand(3), torch.rand(3), torch.rand(3))}
    a.dims, a._last_epoch_s = {(0, "forward"): 3}, 0.125
    b = make_exchange("adaptive", book, norm="gcn")
    b.load_state_dict(a.state_dict())
    assert (b._calls, b.period_index, b._ratios, b.dims, b._last_epoch_s) == (7, 2, [1.25, 0.5], a.dims, 0.125)
    assert b.assigned[(0, "forward")][(0, 1)].tolist() == [1, 32, 2]
    assert (b.link_costs, b.ref_link_costs, b.topology) == (a.link_costs, a.ref_link_costs, a.topology)
    assert all(torch.equal(x, y) for x, y in zip(b.errors[(1, "backward")], a.errors[(1, "backward")]))
    assert all(torch.equal(x, y) for x, y in zip(b._stats[(0, "forward")], a._stats[(0, "forward")]))
    with pytest.raises(ValueError, match="damaged"):
        b.load_state_dict({**a.state_dict(), "calls": "seven"})
