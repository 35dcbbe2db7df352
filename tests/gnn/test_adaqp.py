"""AdaQP exchanges: pure width layouts and the rank-0 solve; on 2 and 3 gloo ranks,
adaqp-p equals vanilla exactly, quantized exchanges round-trip within the quantization
error bound (forward and backward), quantized modes train, widths agree across ranks.
The 3-rank cases of tests/gnn/test_pyg.py and tests/gnn/test_peers.py share its spawn."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from commsched.gnn.context import ExchangeContext
from commsched.gnn.exchange.adaqp_plan import random_widths, solve_widths, width_layout
from commsched.gnn.exchange.modes import AdaQPConfig, UniformConfig
from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
from commsched.gnn.graph.partition import make_parts, partition_nodes
from commsched.gnn.train.trainer import TrainConfig, run_training
from commsched.quant.reference import BITS
from tests.mp import run_ranks

SYN = SyntheticSpec(num_nodes=600, num_edges=3000, num_features=20, num_classes=4,
                    communities_per_class=2, seed=3)


# --------------------------------------------------------------------------- pure
def test_width_layout_sizes_and_agreement():
    w = [np.array([8, 2, 4, 2, 8]), np.zeros(0, np.int64), np.array([4])]
    lay = width_layout(w, dim=5)
    # peer 0: width 2 rows {1, 3}: payload 2 * ceil(10/8) = 4, meta 16; width 4 row {2}: 3 + 8;
    # width 8 rows {0, 4}: 10 + 16
    assert lay.segments.sizes[0] == (4, 16, 3, 8, 10, 16)
    assert lay.segments.sizes[1] == (0,) * 6
    assert lay.segments.sizes[2] == (0, 0, 3, 8, 0, 0)
    assert [t.tolist() for t in lay.idx[0]] == [[1, 3], [2], [0, 4]]
    assert lay.rows_per_width() == {2: 2, 4: 2, 8: 2}
    # per width, the rows among all 6 of the exchange (peer 2's row is row 5), peer by peer
    assert [t.tolist() for t in lay.pos] == [[1, 3], [2, 5], [0, 4]]
    assert lay.peer_rows == ((2, 0, 0), (1, 0, 1), (2, 0, 0))
    with pytest.raises(ValueError, match="must be 2, 4 or 8"):
        width_layout([np.array([3])], dim=4)
    # the sender's row for peer q equals the receiver's row for peer p (3 ranks, random widths)
    P, counts = 3, {(s, d): 7 + 3 * s + d for s in range(3) for d in range(3) if s != d}
    for me in range(P):
        def ch(s, d):
            return random_widths(counts.get((s, d), 0), seed=1, layer=2, direction="backward",
                                 src=s, dst=d, period_index=4)
        send = width_layout([ch(me, p) for p in range(P)], 16)
        for p in range(P):
            recv_p = width_layout([ch(q, p) for q in range(P)], 16)
            assert send.segments.sizes[p] == recv_p.segments.sizes[me]
    assert not np.array_equal(random_widths(50, seed=1, layer=0, direction="forward", src=0, dst=1,
                                            period_index=0),
                              random_widths(50, seed=1, layer=0, direction="forward", src=0, dst=1,
                                            period_index=1))


def _per_rank(P: int, rng) -> list[dict]:
    out = []
    counts = rng.integers(0, 40, size=(P, P))
    np.fill_diagonal(counts, 0)
    for r in range(P):
        tr = {(0, "forward"): [rng.lognormal(size=counts[r, p]) for p in range(P)],
              (1, "backward"): [rng.lognormal(size=counts[p, r]) for p in range(P)]}
        out.append({"trace": tr, "dims": {(0, "forward"): 12, (1, "backward"): 16},
                    "costs": {p: (1e-8 * (1 + r), 1e-5) for p in range(P) if p != r},
                    "counts": (tuple(counts[r]), tuple(counts[:, r]))})
    return out


# --------------------------------------------------------------------------- the codec's compiling
# torch.compile is replaced by the identity (compiling for real takes ~10 s per kernel here);
# what is tested is what the codec says around it, and that COMMSCHED_COMPILE=0 never calls it.
_ODD_D = 4099  # a row width no other test compiles


@pytest.fixture
def fake_compile(monkeypatch):
    """torch.compile as the identity, and no native kernel: the torch.compile path of a
    machine without a C compiler."""
    import commsched.gnn.exchange.adaqp as A
    from commsched.quant import fast

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    monkeypatch.setattr(fast, "native_library", lambda: None)
    monkeypatch.setattr(fast, "warm_native", lambda say=None: False)
    monkeypatch.setattr(A, "warm_native", lambda say=None: False)
    fast._compiled.cache_clear()
    yield fast
    fast._compiled.cache_clear()  # no identity-"compiled" kernel outlives the test


def test_codec_compiling_says_what_and_how_long(fake_compile):
    import re

    fast, lines = fake_compile, []
    assert fast.warm_codec([_ODD_D], bits=[8, 2], say=lines.append) >= 0.0
    assert len(lines) == 2
    assert "compiling the CPU quantization codec" in lines[0] and "4 kernels" in lines[0]
    assert "COMMSCHED_COMPILE=0" in lines[0] and str(_ODD_D) in lines[0]
    assert re.fullmatch(r"commsched\.quant: codec compiled in \d+\.\d s", lines[1])
    assert fast.warm_codec([_ODD_D], bits=[8, 2], say=lines.append) == 0.0 and len(lines) == 2
    # a kernel compiled on first use outside warm_codec says so by itself, once
    x = torch.randn(8, _ODD_D)
    p, m = fast.quantize_cpu(x, 4, 1, compile=True, _say=lines.append)
    fast.quantize_cpu(x, 4, 1, compile=True, _say=lines.append)
    assert len(lines) == 4 and "compiling the quantize_fused_b4_d4099" in lines[2]
    assert re.fullmatch(r"commsched\.quant: compiled quantize_fused_b4_d4099 in \d+\.\d s", lines[3])
    assert torch.equal(p, fast.quantize_cpu(x, 4, 1, compile=False)[0])


def test_adaqp_prepare_speaks_on_rank_0_and_not_without_compiling(fake_compile):
    from commsched.gnn.graph.book import build_books

    # node i of part 0 joined to node 40 + i of part 1: 40 rows each way, 40 * 4099
    # elements per exchange, large enough to compile
    pairs = [(i, 40 + i) for i in range(40)]
    src = np.array([a for a, b in pairs] + [b for a, b in pairs])
    dst = np.array([b for a, b in pairs] + [a for a, b in pairs])
    books = build_books(src, dst, (np.arange(80) >= 40).astype(np.int64), 2)
    assert min(sum(books[0].send_counts), sum(books[0].recv_counts)) * _ODD_D >= 1 << 16
    said = {0: [], 1: []}
    for r in (1, 0):  # (ranks are processes: each compiles its own kernels)
        fake_compile._compiled.cache_clear()
        ex = UniformConfig().build(ExchangeContext(books[r], norm="sum"))
        assert ex.compiles
        ex.prepare([_ODD_D], say=said[r].append)
    assert said[1] == [] and len(said[0]) == 2 and "compiled in" in said[0][1]
    quiet = UniformConfig(compile=False).build(ExchangeContext(books[0], norm="sum"))
    fake_compile._compiled.cache_clear()
    quiet.prepare([_ODD_D], say=said[0].append)
    assert not quiet.compiles and len(said[0]) == 2 and not quiet._compiled_dims


def test_adaqp_prepare_with_the_native_kernel_says_once_and_compiles_nothing(monkeypatch):
    """Where the native kernel is there, prepare loads it (rank 0 says what and from where,
    in one line) and no torch.compile kernel is made for any row width."""
    from commsched.kernels import cpu as C

    from commsched.gnn.graph.book import build_books
    from commsched.quant import fast

    if fast.native_library() is None:
        pytest.skip(f"no native codec here: {C.status().describe()}")
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("torch.compile was called"))
    monkeypatch.setattr(C, "_status", None)  # this process's first load again
    monkeypatch.setattr(C, "_lib", None)
    pairs = [(i, 40 + i) for i in range(40)]
    src = np.array([a for a, b in pairs] + [b for a, b in pairs])
    dst = np.array([b for a, b in pairs] + [a for a, b in pairs])
    books = build_books(src, dst, (np.arange(80) >= 40).astype(np.int64), 2)
    said: list[str] = []
    ex = UniformConfig().build(ExchangeContext(books[0], norm="sum"))
    ex.prepare([_ODD_D, 64], say=said.append)
    assert len(said) == 1 and "native CPU codec kernel" in said[0] and "cache" in said[0]
    assert not ex._compiled_dims
    UniformConfig().build(ExchangeContext(books[1], norm="sum")).prepare([_ODD_D], say=said.append)
    assert len(said) == 1  # rank 1 is quiet, and a second load says nothing


def test_compile_off_by_environment_never_calls_torch_compile(monkeypatch):
    from commsched.config import read_env
    from commsched.gnn.graph.book import build_books
    from commsched.quant import fast

    assert read_env({}).compile and read_env({"COMMSCHED_COMPILE": "1"}).compile
    assert not read_env({"COMMSCHED_COMPILE": "0"}).compile
    with pytest.raises(ValueError, match="COMMSCHED_COMPILE='maybe': expected 0 or 1"):
        read_env({"COMMSCHED_COMPILE": "maybe"})
    monkeypatch.setenv("COMMSCHED_COMPILE", "0")
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("torch.compile was called"))
    x = torch.randn(5, 33)
    p, m = fast.quantize_cpu(x, 2, 3, compile=True)
    assert torch.equal(p, fast.quantize_cpu(x, 2, 3, compile=False)[0])
    assert fast.warm_codec([33], say=lambda s: pytest.fail(f"said {s!r}")) == 0.0
    b = build_books(np.array([0, 1]), np.array([1, 0]), np.array([0, 1]), 2)[0]
    assert not UniformConfig().build(ExchangeContext(b, norm="gcn")).compiles


@pytest.mark.parametrize("P", [2, 3])
def test_solve_widths_covers_every_channel(P):
    per = _per_rank(P, np.random.default_rng(P))
    for lam, only in ((0.0, 2), (1.0, 8), (0.5, None)):
        table, info = solve_widths(per, group_size=5, lam=lam, time_limit_s=5.0)
        for key in ((0, "forward"), (1, "backward")):
            for s in range(P):
                for d in range(P):
                    if s == d:
                        continue
                    n = per[s]["counts"][0 if key[1] == "forward" else 1][d]
                    w = table[key][(s, d)]
                    assert w.shape == (n,) and set(w.tolist()) <= set(BITS)
                    if only is not None and n:
                        assert set(w.tolist()) == {only}
        assert sum(info["rows_per_width"].values()) == sum(
            len(a) for r in per for k in r["trace"] for a in r["trace"][k])


# --------------------------------------------------------------------------- distributed
def _bound_ok(got: torch.Tensor, ref: torch.Tensor, bits_R: np.ndarray) -> bool:
    """|x' - x| <= (max - min) / (2^b - 1) per row (one quantization step), with slack."""
    rng = (ref.amax(1) - ref.amin(1)).double()
    step = rng / torch.from_numpy((2.0 ** bits_R - 1))
    err = (got.double() - ref.double()).abs().amax(1)
    return bool((err <= step * (1 + 1e-4) + 1e-6).all())


