"""MoE inference on the job's device: the device plumbing run with ``device="cpu"``
through the same code (identical to the default), the bank's copy path, and (marked
``cuda``, skipped without a GPU) CUDA against the CPU and loads on the copy stream."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.mp import assert_case, run_cases, run_ranks


def _weights(L: int = 2, E: int = 5, D: int = 4, H: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(*shape, generator=g) for shape in ((E, D, H), (E, H), (E, H, D), (E, D)))
            for _ in range(L)]


def test_ffn_bank_on_the_cpu_loads_by_copy_and_equals_the_reference():
    from commsched.moe.infer.banks import FFNBank

    ws = _weights()
    bank = FFNBank(ws, slots=3, device="cpu")
    default = FFNBank(ws, slots=3)
    assert bank.on == default.on == torch.device("cpu") and bank.copy_stream is None  # no CUDA on a CPU path
    assert not any(t.is_pinned() for t in bank.host[0])
    assert bank.host[0][0].data_ptr() == ws[0][0].data_ptr()  # the CPU keeps the given weights, no copy
    assert bank.ensure(1, [4, 0]) == 2 and default.ensure(1, [4, 0]) == 2
    for e in (4, 0):  # copied into the slot tensors: equal values, separate memory
        s = bank.slot_of[1][e]
        for slot, host in zip(bank.slot_w[1], bank.host[1]):
            assert torch.equal(slot[s], host[e]) and slot[s].data_ptr() != host[e].data_ptr()
    x = torch.randn(7, 4)
    y = bank.compute(1)([0, 4], [3, 4], x)
    assert torch.equal(y, bank.reference(1)([0, 4], [3, 4], x))
    assert torch.equal(y, default.compute(1)([0, 4], [3, 4], x))
    assert bank.ensure(1, [0, 2]) == 1 and bank.loaded_L == [0, 3]  # 4 evicted, 2 copied into its slot
    assert torch.equal(bank.compute(1)([2], [7], x), bank.reference(1)([2], [7], x))
    assert bank.row_cost_s(rows=16, reps=2) > 0


class _Stream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_event(self, ev) -> None:
        self.log.append((self.name, "wait", ev.n))


class _Event:
    count = 0

    def __init__(self, log: list, *a, **kw):
        _Event.count += 1
        self.n, self.log = _Event.count, log

    def record(self, stream) -> None:
        self.log.append((stream.name, "record", self.n))


def test_ffn_bank_cuda_ordering_of_loads_and_computations(monkeypatch):
    # the CUDA branch of the bank with CPU tensors and recording stand-ins for streams and
    # events: loads are non-blocking copies on the copy stream, which first waits for the
    # compute stream's last use of the layer; an event after the copies; the compute stream
    # waits for the loads of the slots it reads (each event once) and records its use
    import contextlib

    from commsched.moe.infer.banks import FFNBank

    log: list = []
    compute = _Stream("compute", log)
    _Event.count = 0
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **kw: _Event(log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    copy_ = torch.Tensor.copy_

    def spy(self, src, non_blocking=False):
        log.append(("copy", "copy_", non_blocking))
        return copy_(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    bank = FFNBank(_weights(L=1, E=4), slots=2, device="cpu")
    bank.cuda, bank.copy_stream = True, _Stream("copy", log)
    x = torch.randn(5, 4)
    ref = bank.reference(0)

    assert bank.ensure(0, [1, 2]) == 2
    assert log == [("copy", "copy_", True)] * 8 + [("copy", "record", 1)]  # nothing used yet: no wait
    log.clear()
    assert torch.equal(bank.compute(0)([1, 2], [2, 3], x), ref([1, 2], [2, 3], x))
    assert log == [("compute", "wait", 1), ("compute", "record", 2)]
    log.clear()
    assert bank.ensure(0, [2, 3]) == 1  # 1 evicted: its slot is overwritten after use 2
    assert log == [("copy", "wait", 2)] + [("copy", "copy_", True)] * 4 + [("copy", "record", 3)]
    log.clear()
    assert torch.equal(bank.compute(0)([2, 3], [1, 4], x), ref([2, 3], [1, 4], x))
    assert log == [("compute", "wait", 1), ("compute", "wait", 3), ("compute", "record", 4)]
    log.clear()
    assert bank.ensure(0, [3, 2]) == 0 and log == []  # resident: no copy, no event


def test_emulated_bank_is_the_cpu_model_and_refuses_cuda():
    from commsched.moe.infer.banks import EmulatedBank

    EmulatedBank(1, 4, 2, 3, us_per_row=0.0, load_ms=0.0, seed=0, device="cpu")
    with pytest.raises(ValueError, match="CPU model of an accelerator"):
        EmulatedBank(1, 4, 2, 3, us_per_row=0.0, load_ms=0.0, seed=0, device="cuda")


def test_infer_config_device_option():
    from commsched.moe.infer import InferConfig
    from commsched.moe.infer.cli import build_parser, config_from_args

    parse = build_parser().parse_args
    assert config_from_args(parse(["--out", "x"])).device == "auto"
    cfg = config_from_args(parse(["--device", "cpu", "--compute", "real", "--out", "x"]))
    assert cfg.device == "cpu" and cfg.device_choice == "cpu"
    assert config_from_args(parse(["--device", "cuda", "--compute", "real", "--out", "x"])).device_choice == "cuda"
    assert InferConfig(compute="emulated").device_choice == "cpu"  # auto: the emulated device is on the CPU
    assert InferConfig(compute="real").device_choice == "auto"
    with pytest.raises(ValueError, match="use --compute real with --device cuda"):
        config_from_args(parse(["--device", "cuda", "--out", "x"]))
    with pytest.raises(ValueError, match="--device must be one of"):
        InferConfig(device="gpu")
    with pytest.raises(SystemExit):
        parse(["--device", "gpu", "--out", "x"])


def test_bench_passes_its_device_to_every_variant():
    from commsched.bench import build_parser
    from commsched.bench.moe.infer import WORKLOAD
    from commsched.moe.infer.cli import build_parser as infer_parser
    from commsched.moe.infer.cli import config_from_args

    a = build_parser(WORKLOAD).parse_args(["--device", "cpu", "--lina-thresholds", "0"])
    for v in WORKLOAD.variants(a):
        assert config_from_args(infer_parser().parse_args([*v.argv, "--out", "x"])).device == "cpu", v.name
    a = build_parser(WORKLOAD).parse_args([])
    assert all(config_from_args(infer_parser().parse_args([*v.argv, "--out", "x"])).device == "auto"
               for v in WORKLOAD.variants(a))
    a = build_parser(WORKLOAD).parse_args(["--device", "cuda", "--compute", "real"])
    assert all("cuda" in v.argv for v in WORKLOAD.variants(a))
    with pytest.raises(ValueError, match="add --compute real"):
        WORKLOAD.variants(build_parser(WORKLOAD).parse_args(["--device", "cuda"]))


def test_trace_inputs_on_an_explicit_cpu_device_are_the_default_inputs():
    from commsched.moe.infer import TraceDriver, TraceDriverConfig
    from commsched.moe.record.traces import SyntheticTraceConfig

    syn = SyntheticTraceConfig(num_experts=8, num_layers=3, k=2, num_tokens=2048, seq_len=16)
    drv = TraceDriver(TraceDriverConfig(synthetic=syn, tokens_per_batch=64, d_model=8), batches=2, seed=3, world=2)
    for got, ref in zip(drv.inputs(1, 1, 8, torch.device("cpu")), drv.inputs(1, 1, 8)):
        assert got.device.type == "cpu" and torch.equal(got, ref)


def test_placed_moe_keeps_its_tensors_on_the_rows_device():
    # one device holding every expert (no exchange): explicit CPU tensors through the
    # device plumbing give the local twin's result
    import numpy as np

    from commsched.moe.infer.banks import FFNBank
    from commsched.moe.infer.placed import placed_moe, placed_moe_local
    from commsched.moe.placement import Placement

    torch.manual_seed(0)
    bank = FFNBank(_weights(L=1, E=3), slots=3, device=torch.device("cpu"))
    bank.ensure(0, [0, 1, 2])
    x = torch.randn(6, 4, device="cpu")
    ex = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 1], [1, 2], [2, 0]], device="cpu")
    g = torch.rand(6, 2, device="cpu")
    p = Placement(((0,), (0,), (0,)), (0.0,), 3)
    counts = np.bincount(ex.reshape(-1).numpy(), minlength=3)[None, :]
    ref = placed_moe_local(x, ex, g, bank.reference(0))
    for pipelined in (True, False):
        y = placed_moe(x, ex, g, counts, p, bank.compute(0), rank=0, pipelined=pipelined)
        assert y.device.type == "cpu" and torch.allclose(y, ref, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- processes
def _cfg(placement: str, compute: str, exchange: str = "pipelined", device: str = "auto"):
    from commsched.moe.infer import EmulationConfig, InferConfig, TraceDriverConfig
    from commsched.moe.record.traces import SyntheticTraceConfig

    syn = SyntheticTraceConfig(num_experts=8, num_layers=3, k=2, num_tokens=4096, seq_len=16)
    return InferConfig(placement=placement, compute=compute, batches=3, warmup=1,
                       emulation=EmulationConfig(us_per_row=0.0, load_ms=0.0), exchange=exchange, device=device,
                       trace=TraceDriverConfig(synthetic=syn, tokens_per_batch=96, d_model=8, expert_hidden=12),
                       seed=1)


def _explicit_cpu_equals_default(rank: int, world: int) -> None:
    import dataclasses

    from commsched.moe.infer import job_device, run

    for compute, placement, exchange in [("real", "lina", "pipelined"), ("real", "oracle", "sequential"),
                                         ("emulated", "lina", "pipelined")]:
        cfg = _cfg(placement, compute, exchange)
        assert job_device(cfg) == torch.device("cpu")  # auto on a gloo group: the CPU
        ref = run(cfg, return_outputs=True)
        for m in (run(dataclasses.replace(cfg, device="cpu"), return_outputs=True),
                  run(cfg, device=torch.device("cpu"), return_outputs=True)):
            assert m["device"] == "cpu" and len(m["outputs"]) == len(ref["outputs"])
            for y, r in zip(m["outputs"], ref["outputs"]):
                assert y.device.type == "cpu" and torch.equal(y, r), (compute, placement, exchange)
            assert m["replans"] == ref["replans"] and m["imbalance"] == ref["imbalance"]


def _cuda_on_gloo_is_refused(rank: int, world: int) -> None:
    from commsched.moe.infer import job_device

    with pytest.raises(ValueError, match="needs a process group with NCCL"):
        job_device(_cfg("lina", "real", device="cuda"))


@pytest.fixture(scope="module")
def results():
    cases = [("explicit_cpu_equals_default", _explicit_cpu_equals_default),
             ("cuda_on_gloo_is_refused", _cuda_on_gloo_is_refused)]
    return run_cases(2, cases, timeout_s=300, env={"COMMSCHED_PROGRESS": "0"})


@pytest.mark.slow
@pytest.mark.parametrize("case", ["explicit_cpu_equals_default", "cuda_on_gloo_is_refused"])
def test_device_plumbing_mp(results, case):
    assert_case(results, case)


# --------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
def test_ffn_bank_cuda_loads_overlap_compute_on_the_copy_stream():
    from commsched.moe.infer.banks import FFNBank

    dev = torch.device("cuda", torch.cuda.current_device())
    ws = _weights(L=1, E=4, D=1024, H=4096)  # 32 MiB of weights per expert
    bank = FFNBank(ws, slots=3, device=dev)
    assert all(t.is_pinned() for t in bank.host[0]) and bank.slot_w[0][0].device == dev
    assert bank.copy_stream is not None and bank.copy_stream != torch.cuda.current_stream(dev)
    a = torch.randn(8192, 8192, device=dev)
    torch.cuda.synchronize(dev)
    for _ in range(30):  # a long queue of compute on the compute stream (hundreds of ms)
        a = torch.tanh(a @ a)
    busy = torch.cuda.Event()
    busy.record(torch.cuda.current_stream(dev))
    assert bank.ensure(0, [3, 1, 2]) == 3  # returns once enqueued: the compute is still running
    ready = bank._ready[0][bank.slot_of[0][3]]
    ready.synchronize()
    assert not busy.query(), "the loads waited for the compute stream instead of overlapping it"
    x = torch.randn(9, 1024, device=dev)
    y = bank.compute(0)([1, 2, 3], [2, 3, 4], x)  # the compute stream waits for the loads on the GPU
    ref = bank.reference(0)([1, 2, 3], [2, 3, 4], x.cpu())
    assert torch.allclose(y.cpu(), ref, rtol=1e-4, atol=1e-3)
    # an eviction overwrites a slot only after the compute stream's last use of the layer
    assert bank.ensure(0, [0, 2, 3]) == 1
    y0 = bank.compute(0)([0], [9], x)
    assert torch.allclose(y0.cpu(), bank.reference(0)([0], [9], x.cpu()), rtol=1e-4, atol=1e-3)
    assert bank.row_cost_s(rows=64, reps=3) > 0


def _one_rank_cuda_equals_cpu(rank: int, world: int, ckpt: str) -> list[str]:
    from commsched.moe.infer import InferConfig, ModelDriverConfig, job_device, run

    done = []
    for placement, exchange in [("lina", "pipelined"), ("oracle", "sequential"), ("static", "pipelined")]:
        cpu = run(_cfg(placement, "real", exchange, device="cpu"), return_outputs=True)
        cfg = _cfg(placement, "real", exchange, device="cuda")
        assert job_device(cfg).type == "cuda"  # one rank: a gloo group may carry it
        gpu = run(cfg, return_outputs=True)
        assert gpu["device"] == "cuda" and gpu["replans"] == cpu["replans"]
        for y, r in zip(gpu["outputs"], cpu["outputs"]):
            assert y.device.type == "cuda"
            assert torch.allclose(y.cpu(), r, rtol=1e-4, atol=1e-4), (placement, (y.cpu() - r).abs().max())
        done.append(placement)
    for dev in ("cpu", "cuda"):
        cfg = InferConfig(placement="lina", driver="model", compute="real", batches=2, warmup=0,
                          model=ModelDriverConfig(checkpoint=ckpt, batch_size=2, profile_tokens=1024), seed=2,
                          device=dev)
        done.append(run(cfg, return_outputs=True)["outputs"])
    for a, b in zip(done[-1], done[-2]):
        assert torch.allclose(a.cpu(), b, rtol=1e-4, atol=1e-4), (a.cpu() - b).abs().max()
    return done[:3]


@pytest.mark.cuda
@pytest.mark.slow
def test_one_rank_inference_on_cuda_equals_cpu(tmp_path):
    from commsched.moe.model.lm import ModelConfig, MoETransformerLM
    from commsched.moe.record.recorder import save_checkpoint

    torch.manual_seed(0)
    model = MoETransformerLM(ModelConfig(d_model=16, n_heads=2, n_layers=3, seq_len=16, d_ff=24, expert_hidden=20,
                                         num_experts=4, k=2, moe_every=1))
    save_checkpoint(tmp_path / "lm.pt", model, {"trained": False})
    out = run_ranks(1, functools.partial(_one_rank_cuda_equals_cpu, ckpt=str(tmp_path / "lm.pt")),
                    timeout_s=300, env={"COMMSCHED_PROGRESS": "0"})
    assert out == [["lina", "oracle", "static"]]
