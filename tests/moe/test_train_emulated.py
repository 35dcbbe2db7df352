"""MoE training on the emulated device (``--compute emulated``): the model's kernels on a
device clock, the communication real -- every schedule runs, the host sleeps, and the
bytes on the links are those of the real run of the same sizes."""

from __future__ import annotations

import time

import pytest
import torch

from commsched.cluster.device import DeviceClock, load_device_model
from commsched.moe.model.layer import DispatchConfig
from commsched.moe.model.lm import ModelConfig, MoETransformerLM
from commsched.moe.train.cli import build_parser, config_from_args
from commsched.moe.train.emulated import (
    ADAM_BYTES,
    EmulatedAdam,
    Emulation,
    emulate,
    gemm,
    linear_kernels,
)
from commsched.moe.train.trainer import train
from commsched.moe.train.training import TrainConfig, a2a_payload_bytes
from commsched.quant.allreduce import wire_bytes
from tests.moe.test_train import CORPUS
from tests.mp import assert_case, run_cases
from tests.priority import sched_of

SCHEDULES = ("lina", "fifo", "serial", "lina-overlap", "flat")
SMALL = ModelConfig(d_model=32, n_heads=2, n_layers=2, seq_len=16, d_ff=48, expert_hidden=40, num_experts=4,
                    k=2, moe_every=2)


def _cfg(schedule: str = "lina", *, compute: str = "emulated", dilation: float = 20.0, steps: int = 3,
         a2a_bits: int = 32, chunks: int = 1, pipeline: bool = False, grad_bits: int = 32) -> TrainConfig:
    return TrainConfig(model=SMALL, schedule=sched_of(schedule, microop_bytes=1024, bucket_bytes=4096),
                       dispatch=DispatchConfig(chunks=chunks, pipeline=pipeline, a2a_bits=a2a_bits), steps=steps, batch_size=2,
                       seed=3, warmup=1, probe_steps=1, eval_batches=1, corpus=str(CORPUS),
                       max_corpus_bytes=1 << 16, device="cpu", fallback_exchange=False, compute=compute,
                       device_model="a100", dilation=dilation if compute == "emulated" else 1.0,
                       grad_bits=grad_bits)  # --dilation is refused under --compute real


# --------------------------------------------------------------------------- pure
def test_flags_and_refusals():
    a = build_parser().parse_args(["--out", "x", "--compute", "emulated", "--device-model", "h100", "--dilation", "5"])
    cfg = config_from_args(a)
    assert (cfg.compute, cfg.device_model, cfg.dilation, cfg.run_device) == ("emulated", "h100", 5.0, "cpu")
    real = config_from_args(build_parser().parse_args(["--out", "x"]))
    assert (real.compute, real.emulated, real.run_device) == ("real", False, real.device)
    for bad, words in ((dict(impl="deepspeed"), "DeepSpeed"), (dict(device="cuda"), "--device cpu"), (dict(checkpoint_every=2), "no weights"),
                       (dict(dilation=0.0), "--dilation")):
        with pytest.raises(ValueError, match=words):
            TrainConfig(compute="emulated", **bad)


def test_kernel_arithmetic():
    assert gemm(8, 4, 2, 2) == ("gemm", 2 * 8 * 4 * 2, 2 * (8 * 2 + 2 * 4 + 8 * 4))
    fwd, bwd = linear_kernels(10, 3, 5, 4)
    assert [k[1] for k in fwd] == [300.0] and [k[1] for k in bwd] == [300.0, 300.0]


def _local_model(dilation: float) -> tuple[MoETransformerLM, Emulation]:
    clock = DeviceClock(load_device_model("a100"), dilation)
    emu = Emulation(clock, dtype="float32", tokens=2 * SMALL.seq_len, seed=0, rank=0,
                    row_bytes=(SMALL.d_model * 4,) * 4, a2a_bits=32)
    with torch.device("meta"):
        model = MoETransformerLM(SMALL)
    return emulate(model, emu)[0], emu


def test_emulated_model_has_the_real_parameters_on_one_buffer():
    torch.manual_seed(0)
    real = MoETransformerLM(SMALL)
    model, _ = _local_model(1.0)
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(ptrs) == 1  # one shared read-only buffer, the size of the largest parameter
    assert max(p.numel() for p in model.parameters()) * 4 == next(model.parameters()).untyped_storage().nbytes()


def test_backward_releases_each_gradient_when_its_kernel_ends():
    """The device is busy for the modelled kernels times k; the host sleeps through them,
    and each gradient reaches its post-accumulate hook (the scheduler's entry) once the
    device has passed the kernel that made it, last layer first."""
    model, emu = _local_model(500.0)
    seen: list[tuple[str, float, float]] = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: seen.append((n, time.perf_counter(), emu.clock.issued())))
    t0, c0 = time.perf_counter(), time.process_time()
    loss, ce = model.loss()
    assert ce is None and emu.clock.busy_s > 0
    fwd_busy = emu.clock.busy_s
    loss.backward()
    emu.wait()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    names = [n for n, _ in model.named_parameters()]
    assert sorted(n for n, _, _ in seen) == sorted(names)
    assert seen[0][0].startswith("head") and seen[-1][0] in ("tok.weight", "pos")
    # released no earlier than the device reached them: the host slept until then
    assert all(t >= issued - 1e-3 for _, t, issued in seen)
    assert emu.clock.busy_s > 2 * fwd_busy  # backward: about twice the forward's kernels
    assert wall >= 0.9 * emu.clock.busy_s
    assert cpu < 0.5 * wall  # sanity of sleeping, not a speed claim
    opt = EmulatedAdam(list(model.parameters()), emu)
    before = emu.clock.busy_s
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    assert emu.clock.busy_s - before == pytest.approx(emu.clock.op_time("optimizer", flops=12 * n,
                                                                         bytes=ADAM_BYTES * n, dtype="fp32"))


