"""A new gradient schedule is one config class and one SCHEDULES entry: both training
command lines run it (MoE's ``--schedule``, GNN's ``--grad-schedule``), on two gloo ranks."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from commsched.priority.policy import SCHEDULES, MicroOpConfig, Policy
from tests.mp import run_ranks

TEXT = Path(__file__).resolve().parents[2] / "commsched" / "moe" / "train" / "cli.py"  # any text will do


@dataclass(frozen=True, kw_only=True)
class EagerConfig(MicroOpConfig):
    """Micro-ops as soon as they are ready, never held for an all-to-all."""

    name = "eager"

    def make_policy(self, rule):
        return Policy(self.name, credit_bytes=None, hold_for_a2a=False, hold_in_block=False)


def _moe(rank: int, world: int, out: str) -> int:
    from commsched.moe.train.cli import main

    with SCHEDULES.registered("eager", EagerConfig):  # main ends the process group: one run per spawn
        return main(["--schedule", "eager", "--microop-bytes", "1024", "--steps", "2", "--warmup", "1", "--seq-len",
                     "8", "--d-model", "16", "--heads", "2", "--d-ff", "16", "--expert-hidden", "16", "--experts", "2",
                     "--probe-steps", "0", "--eval-batches", "0", "--corpus", str(TEXT), "--device", "cpu", "--out", out])


def _gnn(rank: int, world: int, out: str) -> int:
    from commsched.gnn.train.cli import main

    with SCHEDULES.registered("eager", EagerConfig):
        return main(["--grad-schedule", "eager", "--microop-bytes", "1024", "--grad-bits", "8", "--epochs", "2",
                     "--layers", "2", "--hidden", "8", "--device", "cpu", "--partition-method", "random",
                     "--syn-nodes", "200", "--syn-edges", "800", "--syn-features", "8", "--syn-classes", "3",
                     "--out", out])


@pytest.mark.slow
def test_a_new_schedule_runs_in_both_training_command_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("COMMSCHED_PROGRESS", "0")
    assert run_ranks(2, _moe, str(tmp_path / "moe"), timeout_s=240) == [0, 0]
    m = json.loads((tmp_path / "moe" / "metrics.json").read_text())
    assert m["schedule"] == "eager" and m["config"]["schedule"]["microop_bytes"] == 1024 and len(m["loss"]) == 2
    assert run_ranks(2, _gnn, str(tmp_path / "gnn"), timeout_s=240) == [0, 0]
    g = json.loads((tmp_path / "gnn" / "metrics.json").read_text())
    assert g["config"]["schedule"] == asdict(EagerConfig(microop_bytes=1024))  # its policy: "eager"
    assert g["config"]["grad_bits"] == 8 and len(g["loss"]) == 2 and "eager" not in SCHEDULES
