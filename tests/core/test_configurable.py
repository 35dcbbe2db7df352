"""commsched.configurable: configs that check themselves once and build their component, a
registry whose unknown-name error lists the known names, flags generated from the fields and
written back from a config."""

from __future__ import annotations

import argparse
from dataclasses import FrozenInstanceError, dataclass
from typing import Literal

import pytest

from commsched.configurable import (
    Config,
    Registry,
    add_arguments,
    check,
    from_arguments,
    option,
    to_arguments,
)


@dataclass(frozen=True, kw_only=True)
class HalfConfig(Config):
    rate: float = option(0.5, "share of the boundary rows sent", flag="--half-rate")
    pattern: Literal["direct", "ring"] = option("direct", "all-to-all pattern")
    norm: str = option("gcn", "edge normalisation", choices=("gcn", "mean"))
    overlap: bool = option(True, "overlap with the central aggregation")
    period: int | None = option(None, "epochs between draws")
    note: tuple = option((), cli=False)

    def __post_init__(self):
        check(0 < self.rate <= 1, f"--half-rate must be in (0, 1], got {self.rate}")

    def build(self, book, **context):
        return ("half", book, self.rate, context)


def test_config_checks_once_is_frozen_and_builds():
    c = HalfConfig(rate=0.25)
    assert c.build("book", group=None) == ("half", "book", 0.25, {"group": None})
    with pytest.raises(ValueError, match=r"--half-rate must be in \(0, 1\], got 2"):
        HalfConfig(rate=2)
    with pytest.raises(ValueError, match="got 0"):
        c.replace(rate=0)
    with pytest.raises(FrozenInstanceError):
        c.rate = 1.0
    with pytest.raises(TypeError):
        HalfConfig(0.3)  # keyword-only
    with pytest.raises(NotImplementedError, match="builds nothing"):
        Config().build()


def test_registry_names_and_errors():
    reg: Registry = Registry("mode")
    reg.register("half", HalfConfig())

    @reg.register("quarter")
    def quarter():
        return HalfConfig(rate=0.25)

    assert reg.names == ("half", "quarter") and "half" in reg and len(reg) == 2
    assert reg["quarter"]().rate == 0.25
    with pytest.raises(ValueError, match=r"--mode fast is not known \(available: half, quarter\)"):
        reg["fast"]
    with pytest.raises(ValueError, match="registered already"):
        reg.register("half", HalfConfig())
    with reg.registered("eighth", HalfConfig(rate=0.125)) as entry:
        assert reg["eighth"] is entry and reg.names[-1] == "eighth"
    assert "eighth" not in reg
    with pytest.raises(RuntimeError), reg.registered("eighth", HalfConfig()):
        raise RuntimeError("the block failed")
    assert reg.names == ("half", "quarter")  # freed on the way out as well


def test_flags_come_from_the_fields():
    p = argparse.ArgumentParser()
    add_arguments(p, HalfConfig)
    a = p.parse_args([])
    assert from_arguments(HalfConfig, a) == HalfConfig()
    a = p.parse_args(["--half-rate", "0.125", "--pattern", "ring", "--no-overlap", "--period", "3"])
    assert from_arguments(HalfConfig, a) == HalfConfig(rate=0.125, pattern="ring", overlap=False, period=3)
    with pytest.raises(SystemExit):
        p.parse_args(["--pattern", "star"])  # choices from the Literal
    helps = {x.dest: x.help for x in p._actions}
    assert helps["rate"] == "share of the boundary rows sent (default 0.5)"
    assert "note" not in helps
    with pytest.raises(ValueError, match="got 7"):
        from_arguments(HalfConfig, p.parse_args(["--half-rate", "7"]))
    q = argparse.ArgumentParser()
    add_arguments(q, HalfConfig, prefix="half-", skip=("pattern",), defaults={"rate": 0.75})
    b = q.parse_args(["--half-overlap"])  # the field's own flag wins over the prefix
    assert b.half_rate == 0.75 and not hasattr(b, "half_pattern")

    @dataclass(frozen=True, kw_only=True)
    class Bad(Config):
        table: dict = option(default_factory=dict)

    with pytest.raises(TypeError, match="cannot be a flag"):
        add_arguments(argparse.ArgumentParser(), Bad)


