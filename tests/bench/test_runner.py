"""The bench runner: summaries and ratios (pure), an inline fake workload, a tiny torchrun
workload, and stopping a variant that runs too long."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from commsched.bench import (
    RunContext,
    Variant,
    Workload,
    breakdown_medians,
    run_bench,
    run_variant,
    summarize_runs,
    torchrun_command,
)
from commsched.bench.emulation import netem_prefix
from commsched.bench.runner import _stop
from commsched.cluster.netem import check_requirements

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _wl(**kw) -> Workload:
    base = dict(name="fake", description="fake", key_metrics=("time_s", "acc"), higher_is_better=("acc",))
    base.update(kw)
    return Workload(**base)


def test_summarize_runs_ratios():
    runs = {"base": [{"time_s": 4.0, "acc": 0.5}, {"time_s": 2.0, "acc": 0.7}, {"time_s": 3.0, "acc": 0.6}],
            "fast": [{"time_s": 1.0, "acc": 0.9}, {"time_s": 1.5, "acc": 0.3}, {"time_s": 0.5, "acc": 0.6}],
            "broken": [{"time_s": 0.0}]}
    s = summarize_runs(_wl(), runs)
    assert s["baseline"] == "base"
    assert s["median"]["base"] == {"time_s": 3.0, "acc": 0.6}
    assert s["median"]["fast"] == {"time_s": 1.0, "acc": 0.6}
    assert s["speedup_vs_baseline"]["fast"] == {"time_s": 3.0, "acc": 1.0}  # lower time: base/variant
    assert s["speedup_vs_baseline"]["broken"] == {"time_s": None, "acc": None}  # zero / missing
    assert s["repeats"] == {"base": 3, "fast": 3, "broken": 1}


def test_breakdown_medians():
    runs = {"a": [{"breakdown_s": {"comm": 1.0, "quant": 0.5}}, {"breakdown_s": {"comm": 3.0, "quant": 0.5}},
                  {"breakdown_s": {"comm": 2.0, "quant": 1.5, "assign": 0.25}}],
            "b": [{"time_s": 1.0}]}
    assert breakdown_medians(runs) == {"a": {"comm": 2.0, "quant": 0.5, "assign": 0.25}}


def test_torchrun_command_multi_node():
    v = Variant("v", "pkg.mod", ("--x", "1"))
    one = torchrun_command(v, 2, Path("/o"))
    assert one[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m"]
    many = torchrun_command(v, 3, Path("/o"), nnodes=2, node_rank="{host}", rdzv_endpoint="h:1",
                            local_addr="a", rdzv_conf="is_host=1")
    assert "--local-addr=a" in many and "--rdzv-conf=is_host=1" in many and "--nnodes=2" in many
    assert many[-5:] == ["pkg.mod", "--x", "1", "--out", "/o"]
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        torchrun_command(v, 2, Path("/o"), nnodes=2)
    from commsched.priority.policy import FifoConfig  # a variant is a label and a config

    c = Variant("fifo", "pkg.mod", ("--x", "1"), config=FifoConfig(launch="program", bucket_bytes=4096),
                defaults={"launch": "program"})  # the parser's default, not the field's: not written
    assert torchrun_command(c, 2, Path("/o"))[-7:] == ["pkg.mod", "--bucket-bytes", "4096", "--x", "1", "--out", "/o"]


def test_inline_workload_writes_everything(tmp_path):
    # per repeat: variant a takes 2 s then 4 s, variant b 1 s each time; b is 3x faster at the median
    table = [{"a": 2.0, "b": 1.0}, {"a": 4.0, "b": 1.0}]

    def inline(args, out, progress):
        rep = len(calls)
        calls.append(out)
        progress(f"inline repeat {rep}")
        return {v: {"time_s": t, "acc": 0.5 if v == "a" else 0.75,
                    "breakdown_s": {"comm": t / 2, "central": t / 4, "marginal": t / 4}}
                for v, t in table[rep].items()}

    calls: list[Path] = []
    lines: list[str] = []
    wl = _wl(inline=inline)
    s = run_bench(wl, ["--repeat", "2", "--out", str(tmp_path)], ctx=RunContext(), progress=lines.append)
    assert len(calls) == 2
    for v in ("a", "b"):
        for rep in (0, 1):
            m = json.loads((tmp_path / v / f"rep{rep}" / "metrics.json").read_text())
            assert m["time_s"] == table[rep][v]
    assert s["median"]["a"]["time_s"] == 3.0 and s["speedup_vs_baseline"]["b"]["time_s"] == 3.0
    assert s["speedup_vs_baseline"]["b"]["acc"] == 1.5
    assert s["breakdown_s"]["a"] == {"comm": 1.5, "central": 0.75, "marginal": 0.75}
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["speedup_vs_baseline"] == s["speedup_vs_baseline"]
    assert on_disk["meta"]["bandwidth"] is None and on_disk["meta"]["machine"]["cores"] == os.cpu_count()
    assert on_disk["meta"]["command"].startswith("commsched bench fake --repeat 2")
    md = (tmp_path / "summary.md").read_text()
    assert "| b | 1 | 0.75 |" in md and "| b | 3x | 1.5x |" in md and "emulated rate: none (unshaped)" in md
    assert "![breakdown](breakdown.png)" in md
    assert (tmp_path / "breakdown.png").read_bytes()[:8] == PNG_MAGIC
    assert any("inline repeat 1" in x for x in lines) and any("done in" in x for x in lines)


def test_inline_workload_refuses_emulation(tmp_path):
    wl = _wl(inline=lambda a, o, p: {})
    with pytest.raises(ValueError, match="inline"):
        run_bench(wl, ["--out", str(tmp_path)], ctx=RunContext(bandwidth="1gbit", rate_bps=10**9))


@pytest.mark.slow
def test_torchrun_workload_end_to_end(tmp_path):
    """Two tiny torchrun variants (2 ranks each), repeated and interleaved; checks files and ratios."""
    wl = Workload(name="check", description="check", key_metrics=("a2a_time_s", "bytes_sent_total"),
                  variants=lambda a: [Variant("direct", "commsched.bench.micro.netem_check", ("--pattern", "direct", "--scale", "2")),
                                      Variant("ring", "commsched.bench.micro.netem_check", ("--pattern", "ring", "--scale", "2"))])
    lines: list[str] = []
    s = run_bench(wl, ["--nproc", "2", "--out", str(tmp_path), "--timeout", "120", "--bandwidth", "none"],
                  progress=lines.append)
    ms = {v: json.loads((tmp_path / v / "rep0" / "metrics.json").read_text()) for v in ("direct", "ring")}
    for m in ms.values():
        assert m["ok"] and m["world_size"] == 2
    assert s["speedup_vs_baseline"]["ring"]["a2a_time_s"] == pytest.approx(
        ms["direct"]["a2a_time_s"] / ms["ring"]["a2a_time_s"])
    assert s["speedup_vs_baseline"]["ring"]["bytes_sent_total"] == 1.0
    assert (tmp_path / "breakdown.png").read_bytes()[:8] == PNG_MAGIC
    assert set(s["breakdown_s"]) == {"direct", "ring"} and set(s["breakdown_s"]["ring"]) == {"init", "comm", "verify"}
    assert [x.split(":")[1].split()[0] for x in lines if "] run " in x] == ["direct", "ring"]
    assert (tmp_path / "direct" / "rep0" / "log.txt").read_text().startswith("# ")
    assert "commsched bench check --bandwidth none --nproc 2" in (tmp_path / "summary.md").read_text()


def test_run_variant_timeout_stops_the_process_group(tmp_path):
    marker = tmp_path / "pid"
    ctx = RunContext(launch=lambda v, n, d: ["sh", "-c", f"sleep 60 & echo $! > {marker}; wait"])
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="ran past 1 s"):
        run_variant(Variant("slow", "none"), 1, tmp_path / "v", ctx, timeout_s=1.0)
    assert time.monotonic() - t < 10
    child = int(marker.read_text())
    time.sleep(0.2)
    assert _gone(child)  # the background sleep in the same group is gone too


SIGTERM_BENCH = """
import subprocess, sys, time
from pathlib import Path
from commsched.bench.runner import RunContext, Variant, run_variant
tmp, marker, window = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "window"
if window:  # the variant runs, and is seen running, before Popen has returned (a loaded machine)
    class LatePopen(subprocess.Popen):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            deadline = time.monotonic() + 30
            while not (tmp / "sent").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
    subprocess.Popen = LatePopen
