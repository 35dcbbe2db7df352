"""The GNN registries: a mode is one config class, one registry entry and one test (a toy
mode in a test-local registry trains from the command line); the layer registry holds
commsched's own fast-path layers and PyG's, so gin and gat train from the CLI."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest

from commsched.configurable import option
from commsched.gnn.exchange.halo import VanillaExchange
from commsched.gnn.exchange.modes import (
    MODES,
    ExchangeConfig,
    make_exchange,
    mode_config,
    modes_copy,
)
from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
from commsched.gnn.graph.partition import make_parts, partition_nodes
from commsched.gnn.nn.models import LAYERS, FastLayer, PyGLayer
from commsched.gnn.train.trainer import TrainConfig, run_training
from tests.mp import run_ranks

SYN = SyntheticSpec(num_nodes=200, num_edges=800, num_features=8, num_classes=3, seed=3)
SYN_ARGS = ["--syn-nodes", "200", "--syn-edges", "800", "--syn-features", "8", "--syn-classes", "3",
            "--syn-seed", "3"]
KEYS = ("mode", "model", "dataset", "world_size", "epochs", "loss", "val_acc", "test_acc",
        "epoch_time_s", "breakdown_s", "bytes_sent_per_epoch", "wall_clock_s")


# --------------------------------------------------------------------------- a toy mode
class CountingExchange(VanillaExchange):
    """Vanilla's rows, every ``scale``-th layer call counted (a toy: the same results)."""

    name = "counting"

    def __init__(self, ctx, *, every: int):
        super().__init__(ctx)
        self.every, self.calls = every, 0

    def start(self, h, layer, ctx=None):
        self.calls += 1
        return super().start(h, layer, ctx)

    def report(self) -> dict:
        return {"counting": {"calls": self.calls, "every": self.every}}


@dataclass(frozen=True, kw_only=True)
class CountingConfig(ExchangeConfig):
    every: int = option(1, "count every K-th call", flag="--count-every",
                        foreign="{flag} is an option of --mode {owners}, not of --mode {mode}")

    def __post_init__(self):
        if self.every < 1:
            raise ValueError(f"--count-every must be >= 1, got {self.every}")

    def build(self, ctx):
        return CountingExchange(ctx, every=self.every)


def test_a_new_mode_is_one_class_one_entry_and_trains_from_the_cli():
    from commsched.gnn.train.cli import build_parser, config_from_args

    modes = modes_copy()
    modes.register("counting", CountingConfig)
    assert "counting" not in MODES  # the shared registry is untouched
    p = build_parser(modes)
    argv = ["--mode", "counting", "--count-every", "2", "--layers", "2", "--hidden", "8",
            "--epochs", "2", "--device", "cpu"]
    cfg = config_from_args(p.parse_args(argv), modes)
    assert cfg.exchange == CountingConfig(every=2) and cfg.mode == "counting"
    with pytest.raises(ValueError, match="--count-every is an option of --mode counting, not of --mode vanilla"):
        config_from_args(p.parse_args(["--mode", "vanilla", "--count-every", "2"]), modes)
    with pytest.raises(ValueError, match="--count-every must be >= 1"):
        config_from_args(p.parse_args(argv[:2] + ["--count-every", "0"]), modes)
    g = synthetic_graph(SYN)
    part = make_parts(g, partition_nodes(g, 1, "random", 0), 1)[0]
    assert type(make_exchange("counting", part.book, modes=modes)) is CountingExchange
    m, tr = run_training(cfg, part)
    ref, _ = run_training(dataclasses.replace(cfg, mode="vanilla", exchange=None), part)
    assert type(tr.halo) is CountingExchange and tr.halo.calls > 0
    assert m["loss"] == ref["loss"] and m["counting"]["every"] == 2


def test_mode_configs_hold_their_options_and_refuse_others():
    assert MODES.names[:3] == ("vanilla", "adaqp", "adaqp-q")
    assert mode_config("uniform", bits=2).bits == 2
    assert mode_config("vanilla", period=3) == MODES["vanilla"]()  # AdaQP's tuning flags: ignored
    with pytest.raises(ValueError, match="--boundary-rate is an option of --mode bns"):
        mode_config("pipegcn", rate=0.5)
    with pytest.raises(ValueError, match="needs --pattern direct"):
        TrainConfig(mode="pipegcn", pattern="ring")
    with pytest.raises(ValueError, match="--mode wrong is not known"):
        mode_config("wrong")


# --------------------------------------------------------------------------- the layer registry
def test_layer_registry_holds_own_and_pyg_layers():
    from commsched.gnn.nn.layers import GCNConv, SAGEConv
    from commsched.gnn.train.cli import build_parser

    assert LAYERS.names == ("gcn", "sage", "gin", "gat")
    assert LAYERS["gcn"] == FastLayer(conv=GCNConv) and LAYERS["sage"] == FastLayer(conv=SAGEConv)
    assert isinstance(LAYERS["gin"], PyGLayer) and isinstance(LAYERS["gat"], PyGLayer)
    model = next(a for a in build_parser()._actions if a.dest == "model")
    assert tuple(model.choices) == LAYERS.names
    with pytest.raises(ValueError, match="--model must be one of gcn, sage, gin, gat, got 'mlp'"):
        TrainConfig(model="mlp")
    with pytest.raises(ValueError, match="attention"):
        g = synthetic_graph(SYN)
        part = make_parts(g, partition_nodes(g, 1, "random", 0), 1)[0]
        run_training(TrainConfig(model="gat", mode="bns", layers=2, hidden=8, epochs=1), part)


def _cli(out, model, mode="vanilla", extra=()):
    return ["--model", model, "--mode", mode, "--layers", "2", "--hidden", "8", "--epochs", "2",
            "--device", "cpu", "--partition-method", "random", "--out", str(out), *SYN_ARGS, *extra]


@pytest.mark.parametrize("model", ["gin", "gat"])
def test_pyg_models_train_from_the_cli_on_one_rank(tmp_path, model, monkeypatch):
    from commsched.gnn.train.cli import main

    monkeypatch.setenv("COMMSCHED_PROGRESS", "0")
    assert main(_cli(tmp_path / model, model)) == 0
    m = json.loads((tmp_path / model / "metrics.json").read_text())
    assert set(KEYS) <= set(m) and m["model"] == model and m["world_size"] == 1 and m["epochs"] == 2
    assert m["config"]["model"] == model and len(m["loss"]) == 2


def _two_rank_cli(rank, world, out, model, mode):
    from commsched.gnn.train.cli import main

    # main ends the process group: one run per spawn
    return main(_cli(f"{out}/{model}", model, mode, ("--period", "1", "--no-compile")))


@pytest.mark.slow
@pytest.mark.parametrize("model,mode", [("gin", "vanilla"), ("gat", "adaqp")])
def test_pyg_models_train_from_the_cli_on_two_ranks(tmp_path, monkeypatch, model, mode):
    monkeypatch.setenv("COMMSCHED_PROGRESS", "0")
    assert run_ranks(2, _two_rank_cli, str(tmp_path), model, mode, timeout_s=240) == [0, 0]
    m = json.loads((tmp_path / model / "metrics.json").read_text())
    assert set(KEYS) <= set(m) and (m["model"], m["mode"], m["world_size"]) == (model, mode, 2)
    assert m["bytes_sent_per_epoch"] > 0 and len(m["loss"]) == 2
