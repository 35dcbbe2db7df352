"""Bad input and output folders (issue 15, part B): every reader of a file turns a failure
into one ValueError line naming the file; each front-end's CLI edge turns a ValueError or
CommError into one line on stderr and exit 2; ``--out`` is made (or refused) before any
work, an existing run is not mixed without ``--overwrite``, a failed run leaves FAILED;
degenerate settings are refused. All single-process and fast."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from commsched.dist import CommError, cli_error
from commsched.results import FAILED_MARKER, claim_out, load_torch_file, mark_failed, prepare_out
from tests.mp import run_ranks

ROOT = Path(__file__).resolve().parents[2]
SYN = ["--syn-nodes", "120", "--syn-edges", "500", "--syn-features", "4", "--syn-classes", "3"]


def _one_line(msg: str) -> None:
    assert "\n" not in msg.strip() and "Traceback" not in msg, msg


def _graph_arrays(N: int = 6) -> dict[str, np.ndarray]:
    return {"node_features": np.arange(N * 3, dtype=np.float32).reshape(N, 3),
            "node_labels": np.arange(N) % 3, "edges": np.array([[i, (i + 1) % N] for i in range(N)]),
            "train_masks": np.arange(N) < 3, "val_masks": np.arange(N) == 3,
            "test_masks": np.arange(N) > 3}


def _bad_crc(src: Path, dst: Path) -> Path:
    """``src`` (an uncompressed npz) with one byte of its first member's data flipped."""
    blob = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as z:
        info = z.infolist()[0]
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    blob[start + info.file_size - 1] ^= 0xFF  # the last data byte: the header stays parseable
    dst.write_bytes(bytes(blob))
    return dst


# --------------------------------------------------------------------------- file readers
def test_graph_file_corrupt_kinds_name_the_file(tmp_path):
    from commsched.gnn.graph.data import load_graph

    good = tmp_path / "good.npz"
    np.savez(good, **_graph_arrays())
    load_graph(good)
    trunc = tmp_path / "trunc.npz"
    trunc.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip at all" * 10)
    crc = _bad_crc(good, tmp_path / "crc.npz")
    for f in (trunc, garbage, crc):
        with pytest.raises(ValueError) as ei:
            load_graph(f)
        msg = str(ei.value)
        assert f"graph file {f}" in msg and ("corrupt" in msg or "not a readable" in msg), msg
        _one_line(msg)


def test_graph_without_training_nodes_is_refused(tmp_path):
    from commsched.gnn.graph.data import from_edges, load_graph
    from commsched.gnn.graph.partition import make_parts
    from commsched.gnn.train.trainer import TrainConfig, Trainer

    a = _graph_arrays()
    a["train_masks"] = np.zeros(6, bool)
    np.savez(tmp_path / "g.npz", **a)
    with pytest.raises(ValueError, match=r"key 'train_masks': no training nodes"):
        load_graph(tmp_path / "g.npz")
    # a graph built in memory reaches the trainer, which refuses it before any work
    g = from_edges(a["edges"], a["node_features"], a["node_labels"], a["train_masks"],
                   a["val_masks"], a["test_masks"])
    part = make_parts(g, np.zeros(6, np.int64), 1)[0]
    with pytest.raises(ValueError, match="no training nodes"):
        Trainer(TrainConfig(epochs=1, hidden=4, layers=2, device="cpu"), part)


def _parts(tmp_path: Path) -> Path:
    from commsched.gnn.graph.cli import partition_main

    folder = tmp_path / "parts"
    assert partition_main(SYN + ["--parts", "1", "--method", "random", "--out", str(folder)]) == 0
    return folder


