"""Bad input to the emulated cluster (``--compute emulated``, ``--device-model``,
``--dilation``, ``--cluster``): each front-end (``commsched.gnn.train``,
``commsched.moe.train``, ``commsched.moe.infer``) and each bench refuses it with one line
naming the flag or the file, exit 2, before any process group, rank or run folder is
made. The siblings of tests/core/test_bad_input.py; all in-process and fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commsched.cli import main as commsched_main

FRONTS = {"gnn": ("commsched.gnn.train", []),
          "moe-train": ("commsched.moe.train", ["--steps", "1", "--warmup", "0"]),
          "moe-infer": ("commsched.moe.infer", ["--batches", "1", "--warmup", "0"])}


def _front(name: str):
    import importlib

    return importlib.import_module(FRONTS[name][0] + ".cli")


def _emulated(front: str) -> list[str]:
    """The flags that put ``front`` on the emulated device (moe.infer: its GPU model)."""
    return ["--compute", "emulated"] + (["--device-model", "a100"] if front == "moe-infer" else [])


def _device_models(d: Path) -> dict[str, tuple[Path | str, str]]:
    """Model files (and names) that are not a device model, each with what the error says."""
    from commsched.cluster.device import load_device_model

    good = load_device_model("a100").to_dict()
    (d / "trunc.json").write_text(json.dumps(good)[:20])
    (d / "list.json").write_text("[1, 2]")
    (d / "incomplete.json").write_text(json.dumps({"name": "x", "peak_flops": good["peak_flops"]}))
    (d / "badval.json").write_text(json.dumps({**good, "mem_bw": "fast"}))
    (d / "negative.json").write_text(json.dumps({**good, "peak_flops": {**good["peak_flops"], "bf16": -1.0}}))
    return {"missing": (d / "missing.json", "unknown device model"),
            "truncated": (d / "trunc.json", "not readable JSON"),
            "not an object": (d / "list.json", "a device model is a JSON object, not list"),
            "incomplete": (d / "incomplete.json", "missing ['mem_bw', 'efficiency', 'launch_s']"),
            "text value": (d / "badval.json", "mem_bw must be a positive finite number, not 'fast'"),
            "negative value": (d / "negative.json", "peak_flops['bf16'] must be a positive finite number, not -1.0"),
            "unknown name": ("b300", "unknown device model 'b300': give a built-in name (a100, h100, h200)")}


def _one_line(msg: str) -> None:
    assert "\n" not in msg.strip() and "Traceback" not in msg, msg


def _no_work(monkeypatch, front: str) -> None:
    """Fail the test if ``front``'s CLI reaches its process group."""
    def boom(*a, **k):
        raise AssertionError("the run started before its flags were checked")

    monkeypatch.setattr(f"{FRONTS[front][0]}.cli.init_distributed", boom)


# --------------------------------------------------------------------------- the configs
@pytest.mark.parametrize("front", list(FRONTS))
def test_a_device_model_that_is_not_one_is_refused_naming_the_file(front, tmp_path):
    cli = _front(front)
    for kind, (model, says) in _device_models(tmp_path).items():
        a = cli.build_parser().parse_args(_emulated(front)[:2] + ["--device-model", str(model), "--out", "x"])
        with pytest.raises(ValueError) as e:
            cli.config_from_args(a)
        msg = str(e.value)
        assert says in msg, (kind, msg)
        if isinstance(model, Path) and kind != "missing":
            assert f"device model file {model}" in msg, (kind, msg)
        _one_line(msg)


@pytest.mark.parametrize("front", list(FRONTS))
@pytest.mark.parametrize("k", ["0", "-2", "nan", "inf"])
def test_a_dilation_that_is_not_a_positive_finite_number_is_refused(front, k):
    cli = _front(front)
    a = cli.build_parser().parse_args(_emulated(front) + ["--dilation", k, "--out", "x"])
    with pytest.raises(ValueError, match=r"^--dilation must be a finite number > 0, got (0\.0|-2\.0|nan|inf)$"):
        cli.config_from_args(a)


