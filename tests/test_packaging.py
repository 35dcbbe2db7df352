"""The package as a user installs it: a wheel built from the sources, installed (not
editable) into a fresh virtual environment, imported and run from outside the checkout.

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

pytestmark = pytest.mark.slow

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


def test_wheel_holds_the_package_and_nothing_else(installed):
    py, site, env, cwd = installed
    assert (site / "commsched" / "kernels" / "quant_cpu.c").is_file()
    assert (site / "commsched" / "moe" / "placement" / "__init__.py").is_file()
    for name in ("a100", "h100", "h200"):  # the built-in device models (package data)
        assert (site / "commsched" / "cluster" / "devices" / f"{name}.json").is_file()
    assert not (site / "kernels").exists(), "kernels/ must install as commsched.kernels only"
    (dist,) = site.glob("commsched-*.dist-info")
    assert "Apache License" in next(dist.rglob("LICENSE*")).read_text()


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
