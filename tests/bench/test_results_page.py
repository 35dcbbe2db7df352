"""The results page and the README's results table are what `commsched results` renders
from docs/results/headlines.json (so the three cannot drift apart), and a row's figure
imports from a bench's summary.json in the bench's own format. Pure: no runs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from commsched.bench import results_page as rp
from commsched.bench.gnn.tta import tta_rows
from commsched.results import write_json

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "results" / "headlines.json"


@pytest.fixture(scope="module")
def data() -> dict:
    return rp.load(DATA)


def test_committed_page_is_the_render(data):
    page = (ROOT / "docs" / "results.md").read_text()
    assert page == rp.render_page(data), "docs/results.md is stale: run `commsched results`"


def test_committed_readme_block_is_the_render(data):
    readme = (ROOT / "README.md").read_text()
    assert rp.splice_readme(readme, rp.render_readme_block(data)) == readme, \
        "README.md's results table is stale: run `commsched results`"


def test_page_has_every_row_and_links_its_method_pages(data):
    page = rp.render_page(data)
    for s in data["sections"]:
        assert f"## {s['title']}" in page
        assert (ROOT / "docs" / s["method"]).exists(), s["method"]
        for r in s["rows"]:
            assert r["headline"].replace("|", "\\|") in page
            assert f'<a id="{r["id"]}"></a>' in page, r["id"]  # guides link to results.md#<row id>
    for r in rp.rows(data):  # a miss says what limits it
        if r.get("figure") is not None and str(r.get("met", "")).startswith("no"):
            assert r.get("limit"), r["id"]


def test_readme_block_rows_in_order():
    d = {"setting": "Measured here. More.", "picks": [["x", "use [a](gnn.md)"]],
         "sections": [{"id": "s", "title": "S", "rows": [
             {"id": "b", "headline": "second", "command": "c", "figure": 2.0, "unit": "x", "readme": 2},
             {"id": "a", "headline": "first", "command": "c", "figure": 1.5, "unit": "x", "readme": 1,
              "goal": ">= 2x", "met": "no"},
             {"id": "c", "headline": "not shown", "command": "c", "figure": 1.0}]}]}
    block = rp.render_readme_block(d)
    assert block.index("first") < block.index("second") and "not shown" not in block
    assert "| **1.5x** | >= 2x | **no** |" in block
    assert "(docs/gnn.md)" in block  # links rebased from docs/ to the repository root
    readme = f"intro\n{rp.README_BEGIN}\nold\n{rp.README_END}\nrest\n"
    out = rp.splice_readme(readme, block)
    assert out.startswith("intro\n") and out.endswith("\nrest\n") and "old" not in out


def test_check_rejects_bad_rows():
    good = {"sections": [{"id": "s", "title": "S", "rows": [{"id": "a", "headline": "h", "command": "c"}]}]}
    rp.check(good)
    bad = copy.deepcopy(good)
    bad["sections"][0]["rows"].append({"id": "a", "headline": "h", "command": "c"})
    with pytest.raises(ValueError, match="twice"):
        rp.check(bad)
    bad = copy.deepcopy(good)
    bad["sections"][0]["rows"][0]["figure"] = "1.4x"
    with pytest.raises(ValueError, match="number or null"):
        rp.check(bad)


def _run(seed: int, val: list[float], epoch_s: float, test: float) -> dict:
    """One run's metrics.json, the fields time-to-accuracy reads."""
    return {"val_acc_per_eval": val, "eval_epochs": list(range(len(val))),
            "epoch_time_s_per_epoch": [epoch_s] * len(val), "epoch_time_s": epoch_s,
            "epochs": len(val), "test_acc": test, "config": {"seed": seed}}


def _summary(tmp_path: Path) -> Path:
    """A bench gnn summary.json as the bench writes it: tta_rows over the runs, under
    "time_to_acc", and the invocation under "meta", written by the bench's writer."""
    runs = {"gcn-vanilla": [_run(0, [0.5, 0.9, 0.99, 1.0], 4.0, 0.97),
                            _run(1, [0.5, 0.8, 0.99, 1.0], 4.0, 0.96)],
            "gcn-adaptive": [_run(0, [0.5, 0.9, 0.99, 1.0], 0.5, 0.97),
                             _run(1, [0.6, 0.99, 1.0, 1.0], 0.5, 0.965)]}
    rows = tta_rows(runs)
    summary = {"time_to_acc": {"rows": rows, "target_acc": None, "target_frac": 0.98, "regime": "300mbit"},
               "meta": {"command": "commsched bench gnn --nproc 4 --metric time-to-acc --seeds 0,1 --out X"}}
    return write_json(tmp_path / "summary.json", summary)


