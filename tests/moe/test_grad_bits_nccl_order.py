"""The MoE trainer with compressed gradient reductions under NCCL's ordering rules
(tests/nccl_fake.py): with the ``program`` launch rule (CUDA's default) every rank must
issue its gradient collectives and the expert all-to-alls in one interleaving (audit 3,
item 1), checked across ranks at the end of each run."""

from __future__ import annotations

import dataclasses

import pytest

from tests.moe.test_train import _cfg, _run
from tests.mp import assert_case, run_cases


def _trains_in_order(rank: int, world: int) -> None:
    from tests.nccl_fake import nccl_semantics

    for sched, a2a_bits in (("lina", 32), ("lina", 8), ("lina-overlap", 8)):
        base = _cfg(world, sched, chunks=2, steps=2, launch="program")
        cfg = dataclasses.replace(base, grad_bits=8, dispatch=dataclasses.replace(base.dispatch, a2a_bits=a2a_bits))
        with nccl_semantics(delay_s=0.002) as fake:
            got = _run(cfg)
        assert fake.calls["all_to_all_single"] > 0 and len(got["loss"]) == 2, sched


@pytest.mark.parametrize("world", [2])
def test_compressed_reduction_keeps_nccl_order(world):
    res = run_cases(world, [("order", _trains_in_order)], timeout_s=240, env={"COMMSCHED_TIMEOUT_S": "30"})
    assert_case(res, "order")
