"""AdaQP's quantized exchange: multi-width halo rows, periodic adaptive widths, overlap.

Legend: P ranks, n_p messages (rows) of one channel (one peer), D row width, b bits.

:class:`AdaQPExchange`, a :class:`~commsched.gnn.exchange.halo.HaloExchange`, runs the quantized
modes (``--mode``; the table of every mode is :mod:`commsched.gnn.exchange.modes`):

========  =============================================  =========================
mode      widths (scheme)                                 central/marginal overlap
========  =============================================  =========================
adaqp     adaptive (CP-SAT on rank 0 every ``period``)    yes
adaqp-q   adaptive                                        no (exchange, then compute)
uniform   every message at ``--bits``                     yes
random    each message drawn from BITS every period       yes
========  =============================================  =========================

Its pure parts (options, width layouts, random widths, the rank-0 solve) are in
:mod:`commsched.gnn.exchange.adaqp_plan`. The edge normalisation that weighs the messages (below)
is the model's, passed in by whoever builds the exchange.

**Wire format.** The rows one rank sends to peer p in one exchange are cut by width:
for b in BITS (``commsched.quant.reference.BITS``), the rows of width b (in message
order) are quantized and packed (``commsched.quant.codec.quantize_rows``: for CPU rows
its compiled or eager CPU fast path, for CUDA rows the Triton kernels through the codec's
``impl="auto"`` dispatch -- both bit-identical to the reference), giving two byte segments, payload [n_b * ceil(D b / 8)] and metadata [n_b * META_BYTES] (float32 scale and
zero point). The six segments per peer travel as one message through
``commsched.exchange_segments``. Both sides derive the segment sizes from the same
per-channel width vector (:func:`width_layout`), so no sizes are exchanged.

**Widths.** A channel is (src rank, dst rank, layer, direction); its width vector
[n] is known to both ends: uniform and random widths are computed locally from shared
seeds, adaptive widths are solved on rank 0 and broadcast. Until the first assignment
(the first period) adaptive modes run at max(BITS).

**Tracing.** Every quantized training exchange records, per outgoing message k, the
variance weight beta_k = c_k * D * (max_k - min_k)^2 / 6, where the range comes from the
quantization metadata and c_k is the sum of squared aggregation coefficients of k's
receivers (``PartitionBook.send_coef_sq``) forward, and 1 backward (a gradient row is
added into its owner's gradient with weight 1). Link costs (theta, gamma per peer) are
probed at start-up and refined by scaling theta with the ratio of measured to predicted
exchange times. ``AdaQPConfig.link_costs`` (``--link-costs``) picks the probe: ``ring``
(``commsched.cluster.costmodel.probe_link_costs``, the default), ``topology`` (``Topology.probe``:
every ordered pair timed alone, each peer its own measured cost, so a channel that
crosses the slow inter-host link costs more than one inside a host) or ``averaged`` (the
same probe, one cost for every pair: the mean of the pair fits, what a system that does
not know the topology assumes). The assignment's ``link_classes`` reports, per link class,
the mean width and the bytes per epoch it gives (``adaqp_plan.link_class_report``).
With ``equal_variance`` (``--equal-variance``) the topology-aware widths are the fastest
the solver finds at no more modelled variance than the averaged-cost assignment of the
same traces (``adaqp_plan.solve_widths``).

**Overlap.** ``start`` quantizes on the caller's thread, launches the exchange in the
background (the core's asynchronous exchange: gloo's worker thread for the direct
pattern, a comm thread for the ring) and returns; the layer aggregates its central nodes
while the bytes are on the wire; ``wait`` blocks, then dequantizes. Quantization,
communication and central compute are thus separate stages. Without overlap
(``adaqp-q``) the whole chain completes inside ``start``. In backward the same split
holds: the gradient rows are quantized and launched by the halo's receive node, the
central aggregation's backward runs while they are on the wire, and the send node
waits and dequantizes (``commsched.gnn.exchange.halo``).

Breakdown keys: ``quant`` is quantize + dequantize time, ``comm`` the time blocked on the
wire (quantization excluded), ``assign`` the re-assignment (gather, solve, broadcast).

**State across epochs** (:meth:`AdaQPExchange.state_dict`, in a training checkpoint): the
call counter that keys the stochastic rounding, the random widths' period, the assigned
widths, the last traces and dims (the next re-assignment's input), the measured /
predicted exchange time ratios since the last one (resolved to numbers) and the link
costs probed at start-up (with the probed topology), so a resumed run quantizes and
re-assigns as an uninterrupted one.

**Device.** The exchange's index tensors (the width layouts' ``pos``/``idx``, cached per
period) live on its device (``device=`` or ``to``); the rows, the per-row ranges of the
variance trace and the received rows stay there. The trace is kept as the last
exchange's device tensor and read to numpy once per period, when rank 0 gathers it.
Intervals (quantization, the measured wire time of the cost ratio) are marks of the
pass timer's clock: CUDA events on CUDA, ``perf_counter`` on the CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np
import torch

from ...clock import Clock, Mark
from ...comm.all2all import all_to_all, exchange_segments
from ...dist import all_gather_object, broadcast_object
from ...quant.codec import dequantize_rows, payload_bytes, quantize_rows
from ...quant.fast import compile_enabled, say_stderr, warm_codec, warm_native
from ...quant.reference import BITS
from ...results import median
from ..context import ExchangeContext, PassContext
from ..graph.book import NORMS, PartitionBook
from .adaqp_plan import (
    SCHEMES,
    TOPOLOGY_PROBE_SIZES,
    WidthLayout,
    assigned_epoch_time,
    peer_costs,
    random_widths,
    solve_widths,
    width_layout,
)
from .halo import HaloExchange, Pending, cpu, keyed_dict, keyed_items

# --------------------------------------------------------------------------- codec
# CPU rows only (CUDA rows always take the codec's "auto" choice, the Triton kernels).
# Exchanges of at least this many elements (all rows of one layer and direction) use the
# compiled codec for every width group, whatever the group's size: the kernels are compiled
# once per width and row width in ``prepare`` with the row count dynamic, so a small group
# costs a call, not a compile (the eager twin costs ~100x more per row). Smaller exchanges
# (test graphs) take the codec's own choice ("auto": eager on the CPU at these sizes).
EXCHANGE_COMPILE_MIN_ELEMENTS = 1 << 16


def _mix_key(*parts: int) -> int:
    h = 0x811C9DC5
    for x in parts:
        h = ((h ^ (x & 0xFFFFFFFF)) * 0x01000193) & 0xFFFFFFFF
        h ^= h >> 15
    return h


def plain(obj: Any) -> Any:
    """``obj`` with numpy arrays as lists and numpy scalars as Python numbers, tensors on the
    CPU, recursively through dicts, lists and tuples: what a ``weights_only`` checkpoint
    holds."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, torch.Tensor):
        return cpu(obj)
    if isinstance(obj, dict):
        return {plain(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    return obj


def _costs_out(costs: dict[int, tuple[float, float]]) -> list[list]:
    return [[int(p), float(th), float(ga)] for p, (th, ga) in costs.items()]


def _costs_in(items: list) -> dict[int, tuple[float, float]]:
    return {int(p): (float(th), float(ga)) for p, th, ga in items}


def _topology_out(t: Any) -> dict | None:
    """A probed :class:`~commsched.cluster.topology.Topology` as plain values, every cost
    exactly (its file form rounds them through microseconds and rates)."""
    if t is None:
        return None
    return {"hosts": list(t.hosts_P), "source": t.source,
            "links": [[k, float(c.gamma), float(c.theta)] for k, c in t.links.items()],
            "pairs": [[int(a), int(b), float(c.gamma), float(c.theta)] for (a, b), c in t.pairs.items()]}


def _topology_in(d: dict | None) -> Any:
    if d is None:
        return None
    from ...cluster.costmodel import LinkCost
    from ...cluster.topology import Topology

    return Topology(hosts_P=tuple(str(h) for h in d["hosts"]), source=str(d["source"]),
                    links={str(k): LinkCost(float(g), float(t)) for k, g, t in d["links"]},
                    pairs={(int(a), int(b)): LinkCost(float(g), float(t)) for a, b, g, t in d["pairs"]})


def _check_norm(book: PartitionBook, norm: str) -> None:
    """A ValueError unless ``book`` holds AdaQP's message coefficients for ``norm``."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {', '.join(NORMS)} (the layer's edge normalisation, "
                         f"by which the AdaQP exchange weighs its messages), got {norm!r}")
    if norm not in book.send_coef_sq:
        raise ValueError(f"the partition book of rank {book.rank} has no AdaQP coefficients for "
                         f"norm={norm!r} (it holds {', '.join(sorted(book.send_coef_sq))}): it was "
                         "written by an older commsched; make the partition folder again")


@dataclass(eq=False)
class _Call:
    """One quantized exchange as its hooks see it: the rows [T, D] (float32), the rounding
    key of the call, the codec implementation, the stochastic rows encoded so far (their
    counters) and the technique's own state."""

    layer: int
    direction: str
    x: torch.Tensor
    key: int
    impl: str
    row0: int = 0
    state: Any = None


# --------------------------------------------------------------------------- exchange
class AdaQPExchange(HaloExchange):
    """The quantized exchange; see the module doc.

    ctx: what it is built for; its ``norm`` is the model's edge normalisation ("gcn",
    "mean" or "sum": ``PartitionBook.send_coef_sq`` key) that weighs each forward
    message's variance, its ``seed`` that of the random widths and the rounding keys.
    options: the mode's config (:class:`~commsched.gnn.exchange.modes.AdaQPConfig` and its
    subclasses): its ``scheme`` (one of :data:`~commsched.gnn.exchange.adaqp_plan.SCHEMES`), its
    ``overlap`` (launch the exchange in the background, the central aggregation running
    meanwhile, or finish it inside ``start``) and its fields (``period``, ``bits``, ...).
    """

    name = "adaqp"
    _layout_kw: ClassVar[dict] = {}  # width_layout's widths and segments (AdaQP's: BITS)

    def __init__(self, ctx: ExchangeContext, options):
        self._layouts: dict[tuple, tuple[WidthLayout, WidthLayout]] = {}
        self._empty = torch.empty(0, dtype=torch.uint8)  # an empty segment, on the device
        super().__init__(ctx)
        if options.scheme not in SCHEMES:
            raise ValueError(f"AdaQP scheme must be one of {', '.join(SCHEMES)}, got {options.scheme!r}")
        _check_norm(self.book, self.ctx.norm)
        self.scheme, self.overlap = options.scheme, options.overlap
        self.norm, self.seed = self.ctx.norm, self.ctx.seed
        # layer -> its own edge normalisation, where it differs from ``norm`` (set_layer_norm)
        self.layer_norms: dict[int, str] = {}
        self.opt = options
        self._compiles = self.opt.compile and compile_enabled()
        self.rank = self.book.rank
        self._calls = 0
        # the period whose random draws are in force
        self.period_index = 0
        # (layer, direction) -> {(src, dst): widths [n]} for the channels touching this rank
        self.assigned: dict[tuple[int, str], dict[tuple[int, int], np.ndarray]] = {}
        # (layer, direction) -> the last training exchange's per-row (max - min) [T] float64,
        # on the device; :attr:`trace` turns it into betas per peer when asked (once a period)
        self._ranges: dict[tuple[int, str], torch.Tensor] = {}
        self.dims: dict[tuple[int, str], int] = {}
        self.link_costs: dict[int, tuple[float, float]] = {}
        self.hosts_P: tuple[str, ...] | None = None  # the host of every rank (adaptive, set-up)
        self.topology = None  # the probed Topology (link_costs topology / averaged)
        self.ref_link_costs: dict[int, tuple[float, float]] = {}  # averaged (equal_variance)
        # (predicted s, mark at launch, mark after the wait) per exchange, resolved in
        # refined_costs (once a period: on CUDA the marks are events)
        self._measured: list[tuple[float, Clock, Mark, Mark]] = []
        self._ratios: list[float] = []  # measured / predicted of a checkpoint's exchanges (resumed)
        self.assignments: list[dict] = []  # what each re-assignment did (rank 0 fills details)
        self._compiled_dims: set[int] = set()  # row widths whose exchanges use the compiled codec

    # ---- state across epochs (module doc) -------------------------------------------------
    _STATE: ClassVar[tuple[str, ...]] = ("calls", "period_index", "assigned", "ranges", "dims", "measured",
                                         "link_costs", "ref_link_costs", "topology")

    def state_dict(self) -> dict:
        return {"calls": int(self._calls), "period_index": int(self.period_index),
                "assigned": [[int(k[0]), str(k[1]), int(src), int(dst), np.asarray(w).tolist()]
                             for k, chans in self.assigned.items() for (src, dst), w in chans.items()],
                "ranges": keyed_items(self._ranges, cpu), "dims": keyed_items(self.dims, int),
                "measured": self._measured_ratios(),
                "link_costs": _costs_out(self.link_costs), "ref_link_costs": _costs_out(self.ref_link_costs),
                "topology": _topology_out(self.topology)}

    def load_state_dict(self, state: dict) -> None:
        st = self._state_keys(state, self._STATE)
        try:
            calls, period_index = int(st["calls"]), int(st["period_index"])
            assigned: dict = {}
            for layer, direction, src, dst, w in st["assigned"]:
                assigned.setdefault((int(layer), str(direction)), {})[(int(src), int(dst))] = \
                    np.asarray(w, dtype=np.int64)
            ratios = [float(r) for r in st["measured"]]
            costs, ref = _costs_in(st["link_costs"]), _costs_in(st["ref_link_costs"])
            topology = _topology_in(st["topology"])
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{self.name}: the exchange state is damaged ({type(e).__name__}: {e})") from None
        self._ranges = keyed_dict(st["ranges"], lambda t: t.to(self.device))
        self.dims = keyed_dict(st["dims"], int)
        self._calls, self.period_index, self.assigned = calls, period_index, assigned
        self._measured.clear()
        self._ratios = ratios
        self.link_costs, self.ref_link_costs = costs, ref
        if topology is not None:
            self.topology, self.hosts_P = topology, topology.hosts_P
        self._layouts.clear()

    def _measured_ratios(self) -> list[float]:
        """Measured / predicted time of each exchange since the last re-assignment."""
        return self._ratios + [clock.seconds(a, b) / p for p, clock, a, b in self._measured]

    def to(self, device: torch.device | str) -> "AdaQPExchange":
        device = torch.device(device)
        if device != self.device:
            super().to(device)
            self._layouts.clear()
            self._empty = torch.empty(0, dtype=torch.uint8, device=device)
        return self

    @property
    def trace(self) -> dict[tuple[int, str], list[np.ndarray]]:
        """{(layer, direction): [beta of each message sent to peer p, float64 [n_p]]} from the
        last training exchange of each layer and direction (numpy; reads the device once)."""
        P = self.world_size
        out: dict[tuple[int, str], list[np.ndarray]] = {}
        for (layer, direction), rng_T in self._ranges.items():
            D = self.dims[(layer, direction)]
            out_c, _ = self._counts(direction)
            trace = [np.zeros(0)] * P
            norm = self.layer_norms.get(layer, self.norm)
            coef = self.book.send_coef_sq[norm] if direction == "forward" else None
            beta = rng_T.cpu().numpy() ** 2 * (D / 6.0)
            off = 0
            for p in range(P):
                if out_c[p]:
                    c = coef[self.book.send_slice(p)] if direction == "forward" else 1.0
                    trace[p] = c * beta[off:off + out_c[p]]
                off += out_c[p]
            out[(layer, direction)] = trace
        return out

    @property
    def overlaps(self) -> bool:
        return self.overlap

    def set_layer_norm(self, layer: int, norm: str) -> None:
        """Weigh ``layer``'s forward messages by ``norm`` (a model whose layers normalise
        differently; default: the exchange's ``norm``)."""
        _check_norm(self.book, norm)
        self.layer_norms[layer] = norm

    # ---- collective set-up -----------------------------------------------------------------
    def validate(self, *, dtype: torch.dtype | None = None, row_numel: int | None = None) -> None:
        super().validate(dtype=dtype, row_numel=row_numel)
        if self.scheme == "adaptive" and self.world_size > 1:
            from ...cluster.costmodel import probe_link_costs
            from ...cluster.topology import Topology

            # probe buffers on the messages' device, timed to a device sync on CUDA; the
            # measured/predicted ratio of the real exchanges rescales theta every period
            if self.opt.link_costs == "ring":
                costs = probe_link_costs(self.group, sizes=self.opt.probe_sizes,
                                         repeats=self.opt.probe_repeats, device=self.device)
                self.link_costs = {p: (c.theta, c.gamma) for p, c in costs.items()}
                self.hosts_P = Topology.from_env(self.group).hosts_P
            else:  # every pair timed alone; its own cost (topology) or the mean (averaged)
                self.topology = Topology.probe(self.group, sizes=TOPOLOGY_PROBE_SIZES,
                                               repeats=self.opt.probe_repeats, device=self.device)
                self.hosts_P = self.topology.hosts_P
                self.link_costs = peer_costs(self.topology, self.rank, self.opt.link_costs)
                self.ref_link_costs = peer_costs(self.topology, self.rank, "averaged")

    @property
    def compiles(self) -> bool:
        """Whether this exchange compiles its codec (``options.compile`` and
        ``COMMSCHED_COMPILE``, read when the exchange was made, both allow it)."""
        return self._compiles

    def prepare(self, dims: list[int], *, say: Callable[[str], None] | None = say_stderr) -> None:
        """Set-up before the first epoch: compile the codec that will run (for every width
        and row width this run exchanges, so no epoch pays for compilation): on the CPU the
        compiled fast path, on CUDA the Triton kernels (``impl="auto"``). Rank 0 says on
        ``say`` (default: stderr) what it compiles and, after, how long it took. Nothing
        with ``options.compile=False`` or ``COMMSCHED_COMPILE=0``, nor under emulated compute
        (the codec's work is the emulated device's)."""
        if self.world_size == 1 or not self.compiles or self.compute is not None:
            return
        say = say if self.rank == 0 else None
        if self.device.type != "cpu":
            if say is not None:
                say(f"commsched.gnn: compiling the Triton quantization kernels for row widths "
                    f"{sorted(set(dims))} (first use on this machine: seconds per kernel; "
                    "--no-compile runs the torch reference instead) ...")
            t = time.perf_counter()
            gen = torch.Generator(device=self.device)
            for d in sorted(set(dims)):
                x = torch.randn(64, d, generator=gen.manual_seed(d), device=self.device)
                for b in BITS:
                    pay, meta = quantize_rows(x, b, 1, 0, "auto")
                    dequantize_rows(pay, meta, b, d, "auto")
            if say is not None:
                torch.cuda.synchronize(self.device)
                say(f"commsched.gnn: Triton kernels ready in {time.perf_counter() - t:.1f} s")
            return
        if warm_native(say=say):  # the native kernel serves every width and row width
            return
        n_min = min(sum(self.book.send_counts), sum(self.book.recv_counts))
        big = [d for d in sorted(set(dims)) if n_min * d >= EXCHANGE_COMPILE_MIN_ELEMENTS]
        if big:  # smaller exchanges run eagerly
            warm_codec(big, BITS, say=say)
            self._compiled_dims.update(big)

    def begin_epoch(self, ctx: PassContext) -> None:
        epoch = ctx.epoch
        if self.scheme == "random" and epoch // self.opt.period != self.period_index:
            self.period_index = epoch // self.opt.period
            self._layouts.clear()  # fresh draws for the new period
        if self.world_size == 1 or epoch == 0 or epoch % self.opt.period:
            return
        if self.scheme == "adaptive":
            t = time.perf_counter()  # host work and object collectives: the host clock
            self.reassign(epoch)
            dt = time.perf_counter() - t
            ctx.timer.add("assign", dt)
            self.assignments[-1]["wall_s"] = dt

    # ---- widths and layouts ----------------------------------------------------------------
    def channel_widths(self, src: int, dst: int, n: int, layer: int, direction: str) -> np.ndarray:
        if self.scheme == "uniform":
            return np.full(n, self.opt.bits, dtype=np.int64)
        if self.scheme == "random":
            return random_widths(n, seed=self.seed, layer=layer, direction=direction, src=src,
                                 dst=dst, period_index=self.period_index)
        w = self.assigned.get((layer, direction), {}).get((src, dst))
        if w is None:
            return np.full(n, max(BITS), dtype=np.int64)  # the first period: the widest
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
                                 for p in range(P)], dim, **self._layout_kw)
            recv = width_layout([self.channel_widths(p, me, in_c[p], layer, direction)
                                 for p in range(P)], dim, **self._layout_kw)
            self._layouts[key] = (send.to(self.device), recv.to(self.device))
        return self._layouts[key]

    # ---- the transfer ------------------------------------------------------------------------
    def transfer(self, rows: torch.Tensor, layer: int, direction: str, ctx: PassContext) -> Pending:
        if not ctx.training:
            # evaluation: full precision (accuracy is measured on the exact forward pass)
            plan = self.plan if direction == "forward" else self.plan.reversed()
            return Pending.ready(all_to_all(rows, plan, group=self.group, pattern=self.pattern))
        # the backward exchange overlaps too (see halo.py)
        return self._quantized(rows, layer, direction, ctx, background=self.overlap)

    def _quantized(self, rows: torch.Tensor, layer: int, direction: str, ctx: PassContext,
                   background: bool) -> Pending:
        """The skeleton of every quantized exchange: encode each width group of the exchange
        in one call (:meth:`_encode`; the groups' rows ordered peer by peer, so each peer's
        part of a segment is a contiguous slice), send, and on ``wait`` decode each group
        in one call (:meth:`_decode`) and scatter the rows back. What a width is (a bit
        width here; a technique in :class:`~commsched.gnn.exchange.adaptive.AdaptiveExchange`) is
        the hooks' business alone."""
        D = int(rows.shape[1])
        send, recv = self.layouts(layer, direction, D)
        P, timer = self.world_size, ctx.timer
        t0 = timer.mark()
        x = rows.to(torch.float32).contiguous()
        self._calls += 1
        # the compiled CPU fast path is for CPU rows; CUDA rows go to Triton ("auto"); without
        # compiling, the CPU's eager twin or the torch reference elsewhere
        if not self.compiles:
            impl = "eager" if rows.device.type == "cpu" else "reference"
        else:
            impl = "compiled" if D in self._compiled_dims and rows.device.type == "cpu" else "auto"
        call = _Call(layer, direction, x, _mix_key(self.seed, self.rank, self._calls), impl)
        emu = self.compute
        self._begin_encode(call)
        segs: list[list[torch.Tensor]] = [[] for _ in range(P)]
        for w, t in enumerate(send.widths):
            nseg = len(send.seg_of[w])
            if nseg == 0:  # rows that send nothing (adaptive's dropped rows)
                continue
            pos, per_peer = send.pos[w], send.peer_rows[w]
            n = int(pos.numel())
            if n == 0:
                for p in range(P):
                    segs[p] += [self._empty] * nseg
                continue
            if emu is not None:  # the real wire layout of n rows, encoded on the emulated device
                pieces = self._emulated_encode(call, t, x, pos)
                emu.quant(n, D, sum(p.numel() * p.element_size() for p in pieces))
            else:
                sel = x if n == x.shape[0] else x.index_select(0, pos)
                pieces = self._encode(call, t, sel, pos)
            for piece in pieces:
                o = 0
                for p in range(P):
                    segs[p].append(piece[o:o + per_peer[p]].reshape(-1))
                    o += per_peer[p]
        if emu is not None:
            self._emulated_state(call)
            emu.sync()  # the host sends the records next
        self._end_encode(call)
        self.dims[(layer, direction)] = D
        t1 = timer.mark()
        timer.add_span("quant", t0, t1)
        timer.add_span("comm", t0, t1, -1.0)  # the caller times this call as comm; quantizing is not
        t_wire = timer.mark()
        h = exchange_segments(segs, recv.segments, group=self.group, pattern=self.pattern,
                              stats=ctx.stats, async_op=True, device=self.device)
        predicted = self._predict(send)

        def finish() -> torch.Tensor:
            got = h.wait()
            t_got = timer.mark()
            if predicted > 0:
                self._measured.append((predicted, timer.clock, t_wire, t_got))
            if emu is not None:  # decoded on the emulated device; the values are not needed
                for w in range(len(recv.widths)):
                    parts = [p for p in range(P) if recv.peer_rows[w][p]]
                    nb = sum(got[p][s].numel() * got[p][s].element_size()
                             for p in parts for s in recv.seg_of[w])
                    if nb:
                        emu.quant(int(recv.pos[w].numel()), D, nb)
                t_done = timer.mark()
                timer.add_span("quant", t_got, t_done)
                timer.add_span("comm", t_got, t_done, -1.0)
                return emu.blank((sum(recv.counts), D), rows.dtype, rows.device)
            # rows of a width without segments arrive as zeros; otherwise every row is written
            new = torch.zeros if any(not s for s in recv.seg_of) else torch.empty
            out = new((sum(recv.counts), D), dtype=torch.float32, device=rows.device)
            for w, t in enumerate(recv.widths):
                pos = recv.pos[w]
                n = int(pos.numel())
                if n == 0 or not recv.seg_of[w]:
                    continue
                parts = [p for p in range(P) if recv.peer_rows[w][p]]
                # one aligned buffer per segment (the received views start at arbitrary bytes)
                pieces = [torch.cat([got[p][s] for p in parts]) for s in recv.seg_of[w]]
                if n == out.shape[0]:
                    val = self._decode(call, t, pieces, n, out)
                    if val is not out:
                        out.copy_(val)
                else:
                    out.index_copy_(0, pos, self._decode(call, t, pieces, n, None))
            res = out.to(rows.dtype)
            t_done = timer.mark()
            timer.add_span("quant", t_got, t_done)
            timer.add_span("comm", t_got, t_done, -1.0)
            return res

        return Pending(finish) if background else Pending.ready(finish())

    # ---- emulated compute (--compute emulated): the wire layout without the work ------------
    def _emulated_encode(self, call: "_Call", b: int, x: torch.Tensor, pos: torch.Tensor) -> list[torch.Tensor]:
        """Zero segments of the ``pos.numel()`` rows at width ``b``, each the size the codec
        gives (the layout of one row encoded for real, times the rows)."""
        proto = self._encode(call, b, x[:1], pos[:1])
        return [self.compute.zeros((int(pos.numel()), *p.shape[1:]), p.dtype, p.device) for p in proto]

    def _emulated_state(self, call: "_Call") -> None:
        """After an emulated encode: the rows have no values, so each row's range (what the
        width assignment weighs) is taken as 1."""
        call.state.fill_(1.0)

    # ---- the per-technique hooks of the skeleton (AdaQP's: stochastic bit widths) -------------
    def _begin_encode(self, call: "_Call") -> None:
        """Before the first group: each sent row's (max - min), filled by :meth:`_encode`."""
        call.state = torch.zeros(call.x.shape[0], dtype=torch.float64, device=call.x.device)

    def _encode(self, call: "_Call", b: int, sel: torch.Tensor, pos: torch.Tensor) -> list[torch.Tensor]:
        """The segments of the rows ``sel`` [n, D] (at ``pos`` among the sent rows) at width
        ``b``, each with the rows' parts in order: here (payload, metadata bytes)."""
        pay, meta = self._stochastic(call, b, sel)
        call.state.index_copy_(0, pos, meta[:, 0].double() * ((1 << b) - 1))
        return [pay, meta.contiguous().view(torch.uint8)]

    @staticmethod
    def _stochastic(call: "_Call", b: int, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, metadata) of ``sel`` at ``b`` bits, keyed by the call; each row its own
        counter."""
        pay, meta = quantize_rows(sel, b, call.key, call.row0, call.impl)
        call.row0 += int(sel.shape[0])
        return pay, meta

    def _end_encode(self, call: "_Call") -> None:
        """After the last group: keep the ranges (betas are derived once a period: trace)."""
        if call.x.shape[0]:
            self._ranges[(call.layer, call.direction)] = call.state

    def _decode(self, call: "_Call", b: int, pieces: list[torch.Tensor], n: int,
                out: torch.Tensor | None) -> torch.Tensor:
        """float32 [n, D] of the ``n`` received rows at width ``b`` from their segments
        (written into ``out`` when given, where the codec can)."""
        D = int(call.x.shape[1])
        pay, meta = pieces
        return dequantize_rows(pay.view(n, payload_bytes(D, b)), meta.view(torch.float32).view(n, 2),
                               b, D, call.impl, out_ND=out)

    # ---- link model and re-assignment ---------------------------------------------------------
    def _predict(self, send: WidthLayout) -> float:
        """Model time of one exchange (the slowest peer) under the probed link costs."""
        if not self.link_costs:
            return 0.0
        tot = send.segments.peer_totals()
        return max((self.link_costs[p][1] + self.link_costs[p][0] * tot[p]
                    for p in self.link_costs if tot[p]), default=0.0)

    def refined_costs(self, costs: dict[int, tuple[float, float]] | None = None
                      ) -> dict[int, tuple[float, float]]:
        """Probed (theta, gamma) per peer (``costs``, default the exchange's link costs),
        theta scaled by the median ratio of measured to predicted exchange time since the
        last assignment (1 without measurements)."""
        costs = self.link_costs if costs is None else costs
        ratios = self._measured_ratios()
        if not ratios:
            return dict(costs)
        ratio = median(ratios)
        return {p: (th * ratio, ga) for p, (th, ga) in costs.items()}

    def reassign(self, epoch: int) -> None:
        """Collective, at the start of ``epoch``: gather traces on rank 0, solve one problem
        per (layer, direction) with ``assign_many``, broadcast the widths; every rank
        rebuilds its layouts."""
        me = self.rank
        mine = {"trace": {k: [np.asarray(a, dtype=np.float32) for a in v] for k, v in self.trace.items()},
                "dims": dict(self.dims), "costs": self.refined_costs(),
                "ref_costs": self.refined_costs(self.ref_link_costs),
                "counts": (self.book.send_counts, self.book.recv_counts)}
        # all_gather rather than gather: the same cost on gloo
        got = all_gather_object(mine, "gathering AdaQP traces", self.group)
        solved = (solve_widths(got, group_size=self.opt.group_size, lam=self.opt.lam,
                               time_limit_s=self.opt.assign_time_limit_s, seed=self.seed,
                               hosts_P=self.hosts_P, equal_variance=self.opt.equal_variance)
                  if me == 0 else None)
        table, info = broadcast_object(solved, "broadcasting AdaQP widths", 0, self.group)
        self.assigned = {k: {c: w for c, w in chans.items() if me in c} for k, chans in table.items()}
        self._layouts.clear()
        self._measured.clear()
        self._ratios = []
        info = dict(info, epoch=epoch)
        self.assignments.append(info)

    def run_report(self, *, wall_s: float, epoch_time_s_RE: list[list[float]],
                   first_epoch: int = 0) -> dict:
        """:meth:`report` and, on rank 0, what the re-assignments cost: their time on the
        training thread (``assign_total_s``, ``assign_share_of_wall`` of ``wall_s``) and the
        median epoch from the first one applied on (``epoch_time_s_assigned``)."""
        out = self.report()
        if self.rank != 0:
            return out
        mine = out[self.name]
        done = mine.get("assignments", [])
        steady = assigned_epoch_time(done, epoch_time_s_RE, first_epoch)
        if steady is not None:
            mine["first_assigned_epoch"], out["epoch_time_s_assigned"] = steady
        mine["assign_total_s"] = assign = sum(a.get("wall_s", 0.0) for a in done)
        out["assign_share_of_wall"] = assign / wall_s if wall_s > 0 else 0.0
        return out

    def report(self) -> dict:
        """What goes into metrics.json beside the standard keys."""
        out: dict = {"adaqp": {"scheme": self.scheme, "overlap": self.overlap,
                               "period": self.opt.period, "group_size": self.opt.group_size,
                               "lam": self.opt.lam, "link_cost_source": self.opt.link_costs,
                               "equal_variance": self.opt.equal_variance,
                               "hosts": list(self.hosts_P) if self.hosts_P else None,
                               "link_costs": {str(p): {"theta_s_per_byte": th, "gamma_s": ga}
                                              for p, (th, ga) in self.link_costs.items()},
                               "assignments": self.assignments}}
        if self.world_size > 1:
            hist = {b: 0 for b in BITS}
            for send, _ in list(self._layouts.values()):
                for b, n in send.rows_per_width().items():
                    hist[b] += n
            out["adaqp"]["rows_per_width_last_epoch_this_rank"] = {str(b): n for b, n in hist.items()}
        return out


__all__ = ["EXCHANGE_COMPILE_MIN_ELEMENTS", "AdaQPExchange", "plain"]