def _overlap_case(part, grp) -> tuple[bool, bool]:
    """One GCN layer's backward with an asynchronous exchange: the gradient exchange is
    launched before the central aggregation's backward and finished after it (the
    overlap), and the input gradient equals the blocking exchange's."""
    from contextlib import contextmanager

    from commsched.gnn.context import PassContext
    from commsched.gnn.exchange.halo import VanillaExchange
    from commsched.gnn.nn.layers import GCNConv, LocalGraph
    from commsched.gnn.timing import Breakdown

    log: list = []

    class LogTimer(Breakdown):
        @contextmanager
        def time(self, key):
            log.append(key)
            with super().time(key):
                yield

    class LogExchange(VanillaExchange):
        def transfer(self, rows, layer, direction, ctx):
            log.append(f"launch-{direction}")
            pend = super().transfer(rows, layer, direction, ctx)
            return type(pend)(lambda: (pend.wait(), log.append(f"done-{direction}"))[0])

    grads = []
    for asynchronous in (True, False):
        torch.manual_seed(0)
        conv = GCNConv(part.x_nF.shape[1], 4).double()
        ex = LogExchange(ExchangeContext(part.book, group=grp), asynchronous=asynchronous)
        g = LocalGraph(part.book, ex, dtype=torch.float64)
        h = part.x_nF.double().clone().requires_grad_(True)
        out = conv(h, g, 1, PassContext(timer=LogTimer()))
        log.clear()
        out.square().sum().backward()
        if asynchronous:
            order = [e for e in log if e in ("launch-backward", "central", "done-backward")]
        grads.append(h.grad)
    return order == ["launch-backward", "central", "done-backward"], torch.allclose(*grads, rtol=1e-12)


