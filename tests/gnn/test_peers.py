"""The peers' modes: PipeGCN's stale exchange and BNS-GCN's boundary sampling.

Pure pieces (the sample, its agreement between the ends, its unbiased rescaling, the
options and their errors) in milliseconds; on 1 rank in this process and on 3 gloo
ranks (:data:`THREE_RANK_CASES`): ``pipegcn --stale-delay 0`` and ``bns --boundary-rate 1`` equal
vanilla exactly, pipegcn's halo rows and gradients are exactly the previous epoch's (and
their moving average with smoothing), bns sends exactly the kept share of the bytes and
its rows and gradients are the sampled, rescaled ones."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from commsched.gnn.bns import (
    BNSExchange,
    BNSOptions,
    boundary_sample,
    kept_count,
    sample_epoch,
)
from commsched.gnn.context import PassContext
from commsched.gnn.data import SyntheticSpec, synthetic_graph
from commsched.gnn.partition import make_parts, partition_nodes
from commsched.gnn.stale import PipeGCNExchange, PipeGCNOptions
from commsched.gnn.trainer import TrainConfig, run_training
from tests.mp import assert_case, run_cases

SYN = SyntheticSpec(num_nodes=300, num_edges=1500, num_features=10, num_classes=3,
                    communities_per_class=2, seed=4)
BASE = TrainConfig(model="gcn", layers=3, hidden=8, epochs=4, dtype="float64", seed=3)


def _parts(P: int):
    g = synthetic_graph(SYN)
    return g, make_parts(g, partition_nodes(g, P, "metis", 0), P)


# --------------------------------------------------------------------------- pure
def test_boundary_sample_is_shared_sorted_and_sized():
    assert [kept_count(c, 0.5) for c in (0, 1, 2, 3, 7)] == [0, 1, 1, 2, 4]  # half up
    assert kept_count(9, 1.0) == 9 and kept_count(3, 0.1) == 0
    s = boundary_sample(40, 0.25, seed=1, epoch=3, src=0, dst=2)
    assert s.size == 10 and np.all(np.diff(s) > 0) and s.min() >= 0 and s.max() < 40
    assert np.array_equal(s, boundary_sample(40, 0.25, seed=1, epoch=3, src=0, dst=2))
    others = [boundary_sample(40, 0.25, seed=1, epoch=4, src=0, dst=2),
              boundary_sample(40, 0.25, seed=1, epoch=3, src=2, dst=0),
              boundary_sample(40, 0.25, seed=2, epoch=3, src=0, dst=2)]
    assert all(not np.array_equal(s, o) for o in others)
    assert np.array_equal(boundary_sample(6, 1.0, seed=1, epoch=0, src=0, dst=1), np.arange(6))
    # the two ends of every pair of a 3-part book agree, with no communication
    _, parts = _parts(3)
    samples = [sample_epoch(p.book, 0.5, seed=7, epoch=2) for p in parts]
    for s_, ps in enumerate(parts):
        for d, pd in enumerate(parts):
            if s_ == d:
                continue
            sl, rl = ps.book.send_slice(d), pd.book.recv_slice(s_)
            send = samples[s_].send_pos.numpy()
            send = send[(send >= sl.start) & (send < sl.stop)] - sl.start
            recv = samples[d].recv_pos.numpy() + pd.book.num_owned
            recv = recv[(recv >= rl.start) & (recv < rl.stop)] - rl.start
            assert send.size == kept_count(ps.book.send_counts[d], 0.5) > 0
            assert np.array_equal(send, recv), (s_, d)
            assert samples[s_].plan.send_counts[d] == samples[d].plan.recv_counts[s_] == send.size
    assert samples[0].send_scale is not None and sample_epoch(parts[0].book, 1.0, seed=7, epoch=2).send_scale is None


def test_bns_rescaling_is_unbiased():
    """Over epochs, a row's weight (c / k when kept, else 0) averages to 1."""
    _, parts = _parts(2)
    book = parts[0].book
    T = sum(book.send_counts)
    acc = np.zeros(T)
    n = 1500
    for e in range(n):
        s = sample_epoch(book, 0.3, seed=5, epoch=e)
        np.add.at(acc, s.send_pos.numpy(), s.send_scale.numpy())
    # each entry: a mean of n Bernoulli(k / c) * c / k, std sqrt((c / k - 1) / n) < 0.05 here
    assert np.abs(acc / n - 1.0).max() < 0.25 and abs(acc.mean() / n - 1.0) < 0.02


