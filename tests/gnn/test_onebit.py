"""``--mode onebit``: the 1-bit sign format (spec against its fast twin, hand-worked rows,
sizes, errors), error feedback as a pure computation, and the exchange: on 1 rank it
trains as Vanilla; on 3 gloo ranks (one spawn) the received rows equal the reference
codec's decode(encode(x)) with error feedback off, carry the error with it on, and the
bytes on the wire are the packed records (:func:`three_rank_cases`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from commsched.quant import decode_signs, encode_signs
from commsched.quant import reference as R
from commsched.quant.wire import sign_row_bytes
from tests.mp import run_ranks

# --------------------------------------------------------------------------- the format


def test_hand_worked_rows():
    x = torch.tensor([[1.0, -2.0, 0.0, 3.0, -0.0, -1.0, 0.5, 0.5, -4.0],   # D = 9: 2 bytes
                      [0.0] * 9])
    rec, err = encode_signs(x)
    assert err is None and rec.shape == (2, sign_row_bytes(9)) == (2, 2 + 4)
    # planar, B = 2 bytes: byte j holds columns j, j + 2, j + 4, ... (bit s = column j + 2 s);
    # the negative columns are 1, 5 and 8
    assert rec[0, 0].item() == (1 << 4)            # column 8 = 0 + 2 * 4
    assert rec[0, 1].item() == (1 << 0) | (1 << 2)  # columns 1 = 1 + 0, 5 = 1 + 2 * 2
    scale = rec[0, 2:].clone().view(torch.float32).item()
    assert scale == pytest.approx(12.0 / 9.0, rel=1e-7)
    y = decode_signs(rec, 9)
    want = torch.full((9,), scale)
    want[[1, 5, 8]] = -scale  # -0.0 and 0.0 count as positive
    assert torch.equal(y[0], want)
    assert torch.equal(y[1], torch.zeros(9))  # a zero row decodes to zeros exactly


@pytest.mark.parametrize("D", [1, 7, 8, 9, 64, 130])
def test_fast_twin_equals_reference_bit_for_bit(D):
    g = torch.Generator().manual_seed(D)
    x = torch.randn(37, D, generator=g) * torch.rand(37, 1, generator=g) * 10
    x[3] = 0.0
    x[4, : (D + 1) // 2] = -0.0
    e = torch.randn(37, D, generator=g) * 0.1
    for err in (None, e):
        fast, fe = encode_signs(x, error=err)
        ref, re = encode_signs(x, error=err, impl="reference")
        assert torch.equal(fast, ref)
        assert (fe is None and re is None) or torch.equal(fe, re)
        assert torch.equal(decode_signs(fast, D), decode_signs(fast, D, impl="reference"))
    # decode(encode(x)) = sign(x) * mean |x| per row, the L2-optimal scale for these signs
    y = decode_signs(encode_signs(x)[0], D)
    s = x.double().abs().mean(1).float()
    assert torch.equal(y, torch.where(x < 0, -s[:, None], s[:, None]))
    for k in (0.9, 1.1):
        assert ((x - y) ** 2).sum() < ((x - k * y) ** 2).sum()


def test_empty_and_bad_input():
    rec, _ = encode_signs(torch.zeros(0, 5))
    assert rec.shape == (0, sign_row_bytes(5)) and decode_signs(rec, 5).shape == (0, 5)
    with pytest.raises(ValueError, match="non-finite"):
        encode_signs(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="error must be a float32 tensor of the rows' shape"):
        encode_signs(torch.ones(2, 3), error=torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"uint8 \[N, 5\]"):
        decode_signs(torch.zeros(2, 4, dtype=torch.uint8), 8)
    with pytest.raises(ValueError, match="impl must be one of"):
        encode_signs(torch.ones(1, 1), impl="triton")


def test_error_feedback_carries_the_error_to_the_next_message():
    """e_t = (x_t + e_{t-1}) - decode(encode(x_t + e_{t-1})): the next message carries what
    this one lost, so the sum of what arrived trails the sum of what was meant by e_t only."""
    g = torch.Generator().manual_seed(0)
    D = 24
    xs = [torch.randn(6, D, generator=g) for _ in range(5)]
    err = torch.zeros(6, D)
    got_sum = torch.zeros(6, D, dtype=torch.float64)
    for t, x in enumerate(xs):
        rec, new = encode_signs(x, error=err)
        m = x + err
        q = R.sign_decode_reference(*R.sign_encode_reference(m), D)
        assert torch.equal(decode_signs(rec, D), q)  # what is sent is the encoding of x + e
        assert torch.equal(new, m - q)               # what is kept is its error
        err = new
        got_sum += decode_signs(rec, D).double()
        want = sum(xx.double() for xx in xs[: t + 1]) - err.double()
        assert torch.allclose(got_sum, want, atol=1e-5)
    # the same rows sent every time: the mean of what arrived converges to them
    x = xs[0]
    err, acc = torch.zeros(6, D), torch.zeros(6, D, dtype=torch.float64)
    for _ in range(200):
        rec, err = encode_signs(x, error=err)
        acc += decode_signs(rec, D).double()
    one = (decode_signs(encode_signs(x)[0], D) - x).abs().max()
    assert (acc / 200 - x.double()).abs().max() < 0.1 * one


# --------------------------------------------------------------------------- the exchange
def test_one_rank_trains_as_vanilla():
    """One rank has no remote rows: onebit sends nothing and equals Vanilla bit for bit."""
    from commsched.gnn.exchange.modes import MODES, make_exchange
    from commsched.gnn.exchange.onebit import OneBitExchange
    from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
    from commsched.gnn.graph.partition import make_parts, partition_nodes
    from commsched.gnn.train.trainer import TrainConfig, run_training

    g = synthetic_graph(SyntheticSpec(num_nodes=60, num_edges=200, num_features=5, num_classes=3, seed=2))
    part = make_parts(g, partition_nodes(g, 1, "metis", 0), 1)[0]
    ex = make_exchange("onebit", part.book)
    assert type(ex) is OneBitExchange and ex.error_feedback and ex.overlaps and MODES["onebit"].quantized
    with pytest.raises(ValueError, match="takes no wire dtype"):
        make_exchange("onebit", part.book, wire_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="--mode onebit quantizes float32"):
        TrainConfig(mode="onebit", dtype="bfloat16")
    base = dict(layers=2, hidden=8, epochs=3, seed=1, dtype="float64")
    mv, _ = run_training(TrainConfig(**base), part)
    mo, _ = run_training(TrainConfig(mode="onebit", **base), part)
    assert mo["loss"] == mv["loss"] and mo["bytes_sent_per_epoch"] == 0
    assert mo["onebit"]["error_feedback"] is True


def three_rank_cases(rank: int, world: int) -> dict:
    """The 3-rank cases; :func:`check_three_rank` asserts on their per-rank results."""
    from commsched.comm.all2all import CommStats
    from commsched.gnn.context import PassContext
    from commsched.gnn.exchange.onebit import OneBitExchange
    from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
    from commsched.gnn.graph.partition import make_parts, partition_nodes
    from commsched.gnn.train.trainer import TrainConfig, run_training

    def dec_enc(x, err=None):
        return decode_signs(encode_signs(x, error=err, impl="reference")[0], x.shape[1], impl="reference")

    out: dict = {}
    g = synthetic_graph(SyntheticSpec(num_nodes=240, num_edges=1200, num_features=13, num_classes=3,
                                      communities_per_class=2, seed=4))
    part = make_parts(g, partition_nodes(g, world, "metis", 0), world)[rank]
    book, x = part.book, part.x_nF
    ref_R = g.x_NF[torch.from_numpy(book.remote_ids)]  # what the peers own and send us
    # 1. error feedback off: the received rows are decode(encode(x)) of the peers' rows, exactly
    ex = OneBitExchange(book, error_feedback=False)
    ex.validate()
    stats = CommStats(world)
    got = ex.start(x, 0, PassContext(stats=stats)).wait()
    out["fwd_equal"] = torch.equal(got, dec_enc(ref_R))
    out["fwd_not_exact"] = not torch.equal(got, ref_R)
    T = int(ex.send_idx.numel())
    out["bytes"] = (stats.total_bytes_sent, T * sign_row_bytes(x.shape[1]))
    # backward: every rank sends gradient rows = its remote rows' features; the owner gets
    # decode(encode(its own rows)) from each peer, added at send_idx
    gsum = ex.backward_rows(ref_R.clone(), 1)
    sent = x.index_select(0, ex.send_idx)
    out["bwd_equal"] = torch.equal(gsum, torch.zeros_like(x).index_add_(0, ex.send_idx, dec_enc(sent)))
    # 2. error feedback on: the second message of the same rows carries the first's error
    ef = OneBitExchange(book)
    first = ef.start(x, 0, PassContext()).wait()
    e1 = ef.errors[(0, "forward")]
    second = ef.start(x, 0, PassContext()).wait()
    zeros_R = torch.zeros_like(ref_R)
    want_e1 = ref_R - dec_enc(ref_R)  # the peers' kept error, recomputed here from their rows
    out["ef_first"] = torch.equal(first, dec_enc(ref_R, zeros_R))
    out["ef_second"] = torch.equal(second, dec_enc(ref_R, want_e1))
    out["ef_kept"] = torch.equal(e1, sent - dec_enc(sent))
    out["ef_eval_untouched"] = (torch.equal(ef.start(x, 0, PassContext(training=False)).wait(), ref_R)
                                and (0, "forward") in ef.errors)
    # 3. training: finite, learning, and the bytes of the records per epoch
    cfg = dict(model="gcn", layers=3, hidden=16, epochs=4, seed=1)
    mo, tr = run_training(TrainConfig(mode="onebit", **cfg), part)
    mv, _ = run_training(TrainConfig(mode="vanilla", **cfg), part)
    out["loss"], out["loss_vanilla"] = mo["loss"], mv["loss"]
    out["epoch_bytes"] = (mo["bytes_sent_per_epoch"], mv["bytes_sent_per_epoch"])
    out["T"] = T
    out["quant"] = mo["breakdown_s"]["quant"]
    return out


def check_three_rank(res: list[dict]) -> None:
    """The assertions on :func:`three_rank_cases`' per-rank results."""
    F, H, L = 13, 16, 3
    T_all = sum(o["T"] for o in res)
    for rank, o in enumerate(res):
        for k in ("fwd_equal", "fwd_not_exact", "bwd_equal", "ef_first", "ef_second", "ef_kept",
                  "ef_eval_untouched"):
            assert o[k], (k, rank)
        assert o["bytes"][0] == o["bytes"][1] > 0
        assert np.isfinite(o["loss"]).all() and o["loss"][-1] < o["loss"][0]
        assert o["quant"] > 0
    # per epoch, all ranks: layer 0 forward, layers 1..L-1 forward and backward, as records
    ob, va = res[0]["epoch_bytes"]
    assert ob == T_all * (sign_row_bytes(F) + 2 * (L - 1) * sign_row_bytes(H))
    assert va == T_all * 4 * (F + 2 * (L - 1) * H)
    # 1/32 of float32, plus per row and exchange a 4-byte scale and under a byte of padding
    assert ob <= va / 32 + T_all * (1 + 2 * (L - 1)) * 5


