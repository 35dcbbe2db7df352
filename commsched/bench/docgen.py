"""The generated references: ``docs/cli.md`` (every command and its options) and
``docs/api.md`` (the public names of ``commsched`` and of each package).

    python -m commsched.bench.docgen [--out docs] [--check]

Both pages are made from the code itself -- the argparse parsers (whose flags, defaults
and help the configs generate, see :mod:`commsched.configurable`) and the packages'
``__all__`` -- so they cannot drift: ``tests/core/test_docs.py`` regenerates them in memory
and fails when the committed files differ. ``--check`` does the same from the command line.

It lives beside the benches because it imports every room (the benches' parsers
included), which only ``commsched.bench`` may; no library module imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

REGENERATE = "python -m commsched.bench.docgen"

# the packages whose ``__all__`` docs/api.md lists, in this order
API_PACKAGES = ("commsched", "commsched.quant", "commsched.priority", "commsched.gnn",
                "commsched.moe", "commsched.bench")

# ``python -m`` front-ends, each parser taken from its ``main``
_MAIN_MODULES = (
    "commsched.gnn.train", "commsched.moe.train", "commsched.moe.infer.cli",
    "commsched.moe.record", "commsched.bench.demo", "commsched.bench.gnn.demo",
    "commsched.bench.moe.demo", "commsched.bench.gnn.sweep", "commsched.bench.gnn.accuracy",
    "commsched.bench.gnn.tta", "commsched.bench.gnn.kipf", "commsched.bench.moe.placement_report",
    "commsched.bench.moe.a2a_parity", "commsched.bench.moe.hf_parity", "commsched.bench.micro.overlap_profile",
    "commsched.bench.micro.all2all",
    "commsched.bench.micro.hier_check", "commsched.bench.micro.netem_check", "commsched.bench.gpucheck",
    "commsched.bench.docgen", "commsched.cluster.calibrate",
)


@dataclass(frozen=True)
class Command:
    """One command as users type it: its name, and its parser or (for the commands whose
    help is written by hand) the text ``-h`` prints."""
    name: str
    parser: argparse.ArgumentParser | None = None
    text: str | None = None

    def help(self) -> str:
        """What ``NAME -h`` prints."""
        if self.parser is not None:
            return self.parser.format_help()
        return self.text or ""


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


@contextlib.contextmanager
def _capture_parsers() -> Iterator[None]:
    """Inside: the first ``parse_args``/``parse_known_args`` raises :class:`_Captured` with
    its parser, so a ``main`` that builds its parser inside gives it up before it runs."""
    orig = argparse.ArgumentParser.parse_known_args

    def grab(self, *a, **k):
        raise _Captured(self)

    argparse.ArgumentParser.parse_known_args = grab  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = orig  # type: ignore[method-assign]


def parser_of(main: Callable[[Sequence[str]], object]) -> argparse.ArgumentParser:
    """The parser ``main`` builds (``main`` is stopped at its parse; nothing else runs)."""
    with _capture_parsers():
        try:
            main([])
        except _Captured as c:
            return c.parser
    raise RuntimeError(f"{main.__module__}.main parsed no arguments")


def _printed(main: Callable[[Sequence[str]], object], argv: Sequence[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            main(list(argv))
        except SystemExit:
            pass
    return buf.getvalue()


def commands() -> list[Command]:
    """Every command and ``python -m`` front-end, in the order docs/cli.md lists them."""
    from .. import cli
    from ..cluster.netem import build_parser as netem_parser
    from ..gnn.graph.cli import partition_parser
    from .runner import build_parser as bench_parser
    from .workloads import WORKLOADS

    out = [Command("commsched", text=_printed(cli.main, ["-h"])),
           Command("commsched bench", text=_printed(cli.main, ["bench", "-h"]))]
    out += [Command(f"commsched bench {n}", bench_parser(WORKLOADS[n])) for n in sorted(WORKLOADS)]
    out += [Command("commsched netem", netem_parser()),
            Command("commsched partition", partition_parser()),
            Command("commsched datasets", parser_of(importlib.import_module("commsched.gnn.graph.cli").datasets_main)),
            Command("commsched topology", text=cli.TOPOLOGY_HELP),
            Command("commsched scaling", parser_of(importlib.import_module("commsched.bench.plots").scaling_main)),
            Command("commsched results", parser_of(importlib.import_module("commsched.bench.results_page").main))]
    for mod in _MAIN_MODULES:
        p = parser_of(importlib.import_module(mod).main)
        name = p.prog if p.prog.startswith(("commsched ", "python -m ")) else f"python -m {mod}"
        if mod == "commsched.moe.infer.cli":
            name = "python -m commsched.moe.infer"
        p.prog = name
        out.append(Command(name, p))
    for c in out:
        if c.parser is not None:
            _fixed_width(c.parser)
    return out


# --------------------------------------------------------------------------- docs/cli.md
def _cell(s: object) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _anchor(name: str) -> str:
    return "".join(c for c in name.lower().replace(" ", "-") if c.isalnum() or c in "-_")


WIDTH = 100  # of usage lines: fixed, not the terminal's


def _fixed_width(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH)
    return p


def _option_rows(p: argparse.ArgumentParser) -> list[str]:
    rows = []
    for act in p._actions:
        if isinstance(act, argparse._HelpAction):
            continue
        flags = ", ".join(f"`{s}`" for s in act.option_strings) or f"`{act.metavar or act.dest}`"
        if act.choices is not None:
            flags += " {" + ", ".join(str(c) for c in act.choices) + "}"
        elif act.nargs != 0 and act.option_strings:
            flags += " " + (act.metavar if isinstance(act.metavar, str) else act.dest.upper())
        if act.required:
            default = "required"
        elif act.default in (None, argparse.SUPPRESS) or act.nargs == 0:
            default = ""
        else:
            default = f"`{act.default}`"
        help_ = (act.help or "") if act.help != argparse.SUPPRESS else ""
        rows.append(f"| {_cell(flags)} | {_cell(default)} | {_cell(help_)} |")
    return rows


def cli_reference() -> str:
    """docs/cli.md's text."""
    cmds = commands()
    lines = ["# Command-line reference", "",
             f"Generated from the parsers by `{REGENERATE}`; do not edit (a test fails when it",
             "differs from the code). How the options fit together: [usage.md](usage.md).", ""]
    lines += [f"- [`{c.name}`](#{_anchor(c.name)})" for c in cmds] + [""]
    for c in cmds:
        lines += [f"## {c.name}", ""]
        if c.parser is None:
            lines += ["```", c.help().rstrip(), "```", ""]
            continue
        if c.parser.description:
            lines += [c.parser.description.strip(), ""]
        lines += ["```", c.parser.format_usage().strip(), "```", ""]
        rows = _option_rows(c.parser)
        if rows:
            lines += ["| option | default | help |", "|---|---|---|", *rows, ""]
        if c.parser.epilog:
            lines += [c.parser.epilog.strip(), ""]
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------- docs/api.md
def _kind(obj: object) -> str:
    if inspect.isclass(obj):
        return "class"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return "function"
    if inspect.ismodule(obj):
        return "module"
    return type(obj).__name__


