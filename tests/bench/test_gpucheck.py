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
                             sections=("kernels", "codec", "nccl", "shared"))
    assert res["kernels"]["status"] == "skipped" and "CUDA" in res["kernels"]["reason"]
    # the backend called directly at world size 1 (gloo here: what gloo lacks is skipped, by name)
    nccl = res["nccl"]
    assert nccl["status"] == "ok" and nccl["backend"] == "gloo", nccl
    assert {"all_reduce", "work_is_completed", "event_timing", "all_to_all_single_splits",
            "all_gather_into_tensor"} <= set(nccl["checks"]) and all(nccl["checks"].values())
    assert "batch_isend_irecv" in nccl["skipped"]
    assert "kernels: the Triton kernels need a CUDA device" in " ".join(res["skipped"])
    assert any(line.startswith("nccl/batch_isend_irecv: gloo cannot send") for line in res["skipped"])
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
    assert "skipped: nccl/batch_isend_irecv" in log and "skipped: kernels:" in log


def test_section_budgets_add_up_to_the_deadline():
    b = gpucheck.section_budgets(480)
    assert set(b) == set(gpucheck.SECTIONS) and sum(b.values()) == pytest.approx(480)
    with pytest.raises(ValueError, match="deadline"):
        gpucheck.section_budgets(0)


def test_a_section_past_its_budget_fails_and_a_spent_deadline_skips_the_rest(tmp_path, monkeypatch):
    import time

    def hang(device, quick):
        time.sleep(30)
        return {}

    monkeypatch.setattr(gpucheck, "check_codec", hang)
    monkeypatch.setattr(gpucheck, "SECTION_SHARES", {**gpucheck.SECTION_SHARES, "codec": 0.9})
    t0 = time.perf_counter()
    res = gpucheck.run_check(tmp_path, torch.device("cpu"), quick=True, sections=("codec", "nccl"),
                             deadline_s=3.0)
    assert time.perf_counter() - t0 < 20
    assert res["codec"]["status"] == "failed" and "budget" in res["codec"]["error"]
    assert res["nccl"]["status"] == "skipped" and "deadline of 3 s was spent" in res["nccl"]["reason"]
    assert res["ok"] is False and "nccl: the deadline of 3 s was spent" in res["skipped"]


def test_frontend_runs_name_each_entry_point_and_its_dependency(tmp_path):
    runs = gpucheck.frontend_runs(torch.device("cuda"), True, tmp_path)
    assert {m for _, m, _, _ in runs} == {"commsched.gnn.train", "commsched.moe.train",
                                         "commsched.moe.infer"}
    assert all(argv[argv.index("--device") + 1] == "cuda" for _, _, argv, _ in runs)
    assert dict((n, d) for n, _, _, d in runs)["moe-train-deepspeed"] == "deepspeed"
    infer = dict((n, a) for n, _, a, _ in runs)["moe-infer-lina"]  # emulated compute is refused on cuda
    assert infer[infer.index("--compute") + 1] == "real"


def test_every_frontend_run_parses_its_own_arguments(tmp_path):
    """The argv of each run is accepted by its entry point's config (audit 2, item 3: the
    inference run without ``--compute real`` exited 2 on cuda)."""
    from commsched.moe.infer import InferConfig
    from commsched.moe.infer_cli import build_parser, config_from_args

    argv = dict((n, a) for n, _, a, _ in gpucheck.frontend_runs(torch.device("cuda"), True, tmp_path))
    cfg = config_from_args(build_parser().parse_args(argv["moe-infer-lina"] + ["--out", str(tmp_path)]))
    assert isinstance(cfg, InferConfig) and cfg.compute == "real" and cfg.device == "cuda"


def test_gpucheck_refuses_cuda_without_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpucheck.main(["--out", str(tmp_path), "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
