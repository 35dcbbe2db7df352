"""Cluster presets: the papers' GPU clusters as emulated clusters on one machine (pure).

A :class:`ClusterPreset` names a device model (:mod:`commsched.cluster.device`), the hosts
and GPUs (ranks) per host, the intra-host link (NVLink-class, the aggregate of one host)
and each host's NIC (InfiniBand/Ethernet-class), the model shapes the benches run on it,
and where every number comes from. ``commsched bench moe-train|gnn|moe-infer --cluster
NAME`` runs every variant on that device model, on emulated hosts whose links run at the
dilated rates.

Time dilation k (:func:`dilation_for`): every device time is multiplied by k and every
link rate divided by k, so the ratio of compute to communication is the real cluster's and
the predicted time on the real cluster is measured / k. k is fixed by the cluster, never by
a result: the smallest k of the 1-2-5 series (1, 2, 5, 10, 20, 50, ...) at which the NICs
of all hosts together need at most :data:`LINK_BUDGET_BPS` -- the aggregate rate that
``tc tbf`` on the loopback and gloo's TCP on a 2-core machine carry with the ranks' host
CPU share low (the emulator's default regimes run 0.3-0.8 Gbit/s on that machine). The
intra-host link is shaped at its dilated rate where the machine can carry it, else at
:data:`INTRA_CAP_BPS` (:attr:`ClusterPreset.intra_carried_bps`): an NVLink-class host
dilated by the NIC's k needs tens of Gbit/s of loopback copies that two cores cannot make
without becoming the bottleneck; at the cap, a host's internal link is still several
times faster than its emulated NIC, so the bottleneck stays the NIC, as on the cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

GBIT = 1e9
# what the emulated NICs of all hosts may need together (bits/s of emulated traffic)
LINK_BUDGET_BPS = 1 * GBIT
# the most an emulated host's internal link is shaped at (bits/s; see the module text)
INTRA_CAP_BPS = 4 * GBIT

# the share of a GPU's memory that inference may fill with expert weights: the rest holds the
# dense layers' weights, the activations and KV cache of the batches, and the communication
# and framework buffers (a documented choice, not a measurement; see resident_experts)
EXPERT_MEMORY_SHARE = 0.5

# A100 SXM4: NVLink 3, 12 links x 50 GB/s = 600 GB/s per GPU, both directions together,
# i.e. 300 GB/s each way; a host of 4 through NVSwitch: 4 x 300 GB/s each way.
A100_NVLINK_EACH_WAY_BPS = 300e9 * 8
_NVLINK_SRC = ("NVIDIA A100 datasheet: third-generation NVLink, 600 GB/s per GPU (both "
               "directions), 300 GB/s each way; a host's internal link here is 4 GPUs x 300 GB/s")


def dilation_for(hosts: int, nic_bps: float, budget_bps: float = LINK_BUDGET_BPS) -> float:
    """The time dilation k of a cluster of ``hosts`` NICs of ``nic_bps`` each: the smallest
    k of the 1-2-5 series with ``hosts * nic_bps / k <= budget_bps`` (pure)."""
    if hosts < 1 or not nic_bps > 0 or not budget_bps > 0:
        raise ValueError(f"need hosts >= 1 and positive rates, got hosts={hosts}, nic={nic_bps}, "
                         f"budget={budget_bps}")
    need = hosts * nic_bps / budget_bps
    if need <= 1:
        return 1.0
    exp = math.floor(math.log10(need))
    for e in (exp, exp + 1):
        for m in (1, 2, 5):
            k = m * 10.0 ** e
            if k >= need * (1 - 1e-12):
                return float(k)
    raise AssertionError("unreachable")  # pragma: no cover


def resident_experts(memory_bytes: float, experts: int, layers: int, expert_bytes: float,
                     share: float = EXPERT_MEMORY_SHARE) -> int:
    """How many experts of each MoE layer one GPU keeps resident in inference: as many as
    ``share`` of its ``memory_bytes`` holds for all ``layers`` (``expert_bytes`` each), at
    most ``experts`` (all of them), at least 1 (pure). The Lina paper's devices keep the
    expert weights in host DRAM and limit what they load onto the GPU only when its memory
    is scarce; an 80 GB A100 holds every GPT-2-sized expert of 12 layers x 16 experts
    (1.8 GB) many times over."""
    for what, v in (("memory_bytes", memory_bytes), ("expert_bytes", expert_bytes)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{what} must be a positive number, got {v!r}")
    if not 0 < share <= 1:
        raise ValueError(f"share is a fraction of the memory in (0, 1], got {share}")
    if experts < 1 or layers < 1:
        raise ValueError(f"need experts and layers >= 1, got {experts}, {layers}")
    fit = int(share * memory_bytes // (layers * expert_bytes))
    return max(1, min(experts, fit))


@dataclass(frozen=True, kw_only=True)
class MoEShape:
    """The MoE language model a preset's ``bench moe-train`` runs (``commsched.moe.train``'s
    model flags) and, for ``bench moe-infer``, its expert layers."""

    name: str
    d_model: int
    n_heads: int
    n_layers: int
    seq_len: int
    d_ff: int
    expert_hidden: int
    batch_size: int           # sequences per rank per step
    moe_every: int = 2
    k: int = 1
    dtype: str = "bfloat16"
    source: str = ""


@dataclass(frozen=True, kw_only=True)
class GNNShape:
    """The graph and model a preset's ``bench gnn`` runs (``commsched.gnn.train``)."""

    models: str               # comma-separated layer kinds
    layers: int
    hidden: int
    syn_nodes: int
    syn_edges: int
    source: str = ""


