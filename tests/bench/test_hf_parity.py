"""The transformers parity bench's machinery (``commsched.bench.moe.hf_parity``): a tiny
Mixtral made expert-parallel over 2 gloo ranks and trained 2 steps under fifo (through
make_grad_step and through LinaDDP) has the losses of one process that runs both ranks'
batches; the variants' grammar and its refusals."""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("transformers", minversion="5.20",
                    reason="the transformers extra is not installed: pip install commsched[hf]")

from commsched.bench.moe import hf_parity as hp  # noqa: E402
from commsched.moe.model.data import Corpus  # noqa: E402
from tests.mp import run_ranks  # noqa: E402

TOL = 1e-5  # float32


def _args(optim: str = "sgd") -> argparse.Namespace:
    # SGD: a gradient of the wrong scale changes the next loss (Adam's update would not see it)
    return argparse.Namespace(hidden=32, experts=4, k=2, layers=2, heads=4, kv_heads=2, intermediate=16, seq_len=16,
                              batch_size=2, lr=0.5, aux_coef=0.02, steps=2, optim=optim)


def _corpus() -> Corpus:
    data = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    return Corpus(train=data[:3584], val=data[3584:], source="random bytes")


def _curves(rank: int, world: int) -> dict[str, list[float]]:
    return {v: hp.parallel_curve(_args(), _corpus(), 3, hp.parse_variant(v), torch.device("cpu")).loss
            for v in ("fifo", "fifo+ddp")}


def test_two_ranks_train_as_one_process_under_fifo():
    ref = hp.reference_curve(_args(), _corpus(), 3, 2)
    assert len(ref) == 2 and ref[1] < ref[0]  # it trains
    for rank, curves in enumerate(run_ranks(2, _curves, timeout_s=120)):
        for v, c in curves.items():
            assert len(c) == 2, (rank, v)
            assert all(abs(a - b) <= TOL * (1 + abs(b)) for a, b in zip(c, ref)), (rank, v, c, ref)


def test_variants_parse_and_refusals(tmp_path):
    assert hp.parse_variant("lina") == hp.Spec("lina")
    assert hp.parse_variant("fifo+ddp+a8") == hp.Spec("fifo", "ddp", 8, 32)
    assert hp.parse_variant("lina-overlap+g8+a16") == hp.Spec("lina-overlap", "step", 16, 8)
    for bad, why in (("flat", "unknown schedule"), ("lina+a4", "not a part"), ("lina+a8+a8", "not a part"),
                     ("lina-overlap+ddp", "LinaDDP runs fifo, lina, serial"), ("lina+ddp+g8", "full width")):
        with pytest.raises(ValueError, match=why):
            hp.parse_variant(bad)
    # the reference, and the reference with its gradients through the codec
    assert hp.parse_reference("one-process") == (32, "flat") and hp.parse_reference("lina+g8") is None
    assert hp.parse_reference("one-process+g8") == (8, "flat")
    assert hp.parse_reference("one-process+g16+p") == (16, "param")
    for bad in ("one-process+a8", "one-process+g4", "one-process+p"):
        with pytest.raises(ValueError, match="the reference's forms"):
            hp.parse_reference(bad)
    # refused before any run: one line, exit 2
    assert hp.main(["--out", str(tmp_path / "a"), "--variants", "fifo,lina-overlap+ddp"]) == 2
    assert hp.main(["--out", str(tmp_path / "b"), "--nproc", "3"]) == 2  # 8 experts over 3 ranks
    assert hp.main(["--out", str(tmp_path / "c"), "--variants", "one-process"]) == 2  # the reference itself
    assert hp.main(["--out", str(tmp_path / "c"), "--chunks", "0"]) == 2
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


# ------------------------------------------------ commsched bench moe-train --model hf-mixtral-tiny
def _bench_args(*argv: str):
    from commsched.bench import build_parser, load_workload

    wl = load_workload("moe-train")
    return wl, build_parser(wl).parse_args(["--model", "hf-mixtral-tiny", *argv])


