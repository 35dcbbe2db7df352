"""The layout's rules, checked on the source: which room may import which, no import
cycles, lazy packages, exports that do not shadow submodules (see docs/design.md)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.import_graph import ROOT, cycles, graph, module_files

GRAPH = graph()
LIBRARY = [m for m in GRAPH if not (m == "commsched.bench" or m.startswith("commsched.bench."))]


def _room(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) >= 2 and parts[1] in ("quant", "priority", "gnn", "moe", "bench", "kernels"):
        return parts[1]
    return "core"


def test_graph_sees_the_package():
    # the walk finds the rooms and real edges (a broken walk would pass every rule below)
    rooms = {_room(m) for m in GRAPH}
    assert rooms == {"core", "quant", "priority", "gnn", "moe", "bench", "kernels"}
    assert "commsched.comm.all2all" in GRAPH["commsched.moe.model.dispatch"]
    assert "commsched.kernels.quant" in GRAPH["commsched.quant.codec"]
    assert "commsched.bench.runner" in GRAPH["commsched.bench.workloads"]


def test_no_library_module_imports_bench():
    # the command line may import the experiments; nothing else in the library does
    bad = sorted((m, b) for m in LIBRARY if m != "commsched.cli" for b in GRAPH[m]
                 if _room(b) == "bench")
    assert bad == []


def test_dependency_direction():
    # the core never imports a front-end or the planners' users; gnn and moe never meet
    allowed = {
        "core": {"core", "bench"},  # bench: only commsched.cli (checked above)
        "kernels": {"kernels"},
        "quant": {"core", "quant", "kernels"},
        "priority": {"core", "priority"},
        "gnn": {"core", "quant", "priority", "gnn", "kernels"},
        "moe": {"core", "quant", "priority", "moe", "kernels"},
        "bench": {"core", "quant", "priority", "gnn", "moe", "bench", "kernels"},
    }
    bad = sorted((m, b) for m in GRAPH for b in GRAPH[m] if _room(b) not in allowed[_room(m)])
    assert bad == []


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_cycle_finder_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("mod", ["commsched", "commsched.moe.placement", "commsched.moe.infer.popularity",
                                 "commsched.priority.policy", "commsched.quant.widths.problem",
                                 "commsched.results", "commsched.config", "commsched.configurable"])
def test_pure_modules_import_without_torch(mod):
    code = f"import sys, {mod}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _lazy_exports(pkg_file) -> dict[str, str]:
    tree = ast.parse(pkg_file.read_text())
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id.endswith("EXPORTS") for t in targets):
                # a merged table ({**A, **B}) has None keys: its parts are read on their own
                out.update({ast.literal_eval(k): ast.literal_eval(v)
                            for k, v in zip(node.value.keys, node.value.values) if k is not None})
    return out


def test_exports_do_not_shadow_submodules():
    # `from commsched.priority import partition` must not give the module once imported
    files = module_files()
    packages = [m for m, f in files.items() if f.name == "__init__.py"]
    checked = 0
    for pkg in packages:
        exports = _lazy_exports(files[pkg])
        subs = {m.rpartition(".")[2] for m in files if m.rpartition(".")[0] == pkg}
        checked += len(exports)
        assert sorted(set(exports) & subs) == [], pkg
        assert all(f"{pkg}.{mod}" in files for mod in exports.values()), pkg
    assert checked > 50


def test_rooms_are_small():
    # a newcomer finds the room by its name: no folder of more than 10 flat modules, no
    # source file of more than 700 lines
    files = module_files()
    per_folder: dict[str, int] = {}
    for f in files.values():
        if f.name not in ("__init__.py", "__main__.py"):
            per_folder[str(f.parent)] = per_folder.get(str(f.parent), 0) + 1
    assert sorted(d for d, n in per_folder.items() if n > 10) == []
    long = sorted(str(f) for f in files.values() if len(f.read_text().splitlines()) > 700)
    assert long == []