def _signature(obj: object) -> str:
    if not (inspect.isclass(obj) or callable(obj)) or inspect.ismodule(obj):
        return ""
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    # nothing of this machine or this process: the interpreter's path, object addresses
    sig = sig.replace(repr(sys.executable), "sys.executable")
    return re.sub(r" at 0x[0-9a-f]+>", ">", sig)


def _first_line(obj: object) -> str:
    if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj)):
        return ""
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and doc.startswith(obj.__name__ + "("):
        return ""  # a dataclass's generated docstring: its signature, shown already
    first = doc.strip().split("\n\n")[0]
    return " ".join(first.split())


def api_reference() -> str:
    """docs/api.md's text."""
    lines = ["# Public names", "",
             f"Generated from each package's `__all__` by `{REGENERATE}`; do not edit (a test",
             "fails when it differs from the code). Each name: its kind, its signature and the",
             "first paragraph of its docstring. The contracts behind them: [design.md](design.md).", ""]
    lines += [f"- [`{pkg}`](#{_anchor(pkg)})" for pkg in API_PACKAGES] + [""]
    for pkg in API_PACKAGES:
        mod = importlib.import_module(pkg)
        lines += [f"## {pkg}", "", " ".join((inspect.getdoc(mod) or "").split("\n\n")[0].split()), "",
                  "| name | kind | signature | description |", "|---|---|---|---|"]
        for name in mod.__all__:
            obj = getattr(mod, name)
            sig = _signature(obj)
            lines.append(f"| `{name}` | {_kind(obj)} | {f'`{_cell(sig)}`' if sig else ''} | "
                         f"{_cell(_first_line(obj))} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


PAGES: dict[str, Callable[[], str]] = {"cli.md": cli_reference, "api.md": api_reference}


def stale(folder: Path) -> list[str]:
    """The pages under ``folder`` that differ from what the code generates now."""
    return [name for name, make in PAGES.items()
            if not (folder / name).exists() or (folder / name).read_text() != make()]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m commsched.bench.docgen", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("docs"), help="folder of the pages (default docs)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 naming the pages that differ from the code")
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.check:
        bad = stale(a.out)
        for name in bad:
            print(f"{a.out / name} differs from the code; run `{REGENERATE}`", file=sys.stderr)
        return 1 if bad else 0
    a.out.mkdir(parents=True, exist_ok=True)
    for name, make in PAGES.items():
        (a.out / name).write_text(make())
        print(f"wrote {a.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
