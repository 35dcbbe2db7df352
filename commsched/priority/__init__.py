"""Micro-op partitioning, the all-to-all-first priority policy, its executor, urgent
operations beside the background micro-ops, one step interface over every schedule's
optimizer, and a discrete-event simulator of the policy (Lina).

Names are resolved lazily from their submodules; importing ``commsched.priority`` runs nothing.
"""

from __future__ import annotations

from .._lazy import lazy_getattr

_EXPORTS: dict[str, str] = {
    "CommOp": "microops",
    "Piece": "microops",
    "partition": "microops",
    "bucket": "microops",
    "split_equal": "microops",
    "DEFAULT_CREDIT_MICROOPS": "policy",
    "SCHEDULES": "policy",
    "ScheduleConfig": "policy",
    "LinaConfig": "policy",
    "LinaOverlapConfig": "policy",
    "FifoConfig": "policy",
    "SerialConfig": "policy",
    "FlatConfig": "policy",
    "Launch": "policy",
    "Policy": "policy",
    "make_policy": "policy",
    "simulate": "sim",
    "moe_backward_script": "sim",
    "Link": "sim",
    "SimResult": "sim",
    "GradScheduler": "runtime.executor",
    "OverlapPolicy": "policy",
    "OverlapScheduler": "runtime.overlap",
    "OverlapOptimizer": "runtime.overlap",
    "LOCAL": "runtime.buckets",
    "GradSlot": "runtime.buckets",
    "BucketLayout": "runtime.buckets",
    "plan_buckets": "runtime.buckets",
    "OpRecord": "runtime.records",
    "HierGroups": "hier",
    "HostLayout": "hier",
    "make_hier": "hier",
    "UrgentOp": "transfer",
    "urgent": "transfer",
    "GradStep": "step",
    "ReduceThenStep": "step",
    "OverlapStep": "step",
    "make_grad_step": "step",
    "GradGroup": "ddp",
    "LinaDDP": "ddp",
    "LinaState": "ddp",
    "lina_hook": "ddp",
    "ignore_grouped_params": "ddp",
    "set_grad_group": "ddp",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