def test_bench_variants_are_the_bench_configs_run_by_the_worker():
    wl, args = _bench_args("--steps", "6", "--warmup", "2", "--batch-size", "3", "--a2a-bits", "8",
                           "--grad-bits", "8", "--chunks", "2", "--microop-bytes", "65536")
    vs = {v.name: v for v in wl.variants(args)}
    assert list(vs) == ["fifo", "lina", "lina-overlap", "lina-q8", "lina-overlap-q8", "fifo-g8", "lina-g8",
                        "lina-overlap-g8", "fifo-q8-g8", "lina-q8-g8", "lina-overlap-q8-g8"]  # no DeepSpeed
    p = hp.build_parser()
    for name, v in vs.items():
        assert v.module == "commsched.bench.moe.hf_parity"
        w = p.parse_args([*v.argv, "--out", "x"])
        spec = hp.parse_variant(w.worker)
        assert spec.reducer == "step" and spec.schedule == name.split("-q")[0].split("-g")[0]
        assert (spec.a2a_bits, spec.grad_bits) == (8 if "-q8" in name else 32, 8 if "-g8" in name else 32)
        assert (w.steps, w.warmup, w.batch_size, w.seeds, w.world) == (6, 2, 3, "0", 4)
        assert w.chunks == (1 if name.startswith("fifo") else 2)
        cfg = hp.schedule_config(spec, w.schedule_options)  # the bench's schedule options reach the worker
        if spec.schedule != "fifo":
            assert cfg.microop_bytes == 65536 and cfg.fallback_probes == 0
    args.reduce_address = "127.0.0.2"  # the collective link model's reduction class
    for v in wl.variants(args):
        w = p.parse_args([*v.argv, "--out", "x"])
        assert hp.schedule_config(hp.parse_variant(w.worker), w.schedule_options).reduce_address == "127.0.0.2"


def test_bench_refusals(monkeypatch):
    from commsched._lazy import MissingExtra

    wl, args = _bench_args("--nproc", "3")
    with pytest.raises(ValueError, match="8 experts do not split evenly over --nproc 3"):
        wl.variants(args)
    wl, args = _bench_args("--dtype", "bfloat16")
    with pytest.raises(ValueError, match="trains in float32"):
        wl.variants(args)
    with pytest.raises(ValueError, match="unknown schedule 'flat'"):
        hp.parse_variant("flat")
    with pytest.raises(ValueError, match="schedule lina: .*nope"):
        hp.schedule_config(hp.Spec("lina"), {"nope": 1})
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    wl, args = _bench_args()
    with pytest.raises(MissingExtra, match=r"commsched\[hf\]"):
        wl.variants(args)


@pytest.mark.slow
def test_bench_runs_on_two_ranks_and_summarises(tmp_path):
    """Two variants, 3 steps, 2 ranks, unshaped: the runs' metrics and the summary's table."""
    from commsched.bench import run_bench

    s = run_bench("moe-train", ["--model", "hf-mixtral-tiny", "--bandwidth", "none", "--nproc", "2", "--steps", "3",
                                "--warmup", "1", "--batch-size", "2", "--a2a-bits", "8", "--variants", "fifo,lina-q8",
                                "--timeout", "240", "--out", str(tmp_path)], progress=lambda line: None)
    med = s["median"]
    assert set(med) == {"fifo", "lina-q8"}
    assert all(0 < med[v]["step_time_s"] < 30 and 0 < med[v]["a2a_time_s"] <= med[v]["step_time_s"] for v in med)
    r = s["hf_ratios"]["lina-q8"]
    assert r == pytest.approx(med["fifo"]["step_time_s"] / med["lina-q8"]["step_time_s"])
    g = s["hf_loss_gaps"]
    assert g["fifo"]["max_step_gap"] == 0.0 and 0 < g["lina-q8"]["max_step_gap"] < 0.01  # 8-bit rows: close
    m = __import__("json").loads((tmp_path / "lina-q8" / "rep0" / "metrics.json").read_text())
    assert len(m["loss"]["0"]) == 3 and m["loss"]["0"][-1] < m["loss"]["0"][0]  # it trains
    table = (tmp_path / "summary.md").read_text()
    assert "## hf-mixtral-tiny: the variants side by side" in table and "| lina-q8 |" in table
    assert (tmp_path / "loss.png").stat().st_size > 0