@dataclass(frozen=True, kw_only=True)
class ClusterPreset:
    """One GPU cluster, emulated: its device model, shape, links and model shapes.

    ``intra_bps``: one host's internal link (NVLink-class), the aggregate each way;
    ``nic_bps``: each host's NIC, each way. :attr:`dilation` is k (:func:`dilation_for`);
    the emulated links run at :attr:`nic_emulated_bps` and :attr:`intra_carried_bps`."""

    name: str
    description: str
    device_model: str
    hosts: int
    ranks_per_host: int
    intra_bps: float
    nic_bps: float
    nic_kind: str
    moe: MoEShape
    gnn: GNNShape
    infer_experts: int = 16
    infer_layers: int = 12
    infer_tokens_per_batch: int = 2048
    paper_models: tuple[str, ...] = ()
    sources: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.ranks_per_host < 1:
            raise ValueError(f"{self.name}: hosts and ranks per host must be >= 1")
        if not (self.intra_bps > 0 and self.nic_bps > 0):
            raise ValueError(f"{self.name}: link rates must be > 0")

    @property
    def ranks(self) -> int:
        """Emulated GPUs in all."""
        return self.hosts * self.ranks_per_host

    @property
    def dilation(self) -> float:
        """k: device times x k, link rates / k."""
        return dilation_for(self.hosts, self.nic_bps)

    @property
    def nic_emulated_bps(self) -> int:
        """Each emulated host's NIC: the real rate / k (bits/s)."""
        return int(round(self.nic_bps / self.dilation))

    @property
    def intra_emulated_bps(self) -> int:
        """The intra-host link's dilated rate (real / k), before the cap."""
        return int(round(self.intra_bps / self.dilation))

    @property
    def intra_carried_bps(self) -> int:
        """The rate the emulator shapes the intra-host link at: the dilated rate, at most
        :data:`INTRA_CAP_BPS`."""
        return int(min(self.intra_emulated_bps, INTRA_CAP_BPS))

    def predicted(self, measured_s: float | None) -> float | None:
        """The time on the real cluster of a time measured on the emulated one (measured / k)."""
        return None if measured_s is None else measured_s / self.dilation

    def describe(self) -> str:
        """One line: the cluster, k and the emulated links."""
        intra = f"{self.intra_carried_bps / GBIT:g} Gbit/s"
        if self.intra_carried_bps < self.intra_emulated_bps:
            intra += f" (dilated {self.intra_emulated_bps / GBIT:g} Gbit/s, capped)"
        return (f"{self.name}: {self.hosts} hosts x {self.ranks_per_host} {self.device_model} "
                f"({self.ranks} GPUs), {self.nic_kind} {self.nic_bps / GBIT:g} Gbit/s per host, "
                f"intra-host {self.intra_bps / GBIT:g} Gbit/s; k = {self.dilation:g}: NIC emulated at "
                f"{self.nic_emulated_bps / 1e6:g} Mbit/s, intra-host at {intra}")


_LINA = ("Lina (ATC 2023, /work/shared/papers/lina.txt): 'up to 16 A100 GPUs with 100Gbps InfiniBand'; "
         "Transformer-XL, GPT-2, BERT-Large and BERT2GPT2 MoE variants with 2-16 experts. The paper does "
         "not state the hosts' GPU count: 4 per host here (as in AdaQP's testbed)")
_ADAQP = ("AdaQP (MLSys 2023, /work/shared/papers/adaqp.txt): 2M-4D (2 machines x 4 GPUs) partitions, "
          "a 6-machine x 4-GPU scale test on 100 Gb/s Ethernet (V100 and A100 SXM4); GCN and GraphSAGE, "
          "3 layers, hidden 256 (papers.md: their defaults)")
