"""The mode table and the exchanges it builds, the per-pass context, AdaQP's pure planning
and options, and the metrics record -- all without a process group, in milliseconds."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from commsched.comm.all2all import CommStats
from commsched.gnn.context import ExchangeContext, PassContext
from commsched.gnn.exchange.adaqp import AdaQPExchange
from commsched.gnn.exchange.adaqp_plan import build_problems
from commsched.gnn.exchange.bns import BNSExchange
from commsched.gnn.exchange.halo import VanillaExchange, ZeroExchange
from commsched.gnn.exchange.modes import (
    MODE_NAMES,
    MODES,
    AdaQPConfig,
    AdaQPQConfig,
    RandomConfig,
    UniformConfig,
    VanillaConfig,
    make_exchange,
    mode_spec,
    recorded_options,
)
from commsched.gnn.exchange.onebit import OneBitExchange
from commsched.gnn.exchange.stale import PipeGCNExchange
from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
from commsched.gnn.graph.partition import make_parts, partition_nodes
from commsched.gnn.nn.layers import GCNConv, LocalGraph
from commsched.gnn.nn.models import LAYERS
from commsched.gnn.train.metrics import (
    AUC_BINS,
    GNNMetrics,
    auc_from_histograms,
    auc_histograms,
    summarize,
)
from commsched.gnn.train.trainer import TrainConfig
from commsched.quant.reference import BITS

GNN = Path(__file__).resolve().parents[2] / "commsched" / "gnn" / "exchange"
SYN = SyntheticSpec(num_nodes=120, num_edges=500, num_features=6, num_classes=3,
                    communities_per_class=2, seed=1)


@pytest.fixture(scope="module")
def parts():
    g = synthetic_graph(SYN)
    return g, make_parts(g, partition_nodes(g, 2, "metis", 0), 2)


# --------------------------------------------------------------------------- mode table
def test_mode_table_builds_each_modes_exchange(parts):
    _, ps = parts
    book = ps[0].book  # rank 0 of 2; building an exchange needs no process group
    assert MODE_NAMES == ("vanilla", "adaqp", "adaqp-q", "adaqp-p", "uniform", "random", "nocomm",
                          "onebit", "pipegcn", "bns", "adaptive", "minibatch")
    want = {"vanilla": (VanillaExchange, False), "adaqp-p": (VanillaExchange, True),
            "pipegcn": (PipeGCNExchange, True), "bns": (BNSExchange, False),
            "minibatch": (VanillaExchange, False)}  # minibatch: the full-graph evaluation's
    for mode in MODE_NAMES:
        ex = make_exchange(mode, book, config=AdaQPConfig(bits=4), seed=3, norm="mean")
        if mode in want:
            cls, asynchronous = want[mode]
            assert type(ex) is cls and ex.asynchronous is asynchronous, mode
        elif mode == "nocomm":
            assert type(ex) is ZeroExchange and MODES[mode].timing_only
        elif mode == "onebit":
            assert type(ex) is OneBitExchange and ex.error_feedback and MODES[mode].quantized
        elif mode == "adaptive":
            # the AdaQPConfig given carries their own link_costs ("ring") over the mode's default
            assert type(ex).__name__ == "AdaptiveExchange" and ex.opt.link_costs == "ring"
            assert ex.norm == "mean" and ex.overlap and MODES[mode].quantized
        else:
            spec = mode_spec(mode)
            assert type(ex) is AdaQPExchange and (ex.scheme, ex.overlap) == (spec.scheme, spec.overlap)
            assert ex.norm == "mean" and ex.seed == 3 and ex.opt.bits == 4
    assert [m for m, s in MODES.items() if s.timing_only] == ["nocomm"]
    assert [m for m, s in MODES.items() if s.sampled] == ["minibatch"]
    with pytest.raises(ValueError, match="--mode fast is not known"):
        make_exchange("fast", book)
    with pytest.raises(ValueError, match="edge normalisation"):
        make_exchange("adaqp", book)  # the quantized modes need the layer's norm
    with pytest.raises(ValueError, match="norm must be one of"):
        make_exchange("uniform", book, norm="max")
    # every norm a layer may have, sum included, weighs the quantized modes' messages
    for norm in ("gcn", "mean", "sum"):
        assert make_exchange("adaqp", book, norm=norm).norm == norm
    old = dataclasses.replace(book, send_coef_sq={k: v for k, v in book.send_coef_sq.items() if k != "sum"})
    with pytest.raises(ValueError, match="no AdaQP coefficients for norm='sum'.*make the partition folder again"):
        make_exchange("adaqp", old, norm="sum")


def test_train_cli_modes_and_adaqp_flags_come_from_the_table():
    from commsched.gnn.train.cli import build_parser, config_from_args

    p = build_parser()
    mode_action = next(a for a in p._actions if a.dest == "mode")
    assert tuple(mode_action.choices) == MODE_NAMES
    cfg = config_from_args(p.parse_args(["--mode", "uniform", "--bits", "2", "--period", "7",
                                         "--group-size", "9", "--lam", "0.25"]))
    assert cfg.exchange == UniformConfig(bits=2, period=7, group_size=9, lam=0.25)
    assert config_from_args(p.parse_args([])).record()["adaqp"] == recorded_options(AdaQPConfig())["adaqp"]
    assert AdaQPConfig().compile
    assert config_from_args(p.parse_args(["--no-compile"])).exchange == VanillaConfig(compile=False)


def test_mode_help_says_adaqps_period_and_its_start_up_width():
    from commsched.gnn.train.cli import build_parser

    helps = {a.dest: a.help for a in build_parser()._actions}
    period = AdaQPConfig().period
    assert f"every --period epochs, default {period}" in helps["mode"]
    assert "8 bits" in helps["mode"] and f"{2 * period}-epoch run" in helps["mode"]
    assert "8 bits" in helps["period"]


def _imports(path: Path) -> set[str]:
    """Module names a source file imports (relative ones with their leading dots)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
    return out


