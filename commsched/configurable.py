"""Configurable components: a config that builds its component, a registry of them by name,
and command-line flags generated from the configs.

In the spirit of torchtitan's configurable components. A component (an exchange mode, a
schedule policy, a placement strategy, a planner) is a class with a nested ``Config``: a
frozen, keyword-only dataclass deriving from :class:`Config` that checks its own fields
once, in ``__post_init__``, and makes the component with ``build(...)``. A
:class:`Registry` maps the names users type (``--mode adaqp``) to configs (presets) or
config classes, and its unknown-name error lists the known ones. :func:`add_arguments`
turns a config class's fields into argparse flags (type, default, help and choices come
from the dataclass, so no parser re-types a default), :func:`from_arguments` reads them
back and :func:`to_arguments` writes a config as those flags again (a benchmark's variant is
a config, run as a command line). The base checks each field's declared ``choices`` before
a subclass's own ``__post_init__`` runs, so a config checks only what its choices cannot say.

Adding a component is then one class, one registry entry and one test::

    @dataclass(frozen=True, kw_only=True)
    class HalfConfig(Config):
        rate: float = option(0.5, "share of the boundary rows sent", flag="--half-rate")

        def __post_init__(self):
            check(0 < self.rate <= 1, f"--half-rate must be in (0, 1], got {self.rate}")

        def build(self, book, **context):
            return HalfExchange(book, rate=self.rate, **context)

    MODES.register("half", HalfConfig())

Pure: no torch, no torch.distributed (the planners' rule).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Generic, Iterator, Mapping, TypeVar

T = TypeVar("T")


def option(default: Any = MISSING, help: str = "", *, choices: tuple | None = None,
           flag: str | None = None, cli: bool = True, default_factory: Any = MISSING,
           foreign: str | None = None) -> Any:
    """A config field with what its command-line flag needs: ``help``, ``choices``, the
    ``flag`` name (default ``--field-name``); ``cli=False`` keeps it off the command line.
    ``foreign``: the error (a ``str.format`` template) when the option is given to a
    component whose config lacks it (a registry's front-end decides the placeholders)."""
    meta = {"help": help, "choices": choices, "flag": flag, "cli": cli, "foreign": foreign}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check(ok: bool, message: str) -> None:
    """``ValueError(message)`` unless ``ok``: a config's checks read as a list of rules."""
    if not ok:
        raise ValueError(message)


def _check_config(config: "Config") -> None:
    """The rules of every config: frozen, keyword-only, each value among its field's choices."""
    fields = dataclasses.fields(config)
    if not type(config).__dataclass_params__.frozen or not all(f.kw_only for f in fields if f.init):
        raise TypeError(f"{type(config).__name__} must be @dataclass(frozen=True, kw_only=True), as every Config")
    for f, value in ((f, getattr(config, f.name)) for f in fields if f.metadata.get("choices") is not None):
        if value not in f.metadata["choices"] and not (value is None and f.default is None):
            raise ValueError(f"{_flag(f, '')} must be one of {', '.join(map(str, f.metadata['choices']))}, "
                             f"got {value!r}")


def _checked(post_init: Any) -> Any:
    """``post_init`` after the base's rules (run once: not again in a ``super().__post_init__()``)."""
    @functools.wraps(post_init)
    def __post_init__(self, *init_vars: Any) -> None:
        if type(self).__post_init__ is __post_init__:
            _check_config(self)
        post_init(self, *init_vars)
    return __post_init__


@dataclass(frozen=True, kw_only=True)
class Config:
    """Base of every component config: frozen, keyword-only (else a TypeError when one is
    made); a value outside its field's ``choices`` is a ValueError naming the flag and the
    allowed values; a subclass's ``__post_init__`` checks the rest; ``build(...)`` makes the
    component (its arguments are the component's context: a partition book, a group)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__post_init__" in cls.__dict__:
            cls.__post_init__ = _checked(cls.__dict__["__post_init__"])

    @_checked
    def __post_init__(self) -> None:
        getattr(super(), "__post_init__", lambda: None)()  # a mixed-in option set's own checks

    def build(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} builds nothing")

    def replace(self, **changes: Any) -> "Config":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


class Registry(Mapping[str, T], Generic[T]):
    """Names to entries (configs, config classes or factories), in registration order.

    ``kind`` names what it holds ("mode", "schedule"), ``flag`` the option users type
    (``--mode``) for the error an unknown name raises."""

    def __init__(self, kind: str, flag: str | None = None):
        self.kind = kind
        self.flag = flag or f"--{kind}"
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T | None = None) -> Any:
        """Add ``entry`` under ``name`` (a ValueError if taken); without ``entry``, a
        decorator that registers the class or function it decorates."""
        if entry is None:
            def deco(obj):
                self.register(name, obj)
                return obj
            return deco
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered already")
        self._entries[name] = entry
        return entry

    @contextlib.contextmanager
    def registered(self, name: str, entry: T) -> Iterator[T]:
        """``entry`` under ``name`` for the ``with`` block only (a test's or an
        experiment's component, in a shared registry); the name is free again after."""
        self.register(name, entry)
        try:
            yield entry
        finally:
            del self._entries[name]

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"{self.flag} {name} is not known (available: "
                             f"{', '.join(self._entries)})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"


# --------------------------------------------------------------------------- command line
def _flag(f: dataclasses.Field, prefix: str) -> str:
    return f.metadata.get("flag") or "--" + prefix + f.name.replace("_", "-")


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of config class ``cls`` that appear on the command line."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True) and f.init]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _scalar(tp: Any) -> Any:
    """int/float/str/bool of an annotation, ``X | None`` unwrapped; None if another type."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]
    if typing.get_origin(tp) is typing.Literal:
        return str
    return tp if tp in (int, float, str, bool) else None


def add_arguments(parser: argparse.ArgumentParser | Any, cls: type, *, prefix: str = "",
                  skip: tuple[str, ...] = (), defaults: Mapping[str, Any] | None = None,
                  only_given: bool = False) -> None:
    """Add a flag per command-line field of config class ``cls`` to ``parser`` (or an
    argument group): ``--name`` (or the field's ``flag``), its type, default (or
    ``defaults[name]``), help and choices (a ``Literal`` annotation gives the choices too);
    booleans get ``--name/--no-name``. Fields of other types must set ``cli=False``.
    ``only_given``: the namespace holds only the flags given (the help still shows the
    default), so a caller can tell a flag given from its default."""
    hints = typing.get_type_hints(cls)
    for f in cli_fields(cls):
        if f.name in skip:
            continue
        tp = _scalar(hints[f.name])
        if tp is None:
            raise TypeError(f"{cls.__name__}.{f.name}: a field of type {hints[f.name]} cannot be a "
                            "flag; give it option(..., cli=False)")
        default = (defaults or {}).get(f.name, _default(f))
        choices = f.metadata.get("choices")
        if choices is None and typing.get_origin(hints[f.name]) is typing.Literal:
            choices = typing.get_args(hints[f.name])
        help_ = f.metadata.get("help", "")
        shown = "" if default is MISSING or default is None else f" (default {default})"
        kw: dict[str, Any] = {"dest": prefix.replace("-", "_") + f.name, "help": help_ + shown}
        if only_given:
            kw["default"] = argparse.SUPPRESS
        elif default is not MISSING:
            kw["default"] = default
        else:
            kw["required"] = True
        if tp is bool:
            parser.add_argument(_flag(f, prefix), action=argparse.BooleanOptionalAction, **kw)
            continue
        parser.add_argument(_flag(f, prefix), type=tp, choices=choices, **kw)


def from_arguments(cls: type, ns: argparse.Namespace, *, prefix: str = "",
                   **overrides: Any) -> Any:
    """An instance of config class ``cls`` from the flags :func:`add_arguments` made (the
    fields ``overrides`` name come from there instead); its checks run as it is made."""
    values = {f.name: getattr(ns, prefix.replace("-", "_") + f.name) for f in cli_fields(cls)
              if hasattr(ns, prefix.replace("-", "_") + f.name)}
    values.update(overrides)
    return cls(**values)


def config_of(registry: Registry, name: str, values: Mapping[str, Any], *, given: bool = False,
              selector: str | None = None, strict: bool = True) -> Any:
    """The config class ``registry[name]`` made from ``values`` (field name -> value), the one
    rule for options of the other entries: a value of a field the class lacks is dropped,
    unless that field (of another entry) declares its refusal (``option(..., foreign=...)``)
    and the value is not its default (``given``: any value, as the command line holds only the
    flags given): then that ValueError, the template filled with ``flag``, ``owners`` (the
    entries whose config has it), ``name`` (also as ``mode``), ``value`` and ``selector`` (the
    flag that names the entry: ``selector``, default the registry's); ``strict=False`` drops
    it too. A field of no entry is a TypeError."""
    cls = registry[name]
    own = {f.name for f in dataclasses.fields(cls) if f.init}
    for key, value in values.items():
        owners = [n for n, c in registry.items() if key in {f.name for f in dataclasses.fields(c)}]
        if key in own:
            continue
        if not owners:
            raise TypeError(f"{registry.flag} {name}: no {registry.kind} has an option {key!r}")
        f = next(f for f in dataclasses.fields(registry[owners[0]]) if f.name == key)
        if strict and f.metadata.get("foreign") and (given or value != _default(f)):
            raise ValueError(f.metadata["foreign"].format(flag=_flag(f, ""), owners=", ".join(owners), name=name,
                                                          mode=name, value=value, selector=selector or registry.flag))
    return cls(**{k: v for k, v in values.items() if k in own})


def flag_values(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> dict[str, Any]:
    """``{flag: value}`` of every option of ``parser`` as parsed into ``ns``, each under its
    long spelling (``--mode``), in the parser's order: what a rank was started with, in the
    user's terms (the cross-rank check names the flags that differ first)."""
    out: dict[str, Any] = {}
    for a in parser._actions:
        if a.option_strings and hasattr(ns, a.dest):
            name = next((o for o in a.option_strings if o.startswith("--")), a.option_strings[0])
            out[name] = getattr(ns, a.dest)
    return out


def speaks_for_the_node(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process prints the command line's usage errors: not under torchrun, or
    the process of LOCAL_RANK 0 (RANK 0 when LOCAL_RANK is unset) under it."""
    from .config import read_env

    try:
        env = read_env(dict(environ) if environ is not None else None)
    except ValueError:  # a malformed variable is reported later, by the run itself
        return True
    rank = env.local_rank if env.local_rank is not None else env.rank
    return rank in (None, 0)


def parse_args(parser: argparse.ArgumentParser, argv: Any = None, *,
               environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` for a front-end that torchrun starts N times: a wrong flag
    (or ``--help``) is printed by one process per node (:func:`speaks_for_the_node`); the
    others exit with the same status (2 for a wrong flag) without a word."""
    if speaks_for_the_node(environ):
        return parser.parse_args(argv)
    import io

    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return parser.parse_args(argv)


def to_arguments(config: Any, *, prefix: str = "", all: bool = False,
                 defaults: Mapping[str, Any] | None = None) -> list[str]:
    """The flags :func:`add_arguments` made that give ``config`` back through
    :func:`from_arguments`: of the fields that differ from their defaults (or the parser's
    ``defaults``; ``all``: every field), then of its nested configs (whose flags the command
    line adds beside its own, as ``-m commsched.moe.train`` does)."""
    out, nested, cli = [], [], cli_fields(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, Config) and not f.metadata.get("cli", True):
            nested.append(value)
        if f not in cli or (not all and value == (defaults or {}).get(f.name, _default(f))):
            continue
        flag = _flag(f, prefix)
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif value is None and not all:
            raise ValueError(f"{flag}: None (not its default) has no command-line form")
        elif value is not None:
            out += [flag, str(value)]
    for c in nested:
        out += to_arguments(c, prefix=prefix, all=all)
    return out


__all__ = ["Config", "Registry", "add_arguments", "check", "cli_fields", "config_of", "from_arguments",
           "option", "to_arguments"]
