"""Environment reading, config agreement across ranks, and the CLI's surface."""

import dataclasses
import subprocess
import sys

import pytest

from commsched.cli import main as cli_main
from commsched.config import DEFAULT_TIMEOUT_S, read_env
from commsched.dist import check_same_config, config_digest
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