@pytest.mark.parametrize("front", list(FRONTS))
def test_the_emulated_device_on_cuda_is_refused(front):
    cli = _front(front)
    a = cli.build_parser().parse_args(["--compute", "emulated", "--device", "cuda", "--out", "x"])
    with pytest.raises(ValueError, match=r"--compute emulated .*--device cpu") as e:
        cli.config_from_args(a)
    _one_line(str(e.value))


@pytest.mark.parametrize("front", ["gnn", "moe-train"])
@pytest.mark.parametrize("flag", [["--dilation", "2"], ["--device-model", "h100"]])
def test_emulation_options_without_the_emulated_device_are_refused(front, flag):
    cli = _front(front)
    a = cli.build_parser().parse_args(["--compute", "real", *flag, "--out", "x"])
    with pytest.raises(ValueError, match=r"^--device-model and --dilation are options of --compute emulated$"):
        cli.config_from_args(a)


# --------------------------------------------------------------------------- the front-ends' CLIs
@pytest.mark.parametrize("front", list(FRONTS))
def test_the_cli_refuses_a_bad_device_model_before_any_rank_or_folder(front, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COMMSCHED_PROGRESS", "0")
    _no_work(monkeypatch, front)
    prog, args = FRONTS[front]
    (tmp_path / "m.json").write_text('{"name": ')
    out = tmp_path / "run"
    assert _front(front).main(args + ["--compute", "emulated", "--device-model", str(tmp_path / "m.json"),
                                      "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: device model file {tmp_path / 'm.json'}: not readable JSON"), err
    _one_line(err)
    assert not out.exists()  # nothing made, nothing to clean up


# --------------------------------------------------------------------------- the benches
def _bench(argv: list[str], capsys) -> str:
    assert commsched_main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("commsched bench: "), err
    return last


@pytest.mark.parametrize("workload", ["moe-train", "gnn", "moe-infer"])
def test_bench_unknown_cluster_is_one_line_naming_the_presets(workload, tmp_path, capsys):
    from commsched.cluster.presets import CLUSTERS

    last = _bench([workload, "--cluster", "a100x3-carrier-pigeon", "--out", str(tmp_path / "b")], capsys)
    assert last == (f"commsched bench: unknown cluster preset 'a100x3-carrier-pigeon'; choose one of "
                    f"{', '.join(CLUSTERS)}")
    assert not (tmp_path / "b").exists()


def test_bench_cluster_refuses_what_the_preset_sets_and_workloads_without_presets(tmp_path, capsys):
    from commsched.cluster.presets import CLUSTERS, load_preset

    name = next(iter(CLUSTERS))
    p = load_preset(name)
    out = ["--out", str(tmp_path / "b")]
    assert "sets --bandwidth" in _bench(["moe-train", "--cluster", name, "--bandwidth", "1gbit", *out], capsys)
    wrong = p.ranks_per_host + 1
    assert _bench(["gnn", "--cluster", name, "--nproc", str(wrong), *out], capsys) == (
        f"commsched bench: --cluster {name} runs {p.ranks_per_host} ranks per host; drop --nproc {wrong}")
    assert "commsched bench quant has no --cluster presets" in _bench(["quant", "--cluster", name, *out], capsys)


@pytest.mark.parametrize("workload", ["moe-train", "gnn", "moe-infer"])
def test_bench_bad_device_model_is_refused_before_any_variant_runs(workload, tmp_path, capsys, monkeypatch):
    import commsched.bench.runner as runner

    def boom(*a, **k):
        raise AssertionError("a variant was launched")

    monkeypatch.setattr(runner.subprocess, "Popen", boom)
    (tmp_path / "m.json").write_text("[]")
    emulated = [] if workload == "moe-infer" else ["--compute", "emulated"]
    last = _bench([workload, *emulated, "--device-model", str(tmp_path / "m.json"), "--bandwidth", "none",
                   "--out", str(tmp_path / "b")], capsys)
    assert last == f"commsched bench: device model file {tmp_path / 'm.json'}: a device model is a JSON object, not list"
