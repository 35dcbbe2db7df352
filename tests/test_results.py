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
