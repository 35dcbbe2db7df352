"""``commsched demo``'s tables say what their figures are: the GNN accuracies come from a
few epochs on a synthetic graph, the MoE latencies from an emulated accelerator (the
benches are replaced by their summaries: milliseconds)."""

from __future__ import annotations

from commsched.bench import workloads


def _fake(summary):
    def run_bench(workload, argv):
        return summary
    return run_bench


def test_gnn_demo_footnotes_its_accuracy(monkeypatch, capsys, tmp_path):
    from commsched.bench.gnn import demo

    table = "| model | vanilla test acc | adaqp test acc |\n|---|---|---|\n| gcn | 0.37 | 0.36 |"
    monkeypatch.setattr(workloads, "run_bench", _fake({"meta": {"bandwidth": "1gbit"},
                                                       "extra_tables": {"AdaQP against Vanilla (per model)": table}}))
    assert demo.main(["--out", str(tmp_path), "--epochs", "8"]) == 0
    out = capsys.readouterr().out
    after = out.split(table, 1)[1]
    assert after.lstrip().startswith("* test accuracy: after 8 epochs on a synthetic 10,000-node graph of 10 classes")
    assert "far from converged" in after


def test_moe_demo_footnotes_its_emulated_latencies(monkeypatch, capsys, tmp_path):
    from commsched.bench.moe import demo

    med = {"static": {"latency_ms.p50": 30.0, "latency_ms.p95": 41.0, "imbalance": 2.0},
           "lina": {"latency_ms.p50": 20.0, "latency_ms.p95": 22.0, "imbalance": 1.1}}
    monkeypatch.setattr(workloads, "run_bench", _fake({"median": med}))
    assert demo.main(["--out", str(tmp_path), "--batches", "8"]) == 0
    out = capsys.readouterr().out
    after = out.split("| lina | 20 | 22 | 1.1 |", 1)[1]
    assert after.lstrip().startswith("* latencies: 8 batches of synthetic routing traces")
    assert "emulated accelerator, busy 100 us per row" in after
