"""commsched.configurable: configs that check themselves once and build their component, a
registry whose unknown-name error lists the known names, flags generated from the fields."""

from __future__ import annotations

import argparse
from dataclasses import FrozenInstanceError, dataclass
from typing import Literal

import pytest

from commsched.configurable import Config, Registry, add_arguments, check, from_arguments, option


@dataclass(frozen=True, kw_only=True)
class HalfConfig(Config):
    rate: float = option(0.5, "share of the boundary rows sent", flag="--half-rate")
    pattern: Literal["direct", "ring"] = option("direct", "all-to-all pattern")
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
