"""DeepSpeedLina refuses the engines whose reduction it cannot take over, naming each reason
(pure: the checker reads only the engine's configuration accessors, stood in for here; the
2-rank run against DeepSpeed's own reduction is the ``deepspeed_lina`` example of
docs/integrate.md, run by tests/core/test_integrate.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from commsched.moe.train.deepspeed_lina import _check_engine


def _engine(stage=0, fp16=False, bf16=False, gas=1, sp=1, pipe=False):
    """The accessors of ``deepspeed.runtime.engine.DeepSpeedEngine`` the checker reads."""
    return SimpleNamespace(zero_optimization_stage=lambda: stage, fp16_enabled=lambda: fp16,
                           bfloat16_enabled=lambda: bf16, gradient_accumulation_steps=lambda: gas,
                           sequence_parallel_size=sp, pipeline_parallelism=pipe)


def test_deepspeed_lina_refuses_what_it_cannot_reduce():
    _check_engine(_engine())  # stage 0, float32, no accumulation: accepted
    with pytest.raises(ValueError, match=r"ZeRO stage 2 \(DeepSpeed reduces inside its ZeRO optimizer; use stage 0\)"):
        _check_engine(_engine(stage=2))
    with pytest.raises(ValueError, match=r"fp16/bf16 .*; gradient_accumulation_steps=4 \(use 1\)"):
        _check_engine(_engine(bf16=True, gas=4))
    with pytest.raises(ValueError, match="sequence parallelism"):
        _check_engine(_engine(sp=2))
    with pytest.raises(ValueError, match="PipelineEngine"):
        _check_engine(_engine(pipe=True))
