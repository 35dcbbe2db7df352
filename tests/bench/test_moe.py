"""The moe-train bench workload: variants, command lines and the summary (no runs)."""

from __future__ import annotations

import json

from commsched.bench import build_parser, load_workload
from commsched.moe.train.cli import build_parser as train_parser
from commsched.moe.train.cli import config_from_args


def _fake_metrics(step: float, a2a: float, alone: float | None, losses: list[float]) -> dict:
    return {"step_time_s": step, "a2a_time_s": a2a, "allreduce_time_s": 0.5, "a2a_alone_time_s": alone,
            "allreduce_wait_s": 0.1, "val_loss": losses[-1], "loss": losses,
            "sizes": {"non_expert_grad_bytes": 1 << 20, "a2a_payload_bytes_per_step": 2 << 20}}


def test_workload_variants_parse_as_training_configs(tmp_path):
    wl = load_workload("moe-train")
    assert wl.default_bandwidth and {"step_time_s", "a2a_time_s", "allreduce_time_s"} <= set(wl.key_metrics)
    args = build_parser(wl).parse_args(["--steps", "5", "--chunks", "3"])
    variants = {v.name: v for v in wl.variants(args)}
    assert list(variants) == ["deepspeed", "fifo", "lina", "lina-overlap"]
    cfgs = {n: config_from_args(train_parser().parse_args([*v.argv, "--out", str(tmp_path)]))
            for n, v in variants.items()}
    assert cfgs == {n: v.config for n, v in variants.items()}  # a variant is its config, run as flags
    assert cfgs["deepspeed"].impl == "deepspeed"
    assert cfgs["fifo"].schedule.policy == "fifo" and not cfgs["fifo"].dispatch.pipeline
    assert cfgs["lina"].schedule.policy == "lina" and cfgs["lina"].dispatch.pipeline and cfgs["lina"].dispatch.chunks == 3
    ov = cfgs["lina-overlap"]
    assert ov.schedule.policy == "lina-overlap" and ov.dispatch == cfgs["lina"].dispatch
    assert ov.schedule.hold_in_block == cfgs["lina"].schedule.hold_in_block
    # the same model, data and seed in every variant
    assert len({(c.model, c.steps, c.seed, c.batch_size) for c in cfgs.values()}) == 1
    assert cfgs["lina"].fallback_exchange and cfgs["lina-overlap"].fallback_exchange  # the trainer's default
    # --no-fallback-exchange reaches the schedules that probe (fifo and DeepSpeed do not probe)
    nfx = build_parser(wl).parse_args(["--no-fallback-exchange"])
    got = {v.name: config_from_args(train_parser().parse_args([*v.argv, "--out", str(tmp_path)])).fallback_exchange
           for v in wl.variants(nfx) if v.name.startswith("lina")}
    assert got == {"lina": False, "lina-overlap": False}


