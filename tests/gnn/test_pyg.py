"""PyG layers through the halo exchange (commsched.gnn.nn.pyg): layer kinds and their errors,
one rank against the plain PyG layer; and the 3-rank cases (:data:`THREE_RANK_CASES`, on
3 gloo ranks): GCNConv, SAGEConv, GINConv and GATConv
from torch_geometric against the full-graph layer (vanilla and adaqp-p: outputs and
gradients equal to 1e-10 in float64), AdaQP training with the loop protocol (losses within
5 % of vanilla's), and sum aggregation through the trainer in every quantized mode."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch_geometric.nn import ChebConv, GATConv, GCNConv, GINConv, SAGEConv

from commsched.gnn import SyntheticSpec, synthetic_graph
from commsched.gnn.exchange.modes import AdaQPConfig
from commsched.gnn.nn.layers import DistMessagePassing
from commsched.gnn.nn.pyg import DistGraph, LayerKind, distributed, layer_kind
from tests.mp import assert_case, run_cases

SYN = SyntheticSpec(num_nodes=300, num_edges=1500, num_features=12, num_classes=3,
                    communities_per_class=2, seed=5)
LAYERS = ("GCNConv", "SAGEConv", "GINConv", "GATConv")
# re-assignment every 2 epochs, small link probes: AdaQP's machinery in a few epochs
OPTS = AdaQPConfig(period=2, group_size=20, assign_time_limit_s=1.0,
                   probe_sizes=(1 << 10, 1 << 14), probe_repeats=1)
EXACT = 1e-10  # float64, relative to the largest entry: only the order of the sums differs


def _conv(name: str, f: int, h: int, seed: int) -> nn.Module:
    """The same parameters for the same (name, f, h, seed) in every process."""
    torch.manual_seed(seed)
    if name == "GCNConv":
        return GCNConv(f, h)
    if name == "SAGEConv":
        return SAGEConv(f, h)
    if name == "GINConv":
        return GINConv(nn.Sequential(nn.Linear(f, h), nn.ReLU(), nn.Linear(h, h)))
    return GATConv(f, h, heads=2, concat=False)


class _Two(nn.Module):
    """conv -> relu -> conv, each either a plain PyG layer or a distributed one."""

    def __init__(self, name: str, f: int, h: int, k: int, wrap=None):
        super().__init__()
        wrap = wrap or (lambda c: c)
        self.c1, self.c2 = wrap(_conv(name, f, h, 1)), wrap(_conv(name, h, k, 2))

    def forward(self, x, *edges):
        return self.c2(torch.relu(self.c1(x, *edges)), *edges)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    got, want = got.detach(), want.detach()
    err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"
    return err


def _check_exact(name: str, mode: str, g) -> None:
    """The distributed two-layer model against the full-graph one: owned output rows and
    the (allreduced) gradients of every parameter, float64."""
    F_, H, K = g.num_features, 8, g.num_classes
    ref = _Two(name, F_, H, K).double()
    x = g.x_NF.double()
    out_ref = ref(x, g.edge_index_2E)
    loss_ref = torch.nn.functional.cross_entropy(out_ref, g.y_N, reduction="sum") / g.num_nodes
    loss_ref.backward()
    loss_ref = float(loss_ref.detach())
    dg = DistGraph.from_graph(g, mode=mode, dtype=torch.float64)
    if dg.world > 1:  # both halves of the split form take part
        assert dg.book.num_central > 0 and dg.book.num_marginal > 0, dg.book.summary()
    model = _Two(name, F_, H, K, wrap=lambda c: distributed(c.double(), dg))
    with dg.train_pass(0):
        out = model(dg.x)
        loss = torch.nn.functional.cross_entropy(out, dg.y, reduction="sum") / dg.totals["nodes"]
        loss.backward()
        total = dg.sync_grads(model.parameters(), loss)
    _close(out, out_ref.detach()[dg.global_ids], EXACT)
    assert abs(total - loss_ref) <= EXACT * abs(loss_ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        _close(p.grad, q.grad, EXACT)


# --------------------------------------------------------------------------- pure
def test_layer_kinds_and_errors():
    assert layer_kind(GCNConv(4, 3)) == LayerKind("gcn", weighted=True, disable=("normalize",))
    assert layer_kind(GCNConv(4, 3, normalize=False)) == LayerKind("sum")
    assert layer_kind(SAGEConv(4, 3)).norm == "mean" and layer_kind(SAGEConv(4, 3, aggr="sum")).norm == "sum"
    assert layer_kind(GINConv(nn.Linear(4, 3))) == LayerKind("sum", bipartite=True)
    assert layer_kind(GATConv(4, 3)) == LayerKind("mean", bipartite=True)
    with pytest.raises(ValueError, match=r"SAGEConv\(aggr='max'\).*supported aggregations are add, mean, sum"):
        layer_kind(SAGEConv(4, 3, aggr="max"))
    with pytest.raises(ValueError, match=r"layer ChebConv is not a kind.*supported: GATConv, GATv2Conv, "
                                         r"GCNConv, GINConv, GraphConv, SAGEConv.*kind=LayerKind"):
        layer_kind(ChebConv(4, 3, K=2))
    with pytest.raises(ValueError, match="GATConv.edge_dim"):
        layer_kind(GATConv(4, 3, edge_dim=2))
    with pytest.raises(TypeError, match="MessagePassing layer, got Linear"):
        layer_kind(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="norm must be one of gcn, mean, sum, got 'max'"):
        LayerKind("max")


def test_own_layer_with_unknown_norm_is_refused_at_definition():
    with pytest.raises(ValueError, match=r"layer .*MaxConv: norm = 'max'.*supported: gcn, mean, sum"):
        class MaxConv(DistMessagePassing):  # noqa: F841
            norm = "max"


def test_history_is_indexed_by_pass_and_by_field():
    g = synthetic_graph(SYN)
    dg = DistGraph.from_graph(g)
    conv = distributed(GCNConv(g.num_features, 3), dg)
    with pytest.raises(IndexError, match="holds 0 training passes; no pass at position -1"):
        dg.history[-1]
    for epoch in (0, 1):
        with dg.train_pass(epoch):
            conv(dg.x).sum().backward()
    last = dg.history[-1]
    assert last["epoch"] == 1 and last == dg.history.passes[1] and len(dg.history.passes) == 2
    assert set(last["breakdown_s"]) >= {"comm", "central", "marginal"} and last["bytes_sent"] == 0
    assert dg.history["epoch"] == [0, 1] and dg.history["bytes_sent"] == [0, 0]  # by field, as before
    with pytest.raises(KeyError, match="by position .* one of epoch, breakdown_s, bytes_sent"):
        dg.history["loss"]


def test_one_rank_equals_pyg_in_both_forms():
    """One process (no process group): the whole form (vanilla) and the split form (adaqp-p
    overlaps) against the plain layers; a declared kind runs an unknown layer."""
    g = synthetic_graph(SYN)
    for name in LAYERS:
        for mode in ("vanilla", "adaqp-p"):
            _check_exact(name, mode, g)
    dg = DistGraph.from_graph(g, dtype=torch.float64)
    torch.manual_seed(0)
    ref = ChebConv(g.num_features, 4, K=1).double()
    lay = distributed(ChebConv(g.num_features, 4, K=1).double(), dg, kind=LayerKind("sum"))
    lay.conv.load_state_dict(ref.state_dict())
    _close(lay(dg.x), ref(g.x_NF.double(), g.edge_index_2E)[dg.global_ids].detach(), EXACT)
    # a kind that may not be split runs after the exchange where it overlaps, and says so once
    dg2 = DistGraph.from_graph(g, mode="adaqp-p", dtype=torch.float64)
    lay2 = distributed(ChebConv(g.num_features, 4, K=1).double(), dg2, kind=LayerKind("sum", split=False))
    lay2.conv.load_state_dict(ref.state_dict())
    with pytest.warns(RuntimeWarning, match=r"ChebConv \(layer 0\) cannot be split.*without overlap"):
        _close(lay2(dg2.x), ref(g.x_NF.double(), g.edge_index_2E)[dg2.global_ids], EXACT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lay2(dg2.x)
    with pytest.raises(ValueError, match=r"expects the 300 owned rows \[n, F\].*got shape \[5, 12\]"):
        lay(dg.x[:5])
    with pytest.raises(RuntimeError, match="wrap every layer before the first pass"):
        distributed(GCNConv(4, 3), dg)


# --------------------------------------------------------------------------- 3 ranks
def case_vanilla_and_overlap_exact(rank, world):
    g = synthetic_graph(SYN)
    for name in LAYERS:
        for mode in ("vanilla", "adaqp-p"):
            _check_exact(name, mode, g)


def _train(name: str, mode: str, g, epochs: int) -> list[float]:
    """The documented loop: own model of distributed PyG layers, Adam, own loss."""
    dg = DistGraph.from_graph(g, mode=mode, config=OPTS)
    model = _Two(name, g.num_features, 16, g.num_classes, wrap=lambda c: distributed(c, dg))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    losses = []
    m = dg.masks["train"]
    for epoch in range(epochs):
        with dg.train_pass(epoch):
            opt.zero_grad()
            out = model(dg.x)
            loss = torch.nn.functional.cross_entropy(out[m], dg.y[m], reduction="sum") / dg.totals["train"]
            loss.backward()
            losses.append(dg.sync_grads(model.parameters(), loss))
            opt.step()
    model.eval()
    with dg.eval_pass():
        ok = (model(dg.x).argmax(1) == dg.y)[dg.masks["test"]].sum()
    acc = float(dg.all_sum(ok.double())) / dg.totals["test"]
    assert 0.0 <= acc <= 1.0
    if mode.startswith("adaqp") and dg.world > 1:
        assert dg.history["bytes_sent"][-1] > 0 and dg.halo.assignments, "AdaQP never re-assigned"
    return losses


def case_adaqp_trains_close_to_vanilla(rank, world):
    g = synthetic_graph(SYN)
    for name in LAYERS:
        want = _train(name, "vanilla", g, 6)
        got = _train(name, "adaqp", g, 6)
        assert want[-1] < want[0], (name, want)
        for a, b in zip(got, want):
            assert abs(a - b) <= 0.05 * abs(b), (name, got, want)


def case_sum_aggregation_in_every_quantized_mode(rank, world):
    """commsched's own sum layer (docs/gnn.md's GIN) trains in every quantized mode."""
    from commsched.gnn import LAYERS, make_parts, partition_nodes
    from commsched.gnn.nn.models import FastLayer
    from commsched.gnn.train.trainer import TrainConfig, run_training

    class GINConvOwn(DistMessagePassing):
        norm = "sum"

        def __init__(self, f, h):
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(f, h), nn.ReLU(), nn.Linear(h, h))

        def update(self, agg, h):
            return self.mlp(h + agg)

    LAYERS.register("gin_test", FastLayer(conv=GINConvOwn))
    g = synthetic_graph(SYN)
    part = make_parts(g, partition_nodes(g, world, "metis"), world)[rank]
    for mode in ("adaqp", "adaqp-q", "uniform", "random"):
        cfg = TrainConfig(model="gin_test", mode=mode, epochs=3, hidden=8, layers=2,
                          exchange=OPTS)
        m, _ = run_training(cfg, part)
        assert all(x == x for x in m["loss"]) and m["bytes_sent_per_epoch"] > 0, (mode, m["loss"])


THREE_RANK_CASES = [("pyg_exact", case_vanilla_and_overlap_exact),
                    ("pyg_adaqp", case_adaqp_trains_close_to_vanilla),
                    ("pyg_sum", case_sum_aggregation_in_every_quantized_mode)]


@pytest.fixture(scope="module")
def three_ranks():
    return run_cases(3, THREE_RANK_CASES, timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, _ in THREE_RANK_CASES])
def test_pyg_layers_on_three_ranks(three_ranks, name):
    assert_case(three_ranks, name)
