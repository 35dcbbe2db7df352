"""The GPU check's own code on the CPU: its sections run, report and write their files
(on a GPU machine the same command checks the kernels and the front-ends on CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from commsched.bench import gpucheck


@pytest.mark.slow
def test_gpucheck_runs_on_the_cpu_and_reports_what_it_skipped(tmp_path):
    res = gpucheck.run_check(tmp_path, torch.device("cpu"), procs=(2,), quick=True,
                             sections=("kernels", "codec", "shared"))
    assert res["kernels"]["status"] == "skipped" and "CUDA" in res["kernels"]["reason"]
    assert res["codec"]["status"] == "ok" and res["codec"]["clone_GBps"] > 0
    for b in (2, 4, 8):
        assert res["codec"][f"b{b}"]["quantize_GBps"] > 0
    # two processes on one device over gloo: all_to_all, segments, the executor's no-race check
    assert res["shared"]["world2"] == {"all_to_all": True, "segments": True, "executor": True}
    assert res["ok"] is True
    on_disk = json.loads((tmp_path / "gpucheck.json").read_text())
    assert on_disk["shared"]["status"] == "ok"
    log = (tmp_path / "gpucheck.log").read_text()
    assert "kernels: skipped" in log and "gpucheck: ok" in log


def test_frontend_runs_name_each_entry_point_and_its_dependency(tmp_path):
    runs = gpucheck.frontend_runs(torch.device("cuda"), True, tmp_path)
    assert {m for _, m, _, _ in runs} == {"commsched.gnn.train", "commsched.moe.train",
                                         "commsched.moe.infer"}
    assert all(argv[argv.index("--device") + 1] == "cuda" for _, _, argv, _ in runs)
    assert dict((n, d) for n, _, _, d in runs)["moe-train-deepspeed"] == "deepspeed"


def test_gpucheck_refuses_cuda_without_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpucheck.main(["--out", str(tmp_path), "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
