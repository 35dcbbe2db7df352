"""1-bit halo messages with error feedback (``--mode onebit``), in the style of Sylvie.

Legend: T rows sent in one exchange, R rows received, D row width, W = ceil(D / 8) + 4
bytes of one sign record.

Source: M. Zhang, Q. Hu, P. Sun, Y. Wen, T. Zhang, "Boosting Distributed Full-graph GNN
Training with Asynchronous One-bit Communication" (Sylvie, arXiv 2303.01277, 2023): every
boundary row crosses the wire as the signs of its values and one scale, forward
(embeddings) and backward (their gradients), and the communication is pipelined with
compute. What this module builds, and what it leaves out:

* **Wire format.** Each sent row becomes one sign record (``commsched.quant.codec.
  encode_signs``): ceil(D / 8) bytes of packed signs and a float32 scale, the row's mean
  absolute value (the scale that minimises the L2 error of ``sign(x) * scale``). The
  records of one exchange are a uint8 [T, W] matrix sent with the book's own row counts
  through ``commsched.all_to_all_async``, so ``bytes_sent_per_epoch`` counts exactly
  T * W bytes per exchange: (D / 8 + 4) / (4 D) of float32's, 1/32 plus the scales.
* **Error feedback** (on by default; ``error_feedback=False`` for the twin of the plain
  codec): the sender keeps, per (layer, direction), the error of its last message,
  ``e = m - decode(encode(m))`` with ``m = rows + e_prev``, and adds it to the same rows'
  next message (the next epoch's exchange of that layer and direction), so what one
  epoch's rounding loses is sent in the next (as in 1-bit SGD, Seide et al. 2014). The
  rows of an exchange are the same nodes in the same order every epoch (the book's
  ``send_idx``, or the remote rows backward), so the error of row k is carried to row k.
  Evaluation passes send full-precision rows (as AdaQP's exchange does) and leave the
  error untouched. The kept errors are the exchange's state (``state_dict``): a checkpoint
  holds them, so a resumed run sends what an uninterrupted one sends.
* **Codec.** The fast twin of the spec (``commsched.quant.fast``); on the CPU it is
  compiled at set-up (:meth:`OneBitExchange.prepare`, like AdaQP's codec) for the row
  widths whose exchanges are large enough (``EXCHANGE_COMPILE_MIN_ELEMENTS``), unless
  ``compile=False`` (``--no-compile``) or ``COMMSCHED_COMPILE=0``: the same bytes either way.
* **Overlap.** The records are encoded on the caller's thread, launched in the
  background and decoded in ``wait``; the central aggregation (forward and backward)
  runs while they are on the wire, as in AdaQP's ``adaqp`` mode.
* **Not built:** Sylvie's Bounded Staleness Adaptor (using boundary rows up to a bounded
  number of epochs old, so that an epoch need not wait for this epoch's messages); here
  every epoch uses its own messages. Sylvie's own choice of scale may differ; the mean
  absolute value is ours.

Breakdown keys: ``quant`` is encoding + decoding, ``comm`` the time blocked on the wire
(encoding excluded).
"""

from __future__ import annotations

from typing import Callable

import torch

from ...comm.all2all import all_to_all, all_to_all_async
from ...quant.codec import decode_signs, encode_signs
from ...quant.fast import compile_enabled, say_stderr, warm_sign_codec
from ..context import ExchangeContext, PassContext
from ..graph.book import PartitionBook
from .adaqp import EXCHANGE_COMPILE_MIN_ELEMENTS
from .halo import HaloExchange, Pending, cpu, keyed_dict, keyed_items