ctx = RunContext(launch=lambda v, n, d: ["sh", "-c", f"sleep 60 & echo $! > {marker}.tmp; mv {marker}.tmp {marker}; wait"])
run_variant(Variant("slow", "none"), 1, tmp / "v", ctx, timeout_s=60.0)
"""


@pytest.mark.parametrize("when", ["running", "window"])
def test_sigterm_to_the_bench_stops_the_running_variant(tmp_path, when):
    """A bench stopped by SIGTERM (a scheduler, ``kill``) stops its variant's process group
    instead of orphaning it, and exits 128 + SIGTERM: while the variant runs, and while it
    starts (``window``: the signal lands after the variant's group exists, before ``Popen``
    has returned, the race a loaded machine hit)."""
    import signal
    import sys

    marker = tmp_path / "pid"  # written whole (a rename) once the variant's sleep runs
    bench = subprocess.Popen([sys.executable, "-c", SIGTERM_BENCH, str(tmp_path), str(marker), when])
    child = None
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), f"the variant never started (bench exit {bench.poll()})"
        child = int(marker.read_text())
        bench.send_signal(signal.SIGTERM)
        (tmp_path / "sent").touch()
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        # the bench returns once no process of the group runs; a zombie may wait for init
        assert _gone(child)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        if child is not None and not _gone(child):
            os.kill(child, signal.SIGKILL)  # leave no sleep behind a failed run


def _gone(pid: int) -> bool:
    """No such process, or only a zombie left for init to reap."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_stop_is_a_no_op_for_finished_processes():
    p = subprocess.Popen(["true"], start_new_session=True)
    p.wait()
    _stop(p)
    assert p.returncode == 0