def test_import_direction_has_no_cycle():
    halo, adaqp, plan = (_imports(GNN / f) for f in ("halo.py", "adaqp.py", "adaqp_plan.py"))
    assert not {m for m in halo if "adaqp" in m or "modes" in m}, halo
    assert not {m for m in adaqp if m.endswith(("layers", "modes", "trainer"))}, adaqp
    assert not {m for m in plan if "distributed" in m or m in ("...dist", ".halo", ".adaqp")}, plan
    assert "adaqp" not in (GNN / "halo.py").read_text()


# --------------------------------------------------------------------------- exchanges
def test_zero_exchange_sends_nothing_and_gives_zeros(parts):
    _, ps = parts
    book = ps[0].book
    ex = ZeroExchange(book)
    stats = CommStats(2)
    ctx = PassContext(stats=stats)
    h = torch.randn(book.num_owned, 5, requires_grad=True)
    got = ex.start(h, 1, ctx).wait()
    assert got.shape == (book.num_remote, 5) and not got.any() and book.num_remote > 0
    (got.sum() + h.sum()).backward()
    assert torch.equal(h.grad, torch.ones_like(h))  # the (zero) remote gradient adds nothing
    assert stats.total_bytes_sent == 0 and stats.calls == 0


def test_one_exchange_context_builds_every_mode_and_one_skeleton_quantizes(parts):
    from commsched.gnn.exchange.adaptive import AdaptiveExchange

    _, ps = parts
    ctx = ExchangeContext(ps[0].book, seed=3, norm="gcn")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.seed = 4  # type: ignore[misc]
    for mode in MODE_NAMES:  # every mode's config builds from the one context
        ex = MODES[mode]().build(ctx)
        assert ex.ctx is ctx and ex.book is ctx.book and ex.device == torch.device("cpu"), mode
    bare = ZeroExchange(ps[0].book).ctx  # a bare book: the default context around it
    assert bare.book is ps[0].book and (bare.pattern, bare.seed, bare.norm) == ("direct", 0, None)
    # AdaQP's exchange skeleton serves adaptive's; only the technique hooks are its own
    assert "_quantized" not in vars(AdaptiveExchange) and "_encode" in vars(AdaptiveExchange)


