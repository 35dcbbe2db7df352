"""The time-to-accuracy report of ``commsched bench gnn`` (commsched/bench/gnn/tta.py), pure:
the time-to-target computation on hand-made curves, the aggregation over seeds, the
target from Vanilla's best, the table, the plot, and the bench's variants and summary
with ``--metric time-to-acc``."""

from __future__ import annotations

import argparse

import pytest

from commsched.bench.gnn.tta import (
    TimeToTarget,
    pick_score,
    run_curve,
    sampling_lines,
    split_seed,
    targets,
    time_to_target,
    tta_rows,
    tta_table,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_time_to_target_first_evaluation_at_or_above():
    val = [0.2, 0.5, 0.7, 0.69, 0.8]
    ev = [0, 1, 2, 3, 4]
    times = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert time_to_target(val, ev, times, 0.7) == TimeToTarget(3, 6.0)  # reached at epoch index 2
    assert time_to_target(val, ev, times, 0.2) == TimeToTarget(1, 1.0)
    assert time_to_target(val, ev, times, 0.75) == TimeToTarget(5, 15.0)
    never = time_to_target(val, ev, times, 0.81)
    assert never == TimeToTarget(None, None) and not never.reached
    # evaluation every 2 epochs: found at the first evaluated epoch, its epochs all counted
    assert time_to_target([0.3, 0.9], [1, 3], times, 0.5) == TimeToTarget(4, 10.0)
    with pytest.raises(ValueError, match="3 validation accuracies for 2 evaluation epochs"):
        time_to_target([0.1, 0.2, 0.3], [0, 1], times, 0.5)
    with pytest.raises(ValueError, match="only 5 epoch times"):
        time_to_target([0.9], [7], times, 0.5)
    # held for 2 evaluations in a row: the spike at index 1 does not count, 2-3 does not hold
    spiky = [0.2, 0.9, 0.3, 0.8, 0.6, 0.8, 0.85]
    t7 = [1.0] * 7
    assert time_to_target(spiky, range(7), t7, 0.75) == TimeToTarget(2, 2.0)
    assert time_to_target(spiky, range(7), t7, 0.75, sustain=2) == TimeToTarget(6, 6.0)
    assert time_to_target(spiky, range(7), t7, 0.75, sustain=3) == TimeToTarget(None, None)  # ends inside
    with pytest.raises(ValueError, match="sustain"):
        time_to_target(spiky, range(7), t7, 0.75, sustain=0)


def _run(val, times, test, seed, ev=None):
    ev = list(range(len(val))) if ev is None else ev
    return {"val_acc_per_eval": val, "eval_epochs": ev, "epoch_time_s_per_epoch": times,
            "test_acc": test, "epoch_time_s": sorted(times)[len(times) // 2], "epochs": len(times),
            "config": {"seed": seed}}


def _runs():
    return {
        "gcn-vanilla": [_run([0.5, 0.8, 0.9, 0.9], [2.0] * 4, 0.88, 0),
                        _run([0.6, 0.9, 0.92, 0.92], [2.0] * 4, 0.90, 1)],
        # faster epochs, one more epoch to the target; seed 1 never gets there
        "gcn-onebit": [_run([0.4, 0.7, 0.89, 0.9], [0.5] * 4, 0.87, 0),
                       _run([0.4, 0.6, 0.7, 0.8], [0.5] * 4, 0.79, 1)],
    }


def test_rows_target_from_vanilla_and_aggregation():
    runs = _runs()
    assert targets(runs) == {"gcn": pytest.approx(0.98 * (0.9 + 0.92) / 2)}  # 0.8918
    assert targets(runs, target_acc=0.5) == {"gcn": 0.5}
    assert targets({"sage-adaqp": runs["gcn-onebit"]}) == {"sage": None}  # no vanilla: no target
    rows = tta_rows(runs)
    v, o = rows["gcn-vanilla"], rows["gcn-onebit"]
    assert v["epochs_to_target"] == [3, 2] and v["seconds_to_target"] == [6.0, 4.0]
    assert v["epochs_mean"] == 2.5 and v["seconds_mean"] == 5.0 and v["seconds_sd"] == pytest.approx(2 ** 0.5)
    assert o["epochs_to_target"] == [4, None] and o["seconds_to_target"] == [2.0, None]
    assert o["reached"] == 1 and o["epochs_mean"] == 4 and o["epochs_sd"] == 0.0
    assert o["speedup_vs_vanilla"] == 3.0  # seed 0 only: 6 s / 2 s
    assert v["speedup_vs_vanilla"] == 1.0
    assert o["test_acc_mean"] == pytest.approx(0.83) and o["seeds"] == [0, 1]
    assert o["best_val_mean"] == pytest.approx(0.85)
    table = tta_table(rows, skipped=["pipegcn"])
    assert "| gcn-onebit | 0.8918 | 1/2 | 4.0 ± 0.0 | 2.0 ± 0.0 | 3.00x |" in table
    assert "83.00 ± 5.66% (87.0, 79.0)" in table
    assert "Skipped (mode not registered in this checkout): pipegcn." in table
    # an absolute target none reaches
    none = tta_rows(runs, target_acc=0.99)
    assert all(r["reached"] == 0 and r["seconds_mean"] is None and r["speedup_vs_vanilla"] is None
               for r in none.values())
    assert "| 0/2 | - | - | - |" in tta_table(none)
    # the curve: wall-clock at each evaluation = summed epoch times up to it
    assert run_curve(_run([0.1, 0.2], [1.0, 2.0, 3.0], 0.1, 0, ev=[0, 2])) == ([1.0, 6.0], [0.1, 0.2])


def test_full_graph_against_sampling_line():
    """The table says whether the fastest full-graph mode or ``minibatch`` reaches the target
    first, by the ratio of their speed-ups against Vanilla, seeds reached and test score beside."""
    runs = _runs()  # onebit: 3.00x Vanilla (seed 0 only)
    slow = _run([0.5, 0.9, 0.9, 0.9], [2.0] * 4, 0.88, 0)  # at the target after 2 epochs, 4 s: 1.5x
    runs["gcn-minibatch"] = [slow, _run([0.5, 0.6, 0.7, 0.8], [2.0] * 4, 0.80, 1)]  # seed 1 never
    rows = tta_rows(runs)
    assert rows["gcn-minibatch"]["speedup_vs_vanilla"] == 1.5
    lines = sampling_lines(rows)
    assert lines[1] == ("- gcn: full-graph reaches the target first: `gcn-onebit` 2.00x sooner than `gcn-minibatch` "
                        "(`gcn-onebit` 3.00x Vanilla, 1/2 seeds, test 83.00%; "
                        "`gcn-minibatch` 1.50x Vanilla, 1/2 seeds, test 84.00%)")
    assert lines[1] in tta_table(rows)
    runs["gcn-minibatch"][0] = dict(slow, epoch_time_s_per_epoch=[0.5] * 4)  # 1 s to target: 6.0x
    assert sampling_lines(tta_rows(runs))[1].startswith(
        "- gcn: sampling reaches the target first: `gcn-minibatch` 2.00x sooner than `gcn-onebit`")
    # no sampling variant, or one that never reached the target: no line
    assert sampling_lines(tta_rows(_runs())) == []
    runs["gcn-minibatch"] = [_run([0.5] * 4, [1.0] * 4, 0.5, 0), _run([0.5] * 4, [1.0] * 4, 0.5, 1)]
    assert sampling_lines(tta_rows(runs)) == [] and "Full-graph against sampling" not in tta_table(tta_rows(runs))


def _auc_runs():
    """The accuracy curves of :func:`_runs` flat at the majority share (a Tolokers), their
    ROC AUC curves carrying the information."""
    runs = {}
    for v, rs in _runs().items():
        runs[v] = [dict(m, val_acc_per_eval=[0.78] * 4, test_acc=0.78, val_auc_per_eval=m["val_acc_per_eval"],
                        test_auc=m["test_acc"]) for m in rs]
    return runs


def test_rows_in_roc_auc():
    runs = _auc_runs()
    assert pick_score(runs) == "auc" and pick_score(runs, "acc") == "acc"
    assert pick_score(_runs()) == "acc"  # no AUC recorded: accuracy
    with pytest.raises(ValueError, match="ROC AUC was asked for"):
        pick_score(_runs(), "auc")
    with pytest.raises(ValueError, match="expected one of"):
        pick_score(runs, "f1")
    acc = tta_rows(runs, score="acc")
    assert acc["gcn-onebit"]["epochs_to_target"] == [1, 1]  # accuracy: reached at once, says nothing
    auc = tta_rows(runs, score="auc")
    ref = tta_rows(_runs())
    for v in runs:  # AUC rows are the accuracy rows of the same curves
        for k in ("target", "epochs_to_target", "seconds_to_target", "best_val_mean", "test_acc_mean",
                  "speedup_vs_vanilla"):
            assert auc[v][k] == ref[v][k], (v, k)
    assert auc["gcn-onebit"]["score"] == "auc"
    table = tta_table(auc)
    assert "| variant | target val auc |" in table and "best val auc" in table and "ROC AUC" in table
    # an evaluation whose split lacked a class (None) never counts as reaching the target
    assert time_to_target([None, 0.9], [0, 1], [1.0, 1.0], 0.5) == TimeToTarget(2, 2.0)
    assert run_curve(dict(_run([0.1], [1.0], 0.1, 0), val_auc_per_eval=[None]), "auc")[1][0] != 0.0


def test_bench_variants_and_summary_with_time_to_acc(tmp_path, monkeypatch):
    from commsched.bench.gnn import compare as gnn

    p = argparse.ArgumentParser()
    gnn.add_arguments(p)
    a = p.parse_args(["--metric", "time-to-acc", "--seeds", "0,1"])
    names = [v.name for v in gnn.variants(a)]
    keep, skipped = gnn.tta_modes()
    assert names == [f"gcn-{m}-s{s}" for s in (0, 1) for m in keep]  # gcn only, the registered modes
    assert {"vanilla", "vanilla-bf16", "adaqp", "onebit", "minibatch"} <= set(keep)
    # mini-batch training (the peer a user would pick instead) runs beside the full-graph modes, after them
    mb = next(v for v in gnn.variants(a) if v.name == "gcn-minibatch-s0")
    assert mb.config.mode == "minibatch" and keep[-1] == "minibatch"
    assert set(keep) | set(skipped) == set(gnn.TTA_MODES)
    from commsched.gnn.train.cli import build_parser as train_parser
    from commsched.gnn.train.cli import config_from_args

    assert all(config_from_args(train_parser().parse_args(v.argv)) == v.config for v in gnn.variants(a))
    v = gnn.variants(a)[0]
    assert v.config.eval_every == 1 and "--eval-every" not in v.argv  # every epoch evaluated (the default)
    assert "--syn-seed" not in v.argv  # the default graph
    other = gnn.variants(p.parse_args(["--syn-seed", "7"]))[0].argv
    assert other[other.index("--syn-seed") + 1] == "7"
    plain = gnn.variants(p.parse_args([]))[0]
    assert plain.argv[plain.argv.index("--eval-every") + 1] == "5" and plain.config.eval_every == 5
    # a mode this checkout lacks is skipped, not an error
    monkeypatch.setattr(gnn, "TTA_MODES", ("vanilla", "onebit", "nosuchmode"))
    monkeypatch.setattr(gnn.tta_modes, "__defaults__", (gnn.TTA_MODES,))
    assert gnn.tta_modes() == (["vanilla", "onebit"], ["nosuchmode"])
    for bad in (["--target-acc", "1.5"], ["--metric", "time-to-acc", "--target-frac", "0"]):
        with pytest.raises(ValueError, match="--target-"):
            gnn.variants(p.parse_args(bad))
    with pytest.raises(ValueError, match="--sustain is a number of evaluations"):
        gnn.variants(p.parse_args(["--metric", "time-to-acc", "--sustain", "0"]))
    # the summary: the table and the plot, from per-seed runs
    runs = {}
    for v, rs in _runs().items():
        for k, m in enumerate(rs):
            m = dict(m, mode=v.split("-", 1)[1], loss=[1.0, 0.5, 0.4, 0.3],
                     breakdown_s={"comm": 0.1}, bytes_sent_per_epoch=1.0)
            runs[f"{v}-s{k}"] = [m]
    a = p.parse_args(["--target-acc", "0.85", "--seeds", "0,1", "--modes", "vanilla,onebit"])
    a.bandwidth = "300mbit"
    s = gnn.summarize(runs, a, tmp_path)
    rows = s["time_to_acc"]["rows"]
    assert rows["gcn-onebit"]["target"] == 0.85 and rows["gcn-onebit"]["epochs_to_target"] == [3, None]
    assert s["time_to_acc"]["regime"] == "300mbit" and s["time_to_acc"]["skipped_modes"] == []
    assert "Time to accuracy" in s["extra_tables"]
    assert (tmp_path / "time_to_acc.png").read_bytes()[:8] == PNG_MAGIC
    assert s["time_to_acc"]["score"] == "acc"
    # runs with ROC AUC: auto picks it, and the table says so
    for v, rs in _auc_runs().items():
        for k, m in enumerate(rs):
            runs[f"{v}-s{k}"][0].update(val_acc_per_eval=m["val_acc_per_eval"], val_auc_per_eval=m["val_auc_per_eval"],
                                        test_auc=m["test_auc"])
    s = gnn.summarize(runs, p.parse_args(["--metric", "time-to-acc", "--seeds", "0,1", "--modes", "vanilla,onebit"]),
                      tmp_path)
    assert s["time_to_acc"]["score"] == "auc" and "Time to accuracy (ROC AUC)" in s["extra_tables"]
    assert s["time_to_acc"]["rows"]["gcn-onebit"]["epochs_to_target"] == [4, None]  # target 0.98 x 0.91


def _write_bench(d, runs_by_seed):
    import json

    for name, m in runs_by_seed.items():
        f = d / name / "rep0" / "metrics.json"
        f.parent.mkdir(parents=True)
        f.write_text(json.dumps(m))


def test_mode_rank_orders_the_pooled_report():
    from commsched.bench.gnn.tta import TTA_MODES, mode_rank

    ranks = [mode_rank(m) for m in ("vanilla", "vanilla-g8", "vanilla-bf16", "adaptive", "adaptive-g8",
                                    "adaptive-avg-eb0.5", "minibatch", "minibatch-g8", "nosuchmode")]
    at = TTA_MODES.index
    assert ranks == [at("vanilla")] * 2 + [at("vanilla-bf16")] + [at("adaptive")] * 3 + [at("minibatch")] * 2 \
        + [len(TTA_MODES)]
    assert at("vanilla") < at("adaptive") < at("minibatch")  # the full-graph modes, then sampling


def test_split_seed_reads_the_bench_run_names():
    assert split_seed("gcn-adaqp-s3") == ("gcn-adaqp", 3)
    assert split_seed("gcn-vanilla-bf16-s12") == ("gcn-vanilla-bf16", 12)
    assert split_seed("gcn-adaqp") is None and split_seed("gcn-adaqp-s") is None
    assert split_seed("gcn-adaqp-sx1") is None


def test_pool_report_over_separate_invocations(tmp_path, capsys):
    from commsched.bench.gnn import tta as gnn_tta

    runs = _runs()
    # seed 0 in one folder, seed 1 in another (written first: the pool orders by seed)
    a, b = tmp_path / "a", tmp_path / "b"
    _write_bench(b, {f"{v}-s1": rs[1] for v, rs in runs.items()})
    _write_bench(a, {f"{v}-s0": rs[0] for v, rs in runs.items()})
    res = gnn_tta.pool_report([b, a], tmp_path / "pooled")
    want = tta_rows(runs)
    for v in runs:
        for k in ("target", "epochs_to_target", "seconds_to_target", "speedup_vs_vanilla", "test_acc_per_run"):
            assert res["rows"][v][k] == want[v][k], (v, k)
    assert res["seeds"] == {"gcn-onebit": [0, 1], "gcn-vanilla": [0, 1]} and res["score"] == "acc"
    md = (tmp_path / "pooled" / "time_to_acc.md").read_text()
    assert "seeds per variant: gcn-vanilla [0, 1], gcn-onebit [0, 1]" in md and "| gcn-onebit | 0.8918 |" in md
    assert (tmp_path / "pooled" / "time_to_acc.png").read_bytes()[:8] == PNG_MAGIC
    # a seed in two folders, a folder with no runs: one clear error, exit 2
    dup = tmp_path / "dup"
    _write_bench(dup, {"gcn-vanilla-s0": runs["gcn-vanilla"][0]})
    with pytest.raises(ValueError, match="gcn-vanilla seed 0 \\(rep0\\) is in both"):
        gnn_tta.load_bench_runs([a, dup])
    (tmp_path / "empty").mkdir()
    assert gnn_tta.main([str(tmp_path / "empty"), "--out", str(tmp_path / "x")]) == 2
    assert "no VARIANT/repK/metrics.json" in capsys.readouterr().err
    assert gnn_tta.main([str(a), "--out", str(tmp_path / "x"), "--target-acc", "1.5"]) == 2
    assert "--target-acc is a validation accuracy in (0, 1], got 1.5" in capsys.readouterr().err
    assert gnn_tta.main([str(a), str(b), "--out", str(tmp_path / "cli")]) == 0
    assert "| gcn-vanilla |" in capsys.readouterr().out
    # a variant with fewer seeds than vanilla is paired with vanilla's run of the same seed
    c = tmp_path / "c"
    _write_bench(c, {"gcn-vanilla-s0": runs["gcn-vanilla"][0], "gcn-vanilla-s1": runs["gcn-vanilla"][1],
                     "gcn-onebit-s1": dict(runs["gcn-onebit"][0], config={"seed": 1})})
    one = gnn_tta.pool_report([c], tmp_path / "one")
    assert one["seeds"]["gcn-onebit"] == [1] and one["rows"]["gcn-onebit"]["speedup_vs_vanilla"] == 2.0  # 4 s / 2 s
    held = gnn_tta.pool_report([a, b], tmp_path / "held", sustain=2)
    assert held["rows"]["gcn-onebit"]["epochs_to_target"] == [None, None]  # 0.89, 0.9: one eval at the target
    assert held["rows"]["gcn-vanilla"]["epochs_to_target"] == [3, 2]
    assert "that starts 2 evaluations in a row" in held["table"]


def test_adaptive_bench_names():
    """``adaptive`` is in the time-to-accuracy comparison; ``-ebX`` sets its error budget,
    ``-avg`` its link model; ``-eb`` on another mode is refused."""
    from commsched.bench.gnn import compare as gnn
    from commsched.bench.gnn.compare import bench_run
    from commsched.gnn.exchange.modes import mode_config

    assert "adaptive" in gnn.TTA_MODES
    for name, ex in (("adaptive-eb0.5", {"error_budget": 0.5}),
                     ("adaptive-avg-eb.1", {"error_budget": 0.1, "link_costs": "averaged"})):
        assert bench_run(name)[0].mode == "adaptive" and bench_run(name)[0].exchange == mode_config("adaptive", **ex)
    with pytest.raises(ValueError, match="-eb0.5 sets --error-budget of --mode adaptive"):
        bench_run("vanilla-eb0.5")
