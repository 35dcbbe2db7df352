"""``--mode adaptive``: the exchange of mixed techniques on 3 gloo ranks (dropped rows
arrive as zeros, raw rows exactly, sign rows as decode(encode(x)) with their error kept,
quantized rows within their step; the bytes on the wire are the techniques' bytes) and
training through the re-assignment (CP-SAT on rank 0, a technique per row broadcast).
On 1 rank it trains as Vanilla."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from commsched.quant import decode_signs, encode_signs
from commsched.quant.widths.joint import TECHNIQUES, row_bytes
from tests.mp import run_ranks


def _tech(src: int, dst: int, n: int) -> np.ndarray:
    """A technique per row of channel (src, dst), known to both ends."""
    return np.array([TECHNIQUES[(i + src + 2 * dst) % len(TECHNIQUES)] for i in range(n)],
                    dtype=np.int64)


def test_config_and_one_rank_trains_as_vanilla():
    from commsched.gnn.exchange.adaptive import AdaptiveExchange
    from commsched.gnn.exchange.modes import MODES, make_exchange, mode_config
    from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
    from commsched.gnn.graph.partition import make_parts, partition_nodes
    from commsched.gnn.train.trainer import TrainConfig, run_training

    cfg = mode_config("adaptive")
    assert cfg.link_costs == "topology" and cfg.error_budget == 2.0 and MODES["adaptive"].quantized
    with pytest.raises(ValueError, match="--error-budget must be >= 0"):
        mode_config("adaptive", error_budget=-1.0)
    g = synthetic_graph(SyntheticSpec(num_nodes=60, num_edges=200, num_features=5, num_classes=3, seed=2))
    part = make_parts(g, partition_nodes(g, 1, "metis", 0), 1)[0]
    ex = make_exchange("adaptive", part.book, norm="gcn")
    assert type(ex) is AdaptiveExchange and ex.overlaps
    with pytest.raises(ValueError, match="takes no wire dtype"):
        make_exchange("adaptive", part.book, norm="gcn", wire_dtype=torch.bfloat16)
    base = dict(layers=2, hidden=8, epochs=3, seed=1, dtype="float64")
    mv, _ = run_training(TrainConfig(**base), part)
    ma, _ = run_training(TrainConfig(mode="adaptive", **base), part)
    assert ma["loss"] == mv["loss"] and ma["bytes_sent_per_epoch"] == 0
    assert ma["adaptive"]["error_budget"] == 2.0


def test_warmup_and_offered_techniques():
    """The rows of the first period: 2-bit by default, ``--warmup sign`` the onebit mode's
    signs, a warm-up not offered by ``--techniques`` the narrowest offered width; bad
    names refused by the config."""
    from commsched.gnn.exchange.modes import make_exchange, mode_config
    from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
    from commsched.gnn.graph.partition import make_parts, partition_nodes

    g = synthetic_graph(SyntheticSpec(num_nodes=60, num_edges=200, num_features=5, num_classes=3, seed=2))
    book = make_parts(g, partition_nodes(g, 1, "metis", 0), 1)[0].book

    def first(**kw):
        ex = make_exchange("adaptive", book, norm="gcn", config=mode_config("adaptive", **kw))
        return ex.channel_widths(0, 1, 3, 0, "forward").tolist(), ex.report()["adaptive"]

    w, rep = first()
    assert w == [2, 2, 2] and rep["warmup"] == "2-bit" and rep["techniques"][-1] == "fp32"
    assert first(warmup="sign")[0] == [1, 1, 1]
    assert first(warmup="sign", techniques="drop,4,8")[0] == [4, 4, 4]
    w, rep = first(techniques="drop")
    assert w == [32, 32, 32] and rep["techniques"] == ["drop", "fp32"]
    with pytest.raises(ValueError, match="--techniques: unknown technique 'three'"):
        mode_config("adaptive", techniques="2,three")
    with pytest.raises(ValueError, match="--warmup must be one of sign, 2, 4, 8, fp32"):
        mode_config("adaptive", warmup="1")


def three_rank_cases(rank: int, world: int) -> dict:
    from commsched.comm.all2all import CommStats
    from commsched.gnn.context import ExchangeContext, PassContext
    from commsched.gnn.exchange.modes import AdaptiveConfig
    from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
    from commsched.gnn.graph.partition import make_parts, partition_nodes
    from commsched.gnn.train.trainer import TrainConfig, run_training

    out: dict = {}
    g = synthetic_graph(SyntheticSpec(num_nodes=240, num_edges=1200, num_features=13, num_classes=3,
                                      communities_per_class=2, seed=4))
    part = make_parts(g, partition_nodes(g, world, "metis", 0), world)[rank]
    book, x = part.book, part.x_nF
    D = x.shape[1]
    ref_R = g.x_NF[torch.from_numpy(book.remote_ids)]
    ex = AdaptiveConfig().build(ExchangeContext(book, norm="gcn"))
    # techniques set by hand on both ends of every channel (as a broadcast table would)
    ex.assigned = {(0, "forward"): {(s, d): _tech(s, d, n) for s in range(world) for d in range(world)
                                    for n in [int(book.send_counts[d]) if s == rank else
                                              int(book.recv_counts[s]) if d == rank else 0]
                                    if s != d and rank in (s, d)}}
    stats = CommStats(world)
    got = ex.start(x, 0, PassContext(stats=stats)).wait()
    tech_R = np.concatenate([_tech(p, rank, int(book.recv_counts[p])) for p in range(world)])
    t = torch.from_numpy(tech_R)
    out["drop_zero"] = bool((got[t == 0] == 0).all())
    out["raw_exact"] = torch.equal(got[t == 32], ref_R[t == 32])
    sgn = ref_R[t == 1]
    out["sign_equal"] = torch.equal(got[t == 1], decode_signs(encode_signs(sgn, impl="reference")[0], D,
                                                              impl="reference"))
    ok = True
    for b in (2, 4, 8):
        r = ref_R[t == b]
        if r.shape[0]:
            step = (r.amax(1) - r.amin(1)) / ((1 << b) - 1)
            ok &= bool(((got[t == b] - r).abs() <= step[:, None] * 1.0001 + 1e-6).all())
    out["quant_close"] = ok
    T_send = np.concatenate([_tech(rank, p, int(book.send_counts[p])) for p in range(world)])
    out["bytes"] = (stats.total_bytes_sent, int(sum(row_bytes(int(v), D) for v in T_send)))
    # the error is kept for the rows sent as signs, zero for the others
    sent = x.index_select(0, ex.send_idx)
    e = ex.error_rows(0, "forward", sent.shape[0])
    ts = torch.from_numpy(T_send)
    out["err_zero_elsewhere"] = bool((e[ts != 1] == 0).all())
    s_rows = sent[ts == 1]
    out["err_sign"] = torch.allclose(e[ts == 1], s_rows - decode_signs(encode_signs(s_rows)[0], D))
    # training through two re-assignments (period 2): finite, learning, solver recorded
    cfg = dict(model="gcn", layers=3, hidden=16, epochs=6, seed=1)
    from commsched.gnn.exchange.modes import mode_config

    ma, _ = run_training(TrainConfig(mode="adaptive", exchange=mode_config("adaptive", period=2),
                                     **cfg), part)
    out["loss"] = ma["loss"]
    out["assignments"] = ma["adaptive"]["assignments"]
    out["hist"] = ma["adaptive"]["rows_per_technique_last_epoch_this_rank"]
    out["bytes_per_epoch"] = ma["bytes_sent_per_epoch"]
    out["shares"] = (ma.get("assign_share_of_wall"), ma.get("solve_share_of_wall"),
                     ma["adaptive"].get("assign_total_s"), ma["adaptive"].get("solve_total_s"))
    return out


@pytest.mark.slow
def test_adaptive_on_three_ranks():
    res = run_ranks(3, three_rank_cases, timeout_s=300)
    for rank, o in enumerate(res):
        for k in ("drop_zero", "raw_exact", "sign_equal", "quant_close", "err_zero_elsewhere",
                  "err_sign"):
            assert o[k], (k, rank)
        assert o["bytes"][0] == o["bytes"][1] > 0
        assert np.isfinite(o["loss"]).all() and o["loss"][-1] < o["loss"][0]
        a = o["assignments"]
        assert [x["epoch"] for x in a] == [2, 4]  # every period, the same table on every rank
        assert a == res[0]["assignments"] or all(
            x["rows_per_technique"] == y["rows_per_technique"] for x, y in zip(a, res[0]["assignments"]))
        for x in a:
            assert x["status"] in ("optimal", "feasible", "greedy") and x["wall_s"] > 0
            assert x["predicted_s"] <= x["greedy_predicted_s"] + 1e-12
            for k in x["keys"]:
                assert k["error"] <= k["budget"] * (1 + 1e-3)
        assert sum(o["hist"].values()) > 0
        if rank == 0:  # rank 0 reports the re-assignments' share of its wall clock
            inline, solve, inline_s, solve_s = o["shares"]
            assert inline_s == pytest.approx(sum(x["wall_s"] for x in a)) and 0 < inline < 1
            assert solve_s == pytest.approx(sum(x["solve_s"] for x in a)) and 0 < solve < 1


def test_solve_budget_keeps_cpsat_within_a_share_of_the_period():
    from commsched.gnn.exchange.adaptive_plan import CPSAT_MIN_S, CPSAT_SHARE, solve_budget

    assert solve_budget(0.25, "cp-sat", 5, None) == ("cp-sat", 0.25)  # no epoch timed yet
    # a 0.5 s epoch, period 5: 2% of 2.5 s is under the floor, the greedy alone
    assert CPSAT_SHARE * 5 * 0.5 < CPSAT_MIN_S
    assert solve_budget(0.25, "cp-sat", 5, 0.5)[0] == "greedy"
    # a 4 s epoch: CP-SAT at min(limit, half an epoch, 2% of 20 s = 0.4 s)
    assert solve_budget(0.25, "cp-sat", 5, 4.0) == ("cp-sat", 0.25)
    assert solve_budget(1.0, "cp-sat", 5, 4.0) == ("cp-sat", pytest.approx(0.4))
    assert solve_budget(1.0, "greedy", 5, 4.0)[0] == "greedy"