def test_grad_bits_variants(tmp_path):
    """--grad-bits B adds fifo-gB, lina-gB, lina-overlap-gB; with --a2a-bits A the three
    -qA-gB too, each the same run as its base variant with --grad-bits B (and --a2a-bits A)."""
    from commsched.bench.moe.train import compressed, ours

    wl = load_workload("moe-train")
    names = [v.name for v in wl.variants(build_parser(wl).parse_args(["--grad-bits", "8"]))]
    assert names == ["deepspeed", "fifo", "lina", "lina-overlap", "fifo-g8", "lina-g8", "lina-overlap-g8"]
    vs = {v.name: v for v in wl.variants(build_parser(wl).parse_args(["--grad-bits", "16", "--a2a-bits", "8"]))}
    assert {"fifo-q8-g16", "lina-q8-g16", "lina-overlap-q8-g16", "lina-q8", "lina-overlap-q8"} <= set(vs)
    cfg = {n: config_from_args(train_parser().parse_args([*v.argv, "--out", str(tmp_path)])) for n, v in vs.items()}
    for n, c in cfg.items():
        assert c.grad_bits == (16 if n.endswith("-g16") else 32), n
        assert c.dispatch.a2a_bits == (8 if "-q8" in n else 32), n
    base = cfg["lina-overlap"]
    assert cfg["lina-overlap-q8-g16"].schedule == base.schedule and cfg["fifo-q8-g16"].schedule == cfg["fifo"].schedule
    assert compressed(cfg["lina-q8"]) and compressed(cfg["fifo-g16"]) and not compressed(cfg["lina-overlap"])
    assert all(c.grad_batch_bytes == 4 << 20 for c in cfg.values())  # the trainer's default batches
    # --grad-unbatched: fifo-b0-gB, lina-b0-gB (and -qA-gB), their runs with every launch summed alone;
    # --grad-batch-bytes reaches every -gB variant but those
    ab = build_parser(wl).parse_args(["--grad-bits", "8", "--a2a-bits", "8", "--grad-unbatched",
                                      "--grad-batch-bytes", "65536"])
    vs = {v.name: v for v in wl.variants(ab)}
    cfg = {n: config_from_args(train_parser().parse_args([*v.argv, "--out", str(tmp_path)])) for n, v in vs.items()}
    assert cfg["lina-b0-g8"].grad_batch_bytes == 0 and cfg["lina-b0-q8-g8"].grad_batch_bytes == 0
    assert cfg["lina-g8"].grad_batch_bytes == 65536 and cfg["fifo-q8-g8"].grad_batch_bytes == 65536
    import dataclasses
    assert cfg["fifo-b0-g8"].grad_batch_bytes == 0 and cfg["fifo-b0-q8-g8"].grad_batch_bytes == 0
    for n, base in (("lina-b0-g8", "lina-g8"), ("lina-b0-q8-g8", "lina-q8-g8"), ("fifo-b0-g8", "fifo-g8"),
                    ("fifo-b0-q8-g8", "fifo-q8-g8")):
        assert dataclasses.replace(cfg[n], grad_batch_bytes=65536) == cfg[base]
        assert compressed(cfg[n])
    assert "lina-b0-g8" not in [v.name for v in wl.variants(build_parser(wl).parse_args(["--grad-bits", "8"]))]
    assert ours(["deepspeed", "fifo", "fifo-g8"]) == ["fifo", "fifo-g8"]


def test_summary_tables_and_plots(tmp_path):
    wl = load_workload("moe-train")
    args = build_parser(wl).parse_args([])
    runs = {"deepspeed": [_fake_metrics(3.0, 1.2, None, [5.0, 4.0, 3.5])],
            "fifo": [_fake_metrics(2.0, 0.8, 0.6, [5.0, 4.0, 3.6])],
            "lina": [_fake_metrics(1.6, 0.62, 0.6, [5.0, 4.0, 3.6])],
            "lina-overlap": [_fake_metrics(1.25, 0.6, 0.6, [5.0, 4.0, 3.6])]}
    tl = {"step": 2, "ranks": [[{"kind": "a2a", "key": 0, "nbytes": 10, "ready_s": 0.0, "start_s": 0.0, "end_s": 0.1},
                                {"kind": "allreduce", "key": 0, "nbytes": 10, "ready_s": 0.1, "start_s": 0.1,
                                 "end_s": 0.3}]] * 2}
    for v in ("fifo", "lina", "lina-overlap"):
        d = tmp_path / v / "rep0"
        d.mkdir(parents=True)
        if v == "lina-overlap":  # its records reach into the next forward pass
            tl = {**tl, "ranks": [r + [{"kind": "forward", "key": 0, "nbytes": 0, "ready_s": 0.2, "start_s": 0.2,
                                        "end_s": 0.5},
                                       {"kind": "update", "key": 0, "nbytes": 0, "ready_s": 0.2, "start_s": 0.3,
                                        "end_s": 0.31}] for r in tl["ranks"]]}
        (d / "timeline.json").write_text(json.dumps(tl))
    extra = wl.summarize(runs, args, tmp_path)
    table = extra["extra_tables"]["Lina against fifo and DeepSpeed (medians of per-repeat ratios)"]
    assert "| step time: fifo / lina (goal >= 1.0; >= 1.3 per collective) | 1.25x |" in table
    assert "| step time: deepspeed / lina (goal >= 1.4) | 1.88x |" in table
    assert "| all-to-all share of a fifo step | 0.4 |" in table
    assert (tmp_path / "timeline.png").stat().st_size > 0 and (tmp_path / "loss.png").stat().st_size > 0
    assert "max gap to fifo" in extra["extra_tables"]["Loss curves"]
    assert "| step time: fifo / lina-overlap (goal >= 1.0; >= 1.4 per collective) | 1.6x |" in table
    assert "lina-overlap step / its bound (goal <= 1.15)" in table
    # the contention of fifo's all-to-all (0.8 / 0.6) against the paper's median 1.83x
    assert "| contention against the paper's median (goal 0.8-1.2) | 0.729x |" in table


