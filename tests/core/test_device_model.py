"""The emulated device (commsched.cluster.device): the roofline of each op, the built-in
models and model files, the device clock's queueing and sleeping, time dilation."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from commsched.cluster.device import (
    DEVICE_MODELS,
    OP_CLASSES,
    DeviceClock,
    DeviceModel,
    HostCPU,
    host_cpu_share,
    load_device_model,
)
from tests.import_graph import ROOT


def _model(**kw) -> DeviceModel:
    d = dict(name="toy", peak_flops={"bf16": 100e12, "fp32": 10e12}, mem_bw=1e12,
             efficiency={c: 0.5 for c in OP_CLASSES}, launch_s=1e-6)
    d.update(kw)
    return DeviceModel(**d)


def test_roofline_is_the_slower_of_compute_and_memory_plus_launch():
    m = _model()
    # compute-bound: 1e12 FLOP at 100 TFLOP/s * 0.5 = 20 ms; 1 MB at 0.5 TB/s = 2 us
    assert m.op_time("gemm", flops=1e12, bytes=1e6) == pytest.approx(1e-6 + 0.02)
    # memory-bound: 1 GB at 1 TB/s * 0.5 = 2 ms; 1 MFLOP is negligible
    assert m.op_time("elementwise", flops=1e6, bytes=1e9) == pytest.approx(1e-6 + 2e-3)
    # the dtype picks the peak: fp32 is 10x slower than bf16 here
    assert m.op_time("gemm", flops=1e12, dtype="fp32") == pytest.approx(1e-6 + 0.2)
    # torch dtype names are understood
    assert m.op_time("gemm", flops=1e12, dtype="torch.bfloat16") == m.op_time("gemm", flops=1e12)
    # an empty kernel still costs its launch
    assert m.op_time("copy") == pytest.approx(1e-6)
    # the efficiency of the class scales the roofline
    eff = dict(m.efficiency, gemm=0.25)
    assert _model(efficiency=eff).op_time("gemm", flops=1e12) == pytest.approx(1e-6 + 0.04)


def test_unknown_op_class_and_dtype_are_refused_with_the_choices():
    m = _model()
    with pytest.raises(ValueError, match="op class 'matmul'.*gemm"):
        m.op_time("matmul", flops=1)
    with pytest.raises(ValueError, match="no peak for dtype 'fp16'.*bf16, fp32"):
        m.op_time("gemm", flops=1, dtype="fp16")
    with pytest.raises(ValueError, match="non-negative"):
        m.op_time("gemm", flops=-1)


@pytest.mark.parametrize("kw,msg", [
    (dict(mem_bw=0), "mem_bw must be a positive"),
    (dict(peak_flops={"fp64": 1e12}), "unknown dtypes"),
    (dict(peak_flops={}), "peak_flops must map"),
    (dict(efficiency={"gemm": 0.5}), "missing"),
    (dict(efficiency={**{c: 0.5 for c in OP_CLASSES}, "gemm": 1.5}), "at most 1"),
    (dict(launch_s=-1), "launch_s"),
    (dict(name=""), "name"),
])
def test_bad_models_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _model(**kw)


@pytest.mark.parametrize("name", DEVICE_MODELS)
def test_built_in_models_load_with_a_source_for_every_number(name):
    m = load_device_model(name)
    assert m.name == name and not m.calibrated
    assert set(m.efficiency) == set(OP_CLASSES)
    for d in m.peak_flops:
        assert f"peak_flops.{d}" in m.sources
    for k in ("mem_bw", "efficiency", "launch_s"):
        assert m.sources[k]
    assert "estimate" in m.sources["efficiency"]
    # bf16 tensor cores are faster than fp32, and a 4096^3 GEMM is compute-bound
    assert m.peak_flops["bf16"] > m.peak_flops["fp32"]
    n = 4096
    t = m.op_time("gemm", flops=2 * n ** 3, bytes=3 * n * n * 2)
    assert t == pytest.approx(m.launch_s + 2 * n ** 3 / (m.peak_flops["bf16"] * m.efficiency["gemm"]))


def test_built_in_numbers_are_the_datasheets():
    a, h, h2 = (load_device_model(n) for n in ("a100", "h100", "h200"))
    assert (a.peak_flops["bf16"], a.mem_bw) == (312e12, 2039e9)
    assert (h.peak_flops["bf16"], h.mem_bw) == (989.5e12, 3.35e12)
    assert (h2.peak_flops["bf16"], h2.mem_bw) == (989.5e12, 4.8e12)
    # same compute as the H100, faster memory: memory-bound ops are faster, GEMMs not
    assert h2.op_time("elementwise", bytes=1e9) < h.op_time("elementwise", bytes=1e9)
    assert h2.op_time("gemm", flops=1e12) == h.op_time("gemm", flops=1e12)


def test_json_round_trip_and_a_users_own_file(tmp_path):
    m = _model(sources={"mem_bw": "my measurement"}, calibrated=True)
    p = m.save(tmp_path / "mine.json")
    back = load_device_model(str(p))
    assert back == m and back.to_dict() == m.to_dict()
    assert load_device_model(p) == m  # a Path too
    # a built-in file written back and read is the same model
    h = load_device_model("h100")
    assert load_device_model(h.save(tmp_path / "h.json")) == h


@pytest.mark.parametrize("text,msg", [
    ("{not json", "not readable JSON"),
    ("[1, 2]", "is a JSON object"),
    ('{"name": "x"}', "missing"),
    (None, "efficiency\\['gemm'\\] must be a positive"),
    ('{"name": "x", "peak_flops": {"bf16": "fast"}, "mem_bw": 1, "efficiency": {}, "launch_s": 0}',
     "peak_flops\\['bf16'\\] must be a positive"),
])
def test_a_malformed_file_is_refused_with_one_value_error(tmp_path, text, msg):
    if text is None:  # a valid model with one bad number
        d = _model().to_dict()
        d["efficiency"]["gemm"] = "high"
        text = json.dumps(d)
    p = tmp_path / "bad.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=msg) as e:
        load_device_model(str(p))
    assert str(p) in str(e.value)


def test_unknown_name_names_the_choices():
    with pytest.raises(ValueError, match="a100, h100, h200"):
        load_device_model("v100")


def test_back_to_back_work_costs_its_sum_and_queues_after_the_device_is_free():
    clock = DeviceClock(_model(launch_s=0.0))
    t0 = time.perf_counter()
    a = clock.occupy(0.010)
    b = clock.occupy(0.020)  # queued behind a, not started now
    assert b - a == pytest.approx(0.020)
    assert a >= t0 + 0.010
    assert clock.issued() == b and clock.busy_s == pytest.approx(0.030)
    # a kernel of known roofline time
    c = clock.run("gemm", flops=1e12)  # 1e12 / (100e12 * 0.5) = 20 ms
    assert c - b == pytest.approx(0.020)
    assert clock.kernels == 1
    clock.reset_stats()
    assert clock.busy_s == 0 and clock.kernels == 0
    assert clock.issued() == c  # the queue is kept


def test_work_queued_on_an_idle_device_starts_now():
    clock = DeviceClock(_model())
    clock.occupy(0.001)
    time.sleep(0.005)  # the device went idle meanwhile
    t = time.perf_counter()
    tok = clock.occupy(0.002)
    assert t + 0.002 <= tok <= time.perf_counter() + 0.002


def test_wait_sleeps_until_the_token_without_burning_the_cpu():
    clock = DeviceClock(_model())
    first = clock.occupy(0.03)
    clock.occupy(0.06)
    with HostCPU() as cpu:
        start = time.perf_counter()
        clock.wait(first)
        mid = time.perf_counter()
        clock.wait()  # all queued work
        end = time.perf_counter()
    assert mid >= first and end >= clock.issued() and clock.idle()
    queued = clock.issued() - start  # what was left of the 0.09 s of work when the host began waiting
    assert queued > 0.05 and cpu.wall_s >= end - start
    assert cpu.share < 0.2, cpu.share  # slept: near zero process CPU time (not busy-waiting)
    assert queued - 0.01 <= clock.waited_s <= cpu.wall_s  # the host slept for the queued work (less sleep overshoot)
    clock.wait(first)  # a passed token returns at once
    assert time.perf_counter() - end < 0.01


def test_dilation_multiplies_every_device_time():
    m = _model()
    k1, k10 = DeviceClock(m), DeviceClock(m, dilation=10)
    assert k10.op_time("gemm", flops=1e12) == pytest.approx(10 * k1.op_time("gemm", flops=1e12))
    t = time.perf_counter()
    tok = k10.run("elementwise", bytes=1e9)  # the device was idle: it starts now
    assert tok - t == pytest.approx(10 * m.op_time("elementwise", bytes=1e9), abs=1e-3)
    assert k10.busy_s == pytest.approx(10 * m.op_time("elementwise", bytes=1e9))
    with pytest.raises(ValueError, match="dilation"):
        DeviceClock(m, dilation=0)
    with pytest.raises(ValueError, match="busy time"):
        k1.occupy(-1.0)


def test_host_cpu_share_counts_the_process_cpu_time():
    def spin(cpu_s):  # burn cpu_s of process CPU time (however long that takes on a shared machine)
        end = time.process_time() + cpu_s
        n = 0
        while time.process_time() < end:
            n += 1
        return n

    with HostCPU() as cpu:
        spin(0.03)
    assert 0.03 <= cpu.cpu_s < 0.06 and cpu.wall_s >= cpu.cpu_s * 0.9
    assert cpu.share == pytest.approx(cpu.cpu_s / cpu.wall_s)
    out, share = host_cpu_share(spin, 0.02)
    assert out > 0 and share > 0
    assert HostCPU().share == 0.0  # an empty region


def test_the_module_imports_without_torch():
    code = "import sys, commsched.cluster.device; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_host_link_and_memory_of_the_built_in_models():
    a, h, h2 = (load_device_model(n) for n in ("a100", "h100", "h200"))
    # PCIe Gen4 x16 (A100) and Gen5 x16 (H100, H200): 32 and 64 GB/s each way; memory 80, 80, 141 GB
    assert (a.host_link_bw, h.host_link_bw, h2.host_link_bw) == (32e9, 64e9, 64e9)
    assert (a.memory_bytes, h.memory_bytes, h2.memory_bytes) == (80e9, 80e9, 141e9)
    for m in (a, h, h2):
        for k in ("host_link_bw", "host_link_eff", "memory_bytes"):
            assert m.sources[k]
        assert "estimate" in m.sources["host_link_eff"]
    # a GPT-2-sized expert (2 x 768 x 3072 bf16 and biases, 9.44 MB) over ~25.6 GB/s: 0.37 ms
    nbytes = 2 * (2 * 768 * 3072 + 3072 + 768)
    assert a.h2d_time(nbytes) == pytest.approx(a.launch_s + nbytes / (32e9 * 0.8))
    assert 0.3e-3 < a.h2d_time(nbytes) < 0.4e-3
    assert h.h2d_time(nbytes) < a.h2d_time(nbytes) / 1.9


def test_host_link_fields_are_optional_and_checked(tmp_path):
    m = _model()  # no host link, no memory: a load time cannot be derived
    assert m.host_link_bw is None and m.memory_bytes is None
    with pytest.raises(ValueError, match="no host_link_bw.*--load-ms"):
        m.h2d_time(1e6)
    m2 = _model(host_link_bw=1e9, host_link_eff=0.5, memory_bytes=1e10)
    assert m2.h2d_time(1e6) == pytest.approx(1e-6 + 1e6 / 0.5e9)
    with pytest.raises(ValueError, match="bytes copied"):
        m2.h2d_time(-1)
    back = load_device_model(m2.save(tmp_path / "m2.json"))
    assert back == m2 and back.host_link_bw == 1e9
    for kw, msg in ((dict(host_link_bw=0), "host_link_bw must be a positive"),
                    (dict(host_link_bw="fast"), "host_link_bw must be a positive"),
                    (dict(memory_bytes=-5), "memory_bytes must be a positive"),
                    (dict(host_link_eff=1.5), "host_link_eff is the achieved fraction"),
                    (dict(host_link_eff=0), "host_link_eff must be a positive")):
        with pytest.raises(ValueError, match=msg):
            _model(**kw)
        d = _model().to_dict()
        d.update(kw)
        p = tmp_path / "bad.json"
        p.write_text(json.dumps(d))
        with pytest.raises(ValueError, match=msg) as e:
            load_device_model(str(p))
        assert str(p) in str(e.value)
    d = _model().to_dict()
    d["pcie_bw"] = 1e9  # a misspelt field is refused, naming the optional ones
    (tmp_path / "typo.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="host_link_bw.*unknown \\['pcie_bw'\\]"):
        load_device_model(str(tmp_path / "typo.json"))
