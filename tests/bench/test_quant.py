"""The ``commsched bench quant`` workload runs end to end (tiny sizes; no timing asserted)."""

from __future__ import annotations

import json

from commsched.bench import load_workload, run_bench


def test_quant_workload_runs_and_reports(tmp_path):
    assert load_workload("quant").inline is not None
    summary = run_bench("quant", ["--rows", "64", "--dim", "9", "--rounds", "2", "--widths", "2,8",
                                  "--impl", "eager", "--out", str(tmp_path)], progress=lambda s: None)
    assert set(summary["median"]) == {"b2", "b8", "mixed"}
    m = json.loads((tmp_path / "b8" / "rep0" / "metrics.json").read_text())
    assert m["wire_bytes"] == 64 * (9 + 8) and m["bits"] == [8]
    for k in ("clone_GBps", "quantize_GBps", "dequantize_GBps", "dequantize_into_GBps",
              "quantize_vs_clone", "dequantize_vs_clone"):
        assert m[k] > 0
    md = (tmp_path / "summary.md").read_text()
    assert "quantize / clone" in md and "goal >= 1.5x" in md


def _fake_measure(q_ratio: float, d_ratio: float):
    def measure(rows, dim, widths, rounds, **kw):
        out = {}
        for b in widths:
            out[f"b{b}"] = {"rows": rows, "dim": dim, "rounds": rounds, "threads": 1, "impl": "auto",
                            "bits": [b], "wire_bytes": 1, "clone_GBps": 2.0,
                            "quantize_GBps": 2.0 * q_ratio, "dequantize_GBps": 2.0 * d_ratio,
                            "quantize_vs_clone": q_ratio, "dequantize_vs_clone": d_ratio,
                            "quantize_vs_clone_cpu": q_ratio, "dequantize_vs_clone_cpu": d_ratio,
                            "dequantize_into_GBps": 9.0, "dequantize_into_vs_clone": 4.5}
        return out
    return measure


def test_bench_fails_loudly_below_half_its_goal(tmp_path, monkeypatch, capsys):
    """The bench's own ratios decide: 0.7x quantize (goal 1.5x, floor 0.75x) is a regression;
    the summary is still written, the command exits 1 naming the width."""
    from commsched import cli
    from commsched.bench.micro import quant as BQ

    monkeypatch.setattr(BQ, "measure", _fake_measure(0.7, 1.2))
    rc = cli.main(["bench", "quant", "--widths", "4", "--no-mixed", "--out", str(tmp_path / "bad")])
    assert rc == 1
    err = capsys.readouterr().err
    assert "regression floor" in err and "b4 quantize at 0.70x" in err
    md = (tmp_path / "bad" / "summary.md").read_text()
    assert "FAILED: b4 quantize" in md
    # above the floor but below the goal: reported as not met, no failure
    monkeypatch.setattr(BQ, "measure", _fake_measure(1.0, 0.6))
    assert cli.main(["bench", "quant", "--widths", "4", "--no-mixed", "--out", str(tmp_path / "ok")]) == 0
    md = (tmp_path / "ok" / "summary.md").read_text()
    assert "NOT met" in md and "regression floor (0.5 x each goal): held" in md


def test_bench_floor_is_not_checked_on_tiny_messages(tmp_path, monkeypatch):
    from commsched.bench.micro import quant as BQ

    monkeypatch.setattr(BQ, "measure", _fake_measure(0.1, 0.1))
    summary = run_bench("quant", ["--rows", "64", "--dim", "9", "--widths", "2", "--no-mixed",
                                  "--out", str(tmp_path)], progress=lambda s: None)
    assert summary["regressions"] == []
    assert "not checked" in (tmp_path / "summary.md").read_text()