def test_collective_link_model_binds_the_commsched_reductions(tmp_path):
    """Under --link-model collective the runner hands the workload the address of the
    reduction's link class; every commsched variant's config carries it (DeepSpeed's own
    reduction does not use it: --reduce-address is an option of --impl commsched)."""
    wl = load_workload("moe-train")
    assert wl.default_link_model == "collective"
    args = build_parser(wl).parse_args([])
    args.reduce_address = "127.0.0.2"
    for v in wl.variants(args):
        cfg = config_from_args(train_parser().parse_args([*v.argv, "--out", str(tmp_path)]))
        assert cfg.schedule.reduce_address == ("127.0.0.2" if cfg.impl == "commsched" else None)
    args.reduce_address = None
    for v in wl.variants(args):
        cfg = config_from_args(train_parser().parse_args([*v.argv, "--out", str(tmp_path)]))
        assert cfg.schedule.reduce_address is None


def test_overlap_bound_is_the_larger_of_compute_and_link():
    """Hand-worked: 4 ranks share one 8 Mbit/s link (1e6 B/s); the ring allreduce of 1 MiB
    puts 2 * 3 * 1 MiB on it (6.29 s), the all-to-all 0.5 s more."""
    from commsched.bench.moe.train import overlap_bound

    link, bound = overlap_bound(2.0, 1 << 20, 0.5, 4, 8e6)
    assert abs(link - (6 * (1 << 20) / 1e6 + 0.5)) < 1e-9 and bound == link
    assert overlap_bound(9.0, 1 << 20, 0.5, 4, 8e6)[1] == 9.0  # compute-bound
    assert overlap_bound(1.0, None, 0.5, 4, 8e6) == (None, None)


def test_device_and_dtype_reach_every_variant(tmp_path):
    wl = load_workload("moe-train")
    default = build_parser(wl).parse_args([])
    assert (default.device, default.dtype) == ("auto", "float32")
    args = build_parser(wl).parse_args(["--device", "cpu", "--dtype", "bfloat16"])
    for v in wl.variants(args):
        cfg = config_from_args(train_parser().parse_args([*v.argv, "--out", str(tmp_path)]))
        assert (cfg.device, cfg.dtype) == ("cpu", "bfloat16"), v.name


def test_a2a_parity_widths_and_plot(tmp_path):
    """The parity bench's widths: A (--a2a-bits), gB (--grad-bits), AgB (both); the plot
    takes every label."""
    import pytest

    from commsched.bench.moe.a2a_parity import gaps, main, parse_width, plot, width_label

    assert [parse_width(t) for t in ("32", "8", "g8", "8g16")] == [(32, 32), (8, 32), (32, 8), (8, 16)]
    assert [width_label(*parse_width(t)) for t in ("32", "8", "g8", "8g16")] == ["32", "8", "g8", "8g16"]
    for bad in ("", "g", "8g", "x8", "8 g8"):
        with pytest.raises(ValueError, match="is not a width"):
            parse_width(bad)
    assert main(["--out", str(tmp_path / "bad"), "--bits", "32,q8"]) == 2  # refused before any run
    ref = [3.0, 2.5, 2.0, 1.8]
    g = gaps([3.0, 2.6, 2.0, 1.8], ref, 2)
    assert g["max_step_gap"] == pytest.approx(0.1 / 2.5)
    png = plot({(0, "32"): ref, (0, "g8"): [3.0, 2.6, 2.0, 1.8], (0, "8g8"): [3.0, 2.4, 2.1, 1.8]}, 2,
               tmp_path / "loss.png")
    assert png.exists() and png.stat().st_size > 1000


def test_step_after_probe_leaves_out_the_probe_and_the_step_after_it():
    """The steady-state step time: the median of the steps after the fallback probe (steps
    PROBE_WARMUP .. PROBE_WARMUP + 2 probes - 1) and the one step after it that may carry the
    last probe step's overlapped reduction; None when a run has no such step."""
    from commsched.bench.moe.train import after_probe_start, step_after_probe
    from commsched.priority.fallback import PROBE_WARMUP

    assert after_probe_start(2) == PROBE_WARMUP + 5 and after_probe_start(0) == PROBE_WARMUP + 1
    s = after_probe_start(2)
    times = [9.0] * s + [1.0, 3.0, 2.0]  # the slow probe steps are left out
    assert step_after_probe({"step_times_s": times}, s) == 2.0
    assert step_after_probe({"step_times_s": times[:s]}, s) is None
    assert step_after_probe({}, s) is None