def test_peer_mode_options_and_errors():
    from commsched.gnn.modes import make_exchange
    from commsched.gnn.train import build_parser, config_from_args

    for bad in (0, 0.0, -0.5, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match=r"--boundary-rate must be a fraction in \(0, 1\]"):
            BNSOptions(rate=bad)
    for kw, msg in (({"delay": 2}, "--stale-delay must be 0"), ({"smoothing": 1.0}, r"in \[0, 1\)"),
                    ({"smoothing": -0.1}, r"in \[0, 1\)"), ({"delay": 0, "smoothing": 0.5}, "needs stale rows")):
        with pytest.raises(ValueError, match=msg):
            PipeGCNOptions(**kw)
    with pytest.raises(ValueError, match="--boundary-rate is an option of --mode bns"):
        TrainConfig(mode="vanilla", exchange=BNSOptions(rate=0.5))
    with pytest.raises(ValueError, match="options of --mode pipegcn"):
        TrainConfig(mode="bns", exchange=PipeGCNOptions(smoothing=0.2))
    with pytest.raises(ValueError, match="needs --pattern direct"):
        TrainConfig(mode="pipegcn", pattern="ring")
    cfg = TrainConfig(mode="bns", exchange=BNSOptions(rate=0.5), dtype="bfloat16")  # bf16 wire allowed
    assert cfg.record()["bns"] == {"rate": 0.5}
    p = build_parser()
    a = config_from_args(p.parse_args(["--mode", "pipegcn", "--stale-smoothing", "0.3"]))
    assert a.pipegcn == PipeGCNOptions(delay=1, smoothing=0.3) and a.bns == BNSOptions()
    assert config_from_args(p.parse_args(["--mode", "bns", "--boundary-rate", "0.5"])).bns.rate == 0.5
    for argv, msg in ((["--mode", "vanilla", "--boundary-rate", "0.1"], "option of --mode bns"),
                      (["--mode", "adaqp", "--stale-delay", "0"], "options of --mode pipegcn"),
                      (["--mode", "bns", "--boundary-rate", "0"], "must be a fraction")):
        with pytest.raises(ValueError, match=msg):
            config_from_args(p.parse_args(argv))
    _, parts = _parts(2)
    ex = make_exchange("bns", parts[0].book, seed=4, config=BNSOptions(rate=0.25), wire_dtype=torch.bfloat16)
    assert type(ex) is BNSExchange and ex.options.rate == 0.25 and ex.seed == 4 and not ex.asynchronous
    ex = make_exchange("pipegcn", parts[0].book, config=PipeGCNOptions(smoothing=0.5))
    assert type(ex) is PipeGCNExchange and ex.overlaps and ex.options.smoothing == 0.5
    with pytest.raises(ValueError, match="needs --pattern direct"):
        make_exchange("pipegcn", parts[0].book, pattern="ring")


def test_one_rank_peer_modes_equal_vanilla():
    g = synthetic_graph(SYN)
    part = make_parts(g, np.zeros(g.num_nodes, np.int64), 1)[0]
    ref, _ = run_training(BASE, part)
    for cfg in (dataclasses.replace(BASE, mode="pipegcn"),
                dataclasses.replace(BASE, mode="pipegcn", exchange=PipeGCNOptions(delay=0)),
                dataclasses.replace(BASE, mode="bns", exchange=BNSOptions(rate=0.3))):
        m, _ = run_training(cfg, part)
        assert m["loss"] == ref["loss"] and m["test_acc"] == ref["test_acc"], cfg.mode


def test_bns_refuses_attention_layers_in_the_pyg_adapter():
    from torch_geometric.nn import GATConv, SAGEConv

    from commsched.gnn.pyg import DistGraph, distributed

    g = synthetic_graph(SYN)
    dg = DistGraph.from_graph(g, mode="bns")
    lay = distributed(GATConv(g.num_features, 4), dg)
    with pytest.raises(ValueError, match="mode='bns' drops boundary rows.*GATConv's attention"):
        lay(dg.x)
    ok = DistGraph.from_graph(g, mode="bns")
    assert distributed(SAGEConv(g.num_features, 4), ok)(ok.x).shape == (g.num_nodes, 4)


