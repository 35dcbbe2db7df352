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
    return {v: hp.parallel_curve(_args(), _corpus(), 3, hp.parse_variant(v), torch.device("cpu"))[0]
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
    # refused before any run: one line, exit 2
    assert hp.main(["--out", str(tmp_path / "a"), "--variants", "fifo,lina-overlap+ddp"]) == 2
    assert hp.main(["--out", str(tmp_path / "b"), "--nproc", "3"]) == 2  # 8 experts over 3 ranks
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