def test_deferred_finite_check_reads_nothing_back_until_asked():
    """``finite=flag``: no raise at the call (no host read, which is a device sync on CUDA);
    the flag turns false and stays false, for the exchange to read once an epoch."""
    flag = torch.ones((), dtype=torch.bool)
    x = torch.randn(6, 20)
    encode_signs(x, finite=flag)
    assert bool(flag)
    x[3, 7] = float("inf")
    encode_signs(x, finite=flag)  # would raise without the flag
    encode_signs(torch.randn(6, 20), finite=flag)
    assert not bool(flag)
    with pytest.raises(ValueError, match="non-finite"):
        encode_signs(x)


def test_onebit_exchange_raises_at_the_end_of_an_epoch_with_bad_rows():
    from types import SimpleNamespace

    from commsched.gnn.exchange.onebit import OneBitExchange
    from commsched.gnn.graph.book import build_books

    books = build_books(np.array([0, 1]), np.array([1, 0]), np.array([0, 1]), 2)
    ex = OneBitExchange(books[0])
    ex.end_epoch(SimpleNamespace(epoch=0))  # nothing deferred (CPU rows): nothing read
    ex._finite = torch.zeros((), dtype=torch.bool)  # as a CUDA exchange leaves it
    with pytest.raises(ValueError, match="epoch 4 held non-finite"):
        ex.end_epoch(SimpleNamespace(epoch=4))
    assert ex._finite is None  # read once, then a fresh flag next epoch


@pytest.mark.slow
def test_onebit_on_three_ranks():
    check_three_rank(run_ranks(3, three_rank_cases, timeout_s=300))
