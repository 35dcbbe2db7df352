"""Environment reading, config agreement across ranks, and the CLI's surface."""

import dataclasses
import subprocess
import sys

import pytest

from commsched.agree import check_same_config, config_digest
from commsched.cli import main as cli_main
from commsched.config import DEFAULT_TIMEOUT_S, read_env
from tests.mp import run_ranks


def test_read_env_defaults_and_errors():
    e = read_env({})
    assert e.timeout_s == DEFAULT_TIMEOUT_S and e.backend is None and e.progress and e.rank is None
    e = read_env({"COMMSCHED_TIMEOUT_S": "5", "COMMSCHED_PROGRESS": "0", "RANK": "3", "WORLD_SIZE": "4"})
    assert e.timeout_s == 5.0 and not e.progress and e.rank == 3 and e.world_size == 4
    for bad in ({"COMMSCHED_TIMEOUT_S": "soon"}, {"COMMSCHED_TIMEOUT_S": "-1"},
                {"COMMSCHED_BACKEND": "carrier-pigeon"}, {"RANK": "x"}):
        with pytest.raises(ValueError):
            read_env(bad)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    lr: float
    layers: int


def test_config_digest_is_stable_and_sensitive():
    assert config_digest(_Cfg(0.1, 2)) == config_digest({"layers": 2, "lr": 0.1})
    assert config_digest(_Cfg(0.1, 2)) != config_digest(_Cfg(0.1, 3))


def _mismatch(rank, world):
    try:
        check_same_config(_Cfg(0.01, 3 if rank == 2 else 2))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_config_mismatch_stops_every_rank_with_the_difference():
    msgs = run_ranks(3, _mismatch, timeout_s=60)
    for m in msgs:
        assert m is not None and "ranks [2]" in m and "layers" in m


def _mode_mismatch(rank, world):
    from commsched.configurable import flag_values
    from commsched.gnn.graph.data import GraphSource
    from commsched.gnn.train.cli import build_parser, config_from_args, startup_check

    p = build_parser()
    a = p.parse_args(["--mode", "vanilla" if rank == 0 else "adaqp", "--epochs", "3"])
    try:
        startup_check(config_from_args(a), GraphSource(), flags=flag_values(p, a), out="x")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_a_differing_flag_is_named_before_the_settings_it_changes():
    for m in run_ranks(2, _mode_mismatch, timeout_s=60):
        assert m is not None and "ranks [1]" in m
        assert m.index("differing flags: --mode: rank 0 has 'vanilla', rank 1 has 'adaqp'") < m.index("settings")
        assert "--epochs" not in m  # the same on both ranks


def _moe_flag_mismatch(rank, world, front):
    from commsched.configurable import flag_values

    if front == "train":
        from commsched.moe.train.cli import build_parser, config_from_args
        from commsched.moe.train.trainer import train as go
        argv = ["--schedule", "fifo" if rank == 0 else "serial", "--steps", "3", "--out", "x"]
    else:
        from commsched.moe.infer.cli import build_parser, config_from_args
        from commsched.moe.infer.loop import run as go
        argv = ["--placement", "static" if rank == 0 else "lina", "--batches", "3", "--out", "x"]
    p = build_parser()
    a = p.parse_args(argv)
    try:
        go(config_from_args(a), None, device="cpu", flags=flag_values(p, a))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("front", ["train", "infer"])
def test_moe_fronts_name_a_differing_flag_first(front):
    flag, v0, v1 = ("--schedule", "fifo", "serial") if front == "train" else ("--placement", "static", "lina")
    for m in run_ranks(2, _moe_flag_mismatch, front, timeout_s=60):
        assert m is not None and "ranks [1]" in m, m
        assert m.index(f"differing flags: {flag}: rank 0 has {v0!r}, rank 1 has {v1!r}") < m.index("settings"), m
        assert "--out" not in m and "--steps" not in m and "--batches" not in m  # the same on both ranks


