"""Vanilla distributed training on 2, 3 and 4 gloo ranks equals single-process training;
checkpoint/resume, start-up config checks, scattering parts, and the torchrun CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from commsched.gnn.graph.data import (
    SyntheticSpec,
    from_edges,
    load_dataset,
    save_graph,
    synthetic_graph,
)
from commsched.gnn.graph.partition import make_parts, partition_nodes
from commsched.gnn.train.trainer import TrainConfig, run_training
from tests.mp import run_ranks

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
ROOT = Path(__file__).resolve().parents[2]
SYN = SyntheticSpec(num_nodes=500, num_edges=2500, num_features=12, num_classes=4,
                    communities_per_class=2, seed=7)
SYN2 = SyntheticSpec(num_nodes=400, num_edges=2000, num_features=8, num_classes=2,
                     communities_per_class=2, seed=9)  # two classes: ROC AUC is recorded too
EPOCHS = 5
# (graph, config): Cora with Kipf's shape, the synthetic graph with AdaQP's (LayerNorm, 3 layers).
# float64 so that accuracies can be compared for equality; one float32 case for the loss bound.
PLAN = [
    ("cora", TrainConfig(model="gcn", layers=2, hidden=16, layer_norm=False, weight_decay=5e-4,
                         epochs=EPOCHS, dtype="float64", seed=1)),
    ("cora", TrainConfig(model="sage", layers=2, hidden=16, layer_norm=False, weight_decay=5e-4,
                         epochs=EPOCHS, dtype="float64", seed=2)),
    ("syn", TrainConfig(model="gcn", layers=3, hidden=16, epochs=EPOCHS, dtype="float64", seed=4)),
    ("syn", TrainConfig(model="sage", layers=3, hidden=16, epochs=EPOCHS, dtype="float64", seed=5,
                        pattern="ring")),
    ("syn", TrainConfig(model="gcn", layers=2, hidden=8, epochs=EPOCHS, seed=6)),
    ("syn2", TrainConfig(model="gcn", layers=2, hidden=8, epochs=EPOCHS, dtype="float64", seed=8)),
]
KEYS = ("mode", "model", "dataset", "world_size", "epochs", "loss", "val_acc", "test_acc",
        "epoch_time_s", "breakdown_s", "bytes_sent_per_epoch", "wall_clock_s", "val_auc", "test_auc",
        "val_auc_per_eval")


def _directed_graph():
    """Part 1 = {3, 4, 5} has no remote in-neighbour but feeds part 0: it must still take
    part in every backward exchange."""
    e = np.array([[3, 0], [4, 1], [5, 2], [0, 1], [3, 4], [1, 2]])
    rng = np.random.default_rng(0)
    tr = np.array([1, 1, 1, 1, 1, 0], bool)
    return from_edges(e, rng.standard_normal((6, 4)), np.array([0, 1, 0, 1, 0, 1]), tr, ~tr, ~tr,
                      directed=True, name="directed")


def _graphs(paths: dict[str, str]):
    from commsched.gnn.graph.data import load_graph

    return {k: load_graph(v) for k, v in paths.items()}


def _train_plan(rank: int, world: int, paths: dict[str, str], group=None) -> list[dict]:
    graphs = _graphs(paths)
    parts = {k: make_parts(g, partition_nodes(g, world, "metis", 0), world)[rank]
             for k, g in graphs.items()}
    out = []
    for name, cfg in PLAN:
        m, tr = run_training(cfg, parts[name], group=group)
        # numpy, not tensors: torch would share tensor storage with a process about to exit
        out.append({k: m[k] for k in KEYS} | {"params": [p.detach().numpy().copy() for p in tr.model.parameters()]})
    if world <= 2:  # the directed graph with a fixed split {0,1,2} | {3,4,5}
        g = _directed_graph()
        owner = np.array([0, 0, 0, 1, 1, 1]) if world == 2 else np.zeros(6, np.int64)
        cfg = TrainConfig(model="gcn", layers=3, hidden=5, epochs=4, dtype="float64", dropout=0.3)
        m, _ = run_training(cfg, make_parts(g, owner, world)[rank], group=group)
        out.append({"loss": m["loss"], "test_acc": m["test_acc"], "val_acc": m["val_acc"]})
    return out


@pytest.fixture(scope="module")
def graph_paths(tmp_path_factory):
    if not DATA.is_dir():
        pytest.skip("../shared/data not present")
    d = tmp_path_factory.mktemp("gnn")
    save_graph(load_dataset("cora", DATA), d / "cora.npz")
    save_graph(synthetic_graph(SYN), d / "syn.npz")
    save_graph(synthetic_graph(SYN2), d / "syn2.npz")
    return {"cora": str(d / "cora.npz"), "syn": str(d / "syn.npz"), "syn2": str(d / "syn2.npz")}


def _check_matches(ref: list[dict], got: list[dict], world: int) -> None:
    for (name, cfg), r, d in zip(PLAN + [("directed", None)], ref, got):
        what = f"{name} {cfg.model if cfg else 'gcn'} {cfg.dtype if cfg else 'float64'} x{world}"
        rl, dl = np.array(r["loss"]), np.array(d["loss"])
        assert rl.shape == dl.shape == ((EPOCHS,) if cfg else (4,)), what
        rel = np.abs(rl - dl) / np.abs(rl)
        assert rel.max() <= 1e-5, (what, rel.max())
        if cfg is None or cfg.dtype == "float64":
            assert rel.max() <= 1e-10, (what, rel.max())
            assert (d["val_acc"], d["test_acc"]) == (r["val_acc"], r["test_acc"]), what
            if cfg is not None:  # ROC AUC (two-class graphs) from histograms summed over the ranks
                assert (d["val_auc"], d["test_auc"], d["val_auc_per_eval"]) == \
                    (r["val_auc"], r["test_auc"], r["val_auc_per_eval"]), what
                assert (r["val_auc"] is not None) == (name == "syn2"), what
        else:  # float32: a one-node flip of an argmax tie would be rounding, not a bug
            assert abs(d["test_acc"] - r["test_acc"]) <= 1.0 / 250 + 1e-12, what
        if cfg is not None:
            for a, b in zip(r["params"], d["params"]):
                np.testing.assert_allclose(b, a, rtol=1e-4 if cfg.dtype == "float32" else 1e-9,
                                           atol=1e-5 if cfg.dtype == "float32" else 1e-10)
            assert d["world_size"] == world and d["bytes_sent_per_epoch"] > 0
            assert set(d["breakdown_s"]) == {"comm", "quant", "central", "marginal", "reduce", "assign"}
            assert d["breakdown_s"]["comm"] > 0 and d["breakdown_s"]["reduce"] > 0


def _params(tr):
    return [p.detach().clone() for p in tr.model.parameters()]


class _Killed(Exception):
    """Stands for a run killed between two epochs."""


def _die_after(epoch: int):
    def on_epoch(tr) -> None:
        if tr.epoch == epoch:
            raise _Killed
    return on_epoch


def test_final_state_is_saved_whatever_the_epoch_count(tmp_path):
    """--checkpoint-every 2 with 5 epochs: the checkpoint holds epoch 5, not 4; resuming
    that finished run trains nothing and reports the same losses."""
    g = synthetic_graph(SYN)
    part = make_parts(g, partition_nodes(g, 1, "metis", 0), 1)[0]
    cfg = TrainConfig(model="gcn", layers=2, hidden=8, epochs=5, seed=3, checkpoint_every=2)
    m, tr = run_training(cfg, part, out_dir=tmp_path)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["epoch"] == 5 and state["history"]["loss"] == m["loss"]
    assert all(torch.equal(v, tr.model.state_dict()[k]) for k, v in state["model"].items())
    m2, _ = run_training(cfg, part, out_dir=tmp_path, resume=True)
    assert m2["loss"] == m["loss"] and m2["epochs_timed"] == 0
    # no interval, no checkpoint
    run_training(dataclasses.replace(cfg, checkpoint_every=0), part, out_dir=tmp_path / "none")
    assert not (tmp_path / "none" / "checkpoint.pt").exists()


def test_damaged_checkpoint_is_refused_naming_the_tensor(tmp_path, capsys):
    """One flipped bit inside a weight of checkpoint.pt (torch's reader checks no checksum of
    tensor bytes) is refused on --resume, naming the file and the tensor; a checkpoint
    written before digests existed resumes, said on stderr."""
    g = synthetic_graph(SYN)
    part = make_parts(g, partition_nodes(g, 1, "metis", 0), 1)[0]
    cfg = TrainConfig(model="gcn", layers=2, hidden=8, epochs=2, seed=3, checkpoint_every=2)
    run_training(cfg, part, out_dir=tmp_path)
    ckpt = tmp_path / "checkpoint.pt"
    good = ckpt.read_bytes()
    st = torch.load(ckpt, weights_only=True)
    key = next(k for k, v in st["model"].items() if v.dtype == torch.float32 and v.numel() >= 16)
    t = st["model"][key]
    data = bytearray(good)
    pos = good.find(t.contiguous().numpy().tobytes()) + 4 * (t.numel() // 2) + 3
    data[pos] ^= 0x20
    ckpt.write_bytes(bytes(data))
    longer = dataclasses.replace(cfg, epochs=3)
    with pytest.raises(ValueError, match=rf"checkpoint {ckpt} is damaged: tensor model\.{key} does not match"):
        run_training(longer, part, out_dir=tmp_path, resume=True)
    del st["digests"]
    torch.save(st, ckpt)  # as an earlier commsched wrote it
    m, _ = run_training(longer, part, out_dir=tmp_path, resume=True)
    assert m["epochs_timed"] == 1 and "written without tensor digests" in capsys.readouterr().err


def test_roc_auc_on_a_two_class_graph_matches_the_exact_one():
    """The trainer's evaluation on a two-class graph: the histogram ROC AUC of each split
    within 1e-3 of the exact pairwise AUC of the model's class-1 probabilities."""
    from commsched.gnn.context import PassContext
    from commsched.gnn.timing import Breakdown

    g = synthetic_graph(SYN2)
    part = make_parts(g, partition_nodes(g, 1, "metis", 0), 1)[0]
    m, tr = run_training(TrainConfig(model="gcn", layers=2, hidden=8, epochs=3, seed=2), part)
    assert len(m["val_auc_per_eval"]) == len(m["eval_epochs"]) and 0.5 < m["val_auc"] <= 1.0
    ev = tr.evaluate()
    tr.model.eval()
    with torch.no_grad():
        p = torch.softmax(tr._forward(PassContext(epoch=2, training=False, timer=Breakdown(tr.clock))), 1)[:, 1]
    for k in ("train", "val", "test"):
        sel = tr.masks[k]
        s, y = p[sel], tr.y[sel]
        pos, neg = s[y == 1], s[y == 0]
        exact = float((pos[:, None] > neg[None, :]).double().mean() + 0.5 * (pos[:, None] == neg[None, :]).double().mean())
        assert ev[f"{k}_auc"] == pytest.approx(exact, abs=1e-3), k


