"""AdaQP's exchanges: quantized multi-width halo rows, periodic adaptive widths, overlap.

Legend: P ranks, n_p messages (rows) of one channel (one peer), D row width, b bits.

Modes (``--mode``), all subclasses of :class:`~commsched.gnn.halo.HaloExchange`:

========  =============================================  =========================
mode      widths                                          central/marginal overlap
========  =============================================  =========================
adaqp     adaptive (CP-SAT on rank 0 every ``period``)    yes
adaqp-q   adaptive                                        no (exchange, then compute)
adaqp-p   none: full precision (equals vanilla exactly)   yes
uniform   every message at ``--bits``                     yes
random    each message drawn from {2, 4, 8} every period  yes
nocomm    TIMING ONLY: remote rows are zeros, no exchange  -
========  =============================================  =========================

**Wire format.** The rows one rank sends to peer p in one exchange are cut by width:
for b in (2, 4, 8), the rows of width b (in message order) are quantized and packed
(``commsched.quant.codec.quantize_rows``, its compiled or eager CPU fast path -- the
exchange works on CPU tensors over gloo -- bit-identical to the reference), giving two byte
segments, payload [n_b * ceil(D b / 8)] and metadata [n_b * 8] (float32 scale and zero
point). The six segments per peer travel as one message through
``commsched.exchange_segments``. Both sides derive the segment sizes from the same
per-channel width vector (:func:`width_layout`), so no sizes are exchanged.

**Widths.** A channel is (src rank, dst rank, layer, direction); its width vector
[n] is known to both ends: uniform and random widths are computed locally from shared
seeds, adaptive widths are solved on rank 0 and broadcast. Until the first assignment
(the first period) adaptive modes run at 8 bits.

**Tracing.** Every quantized training exchange records, per outgoing message k, the
variance weight beta_k = c_k * D * (max_k - min_k)^2 / 6, where the range comes from the
quantization metadata and c_k is the sum of squared aggregation coefficients of k's
receivers (``PartitionBook.send_coef_sq``) forward, and 1 backward (a gradient row is
added into its owner's gradient with weight 1). Link costs (theta, gamma per peer) are
probed at start-up (``commsched.costmodel.probe_link_costs``) and refined by scaling theta
with the ratio of measured to predicted exchange times.

**Overlap.** ``start`` quantizes on the caller's thread, launches the exchange in the
background (the core's asynchronous exchange: gloo's worker thread for the direct
pattern, a comm thread for the ring) and returns; the layer aggregates its central nodes
while the bytes are on the wire; ``wait`` blocks, then dequantizes. Quantization,
communication and central compute are thus separate stages. Without overlap
(``adaqp-q``) the whole chain completes inside ``start``. In backward the same split
holds: the gradient rows are quantized and launched by the halo's receive node, the
central aggregation's backward runs while they are on the wire, and the send node
waits and dequantizes (``commsched.gnn.halo``).

Breakdown keys: ``quant`` is quantize + dequantize time, ``comm`` the time blocked on the
wire (quantization excluded), ``assign`` the re-assignment (gather, solve, broadcast).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..all2all import SegmentLayout, all_to_all, all_to_all_async, exchange_segments
from ..dist import comm_guard
from ..quant.codec import META_BYTES, dequantize_rows, payload_bytes, quantize_rows
from .book import PartitionBook
from .halo import HaloExchange, Pending

WIDTHS = (2, 4, 8)
SCHEMES = ("adaptive", "uniform", "random", "full", "zeros")
_DIRS = {"forward": 0, "backward": 1}
_EMPTY = torch.empty(0, dtype=torch.uint8)


# --------------------------------------------------------------------------- codec
# Exchanges of at least this many elements (all rows of one layer and direction) use the
# compiled codec for every width group, whatever the group's size: the kernels are compiled
# once per width and row width in ``prepare`` with the row count dynamic, so a small group
# costs a call, not a compile (the eager twin costs ~100x more per row). Smaller exchanges
# (test graphs) take the codec's own choice ("auto": eager on the CPU at these sizes).
COMPILE_MIN_ELEMENTS = 1 << 16


# --------------------------------------------------------------------------- pure layout
@dataclass(frozen=True, eq=False)
class WidthLayout:
    """Where each width's rows sit in every peer's message, and their byte sizes.

    ``idx[p][w]`` (int64 tensor): positions, within the n_p rows exchanged with peer p,
    of the rows at width ``WIDTHS[w]`` (ascending). ``segments`` is the byte layout:
    per peer (payload_2, meta_2, payload_4, meta_4, payload_8, meta_8).
    """

    counts: tuple[int, ...]
    dim: int
    idx: tuple[tuple[torch.Tensor, ...], ...]
    segments: SegmentLayout
    # per width: positions of its rows among all the exchange's rows (peer by peer, each
    # peer's rows in ascending order) [n_b], and how many of them each peer has
    pos: tuple[torch.Tensor, ...] = ()
    peer_rows: tuple[tuple[int, ...], ...] = ()

    def rows_per_width(self) -> dict[int, int]:
        return {b: sum(int(self.idx[p][w].numel()) for p in range(len(self.counts)))
                for w, b in enumerate(WIDTHS)}


def width_layout(widths_P: list[np.ndarray], dim: int) -> WidthLayout:
    """The layout of one exchange side from the per-peer width vectors (each [n_p], values
    in {2, 4, 8}). Sender and receiver of a channel call it with the same vector and get
    the same sizes."""
    if dim < 1:
        raise ValueError(f"row width must be >= 1, got {dim}")
    idx, sizes, off = [], [], 0
    pos: list[list[torch.Tensor]] = [[] for _ in WIDTHS]
    for p, w in enumerate(widths_P):
        w = np.asarray(w)
        bad = ~np.isin(w, WIDTHS)
        if bad.any():
            raise ValueError(f"widths for peer {p} must be 2, 4 or 8; got {sorted(set(w[bad].tolist()))}")
        row_idx, row_sz = [], []
        for k, b in enumerate(WIDTHS):
            sel = torch.from_numpy(np.flatnonzero(w == b).astype(np.int64))
            row_idx.append(sel)
            pos[k].append(sel + off)
            row_sz += [sel.numel() * payload_bytes(dim, b), sel.numel() * META_BYTES]
        idx.append(tuple(row_idx))
        sizes.append(tuple(row_sz))
        off += w.size
    return WidthLayout(tuple(int(np.asarray(w).size) for w in widths_P), dim, tuple(idx),
                       SegmentLayout(tuple(sizes)),
                       pos=tuple(torch.cat(ps) if ps else torch.zeros(0, dtype=torch.int64) for ps in pos),
                       peer_rows=tuple(tuple(int(i[k].numel()) for i in idx) for k in range(len(WIDTHS))))


def random_widths(n: int, *, seed: int, layer: int, direction: str, src: int, dst: int,
                  period_index: int) -> np.ndarray:
    """The ``random`` scheme's widths of one channel: uniform over {2, 4, 8}, the same on
    both ends (a function of the channel and the period only)."""
    rng = np.random.default_rng([seed, layer, _DIRS[direction], src, dst, period_index])
    return rng.choice(np.array(WIDTHS, dtype=np.int64), size=n)


def _mix_key(*parts: int) -> int:
    h = 0x811C9DC5
    for x in parts:
        h = ((h ^ (x & 0xFFFFFFFF)) * 0x01000193) & 0xFFFFFFFF
        h ^= h >> 15
    return h


# --------------------------------------------------------------------------- options
@dataclass(frozen=True)
class AdaQPOptions:
    """Knobs of the AdaQP exchanges (from :class:`~commsched.gnn.trainer.TrainConfig`).

    scheme: one of :data:`SCHEMES`; bits: the width of ``uniform``; overlap: central
    aggregation while the marginal rows are in flight; period: epochs between
    re-assignments (adaptive, random); group_size, lam: the assignment problem's;
    norm: the model's edge normalisation (for beta); assign_time_limit_s: CP-SAT's limit
    per problem; probe_sizes: byte sizes of the start-up link probe.
    """

    scheme: str = "adaptive"
    bits: int = 8
    overlap: bool = True
    period: int = 50
    group_size: int = 100
    lam: float = 0.5
    seed: int = 0
    norm: str = "gcn"
    assign_time_limit_s: float = 2.0
    probe_sizes: tuple[int, ...] = (1 << 12, 1 << 16, 1 << 19)
    probe_repeats: int = 2

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.bits not in WIDTHS:
            raise ValueError(f"--bits must be 2, 4 or 8, got {self.bits}")
        if self.period < 1 or self.group_size < 1:
            raise ValueError("--period and --group-size must be >= 1")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"--lam must lie in [0, 1], got {self.lam}")


# mode -> (scheme, overlap)
MODE_OPTIONS: dict[str, tuple[str, bool]] = {
    "adaqp": ("adaptive", True), "adaqp-q": ("adaptive", False), "adaqp-p": ("full", True),
    "uniform": ("uniform", True), "random": ("random", True), "nocomm": ("zeros", False),
}


def options_for(mode: str, cfg) -> AdaQPOptions:
    """AdaQPOptions of ``mode`` from a TrainConfig-like object."""
    from .layers import CONVS

    scheme, overlap = MODE_OPTIONS[mode]
    return AdaQPOptions(scheme=scheme, overlap=overlap, bits=cfg.bits, period=cfg.period,
                        group_size=cfg.group_size, lam=cfg.lam, seed=cfg.seed,
                        norm=CONVS[cfg.model].norm)


# --------------------------------------------------------------------------- exchange
class AdaQPExchange(HaloExchange):
    """The quantized (or full-precision overlapped, or zero) exchange; see the module doc."""

    name = "adaqp"

    def __init__(self, book: PartitionBook, *, group=None, pattern: str = "direct",
                 options: AdaQPOptions | None = None):
        super().__init__(book, group=group, pattern=pattern)
        self.opt = options or AdaQPOptions()
        self.rank = book.rank
        self.epoch = 0
        self._calls = 0
        self._quantizes = self.opt.scheme not in ("full", "zeros")
        # (layer, direction) -> {(src, dst): widths [n]} for the channels touching this rank
        self.assigned: dict[tuple[int, str], dict[tuple[int, int], np.ndarray]] = {}
        self._layouts: dict[tuple, tuple[WidthLayout, WidthLayout]] = {}
        self.trace: dict[tuple[int, str], list[np.ndarray]] = {}
        self.dims: dict[tuple[int, str], int] = {}
        self.link_costs: dict[int, tuple[float, float]] = {}
        self._measured: list[tuple[float, float]] = []  # (predicted s, measured s) per exchange
        self.assignments: list[dict] = []  # what each re-assignment did (rank 0 fills details)
        self._compiled_dims: set[int] = set()  # row widths whose exchanges use the compiled codec

    # ---- collective set-up -----------------------------------------------------------------
    def validate(self) -> None:
        super().validate()
        if self.opt.scheme == "adaptive" and self.world_size > 1:
            from ..costmodel import probe_link_costs

            costs = probe_link_costs(self.group, sizes=self.opt.probe_sizes,
                                     repeats=self.opt.probe_repeats)
            self.link_costs = {p: (c.theta, c.gamma) for p, c in costs.items()}

    def prepare(self, dims: list[int]) -> None:
        """Set-up before the first epoch: warm the codec (compiles the fast path for every
        width and row width this run exchanges, so no epoch pays for compilation)."""
        if not self._quantizes or self.world_size == 1:
            return
        n_min = min(sum(self.book.send_counts), sum(self.book.recv_counts))
        for d in sorted(set(dims)):
            if n_min * d < COMPILE_MIN_ELEMENTS:
                continue  # exchanges this small run eagerly
            x = torch.randn(64, d, generator=torch.Generator().manual_seed(d))
            for b in WIDTHS:
                pay, meta = quantize_rows(x, b, 1, 0, "compiled")
                dequantize_rows(pay, meta, b, d, "compiled")
            self._compiled_dims.add(d)

    def begin_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self.world_size == 1 or epoch == 0 or epoch % self.opt.period:
            return
        if self.opt.scheme == "random":
            self._layouts.clear()  # fresh draws for the new period
        elif self.opt.scheme == "adaptive":
            t = time.perf_counter()
            self.reassign()
            dt = time.perf_counter() - t
            self.timer.add("assign", dt)
            self.assignments[-1]["wall_s"] = dt

    # ---- widths and layouts ----------------------------------------------------------------
    def channel_widths(self, src: int, dst: int, n: int, layer: int, direction: str) -> np.ndarray:
        s = self.opt.scheme
        if s == "uniform":
            return np.full(n, self.opt.bits, dtype=np.int64)
        if s == "random":
            return random_widths(n, seed=self.opt.seed, layer=layer, direction=direction, src=src,
                                 dst=dst, period_index=self.epoch // self.opt.period)
        w = self.assigned.get((layer, direction), {}).get((src, dst))
        if w is None:
            return np.full(n, 8, dtype=np.int64)  # the first period runs at 8 bits
        assert w.size == n, (w.size, n)
        return w

    def _counts(self, direction: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        b = self.book
        return (b.send_counts, b.recv_counts) if direction == "forward" else (b.recv_counts, b.send_counts)

    def layouts(self, layer: int, direction: str, dim: int) -> tuple[WidthLayout, WidthLayout]:
        """(send layout, receive layout) of this rank for one exchange."""
        key = (layer, direction, dim)
        if key not in self._layouts:
            out_c, in_c = self._counts(direction)
            P, me = self.world_size, self.rank
            send = width_layout([self.channel_widths(me, p, out_c[p], layer, direction)
                                 for p in range(P)], dim)
            recv = width_layout([self.channel_widths(p, me, in_c[p], layer, direction)
                                 for p in range(P)], dim)
            self._layouts[key] = (send, recv)
        return self._layouts[key]

    # ---- the transfer ------------------------------------------------------------------------
    def transfer(self, rows: torch.Tensor, layer: int, direction: str) -> Pending:
        s = self.opt.scheme
        if s == "zeros":  # TIMING ONLY: wrong maths, never a training mode
            n = self.book.num_remote if direction == "forward" else int(self.send_idx.numel())
            return Pending.ready(rows.new_zeros((n, *rows.shape[1:])))
        background = self.opt.overlap  # the backward exchange overlaps too (see halo.py)
        if s == "full":
            plan = self.plan if direction == "forward" else self.plan.reversed()
            if background:
                h = all_to_all_async(rows, plan, group=self.group, pattern=self.pattern, stats=self.stats)
                return Pending(h.wait)
            return Pending.ready(all_to_all(rows, plan, group=self.group, pattern=self.pattern,
                                            stats=self.stats))
        if not self.training:
            # evaluation: full precision (accuracy is measured on the exact forward pass)
            plan = self.plan if direction == "forward" else self.plan.reversed()
            return Pending.ready(all_to_all(rows, plan, group=self.group, pattern=self.pattern))
        return self._quantized(rows, layer, direction, background)

    def _quantized(self, rows: torch.Tensor, layer: int, direction: str, background: bool) -> Pending:
        """Quantize every width group of the exchange in one codec call (the groups' rows
        ordered peer by peer, so each peer's part is a contiguous slice), send, and on
        ``wait`` dequantize each width group in one call and scatter the rows back."""
        D = int(rows.shape[1])
        send, recv = self.layouts(layer, direction, D)
        out_c, in_c = self._counts(direction)
        P = self.world_size
        impl = "compiled" if D in self._compiled_dims else "auto"
        t0 = time.perf_counter()
        x = rows.to(torch.float32).contiguous()
        self._calls += 1
        key = _mix_key(self.opt.seed, self.rank, self._calls)
        segs: list[list[torch.Tensor]] = [[] for _ in range(P)]
        rng_T = torch.zeros(x.shape[0], dtype=torch.float64)  # each sent row's (max - min)
        row0 = 0
        for w, b in enumerate(WIDTHS):
            pos, per_peer = send.pos[w], send.peer_rows[w]
            n = int(pos.numel())
            if n == 0:
                for p in range(P):
                    segs[p] += [_EMPTY, _EMPTY]
                continue
            sel = x if n == x.shape[0] else x.index_select(0, pos)
            pay, meta = quantize_rows(sel, b, key, row0, impl)  # distinct counters per row
            row0 += n
            rng_T.index_copy_(0, pos, meta[:, 0].double() * ((1 << b) - 1))
            meta_bytes = meta.contiguous().view(torch.uint8)
            o = 0
            for p in range(P):
                k = per_peer[p]
                segs[p] += [pay[o:o + k].reshape(-1), meta_bytes[o:o + k].reshape(-1)]
                o += k
        if x.shape[0]:
            trace = self.trace.setdefault((layer, direction), [np.zeros(0)] * P)
            coef = self.book.send_coef_sq[self.opt.norm] if direction == "forward" else None
            beta = rng_T.numpy() ** 2 * (D / 6.0)
            off = 0
            for p in range(P):
                if out_c[p]:
                    c = coef[self.book.send_slice(p)] if direction == "forward" else 1.0
                    trace[p] = c * beta[off:off + out_c[p]]
                off += out_c[p]
        self.dims[(layer, direction)] = D
        q_s = time.perf_counter() - t0
        self.timer.add("quant", q_s)
        self.timer.add("comm", -q_s)  # the caller times this call as comm; quantizing is not
        t_wire = time.perf_counter()
        h = exchange_segments(segs, recv.segments, group=self.group, pattern=self.pattern,
                              stats=self.stats, async_op=True)
        predicted = self._predict(send)

        def finish() -> torch.Tensor:
            got = h.wait()
            wire = time.perf_counter() - t_wire
            if predicted > 0:
                self._measured.append((predicted, wire))
            t1 = time.perf_counter()
            out = torch.empty((sum(in_c), D), dtype=torch.float32)
            for w, b in enumerate(WIDTHS):
                pos = recv.pos[w]
                n = int(pos.numel())
                if n == 0:
                    continue
                parts = [p for p in range(P) if recv.peer_rows[w][p]]
                # one aligned buffer per width (the received views start at arbitrary bytes)
                pay = torch.cat([got[p][2 * w] for p in parts]).view(n, payload_bytes(D, b))
                meta = torch.cat([got[p][2 * w + 1] for p in parts]).view(torch.float32).view(n, 2)
                if n == out.shape[0]:
                    dequantize_rows(pay, meta, b, D, impl, out_ND=out)
                else:
                    out.index_copy_(0, pos, dequantize_rows(pay, meta, b, D, impl))
            res = out.to(rows.dtype)
            dq = time.perf_counter() - t1
            self.timer.add("quant", dq)
            self.timer.add("comm", -dq)
            return res

        return Pending(finish) if background else Pending.ready(finish())

    # ---- link model and re-assignment ---------------------------------------------------------
    def _predict(self, send: WidthLayout) -> float:
        """Model time of one exchange (the slowest peer) under the probed link costs."""
        if not self.link_costs:
            return 0.0
        tot = send.segments.peer_totals()
        return max((self.link_costs[p][1] + self.link_costs[p][0] * tot[p]
                    for p in self.link_costs if tot[p]), default=0.0)

    def refined_costs(self) -> dict[int, tuple[float, float]]:
        """Probed (theta, gamma) per peer, theta scaled by the median ratio of measured to
        predicted exchange time since the last assignment (1 without measurements)."""
        if not self._measured:
            return dict(self.link_costs)
        ratio = float(np.median([m / p for p, m in self._measured]))
        return {p: (th * ratio, ga) for p, (th, ga) in self.link_costs.items()}

    def reassign(self) -> None:
        """Collective: gather traces on rank 0, solve one problem per (layer, direction)
        with ``assign_many``, broadcast the widths; every rank rebuilds its layouts."""
        P, me = self.world_size, self.rank
        mine = {"trace": {k: [np.asarray(a, dtype=np.float32) for a in v] for k, v in self.trace.items()},
                "dims": dict(self.dims), "costs": self.refined_costs(),
                "counts": (self.book.send_counts, self.book.recv_counts)}
        got: list = [None] * P
        with comm_guard("gathering AdaQP traces", self.group):
            dist.all_gather_object(got, mine, group=self.group)  # gather_object: same cost on gloo
        payload: list = [None]
        if me == 0:
            payload = [solve_widths(got, group_size=self.opt.group_size, lam=self.opt.lam,
                                    time_limit_s=self.opt.assign_time_limit_s, seed=self.opt.seed)]
        with comm_guard("broadcasting AdaQP widths", self.group):
            dist.broadcast_object_list(payload, src=0, group=self.group)
        table, info = payload[0]
        self.assigned = {k: {c: w for c, w in chans.items() if me in c} for k, chans in table.items()}
        self._layouts.clear()
        self._measured.clear()
        info = dict(info, epoch=self.epoch)
        self.assignments.append(info)

    def report(self) -> dict:
        """What goes into metrics.json beside the standard keys."""
        out: dict = {"adaqp": {"scheme": self.opt.scheme, "overlap": self.opt.overlap,
                               "period": self.opt.period, "group_size": self.opt.group_size,
                               "lam": self.opt.lam,
                               "link_costs": {str(p): {"theta_s_per_byte": th, "gamma_s": ga}
                                              for p, (th, ga) in self.link_costs.items()},
                               "assignments": self.assignments}}
        if self.opt.scheme in ("adaptive", "uniform", "random") and self.world_size > 1:
            hist = {b: 0 for b in WIDTHS}
            for send, _ in list(self._layouts.values()):
                for b, n in send.rows_per_width().items():
                    hist[b] += n
            out["adaqp"]["rows_per_width_last_epoch_this_rank"] = {str(b): n for b, n in hist.items()}
        return out


def solve_widths(per_rank: list[dict], *, group_size: int, lam: float, time_limit_s: float,
                 seed: int = 0) -> tuple[dict, dict]:
    """Rank 0's part of the re-assignment (no process group here): from every rank's
    traces ({(layer, dir): [betas to each peer]}), dims and link costs, build one problem
    per (layer, direction) over the P - 1 ring rounds (round r: rank p sends to p + r) and
    solve them in parallel. Returns ({(layer, dir): {(src, dst): widths [n]}}, info)."""
    from ..quant import Channel, assign_many, expand_group_bits, group_messages

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
                n = (send_c if key[1] == "forward" else recv_c)[dst]
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
    t = time.perf_counter()
    res = assign_many(problems, lam=lam, time_limit_s=time_limit_s, seed=seed)
    solve_s = time.perf_counter() - t
    table: dict = {}
    hist = {b: 0 for b in WIDTHS}
    status = []
    for key, a, mem in zip(keys, res, members):
        chans = {}
        for r, mrow in enumerate(mem):
            for c, (src, dst, n, m) in enumerate(mrow):
                w = expand_group_bits(m, a.bits[r][c], n) if n else np.zeros(0, np.int64)
                chans[(src, dst)] = w
                for b in WIDTHS:
                    hist[b] += int((w == b).sum())
        table[key] = chans
        status.append({"layer": key[0], "direction": key[1], "status": a.status,
                       "objective": a.objective, "gap": a.gap, "wall_s": a.wall_s})
    info = {"solve_s": solve_s, "rows_per_width": {str(b): n for b, n in hist.items()},
            "problems": status}
    return table, info


__all__ = ["AdaQPExchange", "AdaQPOptions", "MODE_OPTIONS", "SCHEMES", "WIDTHS", "WidthLayout",
           "options_for", "random_widths", "solve_widths", "width_layout"]

