"""The package as a user installs it: a wheel built from the sources, installed (not
editable) into a fresh virtual environment, imported and run from outside the checkout;
and its optional extras: the core imports none of their packages, each package is in the
extra ``commsched._lazy.OPTIONAL`` names, and a feature whose extra is missing says which
one to install.

The fresh environment reuses the dependencies already installed here (a ``.pth`` line per
site-packages folder of this interpreter), so nothing is downloaded; those folders may
hold an editable install of commsched, which the test proves is not the copy it runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what a source distribution holds (the tests and docs are not part of the package)
SOURCES = ("commsched", "kernels", "pyproject.toml", "setup.py", "README.md", "LICENSE")
TIMEOUT_S = 180

_IMPORT_ALL = r"""
import importlib, json, pkgutil, sys
import commsched
mods = ["commsched"]
for m in pkgutil.walk_packages(commsched.__path__, "commsched.",
                               onerror=lambda name: sys.exit(f"cannot walk {name}")):
    importlib.import_module(m.name)
    mods.append(m.name)
import commsched.kernels.cpu as kcpu
print(json.dumps({"file": commsched.__file__, "version": commsched.__version__,
                  "kernel_source": str(kcpu.SOURCE), "kernel_source_exists": kcpu.SOURCE.is_file(),
                  "modules": mods}))