def _two_rank_cases(rank: int, world: int, tmp: str, group) -> dict:
    from commsched.gnn.exchange.modes import make_exchange
    from commsched.gnn.graph.data import GraphSource
    from commsched.gnn.train.cli import obtain_part, startup_check

    out: dict = {}
    src = GraphSource(synthetic=SYN)
    # 1. rank 0 partitions and scatters; each rank gets exactly its part
    part, info = obtain_part(src, rank, world, partition_dir=None, method="metis", seed=0, group=group)
    g = synthetic_graph(SYN)
    mine = make_parts(g, partition_nodes(g, world, "metis", 0), world)[rank]
    out["scatter_ok"] = (np.array_equal(part.book.global_ids, mine.book.global_ids)
                         and torch.equal(part.x_nF, mine.x_nF) and info["partition"]["method"] == "metis")
    # 2. the halo exchange delivers the owners' rows, in the book's remote order
    ex = make_exchange("vanilla", part.book, group=group)
    got = ex.start(part.x_nF, 0).wait()
    out["halo_ok"] = torch.equal(got, g.x_NF[torch.from_numpy(part.book.remote_ids)])
    # 3. the forward exchange in the background (central aggregation overlapping it, as
    #    AdaQP-p will) gives bit-identical training
    from commsched.gnn.context import ExchangeContext
    from commsched.gnn.exchange.halo import VanillaExchange

    c3 = TrainConfig(model="gcn", layers=3, hidden=8, epochs=3, seed=9)
    m_sync, _ = run_training(c3, part, group=group)
    bg = VanillaExchange(ExchangeContext(part.book, group=group), asynchronous=True)
    m_bg, _ = run_training(c3, part, group=group, exchange=bg)
    out["async_equal"] = m_sync["loss"] == m_bg["loss"] and m_sync["test_acc"] == m_bg["test_acc"]
    # 4. checkpoint / resume: an interrupted run continued with --resume ends identical
    cfg = TrainConfig(model="sage", layers=2, hidden=8, epochs=6, seed=3, checkpoint_every=2)
    _, full = run_training(cfg, part, group=group)
    d = os.path.join(tmp, "ckpt")
    try:  # "dies" after epoch 5 (every rank at once), its last checkpoint at 4
        run_training(cfg, part, out_dir=d, group=group, on_epoch=_die_after(5))
    except _Killed:
        pass
    m, resumed = run_training(cfg, part, out_dir=d, resume=True, group=group)      # restarts at 4
    out["resume_params_equal"] = all(torch.equal(a, b) for a, b in zip(_params(full), _params(resumed)))
    out["resume_loss_equal"] = m["loss"] == full.history["loss"]
    out["resume_epochs_timed"] = m["epochs_timed"]
    if rank == 0:
        out["metrics_keys"] = sorted(json.loads(Path(d, "metrics.json").read_text()))
    try:
        run_training(dataclasses.replace(cfg, hidden=9), part, out_dir=d, resume=True, group=group)
        out["resume_mismatch"] = None
    except ValueError as e:
        out["resume_mismatch"] = str(e)
    # 5. ranks started with different configurations stop with one clear error
    try:
        startup_check(TrainConfig(hidden=16 if rank == 0 else 8), src, group=group, out="x")
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    try:
        startup_check(TrainConfig(), src, group=group, out="x" if rank == 0 else "y")
        out["mismatch_run"] = None
    except ValueError as e:
        out["mismatch_run"] = str(e)
    return out


