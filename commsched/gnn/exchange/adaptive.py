"""The ``adaptive`` exchange: every message group of a period picks its technique --
dropped, 1-bit sign + scale with error feedback, 2/4/8-bit stochastic, or raw float32 --
from one assignment that minimises the predicted exchange time on the topology's links
under an error budget (beyond AdaQP: docs/gnn.md, "adaptive").

Legend: P ranks, T rows sent in one exchange, R rows received, D row width.

:class:`AdaptiveExchange` is AdaQP's exchange (:mod:`commsched.gnn.exchange.adaqp`: overlap,
link probe, period, re-assignment on rank 0, widths known to both ends of a channel) with
techniques in place of widths:

* **Wire format.** The rows one rank sends to peer p are cut by technique
  (:data:`~commsched.quant.widths.joint.TECHNIQUES`); each technique's rows travel in its
  segments (:func:`~commsched.gnn.exchange.adaptive_plan.technique_segments`: none for a dropped
  row, one sign record of ceil(D / 8) + 4 bytes, AdaQP's payload and metadata, or the
  float32 row), all segments of a peer as one message (``exchange_segments``). Both ends
  derive the sizes from the same technique vector, so no sizes are exchanged. A dropped
  row arrives as zeros (as BNS-GCN's unsampled boundary rows).
* **Error feedback.** A row sent as signs carries the error of its last sign message:
  ``m = x + e``, ``e <- m - decode(encode(m))`` (as the ``onebit`` mode). A row sent any
  other way resets its error to zero.
* **Until the first assignment** (the first ``period`` epochs) every row is sent with
  ``--warmup`` (default 2-bit stochastic: unbiased and stateless; ``sign`` sends the
  ``onebit`` mode's traffic, half the bytes, but on Squirrel those epochs of signs cost
  2.3 pp of test accuracy that the rest of the run did not recover: docs/results.md).
* **Trace.** In the last epoch of each period the exchange records, per sent row, its
  weighted energy ``c |x|^2`` (the error of dropping it), its weighted 1-bit error (the
  measured error-feedback residual ``c |e|^2`` for a row sent as signs, else the closed
  form ``c (|x|^2 - |x|_1^2 / D)``) and AdaQP's variance weight ``c D range^2 / 6``;
  ``c`` is AdaQP's (``PartitionBook.send_coef_sq`` forward, 1 backward).
* **Re-assignment** (every ``period`` epochs, collective): every rank's trace and its
  measured / predicted exchange times go to rank 0, which solves one problem over every
  layer and direction (``adaptive_plan.solve_period``: CP-SAT hinted by a Lagrangian
  greedy) under the link model of ``--link-costs`` (``topology``: the probed per-link
  costs; ``averaged``; ``ring``), theta scaled by the median measured / predicted ratio,
  and broadcasts a technique per row.

Breakdown keys as AdaQP's: ``quant`` encode + decode, ``comm`` blocked on the wire,
``assign`` the re-assignment.

State across epochs (``state_dict``, in a training checkpoint): AdaQP's, the sign rows'
error-feedback residuals, the period's traces, the last epoch's time (the solve's budget)
and a re-assignment in flight (rank 0's solve is waited for and its answer kept), so a
resumed run continues exactly.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np
import torch

from ...dist import all_gather_object, broadcast_object
from ...quant.codec import decode_signs, encode_signs
from ...quant.fast import say_stderr, warm_sign_codec
from ...quant.widths.joint import (
    DROP,
    SIGN,
    STOCHASTIC,
    TECHNIQUE_NAMES,
    TECHNIQUES,
    parse_techniques,
)
from ...results import median
from ..context import ExchangeContext, PassContext
from .adaptive_plan import link_model, sender_report, solve_budget, solve_period, technique_segments
from .adaqp import EXCHANGE_COMPILE_MIN_ELEMENTS, AdaQPExchange, plain
from .halo import cpu, keyed_dict, keyed_items


class AdaptiveExchange(AdaQPExchange):
    """The ``adaptive`` mode's exchange; see the module doc.

    options: the mode's config (:class:`~commsched.gnn.exchange.modes.AdaptiveConfig`):
    ``error_budget``, each exchange's modelled error at most this share of its rows'
    weighted energy; ``techniques``, the ones offered (float32 always is;
    ``parse_techniques``); ``warmup``, the technique of the first period's rows (``2``:
    2-bit stochastic; where not offered, the narrowest offered width); ``joint_solver``,
    ``cp-sat`` (hinted by the greedy answer, never worse) or ``greedy``; the rest as
    :class:`~commsched.gnn.exchange.adaqp.AdaQPExchange`'s (``link_costs``: the link model,
    ``period``, ``group_size``, ``assign_time_limit_s``: CP-SAT's limit). Only the
    technique hooks of AdaQP's exchange skeleton are its own."""

    name = "adaptive"
    _layout_kw = {"widths": TECHNIQUES, "row_segments": technique_segments}

    def __init__(self, ctx: ExchangeContext, options):
        super().__init__(ctx, options)
        self.error_budget, self.solver = float(options.error_budget), options.joint_solver
        self.techniques = parse_techniques(options.techniques)
        # until the first assignment: ``warmup`` where offered, else the narrowest offered
        # technique that sends something
        w = parse_techniques(str(options.warmup))[0]  # the one named (fp32 sorts last)
        self.warmup = w if w in self.techniques and w != DROP else next(
            t for t in self.techniques if t != DROP)
        # (layer, direction) -> (positions, error-feedback residual [n, D]) of the rows sent as
        # signs in its last exchange
        self.errors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        # (layer, direction) -> (c|x|^2, c * 1-bit error, c D range^2 / 6) per sent row [T]
        self._stats: dict[tuple[int, str], tuple[torch.Tensor, ...]] = {}
        self._tracing = False
        self._sign_compiled: set[int] = set()
        # the re-assignment in flight: started (gather, rank 0's solver thread) at a period's
        # first epoch, applied (broadcast) at the next one
        self._pending: dict | None = None
        self._epoch_t: float | None = None  # host clock at the last begin_epoch
        self._last_epoch_s: float | None = None
        self._coef: dict[str, torch.Tensor] = {}  # norm -> c of each forward row, on the device
        self._finite: torch.Tensor | None = None  # off the CPU: every sign scale this epoch finite

    def end_epoch(self, ctx: PassContext) -> None:
        super().end_epoch(ctx)
        if self._epoch_t is not None:  # the training epoch alone (an evaluation pass between
            # two epochs is not in it: it made the solve's limit follow the evaluation's time)
            self._last_epoch_s = time.perf_counter() - self._epoch_t
        if self._finite is not None:
            ok, self._finite = bool(self._finite), None  # one host read an epoch
            if not ok:
                raise ValueError(
                    f"adaptive: rows sent as signs in epoch {ctx.epoch} held non-finite values "
                    "(a NaN or inf scale); look for an overflow upstream (a too-high learning "
                    "rate) or run with --mode vanilla to find the first bad epoch")

    # ---- state across epochs (module doc) ------------------------------------------------
    _STATE = AdaQPExchange._STATE + ("errors", "stats", "last_epoch_s", "pending")

    def state_dict(self) -> dict:
        pend = self._pending
        if pend is not None:
            solved = pend.get("solved")
            if "thread" in pend:  # rank 0: the solve in flight, waited for and kept
                pend["thread"].join()
                box = pend["box"]
                solved = ("error", repr(box["err"])) if "err" in box else plain(box["out"])
            pend = {"epoch": int(pend["epoch"]), "gather_s": float(pend["gather_s"]), "solved": solved,
                    "gids": [[int(k[0]), str(k[1]), int(src), int(dst), np.asarray(g).tolist()]
                             for (k, src, dst), g in pend["gids"].items()]}
        return {**super().state_dict(),
                "errors": keyed_items(self.errors, lambda v: [cpu(v[0]), cpu(v[1])]),
                "stats": keyed_items(self._stats, lambda v: [cpu(t) for t in v]),
                "last_epoch_s": self._last_epoch_s, "pending": pend}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        dev = self.device
        self.errors = keyed_dict(state["errors"], lambda v: (v[0].to(dev), v[1].to(dev)))
        self._stats = keyed_dict(state["stats"], lambda v: tuple(t.to(dev) for t in v))
        pend = state["pending"]
        try:
            last = state["last_epoch_s"]
            self._last_epoch_s = None if last is None else float(last)
            if pend is not None:
                pend = {"epoch": int(pend["epoch"]), "gather_s": float(pend["gather_s"]),
                        "solved": pend["solved"],
                        "gids": {((int(a), str(d)), int(src), int(dst)): np.asarray(g, dtype=np.int64)
                                 for a, d, src, dst, g in pend["gids"]}}
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{self.name}: the exchange state is damaged ({type(e).__name__}: {e})") from None
        self._pending = pend

    # ---- set-up ----------------------------------------------------------------------------
    def prepare(self, dims: list[int], *, say: Callable[[str], None] | None = say_stderr) -> None:
        """AdaQP's codec warm-up, and the sign codec's for the large exchanges (CPU)."""
        super().prepare(dims, say=say)
        if self.world_size == 1 or not self.compiles or self.device.type != "cpu":
            return
        n_min = min(sum(self.book.send_counts), sum(self.book.recv_counts))
        big = [d for d in sorted(set(dims)) if n_min * d >= EXCHANGE_COMPILE_MIN_ELEMENTS]
        if big:
            warm_sign_codec(big, say=say if self.rank == 0 else None)
            self._sign_compiled.update(big)

    def begin_epoch(self, ctx: PassContext) -> None:
        """Trace in the last epoch of each period; at a period's first epoch gather the
        traces and start rank 0's solve in the background; at the next epoch apply it."""
        epoch = ctx.epoch
        self._epoch_t = time.perf_counter()  # end_epoch measures the training epoch from here
        self._tracing = (epoch + 1) % self.opt.period == 0
        if self.world_size == 1 or epoch == 0:
            return
        t = time.perf_counter()  # host work and object collectives: the host clock
        applied = False
        if self._pending is not None:
            self._apply(epoch)
            applied = True
        if epoch % self.opt.period == 0:
            self._start(epoch)
        if applied or self._pending is not None:
            ctx.timer.add("assign", time.perf_counter() - t)

    # ---- techniques and layouts ------------------------------------------------------------
    def channel_widths(self, src: int, dst: int, n: int, layer: int, direction: str) -> np.ndarray:
        w = self.assigned.get((layer, direction), {}).get((src, dst))
        if w is None:
            return np.full(n, self.warmup, dtype=np.int64)  # until the first assignment
        assert w.size == n, (w.size, n)
        return w

    # ---- the skeleton's hooks (AdaQPExchange._quantized): one technique per width -----------
    def _begin_encode(self, call) -> None:
        key = (call.layer, call.direction)
        # the last sign rows' (positions, residual rows), this call's, its traced 1-bit errors
        call.state = {"old": self.errors.get(key), "new": None, "sign_sq": None,
                      "sign_compiled": int(call.x.shape[1]) in self._sign_compiled}

    def _encode(self, call, t: int, sel: torch.Tensor, pos: torch.Tensor) -> list[torch.Tensor]:
        st, x = call.state, call.x
        if t == SIGN:
            e = self._residual(st["old"], pos, sel, int(x.shape[0]))
            finite = None  # off the CPU the finite check is one flag read an epoch
            if x.device.type != "cpu":
                if self._finite is None:
                    self._finite = torch.ones((), dtype=torch.bool, device=x.device)
                finite = self._finite
            rec, ne = encode_signs(sel, error=e, compile=st["sign_compiled"], finite=finite)
            st["new"] = (pos, ne)
            if self._tracing:
                st["sign_sq"] = (pos, (ne * ne).sum(1))
            return [rec]
        if t in STOCHASTIC:
            pay, meta = self._stochastic(call, t, sel)
            return [pay, meta.contiguous().view(torch.uint8)]
        return [sel.view(torch.uint8)]  # RAW

    def _emulated_state(self, call) -> None:
        """Emulated compute: no sign residual is kept (the rows have no values)."""
        call.state["new"] = None
        call.state["sign_sq"] = None

    def _end_encode(self, call) -> None:
        key, st = (call.layer, call.direction), call.state
        if st["new"] is None:
            self.errors.pop(key, None)
        else:
            self.errors[key] = st["new"]
        if self._tracing and call.x.shape[0]:
            self._trace(key, call.x, st["sign_sq"], call.direction, call.layer)

    def _decode(self, call, t: int, pieces: list[torch.Tensor], n: int,
                out: torch.Tensor | None) -> torch.Tensor:
        D = int(call.x.shape[1])
        if t == SIGN:
            return decode_signs(pieces[0].view(n, -1), D, compile=call.state["sign_compiled"])
        if t in STOCHASTIC:
            return super()._decode(call, t, pieces, n, None)
        return pieces[0].view(torch.float32).view(n, D)

    @staticmethod
    def _residual(old, pos: torch.Tensor, sel: torch.Tensor, T: int) -> torch.Tensor:
        """The error-feedback residual of the rows at ``pos`` (zeros for rows not sent as
        signs last time). Within a period the sign rows are the same (``pos`` is the same
        tensor), so the kept residual is used as it is; after a re-assignment it is
        scattered once to all rows and gathered at the new positions."""
        if old is None:
            return torch.zeros_like(sel)
        opos, oe = old
        if opos is pos and tuple(oe.shape) == tuple(sel.shape):
            return oe
        if opos.numel() and int(opos.max()) >= T or oe.shape[1:] != sel.shape[1:]:
            return torch.zeros_like(sel)  # another exchange's rows: start afresh
        full = torch.zeros((T, sel.shape[1]), dtype=oe.dtype, device=oe.device)
        full.index_copy_(0, opos, oe)
        return full.index_select(0, pos)

    def error_rows(self, layer: int, direction: str, rows: int) -> torch.Tensor | None:
        """The kept residual of one exchange as a [rows, D] tensor (zeros for rows not
        sent as signs); None before any sign message."""
        old = self.errors.get((layer, direction))
        if old is None:
            return None
        full = torch.zeros((rows, old[1].shape[1]), dtype=old[1].dtype, device=old[1].device)
        return full.index_copy_(0, old[0], old[1])

    def _trace(self, key, x: torch.Tensor, sign_sq, direction: str, layer: int) -> None:
        """Record the module doc's three figures per sent row (float32 device tensors)."""
        D = x.shape[1]
        e2 = (x * x).sum(1)
        l1 = x.abs().sum(1)
        s1 = (e2 - l1 * l1 / D).clamp_min(0.0)
        if sign_sq is not None:
            s1.index_copy_(0, sign_sq[0], sign_sq[1].to(s1.dtype))
        lo, hi = torch.aminmax(x, dim=1)
        rng = hi - lo
        beta = rng * rng * (D / 6.0)
        if direction == "forward":
            norm = self.layer_norms.get(layer, self.norm)
            c = self._coef.get(norm)
            if c is None or c.numel() != x.shape[0] or c.device != x.device:
                c = torch.from_numpy(np.asarray(self.book.send_coef_sq[norm][: x.shape[0]],
                                                dtype=np.float32)).to(x.device)
                self._coef[norm] = c
            e2, s1, beta = e2 * c, s1 * c, beta * c
        self._stats[key] = (e2, s1, beta)

    # ---- re-assignment -------------------------------------------------------------------------
    def _ratio(self) -> float | None:
        ratios = self._measured_ratios()
        return median(ratios) if ratios else None

    def reassign(self, epoch: int) -> None:
        """Collective: start and apply one re-assignment at once (what ``begin_epoch`` does
        over two epochs); for callers outside the training loop."""
        self._start(epoch)
        self._apply(epoch)

    def _start(self, epoch: int) -> None:
        """Collective: every rank groups its traced rows per channel (``sender_report``:
        a group id per row and each group's sums) and all ranks gather them; rank 0 starts
        solving in a background thread (CP-SAT's limit: ``assign_time_limit_s``, at most
        half the last epoch), so the solve overlaps the epoch."""
        t0 = time.perf_counter()
        stats = {k: tuple(t.cpu().numpy() for t in v) for k, v in self._stats.items()}
        rep = sender_report(stats, {"forward": self.book.send_counts,
                                    "backward": self.book.recv_counts},
                            group_size=self.opt.group_size)
        mine = {"groups": rep, "dims": dict(self.dims), "ratio": self._ratio(),
                "costs": dict(self.link_costs)}
        got = all_gather_object(mine, "gathering adaptive traces", self.group)
        me = self.rank
        # the group ids of the channels touching this rank (to expand the broadcast table)
        gids = {(k, src, dst): g for src, r in enumerate(got) for k, per in r["groups"].items()
                for dst, (g, _) in per.items() if me in (src, dst)}
        pend: dict = {"epoch": epoch, "gids": gids, "gather_s": time.perf_counter() - t0}
        if me == 0:
            solver, limit = solve_budget(self.opt.assign_time_limit_s, self.solver,
                                         self.opt.period, self._last_epoch_s)
            box: dict = {}

            def solve() -> None:
                try:
                    links = link_model(self.world_size, self.opt.link_costs, topology=self.topology,
                                       peer_costs=[r["costs"] for r in got])
                    ratios = [r["ratio"] for r in got if r["ratio"] is not None]
                    if ratios:
                        links = links.scaled(median(ratios))
                    table, info = solve_period(got, links, error_budget=self.error_budget,
                                               time_limit_s=limit, seed=self.seed,
                                               solver=solver, period=self.opt.period,
                                               hosts_P=self.hosts_P, workers=1,
                                               techniques=self.techniques)
                    info["theta_ratio"] = median(ratios) if ratios else None
                    info["time_limit_s"] = limit
                    box["out"] = (table, info)
                except BaseException as e:  # re-raised on the training thread
                    box["err"] = e

            th = threading.Thread(target=solve, name="commsched-adaptive-solve", daemon=True)
            th.start()
            pend.update(thread=th, box=box)
        self._pending = pend
        self._measured.clear()
        self._ratios = []
        self._stats.clear()

    def _apply(self, epoch: int) -> None:
        """Collective: rank 0 waits for its solve and broadcasts each group's technique;
        every rank expands them to its channels' rows and rebuilds its layouts."""
        pend, self._pending = self._pending, None
        t0 = time.perf_counter()
        solved = None
        if self.rank == 0 and "thread" not in pend:  # a checkpoint's: solved before it was written
            solved = pend["solved"]
            if solved is None or solved[0] != "error":
                if solved is None:
                    solved = ("error", "the checkpoint holds no answer of the re-assignment in flight")
                else:
                    solved = (solved[0], dict(solved[1], join_wait_s=0.0))
        elif self.rank == 0:
            pend["thread"].join()
            wait_s = time.perf_counter() - t0
            if "err" in pend["box"]:
                solved = ("error", repr(pend["box"]["err"]))
            else:
                table, info = pend["box"]["out"]
                solved = (table, dict(info, join_wait_s=wait_s))
        table, info = broadcast_object(solved, "broadcasting adaptive techniques", 0, self.group)
        if table == "error":
            raise RuntimeError(f"adaptive: rank 0's re-assignment failed: {info}")
        assigned: dict = {}
        for (key, src, dst), gid in pend["gids"].items():
            tech_G = table.get(key, {}).get((src, dst))
            if tech_G is not None and src != dst:
                assigned.setdefault(key, {})[(src, dst)] = np.asarray(tech_G, dtype=np.int64)[
                    np.asarray(gid, dtype=np.int64)]
        self.assigned = assigned
        self._layouts.clear()
        self.assignments.append(dict(info, epoch=pend["epoch"], applied_epoch=epoch,
                                     wall_s=pend["gather_s"] + time.perf_counter() - t0))

    def run_report(self, *, wall_s: float, epoch_time_s_RE: list[list[float]],
                   first_epoch: int = 0) -> dict:
        """AdaQP's, and rank 0's background solves (``solve_total_s``,
        ``solve_share_of_wall``: they overlap epochs)."""
        out = super().run_report(wall_s=wall_s, epoch_time_s_RE=epoch_time_s_RE,
                                 first_epoch=first_epoch)
        if self.rank == 0:
            out["adaptive"]["solve_total_s"] = solve = sum(
                a.get("solve_s", 0.0) for a in out["adaptive"]["assignments"])
            out["solve_share_of_wall"] = solve / wall_s if wall_s > 0 else 0.0
        return out

    def report(self) -> dict:
        out = {"adaptive": {"period": self.opt.period, "group_size": self.opt.group_size,
                            "error_budget": self.error_budget, "solver": self.solver,
                            "techniques": [TECHNIQUE_NAMES[t] for t in self.techniques],
                            "warmup": TECHNIQUE_NAMES[self.warmup],
                            "link_cost_source": self.opt.link_costs,
                            "hosts": list(self.hosts_P) if self.hosts_P else None,
                            "link_costs": {str(p): {"theta_s_per_byte": th, "gamma_s": ga}
                                           for p, (th, ga) in self.link_costs.items()},
                            "assignments": self.assignments}}
        if self.world_size > 1:
            hist = {TECHNIQUE_NAMES[t]: 0 for t in TECHNIQUES}
            for send, _ in list(self._layouts.values()):
                for t, n in send.rows_per_width().items():
                    hist[TECHNIQUE_NAMES[t]] += n
            out["adaptive"]["rows_per_technique_last_epoch_this_rank"] = hist
        return out


__all__ = ["AdaptiveExchange"]
