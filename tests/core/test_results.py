"""commsched.results: the progress display without a terminal (plain lines, no carriage
returns), and with one (a tqdm bar)."""

from __future__ import annotations

import dataclasses
import io
import sys

import pytest

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


def test_results_are_strict_json(tmp_path):
    """Non-finite floats (a diverged loss) are written as null, never as bare NaN/Infinity
    tokens that strict parsers reject; numpy's floats too."""
    import json

    import numpy as np

    from commsched.results import Record, dumps_json, write_json

    obj = {"loss": [1.5, float("nan"), float("inf"), -float("inf")], "n": 3, "ok": True,
           "np": [np.float32("nan"), np.float64(0.25)], "t": (1, float("nan"))}
    strict = {"loss": [1.5, None, None, None], "n": 3, "ok": True, "np": [None, 0.25], "t": [1, None]}
    assert json.loads(dumps_json(obj)) == strict
    write_json(tmp_path / "metrics.json", obj)
    assert json.loads((tmp_path / "metrics.json").read_text(), parse_constant=pytest.fail) == strict

    @dataclasses.dataclass(frozen=True)
    class R(Record):
        loss: list

    R([float("nan"), 2.0]).write(tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text(), parse_constant=pytest.fail) == {"loss": [None, 2.0]}


def test_divergence_guard_warns_once_and_stops_after_a_run_of_non_finite_losses():
    from commsched.results import DivergedError, DivergenceGuard

    said: list[str] = []
    g = DivergenceGuard("step", say=said.append, stop_after=3, hint="lower --lr")
    for k, loss in enumerate([2.0, float("nan"), float("nan"), 1.0, None, float("inf"), float("nan")], 1):
        g.check(k, loss)  # a finite loss (or none) in between starts the count again
    assert said == ["warning: the training loss is nan at step 2: the run is diverging; it stops after 3 "
                    "non-finite steps in a row"]
    with pytest.raises(DivergedError, match=r"not finite for 3 steps in a row \(steps 6-8\): the run diverged; "
                                            r"lower --lr"):
        g.check(8, float("nan"))
    quiet = DivergenceGuard("epoch", stop_after=1)  # the other ranks: silent, stop alike
    with pytest.raises(DivergedError, match=r"epochs 4-4"):
        quiet.check(4, float("-inf"))
    with pytest.raises(ValueError, match="stop_after"):
        DivergenceGuard(stop_after=0)


def test_tensor_digests_name_the_damaged_tensor(tmp_path):
    import pytest
    import torch

    from commsched.results import DIGESTS, check_digests, load_torch_file, with_digests

    st = with_digests({"model": {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)},
                       "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}}, "step": 7})
    assert set(st[DIGESTS]) == {"model.w", "model.b", "optimizer.state.0.step"}
    assert check_digests(st, "f", "checkpoint")
    assert not check_digests({"model": {}}, "f", "checkpoint")  # written before digests: unchecked
    st["model"]["w"].view(-1)[5] = -5.0  # one bit: the sign of 5.0
    with pytest.raises(ValueError, match="checkpoint f is damaged: tensor model.w does not match"):
        check_digests(st, "f", "checkpoint")
    # the same through a file: torch's reader alone accepts a flipped bit in tensor bytes
    good = with_digests({"w": torch.full((64,), 0.5)})
    torch.save(good, tmp_path / "c.pt")
    data = bytearray((tmp_path / "c.pt").read_bytes())
    pos = bytes(data).find(good["w"].numpy().tobytes()) + 4 * 32 + 3
    data[pos] ^= 0x20
    (tmp_path / "c.pt").write_bytes(bytes(data))
    assert not torch.equal(torch.load(tmp_path / "c.pt", weights_only=True)["w"], good["w"])
    with pytest.raises(ValueError, match=r"--resume: checkpoint .*c\.pt is damaged: tensor w does not match"):
        load_torch_file(tmp_path / "c.pt", "--resume: checkpoint")


def test_a_dead_runs_lock_does_not_block_the_next(tmp_path):
    """The folder lock is a flock: held while its process lives (a second claim is refused
    naming that pid), dropped by the kernel when it dies, even by SIGKILL."""
    import subprocess

    import pytest

    from commsched.results import claim_out

    out = tmp_path / "run"
    code = ("import sys, time; from commsched.results import claim_out; h = claim_out(sys.argv[1]); "
            "print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"--out {out} is in use by another run \(pid {p.pid}\)"):
            claim_out(out)
    finally:
        p.kill()
        p.wait(timeout=30)
    claim_out(out).release()  # the dead run's lock is gone
