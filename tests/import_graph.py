"""The import graph of the package, from the source (no module is imported).

    python tests/import_graph.py            # cycles and the edges that leave each room
    python tests/import_graph.py --edges    # every edge, one "a -> b" a line

Every ``import`` / ``from ... import`` statement counts, also those inside functions (a
lazy import is still a dependency). ``kernels/`` is the package ``commsched.kernels``.
An edge goes to the deepest module of the package named by the statement: ``from .x
import y`` is an edge to ``x.y`` when ``y`` is a submodule, else to ``x``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = "commsched"


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under ``commsched/`` and ``kernels/``."""
    out: dict[str, Path] = {}
    for base, prefix in ((root / "commsched", TOP), (root / "kernels", f"{TOP}.kernels")):
        for f in sorted(base.rglob("*.py")):
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = f
    return out


def _is_package(files: dict[str, Path], mod: str) -> bool:
    return mod in files and files[mod].name == "__init__.py"


def imports_of(mod: str, files: dict[str, Path]) -> set[str]:
    """The package modules that ``mod`` imports (anywhere in its body)."""
    tree = ast.parse(files[mod].read_text(), str(files[mod]))
    pkg = mod if _is_package(files, mod) else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == TOP or a.name.startswith(TOP + "."):
                    out.add(_deepest(a.name, files))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == TOP or target.startswith(TOP + ".")):
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in files else _deepest(target, files))
    out.discard(mod)
    return out


def _deepest(name: str, files: dict[str, Path]) -> str:
    while name not in files and "." in name:
        name = name.rpartition(".")[0]
    return name


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = module_files(root)
    return {m: imports_of(m, files) for m in files}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def room(mod: str) -> str:
    """The folder a module lives in: ``commsched`` (core), ``commsched.gnn``, ..."""
    parts = mod.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (len(parts) == 2 and parts[1] in ROOMS) else TOP


ROOMS = ("quant", "priority", "gnn", "moe", "bench", "kernels")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    g = graph()
    if "--edges" in argv:
        for a in sorted(g):
            for b in sorted(g[a]):
                print(f"{a} -> {b}")
        return 0
    cyc = cycles(g)
    print(f"{len(g)} modules, {sum(len(v) for v in g.values())} edges, {len(cyc)} cycles")
    for c in cyc:
        print("cycle: " + " <-> ".join(c))
    between: dict[tuple[str, str], int] = {}
    for a, bs in g.items():
        for b in bs:
            ra, rb = room(a), room(b)
            if ra != rb:
                between[(ra, rb)] = between.get((ra, rb), 0) + 1
    for (ra, rb), n in sorted(between.items()):
        print(f"{ra} -> {rb}: {n}")
    return 1 if cyc else 0


if __name__ == "__main__":
    sys.exit(main())
