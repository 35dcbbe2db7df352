"""Mixture-of-Experts front-end: expert-parallel layer, Lina's training schedule,
popularity estimation and expert placement for inference.

Names are resolved lazily from their submodules; importing ``commsched.moe`` runs nothing.
"""

from __future__ import annotations

from .._lazy import lazy_getattr

# name -> submodule, for training (router, dispatcher, expert layer, model, schedule)
_TRAIN_EXPORTS: dict[str, str] = {
    "RouterConfig": "model.router",
    "Router": "model.router",
    "Routing": "model.router",
    "route_top_k": "model.router",
    "load_balancing_loss": "model.router",
    "ExpertFFN": "model.experts",
    "expert_apply": "model.experts",
    "expert_ffn": "model.experts",
    "is_expert_param": "model.experts",
    "ExpertGroup": "model.dispatch",
    "local_moe": "model.dispatch",
    "ep_moe": "model.dispatch",
    "sort_assignments": "model.dispatch",
    "MoELayer": "model.layer",
    "DispatchConfig": "model.layer",
    "ModelConfig": "model.lm",
    "MoETransformerLM": "model.lm",
    "Corpus": "model.data",
    "load_corpus": "model.data",
    "TrainConfig": "train.training",
    "TrainMetrics": "train.training",
    "to_deepspeed": "train.deepspeed_baseline",
    "train_deepspeed": "train.deepspeed_baseline",
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
    "cross_host_weight": "infer.policy",
    "PopularityEstimator": "infer.popularity",
    "topk_overlap": "infer.popularity",
    "estimation_accuracy": "infer.popularity",
    "ReplanDecision": "infer.popularity",
    "phase2_decision": "infer.popularity",
    "DEFAULT_REPLAN_THRESHOLD": "infer.popularity",
    "DEFAULT_MAX_PATH_ENTRIES": "infer.popularity",
    "RoutingTrace": "record.traces",
    "load_trace": "record.traces",
    "save_trace": "record.traces",
    "trace_stats": "record.traces",
    "SyntheticTraceConfig": "record.traces",
    "synthetic_trace": "record.traces",
    "StrategyConfig": "infer.policy",
    "PlacementStrategy": "infer.policy",
    "STRATEGIES": "infer.policy",
    "relabel": "infer.policy",
    "placed_moe": "infer.placed",
    "placed_moe_local": "infer.placed",
    "ExpertBank": "infer.banks",
    "FFNBank": "infer.banks",
    "EmulatedBank": "infer.banks",
    "InferConfig": "infer.config",
    "InferMetrics": "infer.metrics",
    "run_inference": "infer.loop",
    "record_trace": "record.recorder",
    "save_checkpoint": "model.checkpoint",
    "load_checkpoint": "model.checkpoint",
}

_EXPORTS = {**_TRAIN_EXPORTS, **_INFER_EXPORTS}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
