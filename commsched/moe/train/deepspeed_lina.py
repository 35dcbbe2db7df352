"""Lina's gradient schedule for a model built with DeepSpeed's MoE layer, under DeepSpeed's
engine: DeepSpeed runs the model, the expert all-to-all and the optimizer step; commsched's
:class:`~commsched.priority.runtime.executor.GradScheduler` does the gradient reduction.

Legend: E experts of a layer, C capacity (rows per expert), M model width, P ranks of the
expert-parallel group.

How it plugs into DeepSpeed (written against 0.19; each point is checked at construction):

* The engine's reduction is switched off with ``engine.enable_backward_allreduce = False``,
  the attribute DeepSpeed's own ``PipelineEngine`` clears to take the reduction over
  (``deepspeed/runtime/pipe/engine.py``). ``engine.backward`` (``_backward_epilogue``) and
  ``engine.step`` then skip ``allreduce_gradients`` -- the buffered, post-backward
  ``buffered_allreduce_fallback`` of ZeRO stage 0 with its ``_reduce_non_expert_gradients`` and
  ``_reduce_expert_gradients`` -- and ``engine.step`` runs the optimizer on the gradients the
  scheduler reduced.
* The scheduler reduces what those functions would: a non-expert gradient is averaged over
  the (sequence-)data-parallel group; an expert gradient (``is_moe_param``) is summed over
  its expert-data-parallel group and divided by the *data-parallel* world size (DeepSpeed's
  choice, "to maintain the gradients value unaffected by ep_size"), both in the backward pass,
  as micro-ops, all-to-all first.
* The expert all-to-all: ``deepspeed.moe.sharded_moe.MOELayer.forward`` calls
  ``_AllToAll.apply(self.ep_group, x_ECM)`` twice (dispatch, then combine), looking the name
  up in its module at each call. While this object is open that name is a stand-in whose
  ``apply`` is ``commsched.all_to_all`` with an equal split of ``x_ECM``'s rows over the
  group (what ``all_to_all_single`` does), reporting both directions to the scheduler:
  the combine's backward opens the expert block, the dispatch's closes it (a forward
  pre-hook on every ``MOELayer`` resets the pairing). :meth:`close` puts DeepSpeed's class back.

What it does not cover, refused with a ValueError: ZeRO stages 1-3 (stage 1 reduces into its
optimizer's partitions in ``DeepSpeedZeroOptimizer.reduce_gradients``, stages 2 and 3 reduce
in their own gradient hooks during the backward pass, ``reduce_ready_partitions_and_remove_grads``
/ ``overlapping_partition_gradients_reduce_epilogue``, so there is no reduction to replace,
only one to compete with); fp16 and bf16 (their optimizers reduce separate gradient
buffers: ``BF16_Optimizer.get_grads_for_reduction``, the loss scaler's overflow check);
gradient accumulation (the scheduler reduces once per backward pass); sequence parallelism.
Sparse gradients are not supported either.
"""

from __future__ import annotations

from typing import Any

import torch

from ...comm.all2all import A2APlan, all_to_all
from ...comm.observe import A2AObserver
from ...priority.policy import ScheduleConfig
from ...priority.runtime.executor import LOCAL, GradScheduler