def test_the_base_enforces_frozen_keyword_only_and_choices():
    with pytest.raises(ValueError, match="--norm must be one of gcn, mean, got 'max'"):
        HalfConfig(norm="max")  # the base's check: HalfConfig's own does not name it
    with pytest.raises(TypeError, match="frozen"):
        @dataclass(kw_only=True)
        class Mutable(Config):
            x: int = 1

    @dataclass(frozen=True)
    class Positional(Config):
        x: int = option(1, "x")

    with pytest.raises(TypeError, match=r"Positional must be @dataclass\(frozen=True, kw_only=True\)"):
        Positional()
    seen = []

    @dataclass(frozen=True, kw_only=True)
    class Option:  # an option set a config mixes in: its own checks run too
        level: int = option(0, "level", choices=(0, 1))

        def __post_init__(self):
            seen.append("option")

    @dataclass(frozen=True, kw_only=True)
    class Mixed(Config, Option):
        pass

    @dataclass(frozen=True, kw_only=True)
    class Child(HalfConfig, Option):
        def __post_init__(self):
            super().__post_init__()
            seen.append("child")

    assert Child(level=1) and seen == ["child"] and Mixed(level=1) and seen[-1] == "option"
    for bad, message in (({"level": 2}, "--level must be one of 0, 1, got 2"), ({"norm": "max"}, "--norm"),
                         ({"rate": 0}, "got 0")):  # the base's checks, then the subclass's own
        with pytest.raises(ValueError, match=message):
            Child(**bad)


def test_to_arguments_is_the_inverse_of_from_arguments():
    from commsched.moe.model.layer import DispatchConfig
    from commsched.moe.train import cli as moe_train
    from commsched.moe.train.training import TrainConfig
    from commsched.priority.policy import FifoConfig

    p = argparse.ArgumentParser()
    add_arguments(p, HalfConfig)
    c = HalfConfig(rate=0.125, pattern="ring", overlap=False, norm="mean")
    assert to_arguments(HalfConfig()) == [] and to_arguments(HalfConfig(period=3), all=True) == [
        "--half-rate", "0.5", "--pattern", "direct", "--norm", "gcn", "--overlap", "--period", "3"]
    assert to_arguments(c) == ["--half-rate", "0.125", "--pattern", "ring", "--norm", "mean", "--no-overlap"]
    # a front-end's config and its nested ones through its command line (the benches' variants: tests/bench)
    moe = TrainConfig(schedule=FifoConfig(launch="program", bucket_bytes=1 << 19),
                      dispatch=DispatchConfig(chunks=4, pipeline=True, a2a_bits=8), grad_bits=16, corpus="x")
    for full in (False, True):
        for x in (c, HalfConfig(), HalfConfig(rate=0.1, period=7)):
            assert from_arguments(HalfConfig, p.parse_args(to_arguments(x, all=full))) == x
    # the changed fields (what a bench variant renders); the schedule's name is its selector flag
    argv = to_arguments(moe) + ["--schedule", "fifo", "--out", "o"]
    assert moe_train.config_from_args(moe_train.build_parser().parse_args(argv)) == moe
    with pytest.raises(ValueError, match="--allreduce-threads: None .* has no command-line form"):
        to_arguments(moe.replace(allreduce_threads=None))


@pytest.mark.parametrize("front_end", ["commsched.gnn.train.cli", "commsched.moe.train.cli",
                                       "commsched.moe.infer.cli"])
def test_a_wrong_flag_under_torchrun_is_printed_once_per_node(front_end, monkeypatch, capsys):
    import importlib

    main = importlib.import_module(front_end).main
    for var in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    for env, speaks in (({}, True), ({"RANK": "0", "LOCAL_RANK": "0"}, True),
                        ({"RANK": "1", "LOCAL_RANK": "1"}, False), ({"RANK": "5", "LOCAL_RANK": "0"}, True),
                        ({"RANK": "3"}, False)):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with pytest.raises(SystemExit) as e:
            main(["--no-such-flag", "--out", "o"])
        assert e.value.code == 2
        out, err = capsys.readouterr()
        assert out == "" and (("unrecognized arguments: --no-such-flag" in err) if speaks else err == ""), env
        for k in env:
            monkeypatch.delenv(k)