def _topology_case(part, rank: int) -> dict:
    """Ranks 0, 1 on one emulated host, rank 2 on another (torchrun's GROUP_RANK): the
    pair probe, per-pair costs into the assigner, the per-link-class report, the bytes
    per link class."""
    import os

    from commsched import Topology

    saved = os.environ.get("GROUP_RANK")
    os.environ["GROUP_RANK"] = str(rank // 2)
    try:
        hosts = Topology.from_env().hosts_P
        cfg = TrainConfig(mode="adaqp", model="sage", layers=2, hidden=16, epochs=3, seed=1,
                          exchange=AdaQPConfig(period=2, group_size=10, link_costs="topology",
                                            equal_variance=True, probe_repeats=1))
        m, tr = run_training(cfg, part, hosts_P=hosts)
    finally:
        if saved is None:
            os.environ.pop("GROUP_RANK")
        else:
            os.environ["GROUP_RANK"] = saved
    ex = tr.halo
    last = m["adaqp"]["assignments"][-1]
    return {"topo_hosts": list(hosts), "topo_peers": sorted(ex.link_costs),
            "topo_classes": {c: r["rows"] for c, r in last["link_classes"].items()},
            "topo_rows": sum(int(w.size) for k in ex.assigned.values() for (s, d), w in k.items()
                             if s == rank),
            "topo_budget_ok": all(p["variance"] <= p["variance_budget"] * (1 + 1e-9)
                                  for p in last["problems"]),
            "topo_bytes": m.get("bytes_per_epoch_by_class"),
            "topo_source": m["adaqp"]["link_cost_source"]}


def _cases(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from commsched.gnn.exchange.modes import make_exchange

    out: dict = {}
    g = synthetic_graph(SYN)
    sub = dist.new_group([0, 1])  # the 2-rank cases run on ranks 0 and 1
    groups = [(world, None)] + ([(2, sub)] if rank < 2 else [])
    for P, grp in groups:
        part = make_parts(g, partition_nodes(g, P, "metis", 0), P)[rank]
        # 1. adaqp-p (overlap, full precision) equals vanilla exactly
        base = TrainConfig(model="gcn", layers=3, hidden=16, epochs=4, dtype="float64", seed=2)
        mv, tv = run_training(base, part, group=grp)
        mp_, tp = run_training(TrainConfig(**{**base.__dict__, "mode": "adaqp-p"}), part, group=grp)
        out[f"p_equal_{P}"] = (mv["loss"] == mp_["loss"] and mv["test_acc"] == mp_["test_acc"]
                               and all(torch.equal(a, b) for a, b in
                                       zip(tv.model.parameters(), tp.model.parameters())))
        out[f"overlap_order_{P}"], out[f"overlap_equal_{P}"] = _overlap_case(part, grp)
        # 2. the quantized exchange round-trips within one quantization step per row,
        #    forward (features) and backward (gradient rows summed into their owners)
        x = part.x_nF
        ref_R = g.x_NF[torch.from_numpy(part.book.remote_ids)]
        for mode, bits in (("uniform", 8), ("uniform", 2), ("random", 8)):
            cfg = TrainConfig(mode=mode, exchange=AdaQPConfig(bits=bits), seed=5)
            ex = make_exchange(mode, part.book, group=grp, config=cfg.exchange, seed=cfg.seed,
                               norm="gcn")
            ex.validate()
            got = ex.start(x, 0).wait()
            _, recv = ex.layouts(0, "forward", x.shape[1])
            wR = np.zeros(part.book.num_remote, np.int64)
            o = 0
            for p in range(P):
                for w, b in enumerate(BITS):
                    wR[o + recv.idx[p][w].numpy()] = b
                o += part.book.recv_counts[p]
            out[f"fwd_bound_{mode}{bits}_{P}"] = _bound_ok(got, ref_R, wR)
            out[f"fwd_not_exact_{mode}{bits}_{P}"] = not torch.equal(got, ref_R)
            # backward: every rank sends gradient rows = its remote rows' features
            gsum = ex.backward_rows(ref_R.clone(), 1)
            # exact[v] = x[v] * (number of peers v is sent to)
            exact = torch.zeros_like(x).index_add_(0, ex.send_idx, x.index_select(0, ex.send_idx))
            nsent = torch.zeros(x.shape[0]).index_add_(0, ex.send_idx, torch.ones(ex.send_idx.numel()))
            step = (x.amax(1) - x.amin(1)) / 3.0  # width 2 is the loosest step
            err = (gsum - exact).abs().amax(1)
            out[f"bwd_bound_{mode}{bits}_{P}"] = bool((err <= nsent * step * (1 + 1e-4) + 1e-6).all())
        # 3. the quantized modes train; adaptive re-assigns and the widths agree between ends
        for mode in ("adaqp", "adaqp-q", "random", "uniform", "nocomm"):
            cfg = TrainConfig(mode=mode, model="sage", layers=3, hidden=16, epochs=5,
                              exchange=AdaQPConfig(period=2, group_size=10, bits=8), seed=1)
            m, tr = run_training(cfg, part, group=grp)
            out[f"finite_{mode}_{P}"] = bool(np.isfinite(m["loss"]).all())
            out[f"bytes_{mode}_{P}"] = m["bytes_sent_per_epoch"]
            out[f"loss_{mode}_{P}"] = m["loss"]
            if mode == "adaqp":
                ex = tr.halo
                out[f"assignments_{P}"] = len(ex.assignments)
                mine = {k: {c: w.tolist() for c, w in v.items()} for k, v in ex.assigned.items()}
                allv: list = [None] * P
                dist.all_gather_object(allv, mine, group=grp)
                agree = True
                for k, chans in mine.items():
                    for (s, d), w in chans.items():
                        other = d if s == rank else s
                        agree &= allv[other][k][(s, d)] == w
                out[f"widths_agree_{P}"] = agree and bool(mine)
                out[f"assign_share_{P}"] = m.get("assign_share_of_wall")
        mv8, _ = run_training(TrainConfig(model="sage", layers=3, hidden=16, epochs=5, seed=1),
                              part, group=grp)
        out[f"loss_vanilla_{P}"] = mv8["loss"]
        out[f"bytes_vanilla_{P}"] = mv8["bytes_sent_per_epoch"]
        if P == 3:
            out.update(_topology_case(part, rank))
    return out


@pytest.mark.slow
def test_adaqp_on_two_and_three_ranks():
    res = run_ranks(3, _cases, timeout_s=400)
    for rank, out in enumerate(res):
        for P in (3, 2):
            if rank >= P:
                continue
            assert out[f"p_equal_{P}"], f"adaqp-p differs from vanilla on {P} ranks"
            assert out[f"overlap_order_{P}"], "the backward exchange did not overlap the central backward"
            assert out[f"overlap_equal_{P}"], "the overlapped backward changed the gradient"
            for mb in ("uniform8", "uniform2", "random8"):
                assert out[f"fwd_bound_{mb}_{P}"], (mb, P, rank)
                assert out[f"bwd_bound_{mb}_{P}"], (mb, P, rank)
                assert out[f"fwd_not_exact_{mb}_{P}"], (mb, P, rank)
            for mode in ("adaqp", "adaqp-q", "random", "uniform", "nocomm"):
                assert out[f"finite_{mode}_{P}"], (mode, P)
            assert out[f"assignments_{P}"] == 2  # epochs 2 and 4 with period 2
            assert out[f"widths_agree_{P}"]
            van = np.array(out[f"loss_vanilla_{P}"])
            # uniform 8-bit: close to vanilla; (D + 8) / (4 D) of the bytes at width D = 16, 20
            assert np.abs(np.array(out[f"loss_uniform_{P}"]) - van).max() <= 0.02 * van.max()
            assert out[f"bytes_uniform_{P}"] < 0.4 * out[f"bytes_vanilla_{P}"]
            assert out[f"bytes_adaqp_{P}"] < 0.4 * out[f"bytes_vanilla_{P}"]
            assert out[f"bytes_nocomm_{P}"] == 0
    # the probed topology of 2 emulated hosts (ranks 0, 1 | 2)
    for rank, out in enumerate(res):
        assert out["topo_hosts"][0] == out["topo_hosts"][1] != out["topo_hosts"][2]
        assert out["topo_peers"] == [p for p in range(3) if p != rank]
        assert out["topo_source"] == "topology" and out["topo_budget_ok"]
        assert set(out["topo_bytes"]) == {"intra", "inter"}
        assert out["topo_bytes"]["intra"] > 0 and out["topo_bytes"]["inter"] > 0
    # every row of every channel is counted once, in its class (rank 0 writes the metrics)
    assert set(res[0]["topo_classes"]) == {"intra", "inter"}
    assert sum(res[0]["topo_classes"].values()) == sum(out["topo_rows"] for out in res)