# --------------------------------------------------------------------------- 3 ranks
class _Recording(PipeGCNExchange):
    """PipeGCN's exchange, remembering per training epoch what it sent and what it gave
    the pass (``log[epoch][(layer, direction)] = (sent, pending)``)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log: dict[int, dict] = {}

        self.waited_in_pass: dict[int, list[bool]] = {}

    def transfer(self, rows, layer, direction, ctx):
        pend = super().transfer(rows, layer, direction, ctx)
        if ctx.training:
            self.log.setdefault(ctx.epoch, {})[(layer, direction)] = (rows.clone(), pend)
        return pend

    def end_epoch(self, ctx):
        # whether the pass itself waited for each of this epoch's exchanges (it must not,
        # after the first epoch: they stay in flight until here)
        self.waited_in_pass[ctx.epoch] = [p._out is not None for p in self._inflight.values()]
        super().end_epoch(ctx)


def _part3(rank: int):
    return _parts(3)[1][rank]


def _equal_runs(a, b) -> bool:
    (ma, ta), (mb, tb) = a, b
    return (ma["loss"] == mb["loss"] and ma["test_acc"] == mb["test_acc"]
            and all(torch.equal(x, y) for x, y in zip(ta.model.parameters(), tb.model.parameters())))


def case_twins_equal_vanilla(rank: int, world: int) -> None:
    part = _part3(rank)
    ref = run_training(BASE, part)
    zero = run_training(dataclasses.replace(BASE, mode="pipegcn", exchange=PipeGCNOptions(delay=0)), part)
    assert _equal_runs(ref, zero), "pipegcn --stale-delay 0 differs from vanilla"
    full = run_training(dataclasses.replace(BASE, mode="bns", exchange=BNSOptions(rate=1.0)), part)
    assert _equal_runs(ref, full), "bns --boundary-rate 1 differs from vanilla"
    assert full[0]["bytes_sent_per_epoch"] == ref[0]["bytes_sent_per_epoch"] > 0


def _expected_halo(sent_all: list, books: list, me: int, key) -> torch.Tensor:
    """The rows rank ``me`` should receive for ``key`` from every peer's sent rows."""
    layer, direction = key
    out = []
    for q, b in enumerate(books):
        if q == me or key not in sent_all[q]:
            continue
        rows = sent_all[q][key]
        sl = b.send_slice(me) if direction == "forward" else _recv_block(b, me)
        out.append(rows[sl])
    return torch.cat(out)


def _recv_block(book, peer: int) -> slice:
    """The rows of ``book``'s gradient rows [R] that go back to ``peer``."""
    o = int(sum(book.recv_counts[:peer]))
    return slice(o, o + book.recv_counts[peer])


def _stale_run(rank: int, world: int, smoothing: float):
    import torch.distributed as dist

    part = _part3(rank)
    cfg = dataclasses.replace(BASE, mode="pipegcn", epochs=4, exchange=PipeGCNOptions(smoothing=smoothing))
    ex = _Recording(part.book, options=cfg.pipegcn)
    m, _ = run_training(cfg, part, exchange=ex)
    # the kept rows join no graph (else each epoch's graph would hold the one before)
    assert ex._stale and not any(v.requires_grad for v in ex._stale.values())
    # epoch 0 waited for its own rows; later epochs' exchanges ran in the background until
    # the end of the epoch, five of them (3 forward, 2 backward: layer 0 needs no gradient)
    assert ex.asynchronous and ex.waited_in_pass[0] == [True] * 5
    assert all(ex.waited_in_pass[e] == [False] * 5 for e in range(1, cfg.epochs))
    sent = {e: {k: s for k, (s, _) in d.items()} for e, d in ex.log.items()}
    used = {e: {k: p.wait() for k, (_, p) in d.items()} for e, d in ex.log.items()}
    allsent: list = [None] * world
    books: list = [None] * world
    dist.all_gather_object(allsent, sent)
    dist.all_gather_object(books, part.book)
    return m, sent, used, allsent, books