def test_mismatch_message_lists_every_differing_flag_then_a_few_settings():
    from commsched.agree import mismatch_message

    c0 = {"train": {"mode": "vanilla", **{f"k{i}": 0 for i in range(6)}}}
    c1 = {"train": {"mode": "adaqp", **{f"k{i}": 1 for i in range(6)}}}
    m = mismatch_message("training configuration", [1], c0, c1, {"--mode": "vanilla", "--lr": 0.1},
                         {"--mode": "adaqp", "--lr": 0.1})
    assert m.startswith("ranks [1] were started with a training configuration different from rank 0's; "
                        "differing flags: --mode: rank 0 has 'vanilla', rank 1 has 'adaqp'; differing settings: "
                        "train.k0: rank 0 has 0, rank 1 has 1")
    assert "(and 4 more)" in m and "--lr" not in m
    assert "differing: train.k0" in mismatch_message("x", [1], c0, c1)  # no flags: as before


def test_cli_usage_and_unknown_command(capsys):
    assert cli_main(["--help"]) == 0
    assert "bench WORKLOAD" in capsys.readouterr().out
    assert cli_main(["frobnicate"]) == 2
    assert cli_main(["bench", "no-such-workload"]) == 2
    assert "unknown workload" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "commsched.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "commsched COMMAND" in out.stdout


def test_gloo_devices_follow_gloo_socket_ifname(monkeypatch):
    from commsched.dist import gloo_devices

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert len(gloo_devices()) == 1
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "commsched-no-such-if0")
    with pytest.raises(RuntimeError):
        gloo_devices()  # the variable is read: a missing interface is an error, as in torch
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert len(gloo_devices()) == 1


def test_choose_device_auto_cpu_cuda():
    from commsched.dist import choose_device

    no_gpu = dict(cuda_available=False, device_count=0, local_rank=0, local_world_size=4)
    assert choose_device("cpu", **no_gpu)[0] == "cpu"
    dev, why = choose_device("auto", **no_gpu)
    assert dev == "cpu" and "no CUDA" in why
    with pytest.raises(ValueError, match="CUDA is not available"):
        choose_device("cuda", **no_gpu)
    one_gpu = dict(cuda_available=True, device_count=1, local_rank=2, local_world_size=4)
    dev, why = choose_device("auto", **one_gpu)  # 4 ranks share one GPU: CPU, and it says so
    assert dev == "cpu" and "4 local ranks share 1 GPU" in why
    with pytest.raises(ValueError, match="4 local ranks but 1 GPU"):
        choose_device("cuda", **one_gpu)
    enough = dict(cuda_available=True, device_count=8, local_rank=3, local_world_size=4)
    assert choose_device("auto", **enough)[0] == "cuda:3"
    assert choose_device("cuda", **enough)[0] == "cuda:3"
    assert choose_device("auto", cuda_available=True, device_count=1, local_rank=None,
                         local_world_size=None)[0] == "cuda:0"  # no torchrun: one process
    with pytest.raises(ValueError, match="--device must be one of"):
        choose_device("tpu", **enough)


def test_backend_follows_the_device(monkeypatch):
    import torch

    from commsched.dist import default_backend

    monkeypatch.delenv("COMMSCHED_BACKEND", raising=False)
    assert default_backend(torch.device("cpu")) == "gloo"
    assert default_backend(torch.device("cuda:0")) == "cpu:gloo,cuda:nccl"
    monkeypatch.setenv("COMMSCHED_BACKEND", "gloo")
    assert default_backend(torch.device("cuda:0")) == "gloo"


def test_clock_on_cpu_is_the_host_clock():
    import time

    from commsched.clock import Clock

    c = Clock("cpu")
    a = c.mark()
    time.sleep(0.01)
    b = c.mark()
    assert c.seconds(a, b) >= 0.009
    c.sync()


def test_cc_is_read_here_and_passed_to_the_kernel_loader():
    from commsched.config import read_env

    assert read_env({}).cc is None
    assert read_env({"CC": ""}).cc is None
    assert read_env({"CC": "clang"}).cc == "clang"


def test_no_module_but_config_reads_the_environment():
    """Environment variables are read in one place (commsched/config.py): a library or
    kernel module may hand the environment on to a child, never look a variable up."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    read = re.compile(r"os\.environ\.get\(|os\.environ\[|os\.getenv\(")
    found = [f"{p.relative_to(root)}:{i}" for folder in ("commsched", "kernels")
             for p in sorted((root / folder).rglob("*.py")) if p.name != "config.py"
             and "bench" not in p.relative_to(root).parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if read.search(line)]
    assert not found, "environment read outside commsched/config.py: " + ", ".join(found)