def test_import_from_summary_sets_figure_detail_met_command(data, tmp_path):
    path = _summary(tmp_path)
    summary = json.loads(path.read_text())
    d = copy.deepcopy(data)
    r = rp.import_summary(d, "gnn-adaptive-syn-300mbit", summary)
    # target 0.98 x 1.0: vanilla reaches it after 3 epochs (12 s) on both seeds; adaptive after 3 (1.5 s) and 2 (1.0 s)
    assert r["figure"] == pytest.approx(10.0)  # median of 12/1.5 = 8 and 12/1.0 = 12
    assert r["met"] == "yes"
    assert r["command"] == summary["meta"]["command"]
    assert "reached on 2/2 seeds" in r["detail"] and "96.75%" in r["detail"]
    page = rp.render_page(d)
    assert "**10x**" in page and "pending" not in page.split("## GNN training")[1].split("## MoE")[0]


def test_cli_imports_a_row_and_checks(tmp_path, data):
    path = _summary(tmp_path)
    d = tmp_path / "headlines.json"
    d.write_text(json.dumps(data))
    page, readme = tmp_path / "results.md", tmp_path / "README.md"
    readme.write_text(f"top\n{rp.README_BEGIN}\n{rp.README_END}\nbottom\n")
    assert rp.main(["--data", str(d), "--out", str(page), "--readme", str(readme), "--check"]) == 1
    assert rp.main(["--data", str(d), "--out", str(page), "--readme", str(readme),
                    "--from-summary", str(path), "--row", "gnn-adaptive-syn-300mbit"]) == 0
    assert rp.find_row(rp.load(d), "gnn-adaptive-syn-300mbit")["figure"] == pytest.approx(10.0)
    assert "**10x**" in readme.read_text()
    assert rp.main(["--data", str(d), "--out", str(page), "--readme", str(readme), "--check"]) == 0
    # a wrong path names what was there
    assert rp.main(["--data", str(d), "--out", str(page), "--no-readme", "--from-summary", str(path),
                    "--row", "moe-best-vs-fifo"]) == 2
    with pytest.raises(KeyError, match="have: gcn-adaptive, gcn-vanilla"):
        rp.lookup(json.loads(path.read_text()), "time_to_acc/rows/gcn-onebit/reached")


def _bad_results_files(d: Path) -> dict[str, tuple[list[str], str]]:
    """argv tails of `commsched results` that cannot work, each with its one error line."""
    good = d / "good.json"
    good.write_text(DATA.read_text())
    (d / "trunc.json").write_text('{"sections": ')
    (d / "list.json").write_text("[1]")
    (d / "rows.json").write_text('{"sections": [{"id": "s", "title": "S", "rows": 5}]}')
    (d / "section.json").write_text('{"sections": [5]}')
    (d / "plain.md").write_text("no markers here\n")
    row = ["--row", "gnn-adaptive-syn-300mbit"]
    return {
        "missing data": (["--data", str(d / "nope.json")], f"results data {d / 'nope.json'}: cannot read it "
                                                           "(No such file or directory)"),
        "truncated data": (["--data", str(d / "trunc.json")], f"results data {d / 'trunc.json'}: not readable JSON"),
        "data not an object": (["--data", str(d / "list.json")], f"results data {d / 'list.json'}: expected a "
                                                                 "JSON object with 'sections', got list"),
        "rows not a list": (["--data", str(d / "rows.json")], f"results data {d / 'rows.json'}: section 's': "
                                                              "'rows' must be a list of objects"),
        "section not an object": (["--data", str(d / "section.json")], "section 0 must be an object, got int"),
        "data is a folder": (["--data", str(d)], f"results data {d}: cannot read it (Is a directory)"),
        "missing summary": (["--data", str(good), "--from-summary", str(d / "none.json"), *row],
                            f"summary {d / 'none.json'}: cannot read it (No such file or directory)"),
        "truncated summary": (["--data", str(good), "--from-summary", str(d / "trunc.json"), *row],
                              f"summary {d / 'trunc.json'}: not readable JSON"),
        "summary not an object": (["--data", str(good), "--from-summary", str(d / "list.json"), *row],
                                  "no item 'time_to_acc' in a list of 1"),
        "unknown row": (["--data", str(good), "--from-summary", str(d / "list.json"), "--row", "nope"],
                        "no row 'nope' in the results data; rows: gnn-adaptive-syn-300mbit"),
        "summary without row": (["--data", str(good), "--from-summary", str(d / "list.json")],
                                "--from-summary and --row go together"),
        "README without markers": (["--data", str(good), "--readme", str(d / "plain.md")],
                                   "README has no results markers"),
    }


def test_cli_bad_files_are_one_line_exit_2_and_change_nothing(tmp_path, capsys):
    d = tmp_path / "in"
    d.mkdir()
    cases = _bad_results_files(d)
    before = {f: f.read_bytes() for f in d.iterdir()}
    page = tmp_path / "results.md"
    for name, (argv, says) in cases.items():
        assert rp.main([*argv, "--out", str(page)]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("commsched results: ") and says in err, (name, err)
        assert err.count("\n") == 1 and "Traceback" not in err, (name, err)
        assert {f: f.read_bytes() for f in d.iterdir()} == before, name  # the data file is left as it was
    assert not page.exists()  # nothing rendered from bad input
