"""``--compute emulated`` for GNN training: each kernel of a pass occupies the rank's device
clock for its roofline time while the host sleeps; the exchanges stay real."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from commsched.cluster.device import OP_CLASSES, DeviceClock, DeviceModel
from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
from commsched.gnn.graph.partition import make_parts, partition_nodes
from commsched.gnn.nn.emulated import EmulatedCompute
from commsched.gnn.nn.layers import GCNConv, SAGEConv
from commsched.gnn.train.trainer import TrainConfig, emulated_report, run_training
from tests.mp import run_ranks

# a device with round numbers: 1 TFLOP/s fp32, 100 GB/s, every class at the roofline, no launch cost
TOY = DeviceModel(name="toy", peak_flops={"fp32": 1e12}, mem_bw=1e11,
                  efficiency={c: 1.0 for c in OP_CLASSES}, launch_s=0.0)
SYN = SyntheticSpec(num_nodes=600, num_edges=3000, num_features=16, num_classes=4,
                    communities_per_class=2, seed=3)


def _emu(k: float = 1.0) -> EmulatedCompute:
    return EmulatedCompute(DeviceClock(TOY, k), dtype=torch.float32)


# --------------------------------------------------------------------------- pure
def test_spmm_queues_its_roofline_time_forward_and_backward_without_blocking():
    emu = _emu(k=3.0)
    blk = SimpleNamespace(num_dst=50, nnz=400)
    h = torch.zeros(80, 8, requires_grad=True)
    t0 = time.perf_counter()
    out = emu.spmm(blk, 80, h)
    assert time.perf_counter() - t0 < 0.05  # queued, not waited for
    assert out.shape == (50, 8) and out.stride() == (0, 0) and not out.any()
    # forward: bytes E F 4 + E (8 + 4) + dst F 4 over 100 GB/s (above 2 E F / 1 TFLOP/s), x k
    fwd = (400 * 8 * 4 + 400 * 12 + 50 * 8 * 4) / 1e11 * 3.0
    assert emu.clock.busy_s == pytest.approx(fwd)
    out.sum().backward()
    bwd = (400 * 8 * 4 + 400 * 12 + 80 * 8 * 4) / 1e11 * 3.0  # A^T g writes the source rows
    assert emu.clock.busy_s == pytest.approx(fwd + bwd)
    assert h.grad is None  # no gradient values for activations: nothing is computed


def test_dense_update_counts_every_linear_and_gives_parameters_zero_gradients():
    emu = _emu()
    n, F, H = 100, 16, 32
    gemm = max(2 * n * F * H / 1e12, (n * F + F * H + n * H) * 4 / 1e11)
    concat = 2 * n * F * 4 / 1e11
    for conv, lins in ((GCNConv(F, H), 1), (SAGEConv(F, H), 2)):
        emu.clock.reset_stats()
        x = torch.zeros(n, F, requires_grad=True)
        out = emu.linears(conv, n, [x])
        extra = 3 * n * H * 4 / 1e11 if lins > 1 else 0.0  # the sum of the two products
        assert out.shape == (n, H)
        assert emu.clock.busy_s == pytest.approx(lins * gemm + concat + extra)
        out.sum().backward()
        for p in conv.parameters():  # the gradient allreduce moves their real size
            assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any()


def test_sync_sleeps_until_the_device_is_done():
    emu = _emu(k=1.0)
    emu.clock.occupy(0.05)
    c0, t0 = time.process_time(), time.perf_counter()
    emu.sync()
    assert time.perf_counter() - t0 >= 0.045
    assert time.process_time() - c0 < 0.02  # asleep, not spinning


def test_config_checks_and_flags():
    from commsched.gnn.train.cli import build_parser, config_from_args

    a = build_parser().parse_args(["--compute", "emulated", "--device-model", "h100", "--dilation", "20"])
    cfg = config_from_args(a)
    assert (cfg.compute, cfg.device_model, cfg.dilation, cfg.emulated) == ("emulated", "h100", 20.0, True)
    assert TrainConfig().compute == "real" and not TrainConfig().emulated
    with pytest.raises(ValueError, match="options of --compute emulated"):
        TrainConfig(dilation=10.0)
    with pytest.raises(ValueError, match="unknown device model"):
        TrainConfig(compute="emulated", device_model="v100")
    with pytest.raises(ValueError, match="--dilation"):
        TrainConfig(compute="emulated", dilation=0.0)
    with pytest.raises(ValueError, match="float64"):
        TrainConfig(compute="emulated", dtype="float64")
    with pytest.raises(ValueError, match="--model gin"):
        TrainConfig(compute="emulated", model="gin")


def test_emulated_report_predicts_the_cluster_time():
    cfg = TrainConfig(compute="emulated", dilation=10.0)
    # two ranks, two epochs: (host CPU s, wall s, device busy s)
    rep = emulated_report(cfg, "a100", [[(0.1, 1.0, 0.5), (0.1, 1.0, 0.7)], [(0.3, 1.0, 0.4), (0.3, 1.0, 0.4)]],
                          [[1.0, 2.0], [1.5, 1.0]], setup_s=0.5)
    assert rep["host_cpu_share_per_rank"] == pytest.approx([0.1, 0.3])
    assert rep["device_busy_s_per_epoch_per_rank"] == pytest.approx([0.6, 0.4])
    assert rep["epoch_time_s"] == pytest.approx(1.75)  # median over epochs of the slowest rank
    assert rep["predicted_epoch_time_s"] == pytest.approx(0.175)
    assert rep["device_model"] == "a100" and rep["dilation"] == 10.0
    assert rep["host_cpu_share_per_epoch"] == pytest.approx([0.3, 0.3])


def test_one_rank_emulated_run_waits_for_its_device():
    g = synthetic_graph(SYN)
    part = make_parts(g, partition_nodes(g, 1, "metis", 0), 1)[0]
    cfg = TrainConfig(layers=2, hidden=32, epochs=2, eval_every=2, compute="emulated", dilation=200.0)
    m, tr = run_training(cfg, part)
    e = m["emulated"]
    assert e["device_busy_s_per_epoch_per_rank"][0] > 0
    # the epoch lasts at least as long as the device is busy in it (it ends with the device)
    assert m["epoch_time_s"] >= e["device_busy_s_per_epoch_per_rank"][0] * 0.99
    assert e["predicted_epoch_time_s"] == pytest.approx(m["epoch_time_s"] / 200.0)
    assert tr.emulated.kernels > 0
    # the kernels return zeros: no accuracy is reported for them
    assert (m["val_acc"], m["test_acc"], m["best_epoch"], m["val_acc_per_eval"]) == (None, None, None, [])


# --------------------------------------------------------------------------- 2 ranks
MODES = ("vanilla", "adaqp", "adaqp-q")
K = 300.0


def _both_ways(rank: int, world: int) -> dict:
    g = synthetic_graph(SYN)
    part = make_parts(g, partition_nodes(g, world, "metis", 0), world)[rank]
    out = {}
    for mode in MODES:
        for compute in ("real", "emulated"):
            kw = {"compute": "emulated", "dilation": K} if compute == "emulated" else {}
            cfg = TrainConfig(mode=mode, layers=2, hidden=32, epochs=3, eval_every=3, seed=1, **kw)
            m, _ = run_training(cfg, part)
            out[mode, compute] = {"bytes": m["bytes_sent_per_epoch"], "emulated": m.get("emulated"),
                                  "epochs": m["epochs"]}
    return out


def test_two_rank_emulated_runs_move_the_real_bytes():
    """vanilla, adaqp and adaqp-q complete emulated on 2 ranks, each moving the halo bytes per
    epoch of its real run, their metrics carrying the emulated fields; each rank's host CPU
    share stays low (a generous bound: the host sleeps while the device works)."""
    res = run_ranks(2, _both_ways, timeout_s=240, pg_timeout_s=60)
    for mode in MODES:
        real, emu = res[0][mode, "real"], res[0][mode, "emulated"]
        assert real["emulated"] is None  # real mode: no emulated entry
        assert emu["epochs"] == 3 and real["bytes"] > 0
        assert emu["bytes"] == real["bytes"], mode
        e = emu["emulated"]
        assert e["device_model"] == "a100" and e["dilation"] == K
        assert len(e["host_cpu_share_per_rank"]) == 2 and len(e["device_busy_s_per_epoch_per_rank"]) == 2
        assert all(b > 0 for b in e["device_busy_s_per_epoch_per_rank"])
        assert max(e["host_cpu_share_per_rank"]) < 0.6, e
        assert e["predicted_epoch_time_s"] == pytest.approx(e["epoch_time_s"] / K)


def _overlap_probe(rank: int, world: int) -> dict:
    """Whether the emulated device was busy each time a training exchange of adaqp /
    adaqp-q began to wait for its bytes (patched in this forked rank only)."""
    from commsched.cluster import device
    from commsched.gnn.exchange import adaqp

    clocks: list = []
    init = device.DeviceClock.__init__

    def register(self, *a, **kw):
        init(self, *a, **kw)
        clocks.append(self)

    busy: list[bool] = []
    send = adaqp.exchange_segments

    def probed(*a, **kw):
        h = send(*a, **kw)
        wait = h.wait

        def probe_wait():
            busy.append(not clocks[-1].idle())
            return wait()

        h.wait = probe_wait
        return h

    device.DeviceClock.__init__ = register
    adaqp.exchange_segments = probed
    g = synthetic_graph(SYN)
    part = make_parts(g, partition_nodes(g, world, "metis", 0), world)[rank]
    out = {}
    for mode in ("adaqp", "adaqp-q"):
        busy.clear()
        cfg = TrainConfig(mode=mode, layers=2, hidden=16, epochs=1, seed=1, compute="emulated", dilation=2000.0)
        run_training(cfg, part)
        out[mode] = list(busy)
    return out


def test_adaqp_overlaps_the_central_aggregation_with_the_exchange_and_adaqp_q_does_not():
    """adaqp waits for its bytes (forward and backward) while the device runs the central
    aggregation queued before; adaqp-q finishes each exchange with the device idle, the
    central aggregation queued after it (a property of the order of events, not a timing)."""
    res = run_ranks(2, _overlap_probe, timeout_s=240, pg_timeout_s=60)
    for r in (0, 1):
        # 2 forward exchanges, 1 backward (the input features take no gradient)
        assert len(res[r]["adaqp"]) == 3 and all(res[r]["adaqp"]), res[r]
        assert len(res[r]["adaqp-q"]) == 3 and not any(res[r]["adaqp-q"]), res[r]
