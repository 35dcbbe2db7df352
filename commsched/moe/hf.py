"""transformers MoE models made expert-parallel in one call.

Legend: T tokens of this rank, D model width, I expert hidden width, E experts of a block,
P ranks of the expert-parallel group, L = E / P experts held here, K choices per token.

``expert_parallel(model, group)`` finds every sparse MoE block of a transformers 5.x model
and replaces its ``experts`` module, in place, with an :class:`ExpertParallelExperts`: this
rank keeps experts ``[r*L, (r+1)*L)`` of the block's fused ``gate_up_proj`` [E, 2I, D] and
``down_proj`` [E, D, I] under the same names, and its forward pass sends each token's rows
to the rank that owns the chosen expert and back through the project's expert dispatch
(:func:`commsched.moe.model.dispatch.ep_moe`: the uneven all-to-all, the ``a2a_bits`` wire,
the observer). Everything else of the block is the model's own and runs unchanged: the
router (softmax top-k with or without renormalisation; DeepSeek-V3's sigmoid scores with
group-limited top-k and the correction bias), the shared experts (computed locally), the
router logits the model records and the auxiliary loss it computes from them.

Each rank runs the model on its own batch. The tokens of all ranks meet at the experts, so
an expert's gradient on its owner is the sum over every rank's batch; every other parameter
is an ordinary data-parallel one (sum or average it over the ranks, e.g. with
:class:`commsched.priority.LinaDDP`, which also scales the expert gradients to match).

Checkpoints: :func:`gather_state_dict` gives the plain transformers state dict (every
expert, the original key names and layout) on rank 0 of the group; :func:`load_state_dict`
loads such a dict into an expert-parallel model of any group size.

Supported blocks (transformers >= 5.20, < 6; ``pip install commsched[hf]``): Mixtral,
Qwen2-MoE, Qwen3-MoE and DeepSeek-V3. Any other block that holds ``experts`` is refused
with a ValueError naming its class.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..agree import check_same_config
from ..comm.lanes import Lanes
from ..dist import comm_guard
from ..priority.ddp import check_ddp, set_grad_group
from ..priority.runtime.executor import LOCAL
from .model.dispatch import ExpertGroup, MoEWires, ep_moe, format_seed, moe_wires
from .model.experts import EXPERT_ATTR
from .model.layer import DispatchConfig
from .model.router import Routing


def _installed_kernels_first() -> None:
    """From a source checkout whose root is on ``sys.path``, ``import kernels`` would find
    this project's ``kernels/`` folder (installed as ``commsched.kernels``) instead of the
    ``kernels`` distribution transformers imports: import the installed one first, with the
    checkout's root hidden for that one import."""
    root = Path(__file__).resolve().parents[2]
    if "kernels" in sys.modules or not (root / "kernels" / "__init__.py").is_file():
        return
    spec = importlib.util.find_spec("kernels")
    if spec is None or spec.origin is None or Path(spec.origin).resolve().parent != root / "kernels":
        return
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass  # not installed: transformers then runs without hub kernels
    finally:
        sys.path[:] = saved


_installed_kernels_first()
try:
    import transformers
except ImportError as e:
    raise ImportError("commsched.moe.hf needs transformers 5.x (>= 5.20, < 6): pip install commsched[hf]") from e


if int(transformers.__version__.split(".")[0]) != 5:
    raise ImportError(f"commsched.moe.hf needs transformers 5.x (>= 5.20, < 6), found {transformers.__version__}: "
                      "pip install commsched[hf]")