# --------------------------------------------------------------------------- on gloo ranks
FIELDS = ("device_model", "dilation", "host_cpu_share", "device_busy_s_per_step", "predicted_step_time_s",
          "peak_rss_mib", "startup_s", "rows_exchanged_per_step")


def _check_emulation(m: dict, cfg: TrainConfig, world: int) -> dict:
    em = m["emulation"]
    assert set(FIELDS) <= set(em)
    assert em["device_model"] == "a100" and em["dilation"] == cfg.dilation
    assert len(em["host_cpu_share"]) == world and all(0 <= s for s in em["host_cpu_share"])
    assert all(b > 0 for b in em["device_busy_s_per_step"])
    assert em["predicted_step_time_s"] == pytest.approx(m["step_time_s"] / cfg.dilation)
    assert all(r > 0 for r in em["peak_rss_mib"]) and em["startup_s"] > 0
    return em


def _every_schedule(rank: int, world: int) -> None:
    for s in SCHEDULES:
        cfg = _cfg(s, steps=2)
        m = train(cfg, None, progress=False)[0].to_dict()
        _check_emulation(m, cfg, world)
        assert m["schedule"] == s and m["val_loss"] is None and len(m["step_times_s"]) == cfg.steps
        assert m["allreduce_time_s"] is not None and m["a2a_time_s"] is not None
        c = m.get("a2a_contention")  # only where an exchange ran beside an allreduce
        assert c is None or (c["exchanges"] >= 1 and 0 < c["median"] <= c["max"]), c
    # the pipelined exchange and the 8-bit rows
    cfg = _cfg("lina", chunks=2, pipeline=True, a2a_bits=8, steps=2)
    _check_emulation(train(cfg, None, progress=False)[0].to_dict(), cfg, world)
    cfg = _cfg("lina-overlap", grad_bits=16, steps=2)  # the compressed reduction's codec on the device
    _check_emulation(train(cfg, None, progress=False)[0].to_dict(), cfg, world)


def _host_sleeps(rank: int, world: int) -> None:
    """Device-bound (a large k): each rank's host CPU share stays low (a generous bound: the
    host sleeps rather than computes; no speed claim)."""
    cfg = _cfg("lina", dilation=400.0)
    em = _check_emulation(train(cfg, None, progress=False)[0].to_dict(), cfg, world)
    assert max(em["host_cpu_share"]) < 0.5, em["host_cpu_share"]
    assert min(em["device_busy_share"]) > 0.3, em["device_busy_share"]


def _bytes_of(out) -> tuple[list[int], int]:
    import json

    tl = json.loads((out / "timeline.json").read_text())["ranks"]
    ar = [sorted(r["nbytes"] for r in ops if r["kind"] == "allreduce") for ops in tl]
    a2a = [sum(1 for r in ops if r["kind"] == "a2a") for ops in tl]
    return ar, a2a


def _same_bytes_as_real(rank: int, world: int) -> None:
    """The gradient allreduce's operations and the number of exchanges per step of an
    emulated run are the real run's; the rows dispatched are the modelled job's (T * k per
    MoE layer, as the real dropless dispatch sends), so the exchanged payload equals the
    real run's sizes."""
    import tempfile
    from pathlib import Path

    import torch.distributed as dist

    from commsched.dist import broadcast_object

    base = Path(broadcast_object(tempfile.mkdtemp(prefix="emoe-") if rank == 0 else None, "a folder"))
    got = {}
    for compute in ("real", "emulated"):
        cfg = _cfg("lina", compute=compute)
        out = base / compute
        if rank == 0:
            out.mkdir()
        dist.barrier()
        m = train(cfg, out, progress=False)[0].to_dict()
        dist.barrier()
        got[compute] = (m, *_bytes_of(out))
    # --grad-bits 8: the compressed reduction's bytes, as the real codec's wire carries them
    cfg8 = _cfg("fifo", grad_bits=8)
    out = base / "g8"
    if rank == 0:
        out.mkdir()
    dist.barrier()
    m8 = train(cfg8, out, progress=False)[0].to_dict()
    dist.barrier()
    ops = _bytes_of(out)[0][rank]
    assert m8["emulation"]["grad_wire_bytes_per_step"][rank] == sum(wire_bytes(n // 4, world, 8) for n in ops) > 0
    (mr, ar_r, a2a_r), (me, ar_e, a2a_e) = got["real"], got["emulated"]
    assert ar_e == ar_r and sum(ar_e[0]) == mr["sizes"]["non_expert_grad_bytes"]
    assert a2a_e == a2a_r
    assert me["sizes"] == mr["sizes"]
    cfg = _cfg("lina")
    T = cfg.batch_size * SMALL.seq_len
    assert me["emulation"]["rows_exchanged_per_step"] == [T * SMALL.k] * world  # one MoE layer
    assert a2a_payload_bytes(cfg) == mr["sizes"]["a2a_payload_bytes_per_step"]


def test_emulated_training_on_two_ranks():
    res = run_cases(2, [("every_schedule", _every_schedule), ("host_sleeps", _host_sleeps),
                        ("same_bytes_as_real", _same_bytes_as_real)], timeout_s=240)
    for name in ("every_schedule", "host_sleeps", "same_bytes_as_real"):
        assert_case(res, name)
