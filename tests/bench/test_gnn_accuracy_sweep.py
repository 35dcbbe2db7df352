"""The accuracy grid (commsched.bench.gnn.accuracy) and the rate sweep (commsched.bench.gnn.sweep):
their pure parts on hand-worked examples, and the sweep's --collect path end to end on
stored bench summaries. No training runs here (those are the benchmarks)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from commsched.bench.gnn import accuracy, sweep


def _run(ds, mode, seed, acc, loss):
    return {"dataset": ds, "mode": mode, "seed": seed, "test_acc": acc, "loss": loss}


RESULTS = [
    _run("cora", "vanilla", 0, 0.80, [2.0, 1.0]), _run("cora", "vanilla", 1, 0.78, [2.0, 0.8]),
    _run("cora", "adaqp", 1, 0.79, [2.1, 0.9]), _run("cora", "adaqp", 0, 0.785, [2.1, 0.7]),
    _run("cora", "random", 0, 0.70, [2.2, 1.2]), _run("cora", "random", 1, 0.80, [2.2, 1.0]),
    _run("toy", "adaqp", 0, 0.5, [1.0]),
]


def test_summary_means_differences_and_verdicts():
    rows = {(r["dataset"], r["mode"]): r for r in accuracy.summarize(RESULTS)}
    v, q, rnd = rows["cora", "vanilla"], rows["cora", "adaqp"], rows["cora", "random"]
    assert v["mean_pct"] == pytest.approx(79.0) and v["vs_vanilla_pp"] is None
    # seeds sorted: seed 0 (78.5) then seed 1 (79.0)
    assert q["seeds"] == [0, 1] and q["test_acc_pct"] == pytest.approx([78.5, 79.0])
    assert q["mean_pct"] == pytest.approx(78.75) and q["vs_vanilla_pp"] == pytest.approx(-0.25)
    assert q["final_loss"] == pytest.approx(0.8)
    assert rnd["vs_vanilla_pp"] == pytest.approx(-4.0)
    assert rows["toy", "adaqp"]["vs_vanilla_pp"] is None  # no vanilla to compare with
    ver = {x["dataset"]: x for x in accuracy.verdicts(accuracy.summarize(RESULTS), tol_pp=0.5)}
    assert ver["cora"]["within_tol"] is True and ver["cora"]["adaqp_beats_random"] is True
    assert ver["cora"]["adaqp_minus_random_pp"] == pytest.approx(3.75)
    assert ver["toy"]["within_tol"] is None
    # a tighter tolerance flips the verdict
    assert accuracy.verdicts(accuracy.summarize(RESULTS), tol_pp=0.2)[0]["within_tol"] is False
    md = accuracy.table_markdown(accuracy.summarize(RESULTS))
    assert "| cora | adaqp | 2 | 78.75% | 78.5, 79.0 | -0.25 pp | 0.8000 |" in md
    assert "| cora | -0.25 pp | yes | +3.75 pp | yes |" in md


def test_recipe_arguments_and_reuse_check():
    r = accuracy.Recipe(epochs=7)
    a = r.variant("synthetic", "adaqp", 2).argv
    assert a[a.index("--syn-nodes") + 1] == "20000" and a[a.index("--syn-edges") + 1] == "200000"
    assert "--dataset" not in a and a[a.index("--seed") + 1] == "2" and a[a.index("--epochs") + 1] == "7"
    b = r.variant("citeseer", "vanilla", 0).argv
    assert b[b.index("--dataset") + 1] == "citeseer" and b[b.index("--data-root") + 1] == "../shared/data"
    with pytest.raises(ValueError, match="nocomm"):
        r.variant("cora", "nocomm", 0)
    cfg = {"mode": "adaqp", "seed": 2, "epochs": 7, "model": "gcn", "eval_every": 2, "period": 20,
           "group_size": 20, "lam": 0.5, "hidden": 256, "dropout_rng": "local"}
    m = {"config": cfg, "loss": [1.0] * 7, "recipe": dataclasses.asdict(r)}
    assert accuracy.matches(m, r, "adaqp", 2)
    assert not accuracy.matches({"config": cfg, "loss": [1.0] * 7}, r, "adaqp", 2)  # not the grid's run
    assert not accuracy.matches(m, accuracy.Recipe(epochs=7, syn_nodes=5000), "adaqp", 2)
    assert not accuracy.matches(m, r, "adaqp", 1)
    assert not accuracy.matches(m, accuracy.Recipe(epochs=8), "adaqp", 2)
    assert not accuracy.matches(m, accuracy.Recipe(epochs=7, lam=0.9), "adaqp", 2)
    assert not accuracy.matches({**m, "loss": [1.0] * 3}, r, "adaqp", 2)  # cut short


def test_loss_plot_writes_png(tmp_path):
    p = accuracy.plot_losses(RESULTS, tmp_path / "img" / "loss.png")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _summary(v_ep, q_ep, comm, noc_ep=None):
    rows = {"gcn-vanilla": {"epoch_time_s": v_ep, "comm_share": comm, "bytes_per_epoch_MB": 145.0},
            "gcn-adaqp": {"epoch_time_s": q_ep, "speedup_vs_vanilla": v_ep / q_ep, "comm_share": 0.3,
                          "quant_share": 0.1, "bytes_per_epoch_MB": 20.0,
                          **({"x_nocomm": q_ep / noc_ep} if noc_ep else {})}}
    if noc_ep:
        rows["gcn-nocomm"] = {"epoch_time_s": noc_ep}
    return {"gnn": rows}


def test_sweep_point_and_table():
    pt = sweep.point_from_summary("300mbit", _summary(4.0, 1.6, 0.84, 0.8))
    assert pt["speedup"] == pytest.approx(2.5) and pt["adaqp_x_nocomm"] == pytest.approx(2.0)
    assert pt["nocomm_epoch_s"] == 0.8 and pt["vanilla_comm_share"] == 0.84
    no_noc = sweep.point_from_summary("none", _summary(1.0, 2.0, 0.3))
    assert no_noc["adaqp_x_nocomm"] is None
    md = sweep.sweep_table([pt, no_noc])
    assert "| 300mbit | 0.84 | 4 | 1.6 | 2.50x | 0.30 | 0.10 | 0.8 | 2.00 |" in md
    assert "| none | 0.30 | 1 | 2 | 0.50x | 0.30 | 0.10 | - | - |" in md
    with pytest.raises(ValueError, match="gcn-vanilla"):
        sweep.point_from_summary("1gbit", {"gnn": {"sage-vanilla": {}}})


def test_sweep_collect_rebuilds_from_bench_folders(tmp_path, capsys):
    for rate, s in (("none", _summary(1.2, 1.6, 0.35, 0.7)), ("100mbit", _summary(12.0, 3.0, 0.95, 0.7))):
        (tmp_path / rate).mkdir()
        (tmp_path / rate / "summary.json").write_text(json.dumps(s))
    rc = sweep.main(["--collect", "--rates", "none,300mbit,100mbit", "--out", str(tmp_path)])
    assert rc == 0
    pts = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["rate"] for p in pts] == ["none", "100mbit"]  # 300mbit has no folder: skipped
    assert pts[1]["speedup"] == pytest.approx(4.0)
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "| 100mbit | 0.95 |" in (tmp_path / "sweep.md").read_text()
    assert "300mbit" in capsys.readouterr().err