PROBLEM = check_requirements(os.geteuid())


@pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")
@pytest.mark.root
def test_run_variant_timeout_under_netem_removes_namespace(tmp_path):
    """The runner's polite stop (SIGTERM) lets the emulator delete its namespace."""
    ns_file = tmp_path / "ns"
    ctx = RunContext(launch=lambda v, n, d: netem_prefix(100 * 10**6) + [
        "sh", "-c", f"ip netns identify $$ > {ns_file}; exec sleep 60"])
    with pytest.raises(RuntimeError, match="ran past"):
        run_variant(Variant("slow", "none"), 1, tmp_path / "v", ctx, timeout_s=2.0)
    ns = ns_file.read_text().strip()
    assert ns.startswith("commsched-")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ns not in listed


def _gnn_rows(model: str, mode: str, ep: float, acc: float) -> dict:
    return {"epoch_time_s": ep, "test_acc": acc, "bytes_sent_per_epoch": 1e6, "loss": [1.0],
            "breakdown_s": {"comm": ep / 2, "quant": 0.0}, "mode": mode, "model": model}


def test_bench_gnn_compares_within_each_model_and_says_what_to_pick(tmp_path, capsys):
    """Ratios are against Vanilla of the same model (sage-vanilla was compared with
    gcn-vanilla); summary.md ends with a pick per model and why; the help lists the modes and
    the emulation flags; --modes alone says that both default models run."""
    import argparse

    from commsched.bench import load_workload
    from commsched.bench.gnn.compare import PICK_ACC_TOLERANCE, baseline_of, summarize
    from commsched.bench.runner import build_parser, summary_markdown
    from commsched.gnn.exchange.modes import MODE_NAMES

    wl = load_workload("gnn")
    runs = {"gcn-vanilla": [_gnn_rows("gcn", "vanilla", 2.0, 0.80)],
            "gcn-adaqp": [_gnn_rows("gcn", "adaqp", 0.5, 0.80)],
            "gcn-onebit": [_gnn_rows("gcn", "onebit", 0.4, 0.80 - 2 * PICK_ACC_TOLERANCE)],
            "sage-vanilla": [_gnn_rows("sage", "vanilla", 4.0, 0.70)],
            "sage-uniform": [_gnn_rows("sage", "uniform", 5.0, 0.70)]}
    s = summarize_runs(wl, runs)
    assert s["baseline"] == {"gcn-adaqp": "gcn-vanilla", "gcn-onebit": "gcn-vanilla",
                             "sage-uniform": "sage-vanilla"}
    assert s["speedup_vs_baseline"]["sage-uniform"]["epoch_time_s"] == 0.8  # 4.0 / 5.0, not 2.0 / 5.0
    assert "sage-vanilla" not in s["speedup_vs_baseline"]
    assert baseline_of("sage-adaqp-s1", ["gcn-vanilla-s1", "sage-vanilla-s1", "sage-adaqp-s1"]) == "sage-vanilla-s1"
    a = argparse.Namespace(bits=4, bandwidth="300mbit", metric="epoch", target_acc=None, modes=None)
    extra = summarize(runs, a, tmp_path)
    pick = extra["extra_tables"]["Which mode to pick here"]
    assert pick.splitlines()[0].startswith("- gcn: pick **adaqp** at 300mbit: the fastest epoch (4.00x")
    assert pick.splitlines()[1].startswith("- sage: pick **vanilla** at 300mbit: no mode is faster")
    md = summary_markdown(wl, {**s, **extra}, {"command": "x", "machine": {"cpu": "c", "cores": 2},
                                               "nproc": 4, "repeat": 1})
    assert "Ratios against each variant's baseline" in md and "| gcn-adaqp | gcn-vanilla |" in md
    assert "## Which mode to pick here" in md
    p = build_parser(wl)
    helptext = p.format_help()
    assert all(m in " ".join(helptext.split()) for m in MODE_NAMES)
    assert "--bandwidth RATE" in helptext and "--hosts K" in helptext
    ns = p.parse_args(["--modes", "vanilla,adaqp"])
    ns.hosts, ns.bandwidth, ns.rate_bps = 1, None, None
    names = [v.name for v in wl.variants(ns)]
    assert names == ["gcn-vanilla", "gcn-adaqp", "sage-vanilla", "sage-adaqp"]
    assert "--modes without --models runs them for every default model (gcn,sage)" in capsys.readouterr().err