def test_partition_folder_corrupt_kinds_name_the_file(tmp_path):
    from commsched.gnn.graph.partition import load_part

    folder = _parts(tmp_path)
    load_part(folder, 0, 1)
    part = folder / "part-00000.pt"
    blob = part.read_bytes()
    for name, data in (("truncated", blob[: len(blob) // 3]), ("garbage", os.urandom(4096)),
                       ("empty", b"")):
        part.write_bytes(data)
        with pytest.raises(ValueError) as ei:
            load_part(folder, 0, 1)
        assert "part-00000.pt" in str(ei.value) and "not a readable torch file" in str(ei.value), name
        _one_line(str(ei.value))
    torch.save([1, 2, 3], part)
    with pytest.raises(ValueError, match="part-00000.pt is not a part file"):
        load_part(folder, 0, 1)
    meta = folder / "meta.json"
    for data in ("{not json", "[1, 2]", json.dumps({"format": 1})):
        meta.write_text(data)
        with pytest.raises(ValueError, match=r"meta.json") as ei:
            load_part(folder, 0, 1)
        assert str(folder) in str(ei.value)
        _one_line(str(ei.value))


class _NotWeights:
    pass


def test_torch_files_load_only_weights(tmp_path):
    f = tmp_path / "obj.pt"
    torch.save({"x": _NotWeights()}, f)
    with pytest.raises(ValueError) as ei:
        load_torch_file(f, "checkpoint")
    msg = str(ei.value)
    assert f"checkpoint {f}" in msg and "safe load (weights_only=True) refuses" in msg
    assert "weights_only=False" not in msg  # torch's advice is not passed on
    _one_line(msg)
    with pytest.raises(ValueError, match="no such file"):
        load_torch_file(tmp_path / "missing.pt", "checkpoint")
    (tmp_path / "pickle.pt").write_bytes(pickle.dumps({"a": 1}))  # not a torch zip either
    with pytest.raises(ValueError, match=r"pickle.pt: not a readable torch file|pickle.pt: holds objects"):
        load_torch_file(tmp_path / "pickle.pt", "checkpoint")


def test_gnn_checkpoint_truncated_names_the_file(tmp_path):
    from commsched.gnn.graph.data import SyntheticSpec, synthetic_graph
    from commsched.gnn.graph.partition import make_parts
    from commsched.gnn.train.trainer import TrainConfig, run_training

    g = synthetic_graph(SyntheticSpec(num_nodes=120, num_edges=500, num_features=4, num_classes=3))
    part = make_parts(g, np.zeros(g.num_nodes, np.int64), 1)[0]
    cfg = TrainConfig(epochs=2, hidden=4, layers=2, checkpoint_every=1, device="cpu")
    run_training(cfg, part, out_dir=tmp_path)
    ck = tmp_path / "checkpoint.pt"
    ck.write_bytes(ck.read_bytes()[:200])
    with pytest.raises(ValueError) as ei:
        run_training(cfg, part, out_dir=tmp_path, resume=True)
    assert f"checkpoint {ck}" in str(ei.value) and "not a readable torch file" in str(ei.value)
    _one_line(str(ei.value))
    torch.save({}, ck)  # readable but not a trainer's state
    with pytest.raises(ValueError, match=r"--resume: checkpoint .* does not fit this run"):
        run_training(cfg, part, out_dir=tmp_path, resume=True)


def test_trace_file_corrupt_kinds_name_the_file(tmp_path):
    from commsched.moe.record.traces import (
        SyntheticTraceConfig,
        load_trace,
        save_trace,
        synthetic_trace,
    )

    good = tmp_path / "t.npz"
    save_trace(good, synthetic_trace(SyntheticTraceConfig(num_tokens=256, num_layers=2, num_experts=4)))
    load_trace(good)
    plain = tmp_path / "plain.npz"  # uncompressed, so a flipped byte is a CRC error
    with np.load(good) as z:
        np.savez(plain, **{k: z[k] for k in z.files})
    load_trace(plain)
    trunc = tmp_path / "trunc.npz"
    trunc.write_bytes(good.read_bytes()[:100])
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(os.urandom(2048))
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    for f in (trunc, garbage, _bad_crc(plain, tmp_path / "crc.npz"), single):
        with pytest.raises(ValueError) as ei:
            load_trace(f)
        assert f"trace file {f}" in str(ei.value), str(ei.value)
        _one_line(str(ei.value))


def test_corpus_empty_missing_or_folder_names_the_file(tmp_path):
    from commsched.moe.model.data import load_corpus

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=rf"corpus {empty} has only 0 bytes"):
        load_corpus(empty)
    with pytest.raises(ValueError, match=rf"--corpus {tmp_path / 'no.txt'}: no such file"):
        load_corpus(tmp_path / "no.txt")
    with pytest.raises(ValueError, match="a folder, not a text file"):
        load_corpus(tmp_path)
    (tmp_path / "ok.txt").write_bytes(b"abcdefgh" * 400)
    assert load_corpus(tmp_path / "ok.txt", max_bytes=2048).train.numel() + \
        load_corpus(tmp_path / "ok.txt", max_bytes=2048).val.numel() == 2048


def test_moe_checkpoint_corrupt_names_the_file(tmp_path):
    from commsched.moe.model.lm import ModelConfig, MoETransformerLM
    from commsched.moe.record.recorder import load_checkpoint, save_checkpoint

    f = tmp_path / "lm.pt"
    save_checkpoint(f, MoETransformerLM(ModelConfig(d_model=8, n_heads=2, d_ff=8, expert_hidden=8, seq_len=8)))
    load_checkpoint(f)
    f.write_bytes(f.read_bytes()[:300])
    with pytest.raises(ValueError) as ei:
        load_checkpoint(f)
    assert f"checkpoint {f}: not a readable torch file" in str(ei.value)
    _one_line(str(ei.value))


# --------------------------------------------------------------------------- degenerate settings
def test_degenerate_settings_are_refused():
    from commsched.gnn.train.trainer import TrainConfig as GNNConfig
    from commsched.moe.model.lm import ModelConfig
    from commsched.moe.train.training import TrainConfig as MoEConfig

    for kw, pat in ((dict(lr=-1.0), "--lr must be a finite number > 0"), (dict(lr=0.0), "--lr"),
                    (dict(lr=float("nan")), "--lr"), (dict(weight_decay=-0.1), "--weight-decay"),
                    (dict(dropout=1.0), r"--dropout must be in \[0, 1\)"), (dict(dropout=-0.1), "--dropout"),
                    (dict(epochs=0), "--epochs")):
        with pytest.raises(ValueError, match=pat):
            GNNConfig(**kw)
    for kw, pat in ((dict(lr=-1.0), "--lr must be a finite number > 0"), (dict(lr=0.0), "--lr"),
                    (dict(steps=0), "steps"), (dict(ep_size=0), "--ep-size"),
                    (dict(eval_batches=-1), "--eval-batches"), (dict(timeline_step=99), "--timeline-step"),
                    (dict(max_corpus_bytes=-1), "--max-corpus-bytes")):
        with pytest.raises(ValueError, match=pat):
            MoEConfig(**kw)
    with pytest.raises(ValueError, match="--aux-weight"):
        ModelConfig(aux_weight=-1.0)
    with pytest.raises(ValueError, match=">= 1"):
        ModelConfig(n_heads=0)


# --------------------------------------------------------------------------- --out and the CLI edge
def test_prepare_out_and_failed_marker(tmp_path):
    out = prepare_out(tmp_path / "a" / "b")
    assert out.is_dir()
    (out / "metrics.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds a run .* pass --overwrite"):
        prepare_out(out)
    prepare_out(out, resume=True)
    assert (out / "metrics.json").exists()
    mark_failed(out, "prog: it broke\nbadly")
    assert (out / FAILED_MARKER).read_text() == "prog: it broke badly\n"
    prepare_out(out, overwrite=True)  # the old run's results and marker go
    assert not (out / "metrics.json").exists() and not (out / FAILED_MARKER).exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        prepare_out(tmp_path / "file")
    with pytest.raises(ValueError, match="cannot create the folder"):
        prepare_out(tmp_path / "file" / "sub")
    mark_failed(tmp_path / "nowhere", "ignored")  # best effort: no folder, no error


def test_cli_error_is_one_line_naming_the_rank(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert cli_error("prog", CommError("rank 2: barrier failed: a peer died"), tmp_path) == 2
    err = capsys.readouterr().err
    assert err == "prog (rank 2): barrier failed: a peer died\n"
    assert (tmp_path / FAILED_MARKER).read_text() == err
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert cli_error("prog", ValueError("bad\nthing")) == 2
    assert capsys.readouterr().err == "prog: bad thing\n"


def _no_work(monkeypatch, module: str, name: str):
    def boom(*a, **k):
        raise AssertionError("work started before --out was checked")

    monkeypatch.setattr(f"{module}.{name}", boom)


@pytest.mark.parametrize("front", ["gnn", "moe-train", "moe-infer"])
def test_uncreatable_or_used_out_is_refused_before_any_work(front, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COMMSCHED_PROGRESS", "0")
    if front == "gnn":
        from commsched.gnn.train.cli import main
        _no_work(monkeypatch, "commsched.gnn.train.cli", "obtain_part")
        args = ["--device", "cpu", "--epochs", "1"]
        prog = "commsched.gnn.train"
    elif front == "moe-train":
        from commsched.moe.train.cli import main
        _no_work(monkeypatch, "commsched.moe.train.cli", "train")
        args = ["--device", "cpu", "--steps", "1", "--warmup", "0"]
        prog = "commsched.moe.train"
    else:
        from commsched.moe.infer.cli import main
        _no_work(monkeypatch, "commsched.moe.infer.cli", "run")
        args = ["--batches", "1", "--warmup", "0"]
        prog = "commsched.moe.infer"
    (tmp_path / "file").write_text("x")
    t = time.perf_counter()
    assert main(args + ["--out", str(tmp_path / "file" / "run")]) == 2
    err = capsys.readouterr().err
    assert f"{prog}: --out {tmp_path / 'file' / 'run'}: cannot create the folder" in err, err
    assert "Traceback" not in err
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.json").write_text("{}")
    assert main(args + ["--out", str(used)]) == 2
    err = capsys.readouterr().err
    assert "already holds a run (metrics.json); pass --overwrite" in err and "Traceback" not in err
    assert time.perf_counter() - t < 30


@pytest.mark.parametrize("front", ["gnn", "moe-train"])
def test_a_folder_held_by_another_run_is_refused_and_left_alone(front, tmp_path, monkeypatch, capsys):
    """A second training run into a folder another live run holds stops at start with one
    line naming that run's pid and exit 2, removing nothing (not even with --overwrite) and
    leaving no FAILED marker there."""
    monkeypatch.setenv("COMMSCHED_PROGRESS", "0")
    if front == "gnn":
        from commsched.gnn.train.cli import main
        _no_work(monkeypatch, "commsched.gnn.train.cli", "obtain_part")
        args, prog = ["--device", "cpu", "--epochs", "1"], "commsched.gnn.train"
    else:
        from commsched.moe.train.cli import main
        _no_work(monkeypatch, "commsched.moe.train.cli", "train")
        args, prog = ["--device", "cpu", "--steps", "1", "--warmup", "0"], "commsched.moe.train"
    out = tmp_path / "run"
    first = claim_out(out)  # the first run, alive
    files = {"metrics.json": "{}", "timeline.json": "[]", "checkpoint.pt": "first run's"}
    for name, text in files.items():
        (out / name).write_text(text)
    for extra in ([], ["--overwrite"], ["--resume"]):
        assert main(args + extra + ["--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == f"{prog}: --out {out} is in use by another run (pid {os.getpid()}); wait for it to " \
                      "end or choose another folder\n", err
        assert {n: (out / n).read_text() for n in files} == files
        assert not (out / FAILED_MARKER).exists()
    first.release()  # the first run ended: the folder is free
    claim_out(out, overwrite=True).release()
    assert not (out / "metrics.json").exists()


def test_gnn_cli_failed_run_leaves_marker_and_overwrite_replaces(tmp_path, monkeypatch, capsys):
    from commsched.gnn.train.cli import main

    monkeypatch.setenv("COMMSCHED_PROGRESS", "0")
    out = tmp_path / "run"
    base = ["--device", "cpu", "--epochs", "2", "--hidden", "4", "--layers", "2", "--out", str(out)]
    assert main(base + ["--partition-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "no meta.json" in err and "Traceback" not in err
    assert "no meta.json" in (out / FAILED_MARKER).read_text()
    assert not (out / "metrics.json").exists()
    assert main(base + SYN) == 0
    assert (out / "metrics.json").exists() and not (out / FAILED_MARKER).exists()
    assert main(base + SYN) == 2  # the finished run is not mixed with a new one
    assert "pass --overwrite" in capsys.readouterr().err
    assert main(base + SYN + ["--overwrite"]) == 0
    assert main(base + SYN + ["--lr", "-1"]) == 2
    assert "--lr must be a finite number > 0" in capsys.readouterr().err


def test_moe_cli_detected_errors_are_one_line(tmp_path, monkeypatch, capsys):
    from commsched.moe.infer.cli import main as infer_main
    from commsched.moe.train.cli import main as train_main

    monkeypatch.setenv("COMMSCHED_PROGRESS", "0")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    tiny = ["--device", "cpu", "--steps", "1", "--warmup", "0", "--d-model", "8", "--heads", "2",
            "--d-ff", "8", "--expert-hidden", "8", "--seq-len", "8", "--batch-size", "2"]
    cases = [
        (train_main, tiny + ["--corpus", str(empty)], "has only 0 bytes"),
        (train_main, tiny + ["--corpus", str(tmp_path / "none.txt")], "no such file"),
        (train_main, tiny + ["--ep-size", "2"], "--ep-size 2 must divide the world size 1"),
        (train_main, tiny + ["--lr", "-1"], "--lr must be a finite number > 0"),
        (infer_main, ["--batches", "1", "--warmup", "0", "--trace", str(empty)], "trace file"),
    ]
    for i, (main, args, pat) in enumerate(cases):
        out = tmp_path / f"out{i}"
        assert main(args + ["--out", str(out)]) == 2, args
        err = capsys.readouterr().err
        lines = [ln for ln in err.strip().splitlines() if not ln.startswith("commsched: --device")]
        assert len(lines) == 1 and pat in lines[0] and "Traceback" not in err, err
        if main is not train_main or "--lr" not in args:  # a config error stops before --out
            assert pat in (out / FAILED_MARKER).read_text()


def test_record_refuses_its_out_before_training(tmp_path, capsys):
    from commsched.moe.record.cli import main

    (tmp_path / "file").write_text("x")
    t = time.perf_counter()
    assert main(["--train-steps", "100000", "--out", str(tmp_path / "file" / "t.npz")]) == 2
    assert "cannot create its folder" in capsys.readouterr().err
    assert main(["--train-steps", "100000", "--out", str(tmp_path / "file")]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path / "no.pt"), "--out", str(tmp_path / "t.npz")]) == 2
    assert "checkpoint" in capsys.readouterr().err
    assert time.perf_counter() - t < 20


@pytest.mark.slow
def test_moe_train_subprocess_prints_one_line_without_traceback(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    env = dict(os.environ, COMMSCHED_PROGRESS="0", OMP_NUM_THREADS="1", COMMSCHED_TIMEOUT_S="5")
    p = subprocess.run([sys.executable, "-m", "commsched.moe.train", "--device", "cpu", "--steps", "1",
                        "--warmup", "0", "--corpus", str(empty), "--out", str(tmp_path / "o")],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "has only 0 bytes" in p.stderr
    assert (tmp_path / "o" / FAILED_MARKER).exists()


def _moe_train_cli_on_ranks(rank: int, world: int, out: str) -> tuple[int, str]:
    import contextlib
    import io

    from commsched.moe.train.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # main keeps the harness's group and ends it
        rc = main(["--device", "cpu", "--steps", "1", "--warmup", "0", "--experts", "3",
                   "--d-model", "8", "--heads", "2", "--d-ff", "8", "--expert-hidden", "8",
                   "--seq-len", "8", "--out", out])
    return rc, err.getvalue()


@pytest.mark.slow
def test_moe_train_error_on_two_ranks_names_each_rank(tmp_path):
    res = run_ranks(2, _moe_train_cli_on_ranks, str(tmp_path / "o"), timeout_s=90, pg_timeout_s=10,
                    env={"COMMSCHED_PROGRESS": "0", "COMMSCHED_TIMEOUT_S": "10"})
    for rank, (rc, err) in enumerate(res):
        lines = [ln for ln in err.strip().splitlines() if not ln.startswith("commsched: --device")]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith(f"commsched.moe.train (rank {rank}): 3 experts cannot be split"), err
    failed = (tmp_path / "o" / FAILED_MARKER).read_text().splitlines()
    assert sorted(ln.split(":")[0] for ln in failed) == ["commsched.moe.train (rank 0)",
                                                        "commsched.moe.train (rank 1)"]


def test_init_distributed_binds_a_cuda_group_to_its_device(monkeypatch):
    """Audit 2, item 11: on CUDA the default group is made with ``device_id`` (NCCL's
    communicator made eagerly, within the timeout); on the CPU without it."""
    import torch
    import torch.distributed as dist

    from commsched import dist as cdist

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cdist.init_distributed(device=torch.device("cuda", 2))
    (args, kw), = calls
    assert args[0] == "cpu:gloo,cuda:nccl" and kw["device_id"] == torch.device("cuda", 2)
    calls.clear()
    cdist.init_distributed(device=torch.device("cpu"))
    assert calls[0][0][0] == "gloo" and "device_id" not in calls[0][1]


def test_messages_carry_no_foreign_advice(tmp_path):
    """Round 3 of the fault probe: a garbage torch file loses torch's "weights_only=False"
    advice, a text file given as a graph loses numpy's allow_pickle hint, a non-UTF-8
    topology file is named."""
    from commsched.cluster.topology import Topology
    from commsched.gnn.graph.data import load_graph

    bad = tmp_path / "part0.pt"
    bad.write_bytes(bytes(range(256)) * 12)
    with pytest.raises(ValueError) as e:
        load_torch_file(bad, "part file")
    msg = str(e.value)
    assert msg.startswith(f"part file {bad}: not a readable torch file") and "\n" not in msg
    assert "weights_only" not in msg and "PyTorch 2.6" not in msg
    txt = tmp_path / "graph.txt"
    txt.write_text("src dst\n0 1\n")
    with pytest.raises(ValueError) as e:
        load_graph(txt)
    msg = str(e.value)
    assert msg.startswith(f"graph file {txt}: not a readable .npz file (not a zip archive")
    assert "pickle" not in msg
    topo = tmp_path / "topo.json"
    topo.write_bytes(b"\xff\xfe{\"hosts\": []}")
    with pytest.raises(ValueError, match=rf"topology file {topo}: not UTF-8 text \(byte 0"):
        Topology.load(topo)


@pytest.mark.slow
def test_sigterm_leaves_a_failed_marker_and_one_line(tmp_path):
    """torchrun stopping the survivors, a scheduler's limit, ``kill``: SIGTERM ends a GNN
    run with one line, status 143 (128 + 15) and FAILED in its run folder."""
    import signal

    out = tmp_path / "run"
    env = {**os.environ, "COMMSCHED_PROGRESS": "0"}
    p = subprocess.Popen([sys.executable, "-m", "commsched.gnn.train", "--device", "cpu",
                          "--epochs", "100000", "--hidden", "4", "--layers", "2", "--out", str(out),
                          *SYN], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not out.is_dir() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
        time.sleep(2.0)  # into the epochs
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "commsched.gnn.train: stopped by SIGTERM"
    assert "Traceback" not in err
    assert "stopped by SIGTERM" in (out / FAILED_MARKER).read_text()
    assert not (out / "metrics.json").exists()


def test_sigterm_leaves_a_failed_marker_in_an_moe_training_run(tmp_path):
    """The same edge for ``-m commsched.moe.train`` (it runs under cli_main too)."""
    import signal

    out = tmp_path / "run"
    env = {**os.environ, "COMMSCHED_PROGRESS": "0", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "commsched.moe.train", "--device", "cpu", "--steps", "100000",
                          "--d-model", "8", "--heads", "2", "--d-ff", "8", "--expert-hidden", "8",
                          "--seq-len", "8", "--batch-size", "2", "--out", str(out)],
                         env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not out.is_dir() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
        time.sleep(2.0)  # into the steps
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "commsched.moe.train: stopped by SIGTERM"
    assert "Traceback" not in err
    assert "stopped by SIGTERM" in (out / FAILED_MARKER).read_text()
    assert not (out / "metrics.json").exists()


def test_cli_main_maps_errors_and_restores_the_handler(tmp_path, capsys):
    import signal

    import torch.distributed as dist

    from commsched.dist import CommError, Stopped, cli_main, init_distributed

    before = signal.getsignal(signal.SIGTERM)

    def bad():
        raise ValueError("--x must be > 0")

    assert cli_main("prog", bad, out=lambda: tmp_path) == 2
    assert capsys.readouterr().err.strip() == "prog: --x must be > 0"
    assert (tmp_path / FAILED_MARKER).read_text() == "prog: --x must be > 0\n"

    def dead():
        raise CommError("rank 1 stopped answering")

    assert cli_main("prog", dead) == 2

    def term():
        signal.raise_signal(signal.SIGTERM)
        return 0

    assert cli_main("prog", term) == 143
    assert "prog: stopped by SIGTERM" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before
    assert cli_main("prog", lambda: 0) == 0
    with pytest.raises(KeyError):  # not one of ours: the traceback stays
        cli_main("prog", lambda: {}["k"])
    with pytest.raises(KeyError):  # ... and the run folder says it failed, naming the type
        cli_main("prog", lambda: {}["k"], out=lambda: tmp_path)
    assert (tmp_path / FAILED_MARKER).read_text().splitlines()[-1] == "prog (rank 0): KeyError: 'k'"
    assert issubclass(Stopped, BaseException) and not issubclass(Stopped, Exception)
    # the process groups the body made are destroyed, after the error line
    assert cli_main("prog", lambda: init_distributed(backend="gloo", device="cpu") and bad()) == 2
    assert not dist.is_initialized() and capsys.readouterr().err.strip() == "prog: --x must be > 0"


@pytest.mark.slow
def test_moe_checkpoint_on_a_full_disk_is_one_line_and_resumable(tmp_path):
    """A 2 MB filesystem as --out (root only): the second checkpoint does not fit. One line
    naming the file and ENOSPC, exit 2, no temporary left, FAILED holds the line, and the
    first checkpoint is still whole."""
    from tests.core.test_results import _tmpfs

    disk = tmp_path / "disk"
    if not _tmpfs(disk, "2m"):
        pytest.skip("needs root and mount -t tmpfs")
    try:
        r = subprocess.run([sys.executable, "-m", "commsched.moe.train", "--steps", "3",
                            "--checkpoint-every", "1", "--device", "cpu", "--out", str(disk / "run")],
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "COMMSCHED_PROGRESS": "0"})
        assert r.returncode == 2, r.stderr
        line = r.stderr.strip().splitlines()[-1]
        assert line.startswith("commsched.moe.train: cannot write checkpoint ")
        assert line.endswith("No space left on device (ENOSPC)") and "Traceback" not in r.stderr
        names = sorted(p.name for p in (disk / "run").iterdir())
        assert names == [".lock", "FAILED", "checkpoint-rank0.pt"], names
        assert (disk / "run" / FAILED_MARKER).read_text().strip() == line
        assert torch.load(disk / "run" / "checkpoint-rank0.pt", weights_only=True)["step"] == 1
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.slow
def test_gnn_output_on_a_full_disk_is_one_line(tmp_path):
    """A 12 KB filesystem as --out (root only): the first checkpoint does not fit: one line
    naming the file and ENOSPC, exit 2, FAILED holds it, nothing half-written."""
    from tests.core.test_results import _tmpfs

    disk = tmp_path / "disk"
    if not _tmpfs(disk, "12k"):
        pytest.skip("needs root and mount -t tmpfs")
    try:
        r = subprocess.run([sys.executable, "-m", "commsched.gnn.train", "--device", "cpu", "--epochs", "3",
                            "--checkpoint-every", "1", "--hidden", "64", "--layers", "2",
                            "--out", str(disk / "run"), *SYN], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "COMMSCHED_PROGRESS": "0"})
        assert r.returncode == 2, r.stderr
        line = r.stderr.strip().splitlines()[-1]
        assert line == (f"commsched.gnn.train: cannot write checkpoint {disk}/run/checkpoint.pt: "
                        "No space left on device (ENOSPC)"), r.stderr
        assert sorted(p.name for p in (disk / "run").iterdir()) == [".lock", "FAILED"]
        assert (disk / "run" / FAILED_MARKER).read_text().strip() == line
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
