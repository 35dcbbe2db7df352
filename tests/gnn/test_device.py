"""The GNN front-end's device plumbing and the bf16 baseline.

On the CPU the same code runs with ``device="cpu"`` given explicitly (it must equal the
default, bit for bit); the quantized exchange runs through a loopback transport (no
process group) so its device path is exercised in one process; tests marked ``cuda``
compare a CUDA run with the CPU run and check that AdaQP's codec takes the Triton path
(skipped without a CUDA device, see conftest.py).
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
import torch

from commsched.clock import Clock
from commsched.gnn.context import PassContext
from commsched.gnn.exchange import adaqp as adaqp_mod
from commsched.gnn.exchange.modes import AdaQPConfig, make_exchange
from commsched.gnn.graph.data import SyntheticSpec, from_edges, synthetic_graph
from commsched.gnn.graph.partition import make_parts, partition_nodes
from commsched.gnn.nn.layers import LocalGraph
from commsched.gnn.timing import Breakdown
from commsched.gnn.train.trainer import TrainConfig, Trainer, run_device, run_training
from tests.mp import run_ranks

SYN = SyntheticSpec(num_nodes=300, num_edges=1500, num_features=10, num_classes=4,
                    communities_per_class=2, seed=5)
SMALL = dict(layers=3, hidden=16, epochs=4, seed=3)


def _part(world: int = 1, rank: int = 0):
    g = synthetic_graph(SYN)
    return make_parts(g, partition_nodes(g, world, "metis", 0), world)[rank]


def _params(tr: Trainer) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in tr.model.parameters()]


# --------------------------------------------------------------------------- config
def test_device_and_dtype_options_validate():
    assert TrainConfig().device == "cpu" and TrainConfig().dtype == "float32"  # the library's default
    with pytest.raises(ValueError, match="--device must be one of"):
        TrainConfig(device="tpu")
    with pytest.raises(ValueError, match="full-precision modes"):
        TrainConfig(mode="adaqp", dtype="bfloat16")
    for mode in ("vanilla", "adaqp-p", "nocomm"):
        c = TrainConfig(mode=mode, dtype="bfloat16")
        assert c.mixed and c.param_dtype == torch.float32 and c.wire_dtype == torch.bfloat16
    c = TrainConfig(dtype="float64")
    assert not c.mixed and c.param_dtype == torch.float64 and c.wire_dtype is None
    with pytest.raises(ValueError, match="takes no wire dtype"):
        make_exchange("uniform", _part(2).book, norm="gcn", wire_dtype=torch.bfloat16)
    assert run_device(TrainConfig(device="cpu")) == torch.device("cpu")


def test_train_cli_carries_device_and_bf16():
    from commsched.gnn.train.cli import build_parser, config_from_args

    a = build_parser().parse_args(["--device", "cpu", "--dtype", "bfloat16", "--mode", "adaqp-p"])
    cfg = config_from_args(a)
    assert (cfg.device, cfg.dtype, cfg.mode) == ("cpu", "bfloat16", "adaqp-p")
    assert config_from_args(build_parser().parse_args([])).device == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--device", "tpu"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA")
def test_train_cli_device_cuda_without_cuda_says_so(capsys):
    from commsched.gnn.train.cli import main

    assert main(["--device", "cuda", "--epochs", "1"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_bench_passes_device_and_adds_bf16_variants():
    from commsched.bench.gnn import compare as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    a = p.parse_args(["--device", "cpu", "--models", "gcn", "--modes", "vanilla,vanilla-bf16,adaqp"])
    vs = {v.name: v for v in bench.variants(a)}
    assert list(vs) == ["gcn-vanilla", "gcn-vanilla-bf16", "gcn-adaqp"]
    for v in vs.values():
        i = v.argv.index("--device")
        assert v.argv[i + 1] == "cpu"
    bf = vs["gcn-vanilla-bf16"].config
    assert (bf.mode, bf.dtype) == ("vanilla", "bfloat16") and "--dtype" in vs["gcn-vanilla-bf16"].argv
    assert "--dtype" not in vs["gcn-adaqp"].argv
    assert (bench.bench_run("adaqp-p-bf16")[0].mode, bench.bench_run("adaqp-p-bf16")[0].dtype) == ("adaqp-p", "bfloat16")
    with pytest.raises(ValueError, match="quantizes"):
        bench.bench_run("adaqp-bf16")
    with pytest.raises(ValueError, match="not known"):
        bench.bench_run("fast")
    assert "vanilla-bf16" in bench.MODES_GCN and "vanilla-bf16" in bench.MODES_SAGE
    # the summary reports every variant against both Vanillas
    run = lambda t: {"epoch_time_s": t, "bytes_sent_per_epoch": 1.0, "test_acc": 0.5,  # noqa: E731
                     "breakdown_s": {"comm": 0.1, "quant": 0.0}, "loss": [1.0]}
    runs = {"gcn-vanilla": [run(4.0)], "gcn-vanilla-bf16": [run(2.0)], "gcn-adaqp": [run(1.0)]}
    from unittest import mock

    with mock.patch.object(bench, "_plots", lambda runs, out: []):  # no figures in a unit test
        s = bench.summarize(runs, a, None)
    r = s["gnn"]["gcn-adaqp"]
    assert r["speedup_vs_vanilla"] == 4.0 and r["speedup_vs_vanilla_bf16"] == 2.0
    assert s["gnn"]["gcn-vanilla-bf16"]["speedup_vs_vanilla"] == 2.0


# --------------------------------------------------------------------------- timing
class _EventClock(Clock):
    """A stand-in for the CUDA clock: marks are counters, intervals resolve late."""

    def __init__(self):
        super().__init__("cpu")
        self.cuda, self.t, self.resolved = True, 0.0, 0

    def mark(self, stream=None):
        self.t += 1.0
        return self.t

    def seconds(self, a, b):
        self.resolved += 1
        return b - a


def test_breakdown_spans_on_the_host_and_deferred():
    b = Breakdown()
    assert b.clock.device == torch.device("cpu") and not b.clock.cuda
    a0 = b.mark()
    b.add_span("comm", a0, a0 + 2.0)
    b.add_span("comm", a0, a0 + 0.5, -1.0)
    with b.time("central"):
        pass
    d = b.as_dict()
    assert d["comm"] == 1.5 and d["central"] >= 0.0 and set(d) >= {"quant", "assign"}
    ev = _EventClock()
    b = Breakdown(ev)
    with b.time("central"):       # marks 1, 2
        pass
    t = b.mark()                  # 3
    b.add_span("comm", t, b.mark())  # 4: +1
    b.add_span("comm", t, t + 0.25, -1.0)
    assert ev.resolved == 0 and b.seconds["comm"] == 0.0  # nothing read before the pass ends
    d = b.as_dict()
    assert (d["central"], d["comm"], ev.resolved) == (1.0, 0.75, 3)
    assert b.as_dict()["comm"] == 0.75  # resolved once


# --------------------------------------------------------------------------- one rank
def test_trainer_with_device_cpu_equals_the_default():
    part = _part()
    m1, t1 = run_training(TrainConfig(device="cpu", **SMALL), part)
    assert t1.device == torch.device("cpu") and m1["device"] == "cpu"
    assert t1.x.device.type == "cpu" and t1.graph.device.type == "cpu"
    assert t1.graph.blocks("gcn")[0].A.device.type == "cpu"
    m2, t2 = run_training(TrainConfig(**SMALL), part, device=torch.device("cpu"))
    assert m1["loss"] == m2["loss"] and m1["test_acc"] == m2["test_acc"]
    assert all(torch.equal(a, b) for a, b in zip(_params(t1), _params(t2)))
    m3, t3 = run_training(TrainConfig(**SMALL), part)  # the default config: the CPU
    assert t3.device == torch.device("cpu")
    assert m3["loss"] == m1["loss"] and all(torch.equal(a, b) for a, b in zip(_params(t1), _params(t3)))
    if not torch.cuda.is_available():  # auto is the CPU here: the same run again
        m4, t4 = run_training(TrainConfig(device="auto", **SMALL), part)
        assert t4.device == torch.device("cpu") and m4["loss"] == m1["loss"]


def test_bf16_single_rank_trains_with_float32_parameters():
    part = _part()
    m32, _ = run_training(TrainConfig(device="cpu", **SMALL), part)
    m16, tr = run_training(TrainConfig(device="cpu", dtype="bfloat16", **SMALL), part)
    assert all(p.dtype == torch.float32 for p in tr.model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in tr.grad_step.optimizer.state.values())
    l32, l16 = np.array(m32["loss"]), np.array(m16["loss"])
    assert np.isfinite(l16).all() and not np.array_equal(l16, l32)  # bf16 compute ran
    assert np.abs(l16 - l32).max() <= 0.02 * l32.max()


# --------------------------------------------------------------------------- AdaQP loopback
def _ring_part():
    """Rank 0 of a ring of 8 split in halves: it sends 2 rows to rank 1 and receives 2, so
    with uniform widths its send and receive layouts coincide (a loopback can deliver its
    own message as the peer's)."""
    n = 8
    e = np.array([[i, (i + 1) % n] for i in range(n)])
    rng = np.random.default_rng(0)
    tr = np.ones(n, bool)
    g = from_edges(e, rng.standard_normal((n, 5)), np.arange(n) % 2, tr, tr, tr, name="ring")
    part = make_parts(g, np.repeat([0, 1], n // 2), 2)[0]
    assert part.book.send_counts == part.book.recv_counts == (0, 2)
    return part


class _Loopback:
    """``exchange_segments`` without a process group: what rank 0 sends to peer 1 comes
    back as peer 1's message."""

    def __init__(self):
        self.calls = 0

    def __call__(self, segs, layout, **kw):
        self.calls += 1
        assert kw.get("async_op") is True
        return type("H", (), {"wait": lambda self_: [list(s) for s in segs]})()


def _loopback_round_trip(device: str, bits: int, monkeypatch):
    part = _ring_part()
    loop = _Loopback()
    monkeypatch.setattr(adaqp_mod, "exchange_segments", loop)
    ex = make_exchange("uniform", part.book, config=AdaQPConfig(bits=bits), seed=4, norm="gcn",
                       device=device)
    assert ex.device.type == device and ex.send_idx.device.type == device
    lg = LocalGraph(part.book, ex)  # the graph follows its exchange's device by default
    assert lg.device == ex.device and lg.owned_gids.device == ex.device
    x = part.x_nF.to(device)
    ctx = PassContext(timer=Breakdown(Clock(device)))
    got = ex.start(x, 0, ctx).wait()
    send, recv = ex.layouts(0, "forward", x.shape[1])
    assert all(t.device.type == device for t in send.pos + recv.pos)
    assert got.device.type == device and loop.calls == 1
    d = ctx.timer.as_dict()
    assert d["quant"] > 0.0
    return part, ex, x, got


@pytest.mark.parametrize("bits", [2, 8])
def test_quantized_exchange_on_device_cpu_loopback(bits, monkeypatch):
    part, ex, x, got = _loopback_round_trip("cpu", bits, monkeypatch)
    ref = x.index_select(0, ex.send_idx)  # the loopback returns our own rows
    step = (ref.amax(1) - ref.amin(1)) / (2 ** bits - 1)
    assert bool(((got - ref).abs().amax(1) <= step * (1 + 1e-4) + 1e-6).all())
    # the variance trace: read from the device range tensor when asked, beta per message
    tr = ex.trace[(0, "forward")]
    assert tr[0].size == 0 and tr[1].shape == (2,)
    coef = part.book.send_coef_sq["gcn"][part.book.send_slice(1)]
    rng = (ref.amax(1) - ref.amin(1)).double().numpy()
    np.testing.assert_allclose(tr[1], coef * rng ** 2 * (x.shape[1] / 6.0), rtol=1e-5)


# --------------------------------------------------------------------------- two ranks
def _bf16_cases(rank: int, world: int) -> dict:
    part = _part(world, rank)
    out = {}
    for mode in ("vanilla", "adaqp-p"):
        for dtype in ("float32", "bfloat16"):
            m, tr = run_training(TrainConfig(mode=mode, dtype=dtype, device="cpu", **SMALL), part)
            out[(mode, dtype)] = {"loss": m["loss"], "bytes": m["bytes_sent_per_epoch"],
                                  "params_fp32": all(p.dtype == torch.float32 for p in tr.model.parameters()),
                                  "wire": str(tr.halo.wire_dtype)}
    return out


@pytest.mark.slow
def test_bf16_vanilla_sends_half_the_bytes_and_trains():
    res = run_ranks(2, _bf16_cases, timeout_s=300)
    for out in res:
        f32, b16 = out[("vanilla", "float32")], out[("vanilla", "bfloat16")]
        assert b16["bytes"] > 0 and b16["bytes"] * 2 == f32["bytes"]
        assert np.isfinite(b16["loss"]).all() and b16["params_fp32"] and b16["wire"] == "torch.bfloat16"
        l32, l16 = np.array(f32["loss"]), np.array(b16["loss"])
        assert np.abs(l16 - l32).max() <= 0.02 * l32.max()
        # the overlapped full-precision exchange equals the blocking one at bf16 too
        assert out[("adaqp-p", "bfloat16")]["loss"] == b16["loss"]
        assert out[("adaqp-p", "bfloat16")]["bytes"] == b16["bytes"]


# --------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
def test_one_rank_training_on_cuda_equals_cpu():
    part = _part()
    cfg = TrainConfig(dtype="float64", **SMALL)
    mc, tc = run_training(dataclasses.replace(cfg, device="cpu"), part)
    mg, tg = run_training(dataclasses.replace(cfg, device="cuda"), part)
    assert tg.device.type == "cuda" and mg["device"].startswith("cuda")
    assert tg.x.is_cuda and tg.graph.blocks("gcn")[0].A.is_cuda and tg.halo.send_idx.is_cuda
    np.testing.assert_allclose(mg["loss"], mc["loss"], rtol=1e-9)
    for a, b in zip(_params(tc), _params(tg)):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-7, atol=1e-9)
    assert mg["test_acc"] == mc["test_acc"] and mg["epoch_time_s"] > 0
    assert set(mg["breakdown_s"]) >= {"central", "marginal"}


@pytest.mark.cuda
def test_one_rank_bf16_and_local_dropout_on_cuda():
    part = _part()
    m, tr = run_training(TrainConfig(device="cuda", dtype="bfloat16", dropout_rng="local", **SMALL), part)
    assert np.isfinite(m["loss"]).all() and all(p.is_cuda and p.dtype == torch.float32
                                                for p in tr.model.parameters())


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantized_exchange_on_cuda_takes_triton_and_equals_cpu(bits, monkeypatch):
    import commsched.kernels.quant as kq

    calls = {"q": 0, "dq": 0}
    q0, dq0 = kq.quantize_pack, kq.unpack_dequantize

    def q(*a, **k):
        calls["q"] += 1
        return q0(*a, **k)

    def dq(*a, **k):
        calls["dq"] += 1
        return dq0(*a, **k)

    monkeypatch.setattr(kq, "quantize_pack", q)
    monkeypatch.setattr(kq, "unpack_dequantize", dq)
    _, _, _, got_cpu = _loopback_round_trip("cpu", bits, monkeypatch)
    assert calls == {"q": 0, "dq": 0}
    _, ex, _, got_gpu = _loopback_round_trip("cuda", bits, monkeypatch)
    assert calls["q"] >= 1 and calls["dq"] >= 1
    # the same keys: the Triton kernels equal the CPU fast path bit for bit
    assert torch.equal(got_gpu.cpu(), got_cpu)
    assert ex.trace[(0, "forward")][1].shape == (2,)


@pytest.mark.cuda
def test_breakdown_on_cuda_times_with_events():
    dev = torch.device("cuda")
    b = Breakdown(Clock(dev))
    x = torch.randn(2048, 2048, device=dev)
    with b.time("central"):
        for _ in range(5):
            x = x @ x.T / 2048
    assert b._pending and b.as_dict()["central"] > 0 and not b._pending
