"""``commsched calibrate`` on the CPU at tiny sizes: it times every op class, writes a model
file that loads back, and the model reproduces the times it measured."""

from __future__ import annotations

import pytest
import torch

from commsched.cluster.calibrate import calibrate, derive, samples
from commsched.cluster.device import OP_CLASSES, load_device_model


def test_calibrate_command_on_the_cpu_writes_a_model_that_loads_back(tmp_path, capsys):
    from commsched.cli import main

    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--device", "cpu", "--size", "32", "--reps", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "timing the CPU" in text and "not a GPU" in text and f"wrote {out}" in text
    m = load_device_model(str(out))
    h100 = load_device_model("h100")
    assert m.calibrated and m.name == "h100-calibrated"
    assert m.peak_flops == h100.peak_flops and m.mem_bw == h100.mem_bw  # the base's peaks
    assert set(m.efficiency) == set(OP_CLASSES)
    for op in OP_CLASSES:  # every class measured (quant: the codec's quantize, passed by the CLI)
        assert 0 < m.efficiency[op] <= 1
        assert m.sources[f"efficiency.{op}"].startswith("measured by commsched calibrate on the CPU"), op
    assert m.launch_s > 0


def test_the_calibrated_model_reproduces_the_measured_times():
    model, rows, where = calibrate("cpu", "a100", size=16, reps=1)
    assert "CPU" in where and {r.sample.op for r in rows} == set(OP_CLASSES) - {"quant"}
    assert model.sources["efficiency.quant"].startswith("not measured")
    assert model.efficiency["quant"] == load_device_model("a100").efficiency["quant"]
    for r in rows:
        s = r.sample
        if not r.capped and r.seconds > 2 * model.launch_s:
            assert model.op_time(s.op, flops=s.flops, bytes=s.bytes, dtype=s.dtype) == pytest.approx(r.seconds)


def test_derive_caps_a_kernel_faster_than_the_roofline():
    h100 = load_device_model("h100")
    (s,) = [x for x in samples(torch.device("cpu"), 8) if x.op == "copy"]
    model, (r,) = derive(h100, {"copy": (s, 1e-15)}, 0.0, "a test")
    assert r.capped and model.efficiency["copy"] == 1.0 and "capped" in model.sources["efficiency.copy"]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="--size"):
        calibrate("cpu", size=2)
    with pytest.raises(ValueError, match="unknown device model"):
        calibrate("cpu", base="v100", size=8)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            calibrate("cuda", size=8)
