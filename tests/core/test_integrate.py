"""Every runnable example of docs/integrate.md runs, as a user would launch it.

A fenced ``python`` block whose first line is ``# example: NAME`` (optionally followed by
``nproc=N``) is a complete program: it is written to a temporary folder and run with
``python`` (or ``torchrun --standalone --nproc-per-node N``), under a timeout; it must exit
0. The examples assert their own results, so a wrong answer fails here too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrate.md"
HEAD = re.compile(r"^# example:\s*(?P<name>[A-Za-z0-9_]+)(?:\s+nproc=(?P<nproc>\d+))?\s*$")
TIMEOUT_S = 240


def examples(text: str) -> dict[str, tuple[int, str]]:
    """``{name: (nproc, source)}`` for every example block of ``text``."""
    found: dict[str, tuple[int, str]] = {}
    for block in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        first = block.split("\n", 1)[0]
        m = HEAD.match(first)
        if not m:
            continue
        name = m["name"]
        if name in found:
            raise ValueError(f"docs/integrate.md: example {name!r} appears twice")
        found[name] = (int(m["nproc"] or 1), block)
    return found


EXAMPLES = examples(DOC.read_text())


def test_parser_reads_names_and_nproc():
    text = "x\n```python\n# example: a nproc=3\nprint(1)\n```\n```python\nprint(2)\n```\n" \
           "```python\n# example: b\nprint(3)\n```\n"
    got = examples(text)
    assert got == {"a": (3, "# example: a nproc=3\nprint(1)\n"), "b": (1, "# example: b\nprint(3)\n")}
    with pytest.raises(ValueError, match="appears twice"):
        examples(text + "```python\n# example: b\n```\n")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(name, tmp_path):
    nproc, src = EXAMPLES[name]
    path = tmp_path / f"{name}.py"
    path.write_text(src)
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(path)]
    else:
        cmd = [sys.executable, str(path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMSCHED_TIMEOUT_S="60")
    try:
        p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"example {name} ran past {TIMEOUT_S} s:\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, f"example {name} exited {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