class _ObservedAllToAll:
    """Stands in for ``deepspeed.moe.sharded_moe._AllToAll``: ``apply(group, x_ECM)`` is the
    same equal-split exchange through ``commsched.all_to_all``, reported to ``observer``.
    Calls come in pairs per ``MOELayer`` forward: dispatch, then combine."""

    def __init__(self, observer: A2AObserver):
        self.observer = observer
        self.calls = 0

    def apply(self, group, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        P, me = dist.get_world_size(group), dist.get_rank(group)
        if x.shape[0] % P:
            raise ValueError(f"DeepSpeed's all-to-all input has {x.shape[0]} rows (experts), not a multiple "
                             f"of the {P} ranks of its expert-parallel group")
        block = "end" if self.calls % 2 == 0 else "begin"  # dispatch closes the backward block
        self.calls += 1
        split = (x.shape[0] // P,) * P
        return all_to_all(x.contiguous(), A2APlan(split, split, me, agreed=True), group=group, observer=self.observer,
                          backward_block=block)


def _check_engine(engine: Any) -> None:
    problems = []
    stage = int(engine.zero_optimization_stage())
    if stage != 0:
        problems.append(f"ZeRO stage {stage} (DeepSpeed reduces inside its ZeRO optimizer; use stage 0)")
    if engine.fp16_enabled() or engine.bfloat16_enabled():
        problems.append("fp16/bf16 (their optimizers reduce separate gradient buffers; use float32)")
    if int(engine.gradient_accumulation_steps()) != 1:
        problems.append(f"gradient_accumulation_steps={engine.gradient_accumulation_steps()} (use 1)")
    if int(getattr(engine, "sequence_parallel_size", 1) or 1) != 1:
        problems.append("sequence parallelism (use sequence_parallel_size 1)")
    if getattr(engine, "pipeline_parallelism", False):
        problems.append("DeepSpeed's PipelineEngine (it already owns the reduction)")
    if problems:
        raise ValueError("DeepSpeedLina cannot take the gradient reduction over from this engine: "
                         + "; ".join(problems) + ". See commsched/moe/train/deepspeed_lina.py for why.")


def deepspeed_sched_params(engine: Any) -> list[tuple]:
    """GradScheduler entries ``(param, group, scale)`` that reduce as DeepSpeed's stage-0
    reduction does (module docstring), in reverse registration order (roughly when the
    gradients become ready)."""
    import torch.distributed as dist
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.utils import groups

    dp_group = groups._get_sequence_data_parallel_group()
    dp_world = dist.get_world_size(dp_group)
    out = []
    for p in reversed([p for p in engine.module.parameters() if p.requires_grad and p.numel() > 0]):
        if is_moe_param(p):
            g = groups._get_expert_data_parallel_group(p.group_name)
            out.append((p, g if dist.get_world_size(g) > 1 else LOCAL, 1.0 / dp_world))
        else:
            out.append((p, dp_group if dp_world > 1 else LOCAL, 1.0 / dp_world))
    return out


class DeepSpeedLina:
    """Lina's schedule (``cfg``, any of :data:`~commsched.priority.policy.SCHEDULES`) for a
    DeepSpeed engine whose model holds ``deepspeed.moe.layer.MoE`` layers. A context
    manager; per step::

        with DeepSpeedLina(engine, LinaConfig()) as lina:
            for x, y in batches:
                lina.begin_step()
                engine.backward(loss_fn(engine(x), y))
                lina.finish()           # every gradient reduced
                engine.step()

    ``sched`` is the :class:`~commsched.priority.runtime.executor.GradScheduler` (its ``records``,
    ``urgent``, ...). Needs ZeRO stage 0, float32, no gradient accumulation (ValueError
    otherwise, naming what to change); one at a time per process, since it replaces a name
    in DeepSpeed's module. ``timeout_s``: the scheduler's (default ``COMMSCHED_TIMEOUT_S``).
    """

    def __init__(self, engine: Any, cfg: ScheduleConfig, *, timeout_s: float | None = None):
        from deepspeed.moe import sharded_moe

        _check_engine(engine)
        if not hasattr(engine, "enable_backward_allreduce"):
            raise ValueError("this DeepSpeed engine has no enable_backward_allreduce switch (DeepSpeed "
                             "0.19 has it), so its own gradient reduction cannot be turned off")
        if isinstance(sharded_moe._AllToAll, _ObservedAllToAll):
            raise RuntimeError("a DeepSpeedLina is already open in this process; close it first")
        self.engine = engine
        self.sched = GradScheduler(deepspeed_sched_params(engine), cfg, timeout_s=timeout_s,
                                   device=engine.device)
        self._a2a = _ObservedAllToAll(self.sched)
        self._saved = sharded_moe._AllToAll
        self._hooks = [m.register_forward_pre_hook(self._new_layer_call) for m in engine.module.modules()
                       if isinstance(m, sharded_moe.MOELayer)]
        if not self._hooks:
            self.sched.close()
            raise ValueError("the engine's model has no deepspeed.moe MOELayer: nothing for DeepSpeedLina "
                             "to observe (for a dense model use GradScheduler or commsched's DDP hook)")
        sharded_moe._AllToAll = self._a2a
        self._was_reducing = engine.enable_backward_allreduce
        engine.enable_backward_allreduce = False
        self._closed = False

    def _new_layer_call(self, module, args) -> None:
        self._a2a.calls = 0

    def begin_step(self) -> None:
        self.sched.begin_step()

    def finish(self) -> dict:
        """Wait for every gradient of this step to be reduced; returns the step's timings
        (:meth:`GradScheduler.finish`)."""
        return self.sched.finish()

    def close(self) -> None:
        """Give DeepSpeed back its all-to-all and its reduction; stop the scheduler."""
        if self._closed:
            return
        from deepspeed.moe import sharded_moe

        self._closed = True
        sharded_moe._AllToAll = self._saved
        for h in self._hooks:
            h.remove()
        self.engine.enable_backward_allreduce = self._was_reducing
        self.sched.close()

    def __enter__(self) -> "DeepSpeedLina":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["DeepSpeedLina", "deepspeed_sched_params"]