# GPT-2 small's public shape (12 blocks, d 768, 12 heads, FFN 3072; 1024-token context): the
# paper names the family, not its MoE variants' widths. Sequences shortened to 512 and 4 per
# rank so that a step's bytes fit this machine (documented approximation).
_GPT2 = MoEShape(name="gpt2-moe", d_model=768, n_heads=12, n_layers=12, seq_len=512, d_ff=3072,
                 expert_hidden=3072, batch_size=4, moe_every=2, k=1, dtype="bfloat16",
                 source="GPT-2 small's public shape (12 x 768, 12 heads, FFN 3072), every other block MoE "
                        "with one expert per GPU, top-1; 4 sequences of 512 tokens per GPU per step (an "
                        "approximation: the paper states neither batch nor sequence length)")
_GNN = GNNShape(models="gcn,sage", layers=3, hidden=256, syn_nodes=50_000, syn_edges=1_000_000,
                source="AdaQP's defaults: 3 layers, hidden 256 (GCN and GraphSAGE); a synthetic graph of "
                       "50k nodes and 1M edges stands in for ogbn-products (2.4M nodes, 62M edges), "
                       "which this machine cannot partition and hold 8-16 times in a bench's time")
_PAPER_MOE = ("Transformer-XL MoE", "GPT-2 MoE", "BERT-Large MoE", "BERT2GPT2 MoE")
_PAPER_GNN = ("GCN", "GraphSAGE")


def _preset(name: str, hosts: int, nic_kind: str, paper: str, models: tuple[str, ...], what: str,
            per_host: int = 4) -> ClusterPreset:
    nic = 100 * GBIT
    return ClusterPreset(
        name=name, description=what, device_model="a100", hosts=hosts, ranks_per_host=per_host,
        intra_bps=per_host * A100_NVLINK_EACH_WAY_BPS, nic_bps=nic, nic_kind=nic_kind, moe=_GPT2, gnn=_GNN,
        paper_models=models,
        sources={"cluster": paper, "intra_bps": _NVLINK_SRC, "nic_bps": f"100 Gb/s {nic_kind} per host ({paper.split(':')[0]})",
                 "device_model": "commsched.cluster.device's a100 (vendor specs; efficiencies estimated)",
                 "moe": _GPT2.source, "gnn": _GNN.source,
                 "dilation": "dilation_for: smallest 1-2-5 k with hosts x NIC / k <= LINK_BUDGET_BPS"})


PRESETS: dict[str, ClusterPreset] = {p.name: p for p in (
    _preset("a100x16-ib100", 4, "InfiniBand", _LINA, _PAPER_MOE, "the Lina paper's testbed: 16 A100, 100 Gb/s InfiniBand"),
    _preset("a100x8-ib100", 2, "InfiniBand", _LINA, _PAPER_MOE, "the Lina testbed's 8-GPU half: 8 A100, 100 Gb/s InfiniBand"),
    # the scaling series' smallest point: 2 hosts of 2, so that the NIC stays the bottleneck
    # (one host of 4 would put every byte on NVLink, which cannot run at its dilated rate here)
    _preset("a100x4-ib100", 2, "InfiniBand", _LINA, _PAPER_MOE,
            "4 A100 of the Lina testbed as 2 hosts x 2, 100 Gb/s InfiniBand", per_host=2),
    _preset("a100x8-eth100", 2, "Ethernet", _ADAQP, _PAPER_GNN, "AdaQP's 2M-4D setting: 2 machines x 4 A100, 100 Gb/s Ethernet"),
    _preset("a100x16-eth100", 4, "Ethernet", _ADAQP, _PAPER_GNN, "AdaQP's setting at 4 machines x 4 A100, 100 Gb/s Ethernet"),
    _preset("a100x4-eth100", 2, "Ethernet", _ADAQP, _PAPER_GNN,
            "4 A100 in AdaQP's setting as 2 machines x 2, 100 Gb/s Ethernet", per_host=2),
)}
CLUSTERS: tuple[str, ...] = tuple(PRESETS)


def load_preset(name: str) -> ClusterPreset:
    """The preset called ``name``; a ValueError naming the choices otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cluster preset {name!r}; choose one of {', '.join(CLUSTERS)}") from None


__all__ = ["CLUSTERS", "ClusterPreset", "EXPERT_MEMORY_SHARE", "GBIT", "GNNShape", "INTRA_CAP_BPS", "LINK_BUDGET_BPS", "MoEShape",
           "PRESETS", "dilation_for", "load_preset", "resident_experts"]
