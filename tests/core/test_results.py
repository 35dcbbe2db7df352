"""commsched.results: the progress display without a terminal (plain lines, no carriage
returns), and with one (a tqdm bar)."""

from __future__ import annotations

import io
import sys

from commsched import results
from commsched.results import Progress


def test_progress_without_a_terminal_writes_plain_lines(monkeypatch):
    lines: list[str] = []
    clock = iter(range(0, 1000, 7))  # every reading 7 s later than the last
    monkeypatch.setattr(results.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    with Progress(10, "adaqp gcn", "epoch", say=lines.append, interval_s=20) as bar:
        for i in range(10):
            bar.postfix(f"loss {i}")
            bar.update()
    assert lines[0].startswith("adaqp gcn: 0/10 epochs")
    assert lines[-1].startswith("adaqp gcn: 10/10 epochs, done in") and lines[-1].endswith("loss 9")
    assert 3 <= len(lines) <= 6  # coarse: not one line per update
    assert not any("\r" in s for s in lines) and sys.stderr.getvalue() == ""


def test_progress_lines_spell_the_plural_of_the_unit(monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    with Progress(2, "moe-infer", "batch", say=lines.append) as bar:
        bar.update(2)
    assert lines[0].startswith("moe-infer: 0/2 batches") and lines[-1].startswith("moe-infer: 2/2 batches")
    assert results.plural("step") == "steps" and results.plural("epoch") == "epochs" and results.plural("p95 batch") == "p95 batches"


def test_progress_on_a_terminal_is_a_tqdm_bar(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    with Progress(3, "moe-train", "step") as bar:
        assert bar.active
        bar.update(3)
    assert "\r" in sys.stderr.getvalue() and "3/3" in sys.stderr.getvalue()


def test_progress_disabled_says_nothing_but_writes(monkeypatch):
    lines: list[str] = []
    with Progress(3, "x", "step", enabled=False, say=lines.append) as bar:
        bar.update()
        bar.postfix("ignored")
        bar.write("a message")
    assert lines == ["a message"]


def test_write_atomic_failure_removes_the_temporary_and_names_the_file(tmp_path, monkeypatch):
    import errno
    import os

    import pytest

    from commsched.results import OutputError, write_atomic, write_json

    def full(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    target = tmp_path / "metrics.json"
    with pytest.raises(OutputError) as e:
        write_atomic(target, full, what="metrics file")
    assert str(e.value) == f"cannot write metrics file {target}: No space left on device (ENOSPC)"
    assert list(tmp_path.iterdir()) == []  # no temporary, no half file
    write_json(target, {"a": 1})
    assert target.read_text() == '{\n  "a": 1\n}' and len(list(tmp_path.iterdir())) == 1

    def wrapped(f):  # a serializer that hides the OSError inside its own error
        try:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        except OSError as inner:
            raise RuntimeError("[enforce fail at inline_container.cc:626] . file write failed") from inner

    with pytest.raises(OutputError, match=r"Disk quota exceeded \(EDQUOT\)"):
        write_atomic(tmp_path / "ck.pt", wrapped)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def _tmpfs(path, size: str) -> bool:
    import os
    import subprocess

    if os.geteuid() != 0:
        return False
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_disk_is_one_line_for_json_and_torch_files(tmp_path):
    """On a real 1 MiB filesystem (root only): a torch checkpoint and a metrics file that do
    not fit give one OutputError line each and leave no temporary behind."""
    import subprocess

    import pytest
    import torch

    from commsched.results import OutputError, save_torch, write_json

    disk = tmp_path / "disk"
    if not _tmpfs(disk, "1m"):
        pytest.skip("needs root and mount -t tmpfs")
    try:
        with pytest.raises(OutputError, match=rf"cannot write checkpoint {disk}/ck.pt: No space left on device"):
            save_torch({"w": torch.zeros(1 << 20)}, disk / "ck.pt")  # 4 MB
        with pytest.raises(OutputError, match=rf"cannot write metrics file {disk}/metrics.json: No space"):
            write_json(disk / "metrics.json", {"loss": list(range(300_000))})
        assert list(disk.iterdir()) == []
        save_torch({"w": torch.ones(8)}, disk / "small.pt")  # what fits is written as usual
        assert torch.equal(torch.load(disk / "small.pt", weights_only=True)["w"], torch.ones(8))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
