"""The GPU check's own code on the CPU: its sections run, report and write their files
(on a GPU machine the same command checks the kernels and the front-ends on CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from commsched.bench import gpucheck


@pytest.mark.slow
def test_the_check_runs_on_the_cpu_from_its_command_line_passes_and_reports_its_skips(tmp_path):
    """``python -m commsched.bench.gpucheck --device cpu --quick --out DIR``, every section
    included: the front-end runs launch every entry point the check names (audit 3, item 4:
    the inference run's missing main failed it), the new paths run at world size 1 (item 7),
    and what only a GPU can run is reported as skipped."""
    import subprocess
    import sys

    out = tmp_path / "check"
    cmd = [sys.executable, "-m", "commsched.bench.gpucheck", "--device", "cpu", "--quick", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    res = json.loads((out / "gpucheck.json").read_text())
    assert res["ok"] is True and "gpucheck: ok" in p.stdout
    assert set(gpucheck.SECTIONS) <= set(res)
    # what only a GPU runs: skipped, each saying why
    skipped = "\n".join(res["skipped"])
    for section in ("warm", "kernels"):
        assert res[section]["status"] == "skipped" and "CUDA" in res[section]["reason"]
    assert res["cuda_tests"]["status"] == "skipped" and "cuda and not slow" in res["cuda_tests"]["reason"]
    assert "cuda_tests: the cuda-marked tests need a CUDA device" in skipped
    assert any(line.startswith("nccl/batch_isend_irecv: gloo cannot send") for line in res["skipped"])
    # the front-ends: every module the check launches ran (one run each on the CPU's quick plan)
    runs = gpucheck.frontend_runs(torch.device("cpu"), True, out)
    fe = res["frontends"]
    assert fe["status"] == "ok"
    ran = {m for n, m, _, _ in runs if fe[n]["status"] == "ok"}
    assert ran == {m for _, m, _, _ in runs}, fe
    for n, _, _, _ in runs:
        assert fe[n]["status"] == ("ok" if n in gpucheck.CPU_QUICK_RUNS else "skipped"), (n, fe[n])
        if n not in gpucheck.CPU_QUICK_RUNS:
            assert f"frontends/{n}: not in the CPU's --quick plan" in skipped
    # the new paths at world size 1, past the one-rank shortcuts
    assert res["paths"]["status"] == "ok", res["paths"]
    assert all(res["paths"][k]["status"] == "ok" for k in gpucheck.PATH_CHECKS)
    assert res["paths"]["records"]["cases"] > 0 and res["paths"]["launcher"]["launches_summed"] > 0
    assert "paths/cuda: the same checks ran with the CPU's codec" in skipped
    # the backend called directly at world size 1 (gloo here: what gloo lacks is skipped, by name)
    nccl = res["nccl"]
    assert nccl["status"] == "ok" and nccl["backend"] == "gloo", nccl
    assert {"all_reduce", "work_is_completed", "event_timing", "all_to_all_single_splits",
            "all_gather_into_tensor"} <= set(nccl["checks"]) and all(nccl["checks"].values())
    assert res["codec"]["status"] == "ok" and res["codec"]["clone_GBps"] > 0
    # two processes on one device over gloo (the CPU's quick plan: 2 only)
    assert res["shared"]["world2"] == {"all_to_all": True, "segments": True, "executor": True}
    assert "world4" not in res["shared"]
    log = (out / "gpucheck.log").read_text()
    assert "kernels: skipped" in log and "gpucheck: ok" in log and "skipped: cuda_tests:" in log


def test_every_module_the_check_launches_has_the_entry_point_it_calls(tmp_path):
    """audit 3, item 4: the child calls ``import_module(module).main(args)``."""
    from importlib import import_module

    for device in ("cpu", "cuda"):
        for quick in (True, False):
            for _, module, _, _ in gpucheck.frontend_runs(torch.device(device), quick, tmp_path):
                assert callable(getattr(import_module(module), "main", None)), module


def test_section_budgets_fit_the_deadline_with_a_reserve():
    b = gpucheck.section_budgets(480)
    assert set(b) == set(gpucheck.SECTIONS) and 420 <= sum(b.values()) <= 480 - 20
    assert sum(gpucheck.section_budgets(960).values()) == pytest.approx(2 * sum(b.values()))
    with pytest.raises(ValueError, match="deadline"):
        gpucheck.section_budgets(0)


def test_the_budgets_come_from_measured_times_and_fit_the_deadline():
    """audit 3, item 8: each budget is its section's measured time times the margin; together
    they fit the default deadline, which :func:`section_budgets` then hands out in proportion."""
    measured = {**gpucheck.MEASURED_CPU_S, **gpucheck.MEASURED_CUDA_S}
    assert set(measured) == set(gpucheck.SECTIONS) == set(gpucheck.SECTION_BUDGET_S)
    for k, v in gpucheck.SECTION_BUDGET_S.items():
        assert gpucheck.BUDGET_MARGIN * measured[k] <= v <= gpucheck.BUDGET_MARGIN * measured[k] + 5, k
    assert sum(gpucheck.SECTION_BUDGET_S.values()) <= gpucheck.DEADLINE_S
    assert gpucheck.section_budgets(gpucheck.DEADLINE_S) == pytest.approx(gpucheck.SECTION_BUDGET_S)


def test_out_defaults_to_a_timestamped_runs_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert gpucheck.main(["--device", "cpu", "--quick", "--sections", "codec"]) == 0
    made = list((tmp_path / "runs").glob("gpucheck-*/gpucheck.json"))
    assert len(made) == 1 and json.loads(made[0].read_text())["codec"]["status"] == "ok"


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
    argv = dict((n, a) for n, _, a, _ in runs)
    infer = argv["moe-infer-lina"]  # emulated compute is refused on cuda
    assert infer[infer.index("--compute") + 1] == "real"
    # the new MoE paths (audit 3, item 7)
    q8 = " ".join(argv["moe-train-lina-q8"])
    assert "--a2a-bits 8 --grad-bits 8 --chunks 2 --pipeline" in q8 and "--merge" not in q8
    assert "--merge" in argv["moe-train-lina-merge"] and "--pipeline" in argv["moe-train-lina-merge"]
    ov = argv["moe-train-lina-overlap"]
    assert ov[ov.index("--schedule") + 1] == "lina-overlap"
    assert set(gpucheck.CPU_QUICK_RUNS) <= set(argv)


def test_every_frontend_run_parses_its_own_arguments(tmp_path):
    """The argv of each run is accepted by its entry point's own parser and config (audit 2,
    item 3: the inference run without ``--compute real`` exited 2 on cuda; audit 3: the flag
    names of the new runs are the trainer's)."""
    from commsched.gnn.train import cli as gnn_train
    from commsched.moe.infer import InferConfig
    from commsched.moe.infer.cli import build_parser, config_from_args
    from commsched.moe.train import cli as moe_train

    for quick in (True, False):
        runs = gpucheck.frontend_runs(torch.device("cuda"), quick, tmp_path)
        for _, module, argv, _ in runs:
            full = argv + ["--out", str(tmp_path), "--overwrite"]
            if module == "commsched.moe.infer":
                cfg = config_from_args(build_parser().parse_args(full))
                assert isinstance(cfg, InferConfig) and cfg.compute == "real" and cfg.device == "cuda"
            else:
                parser = (moe_train if module == "commsched.moe.train" else gnn_train).build_parser()
                parser.parse_args(full)  # exits 2 (SystemExit) on an unknown flag


def test_cuda_tests_run_only_the_files_with_cuda_marks():
    from pathlib import Path

    root = Path(gpucheck.__file__).resolve().parents[2]
    files = gpucheck.cuda_test_files(root)
    assert "tests/moe/test_a2a_bits.py" in files and "tests/bench/test_gpucheck.py" not in files
    assert all(gpucheck.CUDA_MARK in (root / f).read_text() for f in files)
    cmd = gpucheck.cuda_tests_command(root, quick=True)
    assert cmd[cmd.index("-m", 2) + 1] == "cuda and not slow" and cmd[-len(files):] == files
    assert gpucheck.cuda_tests_command(root, quick=False)[cmd.index("-m", 2) + 1] == "cuda"


def test_a_child_past_its_budget_is_killed_with_its_own_children(tmp_path):
    """The cuda_tests and front-end children run in their own process group, killed whole
    on timeout (pytest's pool children must not linger on the GPU)."""
    import os
    import sys
    import time

    pidfile = tmp_path / "grandchild"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.monotonic()
    assert gpucheck._run_in_own_group([sys.executable, "-c", code], 3.0) is None
    assert time.monotonic() - t0 < 20
    pid = int(pidfile.read_text())
    for _ in range(50):  # reaped by init once killed
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        raise AssertionError("the child's own child outlived the timeout")


def test_gpucheck_refuses_cuda_without_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert gpucheck.main(["--out", str(tmp_path), "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_a_missing_package_names_the_extra_that_installs_it(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m in ("deepspeed", "pytest") else real(m, *a))
    ds = [r for r in gpucheck.frontend_runs(torch.device("cpu"), False, tmp_path) if r[3] == "deepspeed"]
    monkeypatch.setattr(gpucheck, "frontend_runs", lambda *a: ds)
    res = gpucheck.check_frontends(torch.device("cpu"), False, tmp_path)
    assert res["moe-train-deepspeed"] == {
        "status": "skipped", "reason": "deepspeed is not installed; install it with pip install 'commsched[moe]'"}
    with pytest.raises(gpucheck._Skip, match=r"^pytest is not installed; install it with pip install 'commsched\[test\]'$"):
        gpucheck._needs("pytest")
    assert gpucheck.not_installed("somepkg") == "somepkg is not installed"  # not an extra of commsched