"""


def _run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p


def _setuptools_builds_wheels() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    return (major, minor) >= (77, 0)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of the fresh venv, its site-packages, an environment for its runs)."""
    if not _setuptools_builds_wheels():
        pytest.skip("building the wheel offline needs setuptools>=77 in this environment "
                    "(pip install -e '.[test]' installs it)")
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"  # a clean copy: stale files in a build/ folder never reach the wheel
    for name in SOURCES:
        s = ROOT / name
        if s.is_dir():
            shutil.copytree(s, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(s, src / name)
    wheels = tmp / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", str(wheels), str(src)])
    (wheel,) = wheels.glob("commsched-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                .stdout.strip())
    # this interpreter's site-packages folders (dependencies, pip); lines of a .pth file come
    # after the venv's own folder on sys.path and their own .pth files (an editable
    # commsched's finder) are not run
    here = [p for p in sys.path if p and Path(p).name in ("site-packages", "dist-packages")
            and Path(p).is_dir()]
    here.append(sysconfig.get_paths()["purelib"])
    (site / "_reuse_deps.pth").write_text("\n".join(dict.fromkeys(here)) + "\n")
    _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q",
          str(wheel)], cwd=tmp)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(COMMSCHED_PROGRESS="0", OMP_NUM_THREADS="1", COMMSCHED_TIMEOUT_S="60",
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    outside = tmp / "work"
    outside.mkdir()
    return py, site, env, outside


@pytest.mark.slow
def test_wheel_holds_the_package_and_nothing_else(installed):
    py, site, env, cwd = installed
    assert (site / "commsched" / "kernels" / "quant_cpu.c").is_file()
    assert (site / "commsched" / "moe" / "placement" / "__init__.py").is_file()
    for name in ("a100", "h100", "h200"):  # the built-in device models (package data)
        assert (site / "commsched" / "cluster" / "devices" / f"{name}.json").is_file()
    assert not (site / "kernels").exists(), "kernels/ must install as commsched.kernels only"
    (dist,) = site.glob("commsched-*.dist-info")
    assert "Apache License" in next(dist.rglob("LICENSE*")).read_text()
    # the optional packages are requirements of their extras only
    from commsched._lazy import OPTIONAL

    meta = (dist / "METADATA").read_text().splitlines()
    assert {f"Provides-Extra: {e}" for _, e in OPTIONAL.values()} <= set(meta)
    plain = {_req_name(line.partition(":")[2].strip()) for line in meta
             if line.startswith("Requires-Dist:") and "extra ==" not in line}
    assert {"torch", "numpy"} <= plain
    assert plain.isdisjoint(_req_name(d) for d, _ in OPTIONAL.values()), plain


@pytest.mark.slow
def test_every_module_imports_from_the_wheel(installed):
    py, site, env, cwd = installed
    info = json.loads(_run([str(py), "-c", _IMPORT_ALL], cwd=cwd, env=env).stdout.splitlines()[-1])
    assert Path(info["file"]).resolve().is_relative_to(site.resolve()), info["file"]
    assert Path(info["kernel_source"]).resolve().is_relative_to(site.resolve())
    assert info["kernel_source_exists"]
    import commsched

    assert info["version"] == commsched.__version__
    mods = set(info["modules"])
    assert {"commsched.moe.placement", "commsched.moe.placement.eplb", "commsched.kernels.cpu",
            "commsched.gnn.train", "commsched.bench.demo"} <= mods
    # every module of the sources is in the wheel
    for f in (ROOT / "commsched").rglob("*.py"):
        rel = f.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        assert name in mods, f"{name} is not in the wheel"
    # the console script runs the wheel's copy
    p = _run([str(site.parent.parent.parent / "bin" / "commsched"), "--help"], cwd=cwd, env=env)
    assert "bench" in p.stdout


@pytest.mark.slow
def test_gnn_and_moe_jobs_run_from_the_wheel(installed):
    py, site, env, cwd = installed
    torchrun = [str(py), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    gnn = cwd / "gnn"
    _run([*torchrun, "-m", "commsched.gnn.train", "--syn-nodes", "400", "--syn-edges", "2000",
          "--syn-features", "8", "--syn-classes", "3", "--layers", "2", "--hidden", "8",
          "--mode", "adaqp", "--epochs", "2", "--device", "cpu", "--out", str(gnn)], cwd=cwd, env=env)
    m = json.loads((gnn / "metrics.json").read_text())
    assert m["mode"] == "adaqp" and m["world_size"] == 2 and m["epochs"] == 2
    assert len(m["loss"]) == 2 and m["bytes_sent_per_epoch"] > 0
    moe = cwd / "moe"
    _run([*torchrun, "-m", "commsched.moe.train", "--d-model", "32", "--heads", "2", "--layers", "2",
          "--seq-len", "16", "--d-ff", "48", "--expert-hidden", "40", "--experts", "2",
          "--batch-size", "2", "--probe-steps", "1", "--eval-batches", "1",
          "--max-corpus-bytes", str(1 << 18), "--warmup", "0", "--steps", "2", "--device", "cpu",
          "--schedule", "lina", "--out", str(moe)], cwd=cwd, env=env)
    m = json.loads((moe / "metrics.json").read_text())
    assert m["world_size"] == 2 and m["schedule"] == "lina" and len(m["loss"]) == 2
    assert m["step_time_s"] > 0


# --------------------------------------------------------------------------- optional extras
def _block(monkeypatch, top: str) -> None:
    """Make ``top`` (and any of its submodules imported already) look not installed."""
    for name in [m for m in sys.modules if m == top or m.startswith(top + ".")] + [top]:
        monkeypatch.setitem(sys.modules, name, None)


def _extras() -> tuple[list[str], dict[str, list[str]]]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"], project["optional-dependencies"]


def _req_name(req: str) -> str:
    """The normalised distribution name of a requirement string (``torch_geometric>=2.4``)."""
    import re

    return re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")


def _self_extras(reqs: list[str]) -> set[str]:
    """The extras of commsched that a list of requirements pulls in (``commsched[a,b]``)."""
    out: set[str] = set()
    for r in reqs:
        if _req_name(r) == "commsched":
            out |= {e.strip() for e in r.partition("[")[2].partition("]")[0].split(",")}
    return out


def test_each_optional_package_is_in_the_extra_the_table_names():
    from commsched._lazy import OPTIONAL

    core, extras = _extras()
    core_names = {_req_name(r) for r in core}
    for dist, extra in OPTIONAL.values():
        name = _req_name(dist)
        assert name not in core_names, f"{dist} is optional ({extra}) but a core dependency"
        assert extra in extras, f"pyproject.toml has no extra {extra!r} (for {dist})"
        assert name in {_req_name(r) for r in extras[extra]}, f"{dist} is not in extra {extra!r}"
    # `all` pulls in every extra of the table; the tests (and `make`) install `all`
    needed = {extra for _, extra in OPTIONAL.values()}
    assert needed <= _self_extras(extras["all"]), extras["all"]
    assert "all" in _self_extras(extras["test"]), extras["test"]
    assert {"torch", "numpy"} <= core_names


@pytest.mark.parametrize("top", ["deepspeed", "torch_geometric", "pymetis", "ortools", "triton",
                                 "matplotlib", "scipy"])
def test_require_names_the_extra_of_a_missing_package(monkeypatch, top):
    from commsched._lazy import OPTIONAL, MissingExtra, require

    dist, extra = OPTIONAL[top]
    _block(monkeypatch, top)
    with pytest.raises(ImportError) as e:
        require(f"{top}.sub" if top == "ortools" else top, "the feature X")
    assert isinstance(e.value, MissingExtra) and e.value.extra == extra and e.value.name == top
    msg = str(e.value)
    assert "the feature X needs" in msg and dist in msg, msg
    assert f"pip install 'commsched[{extra}]'" in msg, msg


def test_require_keeps_a_broken_package_s_own_error(monkeypatch):
    import builtins
    import importlib

    from commsched._lazy import MissingExtra, require

    def broken(name, *a, **k):  # the package is there, a dependency of it is not
        raise ModuleNotFoundError("No module named 'aiohttp'", name="aiohttp")

    monkeypatch.setattr(importlib, "import_module", broken)
    monkeypatch.setattr(builtins, "__import__", broken)
    with pytest.raises(ModuleNotFoundError) as e:
        require("torch_geometric.nn", "--model gin")
    assert not isinstance(e.value, MissingExtra) and e.value.name == "aiohttp"
    monkeypatch.undo()
    with pytest.raises(ValueError, match="not an optional dependency"):
        require("numpy", "anything")


def test_features_name_their_extra(monkeypatch, tmp_path):
    """Each feature with an optional dependency, its package missing: one MissingExtra."""
    import torch

    from commsched._lazy import MissingExtra
    from commsched.gnn.graph.data import SyntheticSpec, download_dataset, synthetic_graph
    from commsched.gnn.graph.partition import partition_nodes
    from commsched.quant import Channel, MessageGroup, assign_bitwidths, quantize

    g = synthetic_graph(SyntheticSpec(num_nodes=40, num_edges=120, num_features=4))
    for top in ("pymetis", "ortools", "triton", "torch_geometric", "scipy"):
        _block(monkeypatch, top)
    with pytest.raises(MissingExtra, match=r"METIS.*commsched\[gnn\]"):
        partition_nodes(g, 2, "metis")
    assert len(partition_nodes(g, 2, "random")) == 40  # what needs no extra still works
    rounds = [[Channel(1e-8, 1e-5, [MessageGroup(100, 16, 1.0), MessageGroup(50, 16, 3.0)])]]
    with pytest.raises(MissingExtra, match=r"CP-SAT.*commsched\[gnn\]"):
        assign_bitwidths(rounds, lam=0.5, time_limit_s=5)
    assert assign_bitwidths(rounds, lam=0.5, solver="greedy").bits
    with pytest.raises(MissingExtra, match=r"Triton.*commsched\[gpu\]"):
        quantize(torch.ones(3, 5), 4, impl="triton")
    # not taken for a failed download
    with pytest.raises(MissingExtra, match=r"'cora'.*commsched\[gnn\]"):
        download_dataset("cora", tmp_path / "data")
    assert not (tmp_path / "data").exists()


def test_front_ends_report_a_missing_extra_in_one_line(monkeypatch, tmp_path, capsys):
    from commsched import cli
    from commsched._lazy import require
    from commsched.dist import cli_main

    _block(monkeypatch, "matplotlib")
    rc = cli.main(["topology", "--hosts", "1", "--nproc", "2", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert err.startswith("commsched topology: ") and "commsched[plots]" in err, err
    _block(monkeypatch, "deepspeed")
    rc = cli_main("commsched.moe.train", lambda: require("deepspeed", "--impl deepspeed"))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "commsched[moe]" in err, err


_IMPORT_CORE = r"""
import importlib, json, pkgutil, sys
from commsched._lazy import OPTIONAL
import commsched
for m in pkgutil.walk_packages(commsched.__path__, "commsched."):
    # the modules that are an extra's feature themselves: the Triton kernels (gpu) and the
    # transformers models (hf; without it its import names the extra)
    if m.name not in ("commsched.kernels.quant", "commsched.moe.hf"):
        importlib.import_module(m.name)
import commsched.cli, commsched.kernels.cpu
print(json.dumps(sorted(top for top in OPTIONAL if top in sys.modules)))
"""


@pytest.mark.slow
def test_no_module_imports_an_optional_package_at_import():
    # every module of the package (the front-ends' entry points included) imports, and
    # none of them pulls in an optional package until a feature asks for it
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = _run([sys.executable, "-c", _IMPORT_CORE], cwd=ROOT, env=env)
    assert json.loads(p.stdout.splitlines()[-1]) == []