def case_pipegcn_is_exactly_one_epoch_stale(rank: int, world: int) -> None:
    m, sent, used, allsent, books = _stale_run(rank, world, 0.0)
    keys = set(used[0])
    assert keys == {(0, "forward"), (1, "forward"), (2, "forward"), (1, "backward"), (2, "backward")}
    for e in range(4):
        for key in keys:
            # epoch 0 exact (its own epoch's rows), later epochs the previous epoch's, bit for bit
            want = _expected_halo([s[max(e - 1, 0)] for s in allsent], books, rank, key)
            assert torch.equal(used[e][key], want), (e, key)
            if e >= 1:
                now = _expected_halo([s[e] for s in allsent], books, rank, key)
                assert not torch.equal(used[e][key], now), (e, key)
    assert np.isfinite(m["loss"]).all() and m["loss"][-1] < m["loss"][0]
    # smoothing: the rows used in epoch t + 1 are gamma s_t-1 + (1 - gamma) received in t
    _, _, used_s, allsent_s, _ = _stale_run(rank, world, 0.5)
    for key in keys:
        recv = [_expected_halo([s[e] for s in allsent_s], books, rank, key) for e in range(3)]
        assert torch.equal(used_s[1][key], recv[0])
        torch.testing.assert_close(used_s[2][key], 0.5 * recv[0] + 0.5 * recv[1], rtol=1e-12, atol=0)
        torch.testing.assert_close(used_s[3][key], 0.5 * used_s[2][key] + 0.5 * recv[2],
                                   rtol=1e-12, atol=0)


def case_bns_sends_the_kept_rows_rescaled(rank: int, world: int) -> None:
    g, parts = _parts(3)
    part = parts[rank]
    book = part.book
    rate = 0.5
    ex = BNSExchange(book, options=BNSOptions(rate=rate), seed=11)
    x = part.x_nF
    ref_R = g.x_NF[torch.from_numpy(book.remote_ids)]
    for epoch in (0, 1):
        ctx = PassContext(epoch=epoch)
        s = ex.sample(epoch)
        # forward: a kept remote row is its owner's row times c / k of that pair; the rest 0
        got = ex.start(x, 0, ctx).wait()
        want = torch.zeros_like(ref_R)
        scale_R = torch.zeros(book.num_remote, dtype=ref_R.dtype)
        o = 0
        for q in range(world):
            c = book.recv_counts[q]
            if q != rank and c:
                scale_R[o:o + c] = c / kept_count(c, rate)
            o += c
        want[s.recv_pos] = ref_R[s.recv_pos] * scale_R[s.recv_pos, None]
        assert torch.equal(got, want) and bool((got[s.recv_pos] != 0).any())
        dropped = torch.ones(book.num_remote, dtype=torch.bool)
        dropped[s.recv_pos] = False
        assert bool(dropped.any()) and not got[dropped].any()
        # backward: every rank sends back its remote rows' features as gradients; an owned
        # row gets, from each peer that kept it, its own features times c / k
        gsum = ex.backward_rows(ref_R.clone(), 1, ctx)
        kept = ex.send_idx[s.send_pos]
        want_g = torch.zeros_like(x).index_add_(0, kept, x[kept] * s.send_scale[:, None].to(x.dtype))
        torch.testing.assert_close(gsum, want_g, rtol=1e-6, atol=1e-6)
        assert sorted(set(s.send_pos.tolist())) == s.send_pos.tolist()
    # training sends exactly the kept share of vanilla's bytes, and learns
    cfg = dataclasses.replace(BASE, mode="bns", exchange=BNSOptions(rate=rate), epochs=4)
    m, tr = run_training(cfg, part)
    v, _ = run_training(BASE, part)
    import torch.distributed as dist

    kept_all = torch.tensor([sum(kept_count(c, rate) for c in book.send_counts), sum(book.send_counts)])
    dist.all_reduce(kept_all)
    share = float(kept_all[0]) / float(kept_all[1])
    assert 0.4 < share < 0.6
    assert m["bytes_sent_per_epoch"] == pytest.approx(v["bytes_sent_per_epoch"] * share, rel=1e-12)
    assert m["bns"]["boundary_rate"] == rate and np.isfinite(m["loss"]).all()
    assert m["loss"][-1] < m["loss"][0]


THREE_RANK_CASES = [("peers_twins", case_twins_equal_vanilla),
                    ("peers_stale", case_pipegcn_is_exactly_one_epoch_stale),
                    ("peers_bns", case_bns_sends_the_kept_rows_rescaled)]


@pytest.fixture(scope="module")
def three_ranks():
    return run_cases(3, THREE_RANK_CASES, timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, _ in THREE_RANK_CASES])
def test_peers_on_three_ranks(three_ranks, name):
    assert_case(three_ranks, name)
