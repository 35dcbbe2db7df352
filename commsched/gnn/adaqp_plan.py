"""AdaQP's pure planning: options, width layouts, random widths, the rank-0 solve.

Legend: P ranks, n_p messages (rows) exchanged with peer p, D row width, b bits.

No process group here (DESIGN.md rule 1): every function maps plain data to plain data
and is tested in milliseconds on hand-worked examples. :mod:`commsched.gnn.adaqp` runs
the exchange that uses them.

* :class:`AdaQPOptions`: the AdaQP knobs of a run (nested in ``TrainConfig.adaqp``).
* :func:`width_layout`: where each width's rows sit in every peer's message and how many
  bytes each segment has; sender and receiver derive it from the same width vectors, so
  no sizes are exchanged.
* :func:`random_widths`: the ``random`` scheme's widths of one channel (a function of the
  channel and the period, so both ends agree without talking).
* :func:`build_problems` / :func:`solve_widths`: rank 0's re-assignment, from every
  rank's traces to one bit-width problem per (layer, direction) and back to a width
  vector per channel (optionally within the averaged-cost assignment's variance).
* :func:`peer_costs` / :func:`link_class_report`: per-peer costs from a probed
  ``Topology`` (each pair's own, or their mean), and an assignment's mean width and
  bytes per link class.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..all2all import SegmentLayout
from ..configurable import Config, option
from ..quant.assign_problem import Channel, expand_group_bits, group_messages
from ..quant.codec import META_BYTES, payload_bytes
from ..quant.reference import BITS
from ..topology import INTER, INTRA, Topology

# width schemes of the quantized exchange
SCHEMES = ("adaptive", "uniform", "random")
# where the adaptive assigner's per-peer (theta, gamma) come from (``--link-costs``):
# ring: probe_link_costs (every rank sends to rank + i at once, per peer); topology: every
# ordered pair timed alone (Topology.probe), each pair its own fit; averaged: the same probe,
# one cost for every pair (the mean of the pair fits: what the published systems assume)
LINK_COST_SOURCES = ("ring", "topology", "averaged")
# the pair probe's sizes for topology / averaged: 4 KiB (latency), then sizes past an
# emulated link's token bucket (docs/topology.md, "Known limits")
TOPOLOGY_PROBE_SIZES = (1 << 12, 1 << 20, 1 << 22)
_DIRS = {"forward": 0, "backward": 1}


# --------------------------------------------------------------------------- options
@dataclass(frozen=True, kw_only=True)
class AdaQPOptions(Config):
    """Knobs of the AdaQP exchanges (``TrainConfig.adaqp``; the CLI's ``--bits``,
    ``--period``, ``--group-size`` and ``--lam``). Recorded but unused by the modes that do
    not quantize.

    bits: the width of ``uniform``; period: epochs between re-assignments (adaptive) or
    redraws (random); group_size, lam: the assignment problem's (messages per group, the
    variance/time trade-off); assign_time_limit_s: CP-SAT's limit per problem;
    probe_sizes, probe_repeats: the start-up link probe's message sizes (bytes) and repeats;
    compile (``--no-compile`` sets False): compile the codec at set-up (torch.compile on the
    CPU, the Triton kernels on CUDA); False runs the uncompiled codec (the CPU's eager twin,
    the torch reference on CUDA: the same bits, slower), as ``COMMSCHED_COMPILE=0`` does;
    link_costs (``--link-costs``, one of :data:`LINK_COST_SOURCES`): where the assigner's
    per-peer costs come from (``topology``/``averaged`` probe with
    :data:`TOPOLOGY_PROBE_SIZES` and ``probe_repeats``); equal_variance
    (``--equal-variance``, needs ``topology``): widths as fast as the per-pair costs allow
    at no more variance than the averaged-cost assignment (:func:`solve_widths`).
    """

    bits: int = option(max(BITS), "the width of --mode uniform", foreign=(
        "--bits is the width of --mode uniform (AdaQP's exchange); --mode {mode} does not "
        "quantize to a chosen width and would ignore --bits {value}: drop it"))
    period: int = option(50, "AdaQP re-assignment period (epochs)")
    group_size: int = option(100, "AdaQP message group size")
    lam: float = option(0.5, "AdaQP variance/time trade-off")
    assign_time_limit_s: float = option(2.0, cli=False)
    probe_sizes: tuple[int, ...] = option((1 << 12, 1 << 16, 1 << 19), cli=False)
    probe_repeats: int = option(2, cli=False)
    compile: bool = option(True, "compile the quantization codec at start-up")
    link_costs: str = option("ring", "AdaQP's link costs: ring (probe_link_costs), topology (every "
                             "pair timed alone, its own cost) or averaged (that probe, one mean "
                             "cost for every pair)", choices=LINK_COST_SOURCES)
    equal_variance: bool = option(False, "with --link-costs topology: the fastest widths at no "
                                  "more variance than the averaged-cost assignment")

    def __post_init__(self) -> None:
        if self.equal_variance and self.link_costs != "topology":
            raise ValueError("--equal-variance caps the variance of topology-aware widths at that "
                             "of the averaged-cost ones: it needs --link-costs topology, got "
                             f"--link-costs {self.link_costs}")
        if self.bits not in BITS:
            raise ValueError(f"--bits must be one of {', '.join(map(str, BITS))}, got {self.bits}")
        if self.period < 1 or self.group_size < 1:
            raise ValueError("--period and --group-size must be >= 1")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"--lam must lie in [0, 1], got {self.lam}")
        if self.assign_time_limit_s <= 0 or self.probe_repeats < 1 or not self.probe_sizes:
            raise ValueError("assign_time_limit_s must be > 0, probe_repeats >= 1 and "
                             "probe_sizes non-empty")
        object.__setattr__(self, "probe_sizes", tuple(int(s) for s in self.probe_sizes))


# --------------------------------------------------------------------------- layouts
@dataclass(frozen=True, eq=False)
class WidthLayout:
    """Where each width's rows sit in every peer's message, and their byte sizes.

    ``idx[p][w]`` (int64 tensor): positions, within the n_p rows exchanged with peer p,
    of the rows at width ``widths[w]`` (ascending). ``segments`` is the byte layout: per
    peer, each width's segments in order (AdaQP's: payload_2, meta_2, payload_4, meta_4,
    payload_8, meta_8); ``seg_of[w]``: the indices of width w's segments in a peer's list.
    """

    counts: tuple[int, ...]
    dim: int
    idx: tuple[tuple[torch.Tensor, ...], ...]
    segments: SegmentLayout
    # per width: positions of its rows among all the exchange's rows (peer by peer, each
    # peer's rows in ascending order) [n_b], and how many of them each peer has
    pos: tuple[torch.Tensor, ...] = ()
    peer_rows: tuple[tuple[int, ...], ...] = ()
    widths: tuple[int, ...] = BITS
    seg_of: tuple[tuple[int, ...], ...] = ((0, 1), (2, 3), (4, 5))

    def rows_per_width(self) -> dict[int, int]:
        return {b: sum(int(self.idx[p][w].numel()) for p in range(len(self.counts)))
                for w, b in enumerate(self.widths)}

    def to(self, device: torch.device | str) -> "WidthLayout":
        """The same layout with its index tensors (``idx``, ``pos``) on ``device`` (itself
        when they are there already)."""
        device = torch.device(device)
        if all(t.device == device for t in self.pos):
            return self
        return dataclasses.replace(
            self, idx=tuple(tuple(t.to(device) for t in row) for row in self.idx),
            pos=tuple(t.to(device) for t in self.pos))


def quantized_segments(dim: int, bits: int) -> tuple[int, ...]:
    """Per-row bytes of the segments of one AdaQP width: (payload, metadata)."""
    return (payload_bytes(dim, bits), META_BYTES)


def width_layout(widths_P: list[np.ndarray], dim: int, *, widths: tuple[int, ...] = BITS,
                 row_segments=quantized_segments) -> WidthLayout:
    """The layout of one exchange side from the per-peer width vectors (each [n_p], values
    in ``widths``, default :data:`~commsched.quant.reference.BITS`); ``row_segments(dim,
    w)``: the per-row bytes of each segment width w's rows travel in (default AdaQP's
    payload and metadata; the ``adaptive`` mode's techniques have their own). Sender and
    receiver of a channel call it with the same vector and get the same sizes."""
    if dim < 1:
        raise ValueError(f"row width must be >= 1, got {dim}")
    per_w = [tuple(row_segments(dim, b)) for b in widths]
    seg_of, s0 = [], 0
    for segs in per_w:
        seg_of.append(tuple(range(s0, s0 + len(segs))))
        s0 += len(segs)
    idx, sizes, off = [], [], 0
    pos: list[list[torch.Tensor]] = [[] for _ in widths]
    for p, w in enumerate(widths_P):
        w = np.asarray(w)
        bad = ~np.isin(w, widths)
        if bad.any():
            raise ValueError(f"widths for peer {p} must be {', '.join(map(str, widths[:-1]))} or "
                             f"{widths[-1]}; got {sorted(set(w[bad].tolist()))}")
        row_idx, row_sz = [], []
        for k, b in enumerate(widths):
            sel = torch.from_numpy(np.flatnonzero(w == b).astype(np.int64))
            row_idx.append(sel)
            pos[k].append(sel + off)
            row_sz += [sel.numel() * nb for nb in per_w[k]]
        idx.append(tuple(row_idx))
        sizes.append(tuple(row_sz))
        off += w.size
    return WidthLayout(tuple(int(np.asarray(w).size) for w in widths_P), dim, tuple(idx),
                       SegmentLayout(tuple(sizes)),
                       pos=tuple(torch.cat(ps) if ps else torch.zeros(0, dtype=torch.int64) for ps in pos),
                       peer_rows=tuple(tuple(int(i[k].numel()) for i in idx) for k in range(len(widths))),
                       widths=tuple(widths), seg_of=tuple(seg_of))


def random_widths(n: int, *, seed: int, layer: int, direction: str, src: int, dst: int,
                  period_index: int) -> np.ndarray:
    """The ``random`` scheme's widths of one channel: uniform over BITS, the same on both
    ends (a function of the channel and the period only)."""
    rng = np.random.default_rng([seed, layer, _DIRS[direction], src, dst, period_index])
    return rng.choice(np.array(BITS, dtype=np.int64), size=n)


# --------------------------------------------------------------------------- the solve
@dataclass(frozen=True)
class WidthProblems:
    """One bit-width problem per (layer, direction) key, ready for ``assign_many``.

    ``problems[i]`` are the rounds of ``keys[i]`` (round r - 1: every rank p sends to
    p + r); ``members[i][r][c] = (src, dst, n, groups)``: channel c of round r, its message
    count and the message indices of each group (``group_messages``)."""

    keys: tuple[tuple[int, str], ...]
    problems: tuple[list[list[Channel]], ...]
    members: tuple[list[list[tuple[int, int, int, list[np.ndarray]]]], ...]


def build_problems(per_rank: list[dict], *, group_size: int) -> WidthProblems:
    """From every rank's report -- ``trace`` {(layer, dir): [betas to each peer]}, ``dims``
    {(layer, dir): row width}, ``costs`` {peer: (theta, gamma)} and ``counts`` (send
    counts, recv counts) -- the problems over the P - 1 ring rounds. A channel never
    traced (no message this period) weighs all its messages alike; a peer without a
    measured cost gets (1e-8 s/byte, 0 s)."""
    P = len(per_rank)
    keys = sorted({k for r in per_rank for k in r["trace"]})
    problems, members = [], []
    for key in keys:
        dim = max(r["dims"].get(key, 1) for r in per_rank)
        rounds, mem = [], []
        for rnd in range(1, P):
            chans, mrow = [], []
            for src in range(P):
                dst = (src + rnd) % P
                send_c, recv_c = per_rank[src]["counts"]
                n = int((send_c if key[1] == "forward" else recv_c)[dst])
                tr = per_rank[src]["trace"].get(key)
                betas = np.asarray(tr[dst], dtype=np.float64) if tr is not None else np.zeros(0)
                if betas.size != n:  # never traced (no message this epoch): weigh all alike
                    betas = np.ones(n)
                groups, m = group_messages(betas, dim, group_size) if n else ([], [])
                theta, gamma = per_rank[src]["costs"].get(dst, (1e-8, 0.0))
                chans.append(Channel(float(theta), float(gamma), groups))
                mrow.append((src, dst, n, m))
            rounds.append(chans)
            mem.append(mrow)
        problems.append(rounds)
        members.append(mem)
    return WidthProblems(tuple(keys), tuple(problems), tuple(members))


def peer_costs(topology: Topology, rank: int, source: str) -> dict[int, tuple[float, float]]:
    """{peer: (theta, gamma)} of ``rank``'s channels from a probed topology: ``topology``
    gives each pair its own measured cost (``pair_cost(rank, p)``), ``averaged`` every pair
    one cost, the mean over all ordered pairs of their theta and of their gamma."""
    P = topology.world_size
    if not 0 <= rank < P:
        raise ValueError(f"rank must be in 0..{P - 1}, got {rank}")
    if source == "topology":
        return {p: (topology.pair_cost(rank, p).theta, topology.pair_cost(rank, p).gamma)
                for p in range(P) if p != rank}
    if source == "averaged":
        pairs = [topology.pair_cost(a, b) for a in range(P) for b in range(P) if a != b]
        th = float(np.mean([c.theta for c in pairs])) if pairs else 0.0
        ga = float(np.mean([c.gamma for c in pairs])) if pairs else 0.0
        return {p: (th, ga) for p in range(P) if p != rank}
    raise ValueError(f"peer_costs: source must be 'topology' or 'averaged', got {source!r}")


def link_class_report(table: dict, dims: dict, hosts_P) -> dict:
    """Per link class (``intra``: both ends on one host, ``inter``: not) of an assignment
    ``table`` {(layer, dir): {(src, dst): widths [n]}} with row widths ``dims`` {(layer,
    dir): D}: ``rows`` exchanged per epoch, ``rows_per_width``, ``mean_bits`` (over rows)
    and ``bytes_per_epoch`` (payload and metadata, every (layer, direction) once). Only the
    classes some channel has appear."""
    out: dict = {}
    for key, chans in table.items():
        D = int(dims[key])
        for (src, dst), w in chans.items():
            cls = INTRA if hosts_P[src] == hosts_P[dst] else INTER
            r = out.setdefault(cls, {"rows": 0, "rows_per_width": {str(b): 0 for b in BITS},
                                     "bits_sum": 0, "bytes_per_epoch": 0})
            w = np.asarray(w)
            for b in BITS:
                n = int((w == b).sum())
                r["rows_per_width"][str(b)] += n
                r["bytes_per_epoch"] += n * (payload_bytes(D, b) + META_BYTES)
            r["rows"] += int(w.size)
            r["bits_sum"] += int(w.sum())
    for r in out.values():
        r["mean_bits"] = r.pop("bits_sum") / r["rows"] if r["rows"] else None
    return out


def solve_widths(per_rank: list[dict], *, group_size: int, lam: float, time_limit_s: float,
                 seed: int = 0, hosts_P=None, equal_variance: bool = False) -> tuple[dict, dict]:
    """Rank 0's part of the re-assignment: :func:`build_problems`, solve them in parallel
    (``assign_many``), expand each group's width to its messages. Returns
    ({(layer, dir): {(src, dst): widths [n]}}, info: solve time, widths histogram, each
    problem's solver status and, given ``hosts_P`` (the host of every rank),
    ``link_classes``: :func:`link_class_report`).

    ``equal_variance``: every report also holds ``ref_costs`` {peer: (theta, gamma)} (the
    averaged costs); each problem is first solved at ``lam`` under those, and then, under
    the reports' own ``costs``, the fastest assignment found whose variance is at most that
    one's (``assign_many(variance_budgets=...)``): as precise as the averaged-cost
    assignment, with the time spent where the links are slow."""
    from ..quant import assign_many  # the solver (OR-Tools) loads only when rank 0 solves

    wp = build_problems(per_rank, group_size=group_size)
    t = time.perf_counter()
    budgets = None
    if equal_variance:
        if any("ref_costs" not in r for r in per_rank):
            raise ValueError("equal_variance needs every rank's ref_costs (the averaged link costs)")
        ref = build_problems([{**r, "costs": r["ref_costs"]} for r in per_rank], group_size=group_size)
        budgets = [a.variance for a in assign_many(list(ref.problems), lam=lam,
                                                   time_limit_s=time_limit_s, seed=seed)]
    res = assign_many(list(wp.problems), lam=lam, time_limit_s=time_limit_s, seed=seed,
                      variance_budgets=budgets)
    solve_s = time.perf_counter() - t
    table: dict = {}
    hist = {b: 0 for b in BITS}
    status = []
    for key, a, mem in zip(wp.keys, res, wp.members):
        chans = {}
        for r, mrow in enumerate(mem):
            for c, (src, dst, n, m) in enumerate(mrow):
                w = expand_group_bits(m, a.bits[r][c], n) if n else np.zeros(0, np.int64)
                chans[(src, dst)] = w
                for b in BITS:
                    hist[b] += int((w == b).sum())
        table[key] = chans
        status.append({"layer": key[0], "direction": key[1], "status": a.status,
                       "objective": a.objective, "gap": a.gap, "wall_s": a.wall_s,
                       "lam": a.lam, "time_s": a.time_s, "variance": a.variance,
                       **({"variance_budget": a.stats["v_budget"]} if "v_budget" in a.stats else {})})
    info = {"solve_s": solve_s, "rows_per_width": {str(b): n for b, n in hist.items()},
            "problems": status}
    if hosts_P is not None:
        dims = {k: max(r["dims"].get(k, 1) for r in per_rank) for k in wp.keys}
        info["link_classes"] = link_class_report(table, dims, hosts_P)
    return table, info


__all__ = ["AdaQPOptions", "LINK_COST_SOURCES", "SCHEMES", "TOPOLOGY_PROBE_SIZES",
           "link_class_report", "peer_costs", "WidthLayout", "WidthProblems", "build_problems",
           "quantized_segments", "random_widths", "solve_widths", "width_layout"]