class OneBitExchange(HaloExchange):
    """Sign-and-scale messages with error feedback; see the module doc.

    error_feedback: carry each message's quantization error into the next message of the
    same layer and direction (default) or send every message on its own; overlap: launch
    the exchange in the background (the central aggregation runs meanwhile) or finish it
    inside ``start``; compile: compile the CPU codec at set-up (``prepare``)."""

    name = "onebit"

    def __init__(self, ctx: ExchangeContext | PartitionBook, *, error_feedback: bool = True,
                 overlap: bool = True, compile: bool = True):
        super().__init__(ctx)
        self.error_feedback = error_feedback
        self.overlap = overlap
        self.compile = compile and compile_enabled()
        self._compiled_dims: set[int] = set()  # row widths whose exchanges use the compiled codec
        # (layer, direction) -> the error kept from the last message, float32 [T, D]
        self.errors: dict[tuple[int, str], torch.Tensor] = {}
        self._finite: torch.Tensor | None = None  # off the CPU: all rows sent this epoch were finite

    def end_epoch(self, ctx: PassContext) -> None:
        super().end_epoch(ctx)
        if self._finite is not None:
            ok, self._finite = bool(self._finite), None  # one host read an epoch
            if not ok:
                raise ValueError(
                    f"onebit: rows sent in epoch {ctx.epoch} held non-finite values (a NaN or "
                    "inf scale); look for an overflow upstream (a too-high learning rate) or "
                    "run with --mode vanilla to find the first bad epoch")

    @property
    def overlaps(self) -> bool:
        return self.overlap

    def state_dict(self) -> dict:
        """The error-feedback residuals (module doc)."""
        return {"errors": keyed_items(self.errors, cpu)}

    def load_state_dict(self, state: dict) -> None:
        st = self._state_keys(state, ("errors",))
        self.errors = keyed_dict(st["errors"], lambda t: t.to(self.device))

    def prepare(self, dims: list[int], *, say: Callable[[str], None] | None = say_stderr) -> None:
        """Compile the CPU sign codec for the row widths whose exchanges hold at least
        ``EXCHANGE_COMPILE_MIN_ELEMENTS`` values (rank 0 says so on ``say``); nothing under
        emulated compute (the codec's work is the emulated device's)."""
        if self.world_size == 1 or not self.compile or self.device.type != "cpu" or self.compute is not None:
            return
        n_min = min(sum(self.book.send_counts), sum(self.book.recv_counts))
        big = [d for d in sorted(set(dims)) if n_min * d >= EXCHANGE_COMPILE_MIN_ELEMENTS]
        if big:
            warm_sign_codec(big, say=say if self.book.rank == 0 else None)
            self._compiled_dims.update(big)

    def report(self) -> dict:
        return {"onebit": {"error_feedback": self.error_feedback, "overlap": self.overlap,
                           "scale": "mean absolute value per row",
                           "compiled_dims": sorted(self._compiled_dims)}}

    def transfer(self, rows: torch.Tensor, layer: int, direction: str, ctx: PassContext) -> Pending:
        plan = self.plan if direction == "forward" else self.plan.reversed()
        if not ctx.training:  # evaluation: full precision, the error kept for training
            return Pending.ready(all_to_all(rows, plan, group=self.group, pattern=self.pattern))
        timer = ctx.timer
        D = int(rows.shape[1])
        t0 = timer.mark()
        key = (layer, direction)
        err = None
        if self.error_feedback and self.compute is None:
            err = self.errors.get(key)
            if err is None or tuple(err.shape) != tuple(rows.shape):
                err = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        compiled = D in self._compiled_dims
        # on the CPU the finite check is a cheap read; elsewhere it is deferred to a device
        # flag read once an epoch (end_epoch), not a synchronisation per exchange
        finite = None
        if rows.device.type != "cpu":
            if self._finite is None:
                self._finite = torch.ones((), dtype=torch.bool, device=rows.device)
            finite = self._finite
        emu = self.compute
        if emu is not None:  # the records' real size, encoded on the emulated device
            proto, _ = encode_signs(rows[:1].to(torch.float32), error=None, compile=False)
            records = emu.zeros((int(rows.shape[0]), *proto.shape[1:]), proto.dtype, proto.device)
            emu.quant(int(rows.shape[0]), D, records.numel())
            emu.sync()  # the host sends them next
        else:
            records, new_err = encode_signs(rows.to(torch.float32), error=err, compile=compiled,
                                            finite=finite)
            if new_err is not None:
                self.errors[key] = new_err
        t1 = timer.mark()
        timer.add_span("quant", t0, t1)
        timer.add_span("comm", t0, t1, -1.0)  # the caller times this call as comm; encoding is not
        h = all_to_all_async(records, plan, group=self.group, pattern=self.pattern, stats=ctx.stats)

        def finish() -> torch.Tensor:
            got = h.wait()
            t_got = timer.mark()
            if emu is not None:  # decoded on the emulated device; the values are not needed
                emu.quant(int(got.shape[0]), D, got.numel())
                return emu.blank((int(got.shape[0]), D), rows.dtype, rows.device)
            out = decode_signs(got, D, compile=compiled).to(rows.dtype)
            t_done = timer.mark()
            timer.add_span("quant", t_got, t_done)
            timer.add_span("comm", t_got, t_done, -1.0)
            return out

        return Pending(finish) if self.overlap else Pending.ready(finish())


__all__ = ["OneBitExchange"]
