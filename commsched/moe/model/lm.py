"""A small byte-level transformer language model whose feed-forward layers are MoE.

Legend: B batch, S sequence, D model width, V = 256 byte values.

Pre-norm blocks: ``x + attn(ln(x))`` then ``x + ffn(ln(x))``; the FFN of every
``moe_every``-th block is an :class:`~commsched.moe.model.layer.MoELayer` (GShard/Switch put one
in every other block), the others are dense. Causal self-attention uses
``scaled_dot_product_attention``. ``forward(tokens_BS)`` returns ``(logits_BSV, aux)``
with ``aux`` the mean load-balancing loss of the MoE layers.

``forward(tokens_BS, moe_call=f)`` is the seam for callers that run the MoE layers
themselves (the inference runtime places their experts): every MoE block's FFN becomes
``f(j, layer, h_BSD) -> y_BSD`` (j counts MoE layers from 0, ``layer`` is the block's
:class:`~commsched.moe.model.layer.MoELayer`, ``h`` its normalised input); everything else
is the model's own arithmetic. ``aux`` is then None (the layers' losses are not run).

Parameters are created in a fixed order from the global random stream, so every rank
that seeds it alike builds identical non-expert weights, and an expert-parallel model
holds exactly its block of the experts a single-process model holds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...comm.observe import A2AObserver
from ...configurable import Config, option
from .dispatch import ExpertGroup
from .layer import DispatchConfig, MoELayer
from .router import RouterConfig


@dataclass(frozen=True, kw_only=True)
class ModelConfig(Config):
    """The MoE language model's sizes (flags of ``-m commsched.moe.train`` and ``record``)."""

    vocab: int = option(256, "vocabulary (bytes)", cli=False)
    d_model: int = option(64, "model width")
    n_heads: int = option(4, "attention heads", flag="--heads")
    n_layers: int = option(2, "transformer blocks", flag="--layers")
    seq_len: int = option(64, "tokens per sequence")
    d_ff: int = option(128, "hidden width of the dense FFNs")
    expert_hidden: int = option(128, "hidden width of each expert")
    num_experts: int = option(4, "experts per MoE layer", flag="--experts")
    k: int = option(1, "experts per token", choices=(1, 2))
    capacity_factor: float | None = option(None, "expert capacity factor (default: dropless)")
    moe_every: int = option(2, "block i is MoE when i + 1 is a multiple of it")
    aux_weight: float = option(0.01, "weight of the load-balancing loss")

    def __post_init__(self) -> None:
        if min(self.vocab, self.d_model, self.n_heads, self.seq_len, self.d_ff, self.expert_hidden) < 1:
            raise ValueError("vocab, d_model, heads, seq_len, d_ff and expert_hidden must be >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.n_layers < 1 or self.moe_every < 1:
            raise ValueError("n_layers and moe_every must be >= 1")
        if not any(self.is_moe(i) for i in range(self.n_layers)):
            raise ValueError(f"no MoE block: n_layers={self.n_layers} with moe_every={self.moe_every}")
        if not (self.aux_weight >= 0 and math.isfinite(self.aux_weight)):
            raise ValueError(f"--aux-weight must be a finite number >= 0, got {self.aux_weight}")
        RouterConfig(self.num_experts, self.k, self.capacity_factor)  # validates

    def is_moe(self, i: int) -> bool:
        return (i + 1) % self.moe_every == 0

    @property
    def router(self) -> RouterConfig:
        return RouterConfig(self.num_experts, self.k, self.capacity_factor)


# moe_call(j, layer, h_BSD) -> y_BSD: the caller's MoE layer j (see the module docstring)
MoECall = Callable[[int, nn.Module, torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(x_BSD).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, S, D))


class DenseFFN(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.fc2(F.gelu(self.fc1(x))), None


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn: nn.Module):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.ffn = ffn

    def forward(self, x: torch.Tensor, ffn: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``ffn`` replaces the block's own FFN (it returns y alone, no auxiliary loss)."""
        x = x + self.attn(self.ln1(x))
        if ffn is not None:
            return x + ffn(self.ln2(x)), None
        y, aux = self.ffn(self.ln2(x))
        return x + y, aux


class MoETransformerLM(nn.Module):
    def __init__(self, cfg: ModelConfig, *, expert_group: ExpertGroup | None = None,
                 dispatch: DispatchConfig | None = None, observer: A2AObserver | None = None,
                 expert_dp_group: object | None = None, wire_seed: int = 0):
        """``expert_dp_group``: the ranks holding the same experts as this one (see
        :class:`~commsched.moe.model.layer.MoELayer`; None: this rank alone). ``wire_seed``
        (the run's seed): with the layer's index, the seed of its 8-bit key stream."""
        super().__init__()
        self.cfg = cfg
        dispatch = dispatch or DispatchConfig()
        D = cfg.d_model
        self.tok = nn.Embedding(cfg.vocab, D)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, D) * 0.02)
        blocks = []
        for i in range(cfg.n_layers):
            if cfg.is_moe(i):  # wire_seed: each layer its own 8-bit key stream (--a2a-bits 8)
                ffn: nn.Module = MoELayer(D, cfg.expert_hidden, cfg.router, expert_group=expert_group,
                                          dispatch=dispatch, observer=observer, expert_dp_group=expert_dp_group,
                                          wire_seed=wire_seed * 1009 + i)
            else:
                ffn = DenseFFN(D, cfg.d_ff)
            blocks.append(Block(D, cfg.n_heads, ffn))
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, cfg.vocab)

    def moe_layers(self) -> list[nn.Module]:
        return [b.ffn for i, b in enumerate(self.blocks) if self.cfg.is_moe(i)]

    def wire_key_state(self) -> dict[str, dict]:
        """{MoE layer index: its 8-bit key stream position} (``--a2a-bits 8``; empty at other
        widths): what a checkpoint holds so that a resumed run rounds as an uninterrupted one."""
        out = {}
        for j, layer in enumerate(self.moe_layers()):
            st = layer.key_state() if hasattr(layer, "key_state") else None
            if st is not None:
                out[str(j)] = st
        return out

    def load_wire_key_state(self, st: dict) -> None:
        """Continue the key streams of :meth:`wire_key_state` (ValueError when the layers
        differ from those the state was taken from, or for a damaged state)."""
        mine = self.wire_key_state()
        if not isinstance(st, dict) or set(st) != set(mine):
            got = sorted(st) if isinstance(st, dict) else type(st).__name__
            raise ValueError(f"the 8-bit key streams saved are of MoE layers {got}, this model's are "
                             f"{sorted(mine)}")
        layers = self.moe_layers()
        for j, s in st.items():
            layers[int(j)].load_key_state(s)

    def close(self) -> None:
        """Stop the helper threads of the MoE layers (the pipelined exchange's comm lanes)."""
        for layer in self.moe_layers():
            if hasattr(layer, "close"):
                layer.close()

    def forward(self, tokens_BS: torch.Tensor, moe_call: MoECall | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits_BSV, mean auxiliary loss of the MoE layers); with ``moe_call`` the MoE
        layers are the caller's and the loss is None (module docstring)."""
        S = tokens_BS.shape[1]
        if S > self.cfg.seq_len:
            raise ValueError(f"sequence of {S} tokens is longer than the model's seq_len={self.cfg.seq_len}")
        x = self.tok(tokens_BS) + self.pos[:S]
        auxes = []
        j = 0
        for i, b in enumerate(self.blocks):
            ffn = None
            if moe_call is not None and self.cfg.is_moe(i):
                ffn = functools.partial(moe_call, j, b.ffn)
                j += 1
            x, aux = b(x, ffn)
            if aux is not None:
                auxes.append(aux)
        logits = self.head(self.ln_f(x))
        return logits, (torch.stack(auxes).mean() if auxes else None)

    def loss(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(total loss, language-model cross-entropy) of one batch."""
        logits, aux = self(tokens_BS)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets_BS.reshape(-1))
        return ce + self.cfg.aux_weight * aux, ce


__all__ = ["Attention", "Block", "DenseFFN", "MoECall", "ModelConfig", "MoETransformerLM"]