# family -> (modeling module, sparse MoE block class)
FAMILIES: dict[str, tuple[str, str]] = {
    "Mixtral": ("mixtral", "MixtralSparseMoeBlock"),
    "Qwen2-MoE": ("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    "Qwen3-MoE": ("qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "DeepSeek-V3": ("deepseek_v3", "DeepseekV3MoE"),
}
EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # the fused expert weights, [E, 2I, D] and [E, D, I]


def supported_blocks() -> dict[type, str]:
    """The sparse MoE block classes :func:`expert_parallel` converts -> their family."""
    out = {}
    for family, (mod, cls) in FAMILIES.items():
        m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
        out[getattr(m, cls)] = family
    return out


def _supported_names() -> str:
    return ", ".join(f"{cls} ({family})" for family, (_, cls) in FAMILIES.items())


def _swiglu_experts(x_RD: torch.Tensor, counts_L, gate_up_LKD: torch.Tensor, down_LDI: torch.Tensor,
                    act_fn) -> torch.Tensor:
    """Apply local expert j to its ``counts_L[j]`` consecutive rows: ``down(act(gate(x)) * up(x))``
    with ``gate_up_LKD[j]`` [2I, D] (gate rows first) and ``down_LDI[j]`` [D, I]; [R, D] -> [R, D].
    Every expert runs, even on no rows, so that every rank's autograd graph reaches the
    exchanges of the backward pass."""
    outs, off = [], 0
    for j, n in enumerate(counts_L):
        n = int(n)
        gate, up = F.linear(x_RD[off:off + n], gate_up_LKD[j]).chunk(2, dim=-1)
        outs.append(F.linear(act_fn(gate) * up, down_LDI[j]))
        off += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class _Shard:
    """The view of an :class:`ExpertParallelExperts` that the dispatch calls on its rows."""

    def __init__(self, owner: "ExpertParallelExperts"):
        self.owner = owner
        self.num_experts, self.first, self.num_local = owner.num_experts, owner.first, owner.num_local

    def __call__(self, x_RD: torch.Tensor, counts_L) -> torch.Tensor:
        return self.apply_rows(x_RD, counts_L, *self.params())

    def params(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.gate_up_proj, self.owner.down_proj

    def apply_rows(self, x_RD: torch.Tensor, counts_L, gate_up_LKD: torch.Tensor,
                   down_LDI: torch.Tensor) -> torch.Tensor:
        return _swiglu_experts(x_RD, counts_L, gate_up_LKD, down_LDI, self.owner.act_fn)


class ExpertParallelExperts(nn.Module):
    """This rank's L experts of a transformers experts module, with its forward signature
    ``(hidden_states [T, D], top_k_index [T, K], top_k_weights [T, K]) -> [T, D]``.

    ``gate_up_proj`` [L, 2I, D] and ``down_proj`` [L, D, I] are rows ``[first, first + L)`` of
    the original's; collective on the group: every rank calls the forward pass together.
    """

    def __init__(self, experts: nn.Module, eg: ExpertGroup, wires: MoEWires, observer: Any = None,
                 dispatch: DispatchConfig | None = None):
        super().__init__()
        self.dispatch = dispatch or DispatchConfig()
        self._lanes: Lanes | None = None  # comm lane of the pipelined exchange, made on first use
        self.num_experts, self.first, self.num_local = eg.num_experts, eg.first, eg.num_local
        self.expert_group, self.wires, self.observer = eg, wires, observer
        self.source_class = type(experts).__name__
        self.hidden_dim, self.intermediate_dim = experts.hidden_dim, experts.intermediate_dim
        self.act_fn = experts.act_fn
        lo, hi = eg.first, eg.first + eg.num_local
        for name in EXPERT_PARAMS:
            full = getattr(experts, name)
            p = nn.Parameter(full.detach()[lo:hi].clone(), requires_grad=full.requires_grad)
            setattr(p, EXPERT_ATTR, True)
            setattr(self, name, p)
        if eg.size > 1:  # summed over the group's batches already: not data-parallel over it
            set_grad_group(self.parameters(), LOCAL, eg.size)

    def close(self) -> None:
        """Stop the comm lane thread of the pipelined exchange, if one was started."""
        if self._lanes is not None:
            self._lanes.close()
            self._lanes = None

    def extra_repr(self) -> str:
        return (f"experts [{self.first}, {self.first + self.num_local}) of {self.num_experts} "
                f"(from {self.source_class}), {self.wires.bits}-bit all-to-all over {self.expert_group.size} ranks")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        eg = self.expert_group
        if eg.size > 1:
            check_ddp(self, self.parameters())  # a plain DDP would average different experts
        x_TD = hidden_states.reshape(-1, hidden_states.shape[-1])
        expert_TK = top_k_index.reshape(x_TD.shape[0], -1)
        routing = Routing(expert_TK=expert_TK, gate_TK=top_k_weights.reshape(expert_TK.shape),
                          keep_TK=torch.ones_like(expert_TK, dtype=torch.bool),
                          aux_loss=x_TD.new_zeros(()), probs_TE=x_TD.new_zeros((0,)))  # the model keeps its own
        dc = self.dispatch
        if dc.pipeline and (self._lanes is None or self._lanes.device != x_TD.device):
            self.close()
            self._lanes = Lanes(x_TD.device, names=("compute", "comm"))
        y_TD = ep_moe(x_TD, routing, _Shard(self), eg, chunks=dc.chunks, pipeline=dc.pipeline,  # type: ignore[arg-type]
                      observer=self.observer, lanes=self._lanes, wires=self.wires)
        return y_TD.to(hidden_states.dtype).reshape(hidden_states.shape)


def _group_size_rank(group) -> tuple[int, int]:
    if not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _blocks(model: nn.Module) -> tuple[list[tuple[str, nn.Module, str]], list[str]]:
    """The supported blocks (name, module, family) and the description of every block that
    holds ``experts`` but is not supported."""
    supported = supported_blocks()
    found, unsupported = [], []
    for name, m in model.named_modules():
        if type(m) in supported:
            found.append((name, m, supported[type(m)]))
        elif isinstance(getattr(m, "experts", None), nn.Module) and not isinstance(m.experts, ExpertParallelExperts):
            unsupported.append(f"{type(m).__name__} ({name or 'the model'})")
    return found, unsupported


def _layout_problem(name: str, block: nn.Module, size: int) -> str | None:
    ex = block.experts
    if isinstance(ex, ExpertParallelExperts):
        return f"{name} is already expert-parallel"
    flags = {"is_transposed": False, "has_bias": False, "is_concatenated": True, "has_gate": True}
    odd = [f"{k}={getattr(ex, k)}" for k, v in flags.items() if getattr(ex, k, v) != v]
    shapes_ok = all(isinstance(getattr(ex, n, None), torch.Tensor) and getattr(ex, n).dim() == 3
                    for n in EXPERT_PARAMS)
    if odd or not shapes_ok:
        return (f"{name}.experts ({type(ex).__name__}) does not hold fused gate_up_proj [E, 2I, D] and "
                f"down_proj [E, D, I] weights{' (' + ', '.join(odd) + ')' if odd else ''}")
    E = ex.gate_up_proj.shape[0]
    if E % size:
        return (f"{name} ({type(block).__name__}) has {E} experts, which cannot be split evenly over "
                f"{size} ranks; use a group whose size divides {E}")
    return None


def expert_parallel(model: nn.Module, group=None, *, a2a_bits: int = 32, observer: Any = None,
                    chunks: int = 1, pipeline: bool = False, wire_seed: int = 0) -> nn.Module:
    """Make every sparse MoE block of the transformers ``model`` expert-parallel over
    ``group`` (default: the world; without torch.distributed, one rank), in place; returns
    ``model``.

    Rank r of the group keeps experts ``[r*E/P, (r+1)*E/P)`` of each block; tokens reach
    them through commsched's uneven all-to-all, whose rows travel at ``a2a_bits`` (32 as
    computed, 16 bfloat16, 8 the 8-bit row records; see
    :class:`commsched.moe.model.layer.DispatchConfig`), and ``observer`` (an
    :class:`~commsched.comm.observe.A2AObserver`, e.g. Lina's scheduler) is told about every
    exchange. ``chunks`` cuts each exchange into that many, and ``pipeline`` overlaps each
    chunk's exchange with the expert compute of the others (the MoE layer's pipelined
    exchange; :func:`commsched.moe.model.dispatch.ep_moe`; ``close()`` on each
    :class:`ExpertParallelExperts` stops its comm lane). Collective: every rank of the
    group calls it with the same model layout and options.

    Raises TypeError for a ``model`` that is not a module, ValueError (on every rank) for a
    model with no supported block, a model made expert-parallel already, an unsupported
    block (naming its class), a block whose experts do not split evenly over the group, or
    ranks whose models differ.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expert_parallel takes a transformers model (a torch.nn.Module), got {type(model).__name__}")
    size, rank = _group_size_rank(group)
    dc = DispatchConfig(chunks=chunks, pipeline=pipeline, a2a_bits=a2a_bits)  # bad options: refused here
    moe_wires(a2a_bits)
    found, unsupported = _blocks(model)
    weights = [getattr(b.experts, "gate_up_proj", torch.empty(0)) for _, b, _ in found]
    layout = {"blocks": [(n, type(b).__name__, tuple(w.shape), str(w.dtype)) for (n, b, _), w in zip(found, weights)],
              "unsupported": unsupported, "a2a_bits": a2a_bits, "chunks": chunks, "pipeline": pipeline}
    check_same_config(layout, group, what="transformers MoE model")
    if unsupported:
        raise ValueError(f"commsched.moe.hf.expert_parallel does not support {', '.join(unsupported)}; "
                         f"supported blocks: {_supported_names()}")
    if not found:
        raise ValueError(f"{type(model).__name__} has no sparse MoE block to make expert-parallel; "
                         f"supported blocks: {_supported_names()}")
    problems = [p for p in (_layout_problem(n, b, size) for n, b, _ in found) if p]
    if problems:
        raise ValueError("; ".join(problems))
    global_rank = dist.get_rank() if dist.is_initialized() else 0
    for i, (_, block, _) in enumerate(found):
        eg = ExpertGroup(block.experts.gate_up_proj.shape[0], size, rank, group)
        wires = moe_wires(a2a_bits, format_seed(wire_seed + i, global_rank))  # each block its own key stream
        block.experts = ExpertParallelExperts(block.experts, eg, wires, observer, dc)
    return model


# the tiny byte-level Mixtral of the training-parity bench and of the trace recorder
TINY_MIXTRAL: dict[str, Any] = {"hidden": 128, "experts": 8, "k": 2, "layers": 4, "heads": 4, "kv_heads": 2,
                                "intermediate": 256, "seq_len": 64, "aux_coef": 0.02}


def tiny_mixtral(seed: int = 0, **sizes: Any) -> nn.Module:
    """A float32 ``MixtralForCausalLM`` over bytes (vocabulary 256) of :data:`TINY_MIXTRAL`'s
    sizes (``sizes`` overrides any of them), its weights drawn from ``seed``; the router's
    auxiliary loss is on when ``aux_coef`` > 0. An unknown size is a ValueError."""
    unknown = sorted(set(sizes) - set(TINY_MIXTRAL))
    if unknown:
        raise ValueError(f"tiny_mixtral: unknown size {', '.join(unknown)}; sizes: {', '.join(TINY_MIXTRAL)}")
    z = {**TINY_MIXTRAL, **sizes}
    cfg = transformers.MixtralConfig(
        vocab_size=256, hidden_size=z["hidden"], intermediate_size=z["intermediate"], num_hidden_layers=z["layers"],
        num_attention_heads=z["heads"], num_key_value_heads=z["kv_heads"], num_local_experts=z["experts"],
        num_experts_per_tok=z["k"], max_position_embeddings=z["seq_len"], output_router_logits=z["aux_coef"] > 0,
        router_aux_loss_coef=z["aux_coef"])
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(cfg).float()


def _ep_modules(model: nn.Module) -> list[tuple[str, ExpertParallelExperts]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)]


def gather_state_dict(model: nn.Module, group=None) -> dict[str, torch.Tensor] | None:
    """The plain transformers state dict of an expert-parallel ``model``: every expert
    gathered into its original [E, ...] tensor under its original key, the rest as
    ``model.state_dict()`` has it. Collective on ``group`` (the one given to
    :func:`expert_parallel`); the dict on its rank 0, None on the others."""
    size, rank = _group_size_rank(group)
    sd = model.state_dict()
    for name, m in _ep_modules(model):
        if m.expert_group.size != size:
            raise ValueError(f"{name} is expert-parallel over {m.expert_group.size} ranks, the group given has {size}")
        for p in EXPERT_PARAMS:
            t = getattr(m, p).detach().contiguous()
            if size == 1:
                full = t.clone()
            else:
                parts = [torch.empty_like(t) for _ in range(size)]
                with comm_guard(f"gathering {name}.{p}", group):
                    dist.all_gather(parts, t, group=group)
                full = torch.cat(parts)
            sd[f"{name}.{p}" if name else p] = full
    return sd if rank == 0 else None


def load_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True):
    """Load a plain transformers state dict (every expert, as :func:`gather_state_dict` or
    ``save_pretrained`` give it) into an expert-parallel ``model`` of any group size: each
    rank copies its own experts' rows. Local (no communication); returns what
    ``nn.Module.load_state_dict`` returns. An expert tensor of the wrong shape is a ValueError."""
    sd = dict(state_dict)
    for name, m in _ep_modules(model):
        for p in EXPERT_PARAMS:
            key = f"{name}.{p}" if name else p
            if key not in sd:
                continue  # strict loading names it
            full, mine = sd[key], getattr(m, p)
            if tuple(full.shape) != (m.num_experts, *mine.shape[1:]):
                raise ValueError(f"{key} in the state dict has shape {tuple(full.shape)}, the model's experts "
                                 f"need {(m.num_experts, *mine.shape[1:])} (every expert of the block)")
            sd[key] = full[m.first:m.first + m.num_local]
    return model.load_state_dict(sd, strict=strict)


__all__ = ["EXPERT_PARAMS", "ExpertParallelExperts", "FAMILIES", "TINY_MIXTRAL", "expert_parallel",
           "gather_state_dict", "load_state_dict", "supported_blocks", "tiny_mixtral"]