def _all_worlds(rank: int, world: int, paths: dict[str, str], tmp: str) -> dict:
    """One spawn of 4 ranks: the plan on 4 ranks, on a 3-rank and on a 2-rank subgroup
    (ranks outside a subgroup wait), then the two-rank cases."""
    import torch.distributed as dist

    assert world == 4
    g3, g2 = dist.new_group([0, 1, 2]), dist.new_group([0, 1])
    out: dict = {"w4": _train_plan(rank, 4, paths)}
    if rank < 3:
        out["w3"] = _train_plan(rank, 3, paths, group=g3)
    if rank < 2:
        out["w2"] = _train_plan(rank, 2, paths, group=g2)
        out["cases"] = _two_rank_cases(rank, 2, tmp, g2)
    dist.barrier()
    return out


@pytest.mark.slow
def test_vanilla_on_2_3_4_ranks_equals_single_process(graph_paths, tmp_path):
    """Loss per epoch within 1e-5 relative (1e-10 in float64) and the same accuracy as
    single-process training; plus scatter, halo rows, checkpoint/resume and start-up
    checks on two ranks."""
    reference = _train_plan(0, 1, graph_paths)
    res = run_ranks(4, _all_worlds, graph_paths, str(tmp_path), timeout_s=600, pg_timeout_s=180)
    for key, world in (("w4", 4), ("w3", 3), ("w2", 2)):
        for r in range(1, world):  # every rank reports the same global numbers
            assert [x["loss"] for x in res[r][key]] == [x["loss"] for x in res[0][key]]
        _check_matches(reference, res[0][key], world)
    for r in (0, 1):
        o = res[r]["cases"]
        assert o["scatter_ok"] and o["halo_ok"] and o["async_equal"], o
        assert o["resume_params_equal"] and o["resume_loss_equal"], o
        assert o["resume_epochs_timed"] == 2
        assert "hidden: 8 -> 9" in o["resume_mismatch"]
        assert "ranks [1] were started with a training configuration different from rank 0's" in o["mismatch"]
        assert "hidden" in o["mismatch"]
        assert "out: rank 0 has 'x', rank 1 has 'y'" in o["mismatch_run"]
    assert set(KEYS) <= set(res[0]["cases"]["metrics_keys"])


