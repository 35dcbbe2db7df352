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