def test_random_widths_follow_the_passs_period(parts):
    _, ps = parts
    ex = RandomConfig(period=2).build(ExchangeContext(ps[0].book, norm="gcn", seed=4))
    first = ex.layouts(0, "forward", 8)[0].rows_per_width()
    ex.begin_epoch(PassContext(epoch=1))
    assert ex.layouts(0, "forward", 8)[0].rows_per_width() == first  # same period
    ex.begin_epoch(PassContext(epoch=5))  # a resumed run: period 2, fresh draws
    assert ex.period_index == 2
    w = ex.channel_widths(0, 1, 40, 0, "forward")
    assert set(w.tolist()) <= set(BITS)
    ex0 = RandomConfig(period=2).build(ExchangeContext(ps[0].book, norm="gcn", seed=4))
    assert not np.array_equal(w, ex0.channel_widths(0, 1, 40, 0, "forward"))
    # adaptive before its first assignment: the widest width
    ad = AdaQPQConfig().build(ExchangeContext(ps[0].book, norm="gcn"))
    assert (ad.scheme, ad.overlap) == ("adaptive", False)
    assert set(ad.channel_widths(0, 1, 5, 1, "backward").tolist()) == {max(BITS)}


# --------------------------------------------------------------------------- pass context
def test_pass_context_is_frozen_and_carries_the_pass(parts):
    g, _ = parts
    one = make_parts(g, partition_nodes(g, 1, "metis", 0), 1)[0]
    ctx = PassContext()
    assert (ctx.epoch, ctx.training, ctx.stats) == (0, True, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.epoch = 3  # type: ignore[misc]
    ex = make_exchange("vanilla", one.book)
    for attr in ("timer", "stats", "training", "epoch"):
        assert not hasattr(ex, attr), attr  # per-pass state is not the exchange's
    lg = LocalGraph(one.book, ex)
    conv = GCNConv(6, 4)
    run = PassContext(epoch=2)
    conv(one.x_nF, lg, 0, run)
    assert run.timer.seconds["central"] > 0 and run.timer.seconds["marginal"] >= 0
    # dropout follows the context's flag and epoch, not attributes of the graph
    m = LAYERS["gcn"].model(6, 8, 3, layers=2, dropout=0.5, seed=1)
    x = one.x_nF
    ev = m(x, lg, PassContext(training=False))
    torch.testing.assert_close(ev, m(x, lg, PassContext(training=False, epoch=9)))
    e0, e0b, e1 = (m(x, lg, PassContext(epoch=e)) for e in (0, 0, 1))
    torch.testing.assert_close(e0, e0b)
    assert not torch.allclose(e0, ev) and not torch.allclose(e0, e1)


# --------------------------------------------------------------------------- options
def test_adaqp_options_nest_in_train_config_and_validate():
    cfg = TrainConfig(mode="uniform", exchange=AdaQPConfig(bits=2))
    assert cfg.exchange.bits == 2
    assert TrainConfig().record()["adaqp"] == recorded_options(AdaQPConfig())["adaqp"]
    assert cfg.record()["adaqp"]["bits"] == 2  # recorded nested in metrics' config
    assert AdaQPConfig().bits == max(BITS)
    for kw, msg in (({"bits": 3}, "--bits must be one of 2, 4, 8"), ({"period": 0}, "--period"),
                    ({"group_size": 0}, "--group-size"), ({"lam": 1.5}, "--lam must lie"),
                    ({"probe_repeats": 0}, "probe_repeats")):
        with pytest.raises(ValueError, match=msg):
            AdaQPConfig(**kw)
    with pytest.raises(TypeError, match="ExchangeConfig"):
        TrainConfig(exchange={"bits": 4})  # type: ignore[arg-type]


# --------------------------------------------------------------------------- planning
def test_build_problems_by_hand():
    # 2 ranks, forward of layer 0: rank 0 sends 3 rows to rank 1, rank 1 sends 2 to rank 0;
    # rank 1 never traced its messages (all weigh 1); rank 1 has no cost for peer 0
    per = [{"trace": {(0, "forward"): [np.zeros(0), np.array([1.0, 4.0, 2.0])]},
            "dims": {(0, "forward"): 6}, "costs": {1: (2e-9, 1e-5)},
            "counts": ((0, 3), (0, 2))},
           {"trace": {}, "dims": {}, "costs": {}, "counts": ((2, 0), (3, 0))}]
    wp = build_problems(per, group_size=2)
    assert wp.keys == ((0, "forward"),)
    (rounds,) = wp.problems
    assert len(rounds) == 1 and len(rounds[0]) == 2  # P - 1 rounds of P channels
    c0, c1 = rounds[0]
    assert (c0.theta, c0.gamma) == (2e-9, 1e-5) and (c1.theta, c1.gamma) == (1e-8, 0.0)
    # sorted by beta, cut into groups of 2: {4, 2} and {1}; rank 1's two rows: one group
    assert [(g.count, g.dim, g.beta) for g in c0.groups] == [(2, 6, 6.0), (1, 6, 1.0)]
    assert [(g.count, g.beta) for g in c1.groups] == [(2, 2.0)]
    (mem,) = wp.members
    assert [(s, d, n) for s, d, n, _ in mem[0]] == [(0, 1, 3), (1, 0, 2)]
    assert [m.tolist() for m in mem[0][0][3]] == [[1, 2], [0]]


# --------------------------------------------------------------------------- metrics
def _hist(times, comm, nbytes):
    return {"epoch_time_s": times, "breakdown_s": [{"comm": c, "central": 0.1} for c in comm],
            "bytes_sent": nbytes, "peak_rss_mib": 100.0, "book": {"owned": 1}}


def test_summarize_by_hand():
    per = [_hist([1.0, 2.0, 3.0], [0.5, 0.2, 0.9], [10, 20, 30]),
           _hist([1.5, 1.0, 2.0], [0.1, 0.4, 0.3], [1, 2, 3])]
    evals = [{"epoch": 0, "train_acc": 0.5, "val_acc": 0.6, "test_acc": 0.4},
             {"epoch": 1, "train_acc": 0.7, "val_acc": 0.8, "test_acc": 0.7},
             {"epoch": 2, "train_acc": 0.9, "val_acc": 0.8, "test_acc": 0.9}]
    cfg = TrainConfig(mode="adaqp", epochs=3)
    m = summarize(cfg, [3.0, 2.0, 1.0], evals, per, world_size=2, wall_s=9.0, dataset="syn",
                  extra={"adaqp": {"scheme": "adaptive"}})
    assert m.epoch_time_s_per_epoch == [1.5, 2.0, 3.0] and m.epoch_time_s == 2.0
    # per epoch the max over ranks (comm 0.5, 0.4, 0.9), then the median over epochs
    assert m.breakdown_s["comm"] == 0.5 and m.breakdown_s["central"] == 0.1
    assert m.breakdown_s["quant"] == 0.0
    # the rest per epoch: 1.5 - 0.6, 2.0 - 0.5, 3.0 - 1.0
    assert m.breakdown_other_s == pytest.approx(1.5)
    assert m.bytes_sent_per_epoch == 22.0  # summed over ranks, median over epochs
    assert (m.best_epoch, m.val_acc, m.test_acc, m.train_acc) == (1, 0.8, 0.7, 0.7)  # earliest tie
    d = m.to_dict()
    keys = ("mode", "model", "dataset", "world_size", "epochs", "loss", "val_acc", "test_acc",
            "epoch_time_s", "breakdown_s", "bytes_sent_per_epoch", "wall_clock_s")
    assert set(keys) <= set(d) and set(keys) <= set(GNNMetrics.field_names())
    assert d["adaqp"] == {"scheme": "adaptive"} and "extra" not in d
    assert d["config"]["adaqp"]["period"] == 50 and d["peak_rss_mib_total"] == 200.0
    # nothing timed (a resume of a finished run): zeros, not None
    none = summarize(cfg, [1.0], [], [_hist([], [], [])], world_size=1, wall_s=1.0, dataset="x")
    assert none.epoch_time_s == 0.0 and none.best_epoch is None
    with pytest.raises(ValueError, match="shadow"):
        dataclasses.replace(m, extra={"loss": []}).to_dict()
    assert m.val_auc is None and m.val_auc_per_eval == []  # no AUC recorded: a many-class graph
    # a two-class graph: the AUC's best validation epoch is its own, not the accuracy's
    auc = [dict(e, val_auc=a, test_auc=b) for e, a, b in zip(evals, (0.7, 0.75, 0.9), (0.6, 0.8, 0.85))]
    m2 = summarize(cfg, [3.0, 2.0, 1.0], auc, per, world_size=2, wall_s=9.0, dataset="syn")
    assert (m2.best_epoch, m2.val_auc, m2.test_auc) == (1, 0.9, 0.85)
    assert m2.val_auc_per_eval == [0.7, 0.75, 0.9] and m2.test_auc_per_eval == [0.6, 0.8, 0.85]


def _exact_auc(score, y):
    pos, neg = score[y == 1], score[y == 0]
    gt = (pos[:, None] > neg[None, :]).double().sum() + 0.5 * (pos[:, None] == neg[None, :]).double().sum()
    return float(gt) / (len(pos) * len(neg))


def test_roc_auc_from_histograms():
    # by hand, 4 bins: negatives at bins 0, 1; positives at 1, 3: pairs (pos > neg) = 3 of 4, one tie
    assert auc_from_histograms([1, 1, 0, 0], [0, 1, 0, 1]) == pytest.approx((3 + 0.5) / 4)
    assert auc_from_histograms([0, 0, 2], [3, 0, 0]) == 0.0 and auc_from_histograms([2, 0], [0, 5]) == 1.0
    assert auc_from_histograms([0, 0], [1, 1]) is None and auc_from_histograms([1, 1], [0, 0]) is None
    with pytest.raises(ValueError, match="shapes"):
        auc_from_histograms([1, 2], [1, 2, 3])
    # against the exact pairwise AUC on random scores: within the bin width's share of tied pairs
    g = torch.Generator().manual_seed(0)
    n = 3000
    y = (torch.rand(n, generator=g) < 0.3).long()
    score = torch.sigmoid(torch.randn(n, generator=g) + 1.2 * y)
    masks = [torch.ones(n, dtype=torch.bool), torch.arange(n) % 2 == 0]
    h = auc_histograms(score, y, masks)
    assert h.shape == (2, 2, AUC_BINS) and h.dtype == torch.float64
    assert h[0].sum() == n and h[1, 1].sum() == int((y[::2] == 1).sum())
    for k, m in enumerate(masks):
        assert auc_from_histograms(h[k, 0], h[k, 1]) == pytest.approx(_exact_auc(score[m], y[m]), abs=2e-4)
    # scores of exactly 0 and 1 land in the end bins; equal scores are ties in both
    edge = auc_histograms(torch.tensor([0.0, 1.0, 0.5, 0.5]), torch.tensor([0, 1, 0, 1]), [torch.ones(4, dtype=torch.bool)])
    assert edge[0, 0, 0] == 1 and edge[0, 1, -1] == 1
    assert auc_from_histograms(edge[0, 0], edge[0, 1]) == pytest.approx(_exact_auc(torch.tensor([0.0, 1.0, 0.5, 0.5]),
                                                                                  torch.tensor([0, 1, 0, 1])))


def test_bits_is_refused_where_no_mode_uses_it():
    """``--mode onebit --bits 4`` (or vanilla, pipegcn, ...) would ignore the width: refused;
    the AdaQP-exchange modes keep it (uniform uses it; the adaptive and random widths take
    the default)."""
    for mode in ("onebit", "vanilla", "adaqp-p", "nocomm", "pipegcn", "bns"):
        with pytest.raises(ValueError, match=f"--bits is the width of --mode uniform.*--mode {mode}"):
            TrainConfig(mode=mode, exchange=AdaQPConfig(bits=4))
        TrainConfig(mode=mode)  # the default width is no request
    for mode in ("uniform", "random", "adaqp"):
        assert TrainConfig(mode=mode, exchange=AdaQPConfig(bits=2)).exchange.bits == 2


def test_bench_passes_bits_only_to_the_adaqp_exchange_modes():
    import argparse

    from commsched.bench import load_workload
    from commsched.bench.runner import build_parser

    wl = load_workload("gnn")
    a = build_parser(wl).parse_args(["--modes", "vanilla,uniform,onebit,adaqp", "--models", "gcn",
                                     "--bits", "2"])
    a.hosts, a.bandwidth, a.rate_bps = 1, None, None
    got = {v.name: v.argv for v in wl.variants(argparse.Namespace(**vars(a)))}
    for name, args in got.items():
        has = "--bits" in args
        assert has == (name in ("gcn-uniform", "gcn-adaqp")), (name, args)
        if has:
            assert args[args.index("--bits") + 1] == "2"