# --------------------------------------------------------------------------- torchrun CLI
@pytest.mark.slow
def test_torchrun_cli_with_partition_folder(tmp_path, capsys):
    from commsched.gnn.graph.cli import partition_main

    syn = ["--syn-nodes", "300", "--syn-edges", "1500", "--syn-features", "8", "--syn-classes", "3"]
    assert partition_main(syn + ["--parts", "2", "--out", str(tmp_path / "parts")]) == 0
    env = dict(os.environ, COMMSCHED_PROGRESS="0", OMP_NUM_THREADS="1")
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "commsched.gnn.train", "--partition-dir", str(tmp_path / "parts"), "--layers", "2",
            "--hidden", "8", "--epochs", "3", "--device", "cpu", "--out", str(tmp_path / "run")]
    p = subprocess.run(base + syn, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert set(KEYS) <= set(m) and m["world_size"] == 2 and m["epochs"] == 3 and m["mode"] == "vanilla"
    assert len(m["peak_rss_mib_per_rank"]) == 2 and m["bytes_sent_per_epoch"] > 0
    assert "vanilla gcn on synthetic x2" in p.stdout
    # in-process (world size 1): another graph's options against a folder, an unknown mode
    from commsched.gnn.train.cli import main as train_main

    assert partition_main(syn + ["--parts", "1", "--out", str(tmp_path / "one")]) == 0
    one = ["--partition-dir", str(tmp_path / "one"), "--epochs", "1", "--hidden", "4",
           "--out", str(tmp_path / "run1")]
    assert train_main(one + ["--syn-nodes", "301"] + syn[2:]) == 2
    assert "made for another graph" in capsys.readouterr().err
    assert train_main(one) == 0
    assert "x1" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        train_main(["--mode", "no-such-mode"])
    assert "invalid choice" in capsys.readouterr().err


def _poison_after(epoch: int):
    """NaN in every parameter once epoch ``epoch`` ended: the loss is NaN from then on."""
    def on_epoch(tr) -> None:
        if tr.epoch == epoch:
            with torch.no_grad():
                for p in tr.model.parameters():
                    p.fill_(float("nan"))
    return on_epoch


def test_a_diverged_run_warns_once_stops_and_writes_strict_json(tmp_path, capsys):
    import json

    from commsched.results import NONFINITE_STOP_AFTER, DivergedError

    g = synthetic_graph(SYN)
    part = make_parts(g, partition_nodes(g, 1, "metis", 0), 1)[0]
    cfg = TrainConfig(model="gcn", layers=2, hidden=8, epochs=4, seed=3)
    m, _ = run_training(cfg, part, out_dir=tmp_path, on_epoch=_poison_after(2))  # 2 NaN epochs: runs on
    err = capsys.readouterr().err
    assert err.count("warning: the training loss is nan at epoch 3") == 1, err
    text = (tmp_path / "metrics.json").read_text()
    loss = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.json"))["loss"]
    assert loss[2:] == [None, None] and all(isinstance(x, float) for x in loss[:2])
    long = dataclasses.replace(cfg, epochs=4 + NONFINITE_STOP_AFTER)
    with pytest.raises(DivergedError, match=rf"not finite for {NONFINITE_STOP_AFTER} epochs in a row \(epochs "
                                            rf"3-{2 + NONFINITE_STOP_AFTER}\): the run diverged; lower --lr"):
        run_training(long, part, on_epoch=_poison_after(2))
