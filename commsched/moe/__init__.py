"""Mixture-of-Experts front-end: expert-parallel layer, Lina's training schedule,
popularity estimation and expert placement for inference.

Names are resolved lazily from their submodules; importing ``commsched.moe`` runs nothing.
"""

from __future__ import annotations

from .._lazy import lazy_getattr

# name -> submodule, for training (router, dispatcher, expert layer, model, schedule)
_TRAIN_EXPORTS: dict[str, str] = {
    "RouterConfig": "router",
    "Router": "router",
    "Routing": "router",
    "route_top_k": "router",
    "load_balancing_loss": "router",
    "ExpertFFN": "experts",
    "expert_apply": "experts",
    "expert_ffn": "experts",
    "is_expert_param": "experts",
    "ExpertGroup": "dispatch",
    "local_moe": "dispatch",
    "ep_moe": "dispatch",
    "sort_assignments": "dispatch",
    "MoELayer": "layer",
    "DispatchConfig": "layer",
    "ModelConfig": "model",
    "MoETransformerLM": "model",
    "Corpus": "data",
    "load_corpus": "data",
    "TrainConfig": "training",
    "TrainMetrics": "training",
    "to_deepspeed": "deepspeed_baseline",
    "train_deepspeed": "deepspeed_baseline",
}

# name -> submodule, for inference (placement, popularity estimation, traces, runtime)
_INFER_EXPORTS: dict[str, str] = {
    "plan_placement": "placement",
    "Placement": "placement",
    "greedy_placement": "placement",
    "eplb_placement": "placement",
    "EplbPlan": "placement",
    "static_placement": "placement",
    "lower_bound": "placement",
    "split_tokens": "placement",
    "split_offsets": "placement",
    "node_cost": "placement",
    "cross_rows": "placement",
    "even_origin": "placement",
    "cross_host_weight": "placement_policy",
    "PopularityEstimator": "popularity",
    "topk_overlap": "popularity",
    "estimation_accuracy": "popularity",
    "ReplanDecision": "popularity",
    "phase2_decision": "popularity",
    "DEFAULT_REPLAN_THRESHOLD": "popularity",
    "DEFAULT_MAX_PATH_ENTRIES": "popularity",
    "RoutingTrace": "traces",
    "load_trace": "traces",
    "save_trace": "traces",
    "trace_stats": "traces",
    "SyntheticTraceConfig": "traces",
    "synthetic_trace": "traces",
    "StrategyConfig": "placement_policy",
    "PlacementStrategy": "placement_policy",
    "STRATEGIES": "placement_policy",
    "relabel": "placement_policy",
    "placed_moe": "placed",
    "placed_moe_local": "placed",
    "ExpertBank": "banks",
    "FFNBank": "banks",
    "EmulatedBank": "banks",
    "InferConfig": "infer_config",
    "InferMetrics": "infer_metrics",
    "run_inference": "infer_run",
    "record_trace": "recorder",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
}

_EXPORTS = {**_TRAIN_EXPORTS, **_INFER_EXPORTS}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
