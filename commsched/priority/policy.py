"""The launch policy of one rank's communication (pure: no process group, no clock).

A policy is a small state machine. It is told what happens (an all-to-all wants the link,
a gradient micro-op became ready, an operation finished, the expert block of a backward
pass began or ended, the backward pass ended) and :meth:`Policy.next_ops` answers which
operations to launch now, all-to-alls first. The discrete-event simulator
(:mod:`commsched.priority.sim`) and the executor on real process groups
(:mod:`commsched.priority.runtime.executor`) drive the same class, built by :func:`make_policy`
from the same :class:`ScheduleConfig` (one set of defaults: what the simulator checks is
what runs).

Allreduce operations carry a sequence number and are launched strictly in that order
(every rank uses the same order, so the collectives match); a policy only decides *when*.

Schedules (:data:`SCHEDULES`, a :class:`~commsched.configurable.Registry` of
:class:`ScheduleConfig` classes by name; each holds its options and makes its :class:`Policy`):

* ``lina`` -- all-to-all first: an allreduce micro-op is launched only when no all-to-all
  of this rank is waiting or in flight, and only while the bytes of allreduce in flight
  stay within the credit (one micro-op may always be in flight, whatever its size). The
  decision is local: on real process groups a launched micro-op waits inside the
  collective for peers still in an all-to-all. With ``hold_in_block`` (the default of
  :class:`LinaConfig`) it is also held inside an expert block (between the combine and
  dispatch exchanges of an MoE layer in the backward pass, expert compute included), which
  keeps the block's second exchange clear at the price of leaving the link to in-flight
  micro-ops during expert compute. Once the backward pass has
  ended no all-to-all can come before the optimizer step, so nothing holds allreduce
  back any more, the credit included (the remaining micro-ops go out at once).
* ``fifo`` -- every operation is launched as soon as it is ready (DDP's behaviour).
* ``serial`` -- allreduce waits until the backward pass has ended (no overlap at all; the
  all-to-all then runs alone, which is how its uncontended time is measured).
* ``flat`` -- ``serial``'s timing, the gradients of each group in one fused operation (the
  data-parallel allreduce of a plain training loop).
* ``lina-overlap`` -- ``lina`` in the backward pass; the step does not wait for the
  reduction (:class:`OverlapPolicy`): the micro-ops still to launch when the backward pass
  ends go out in the order in which the next forward pass needs their parameters (first
  layer first, :meth:`OverlapPolicy.set_priorities`), still under the credit and still
  behind every all-to-all of this rank (those of the next forward pass), while the
  optimizer steps each parameter group as soon as its reduction ends and the next forward
  pass waits, module by module, only for its own parameters
  (:mod:`commsched.priority.runtime.overlap`). Which micro-ops are still to launch differs between
  ranks under the ``completion`` rule, so the ranks agree on it first
  (:attr:`OverlapPolicy.wants_agreement`, :meth:`OverlapPolicy.agree`: the largest count
  launched on any rank); under ``program`` it is the same everywhere already.

Launch rules (:data:`LAUNCH_RULES`, ``ScheduleConfig.launch``):

* ``completion`` -- the rule above: a decision may depend on *when* operations finish (an
  allreduce completing frees credit, an all-to-all completing opens a gap). Right on gloo,
  whose worker threads progress each collective independently, so ranks that decide at
  different moments still meet inside the collective.
* ``program`` -- decisions are taken only at points of the program, which every rank
  passes in the same order (a gradient becoming ready, an all-to-all beginning or ending on
  the host, an expert block beginning or ending, the end of the backward pass), and never
  depend on completions: instead of the credit, at most :attr:`LinaConfig.gap_budget`
  micro-ops are launched in each gap between two all-to-alls. Every rank then issues its
  allreduce and all-to-all collectives in the same interleaving, which NCCL requires of
  collectives on different communicators (otherwise they can deadlock). The default on
  CUDA devices (:meth:`ScheduleConfig.launch_rule`). ``fifo``, ``serial`` and ``flat`` never depend on
  completions, so the rule changes only ``lina``.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import ClassVar, Hashable, Sequence

from ..configurable import Config, Registry, check, option
from .microops import CommOp, bucket, partition

# Default credit of ``lina``, in micro-ops. A micro-op's collective takes far longer than its
# bytes need on the link when peers arrive late (tens of ms on 4 ranks sharing 2 cores, against
# about 15 ms of link for 256 KiB at 800 Mbit/s), so with one micro-op in flight the allreduce
# crawled through the gaps of the backward pass; several in flight keep the link busy, at the
# price of a longer worst-case wait for an all-to-all that arrives (docs/results.md).
DEFAULT_CREDIT_MICROOPS = 8

# Under hier_reduce, operations below this many bytes are reduced flat: a 4 KiB layer-norm
# micro-op saves about 0.1 ms of a 267 Mbit/s NIC by the hierarchy, while its two extra gloo
# collectives cost milliseconds on a busy machine (docs/moe.md, "Hierarchical reduction").
HIER_MIN_BYTES = 64 << 10

# ScheduleConfig.launch: may decisions depend on completion times, or only on program points
LAUNCH_RULES = ("completion", "program")


@dataclass(frozen=True)
class Launch:
    """An operation to launch now: ``kind`` is ``"a2a"`` (key = the caller's key) or
    ``"allreduce"`` (key = its sequence number)."""

    kind: str
    key: Hashable
    nbytes: int


class Policy:
    """See the module docstring. ``credit_bytes=None``: no bound on bytes in flight."""

    def __init__(self, name: str = "lina", *, credit_bytes: int | None = None, hold_for_a2a: bool = True,
                 hold_in_block: bool = True, defer_to_end: bool = False, gap_budget: int | None = None):
        if credit_bytes is not None and credit_bytes < 1:
            raise ValueError(f"credit_bytes must be >= 1 or None, got {credit_bytes}")
        if gap_budget is not None and gap_budget < 1:
            raise ValueError(f"gap_budget must be >= 1 or None, got {gap_budget}")
        self.name = name
        self.credit_bytes = credit_bytes
        # the ``program`` launch rule: at most this many allreduce launches per gap between
        # all-to-alls, the credit (which depends on completions) unused
        self.gap_budget = gap_budget
        self.hold_for_a2a, self.hold_in_block, self.defer_to_end = hold_for_a2a, hold_in_block, defer_to_end
        self.begin_step(0)

    # ------------------------------------------------------------------ events
    def begin_step(self, num_allreduce: int) -> None:
        """A new step with ``num_allreduce`` allreduce operations (sequence 0..n-1)."""
        if num_allreduce < 0:
            raise ValueError("num_allreduce must be >= 0")
        self._n = num_allreduce
        self._next = 0
        self._ready: dict[int, int] = {}
        self._ar_inflight: dict[int, int] = {}
        self._ar_done = 0
        self._a2a_wait: deque[tuple[Hashable, int]] = deque()
        self._a2a_inflight: set[Hashable] = set()
        self._block = 0
        self._ended = False
        self._gap_launched = 0

    def a2a_waiting(self, key: Hashable, nbytes: int = 0) -> None:
        if key in self._a2a_inflight or any(k == key for k, _ in self._a2a_wait):
            raise ValueError(f"all-to-all {key!r} is already known to the policy")
        self._a2a_wait.append((key, nbytes))

    def a2a_done(self, key: Hashable) -> None:
        if key not in self._a2a_inflight:
            raise ValueError(f"all-to-all {key!r} finished but was never launched")
        self._a2a_inflight.discard(key)
        if not self._a2a_inflight:
            self._gap_launched = 0  # a new gap opens

    def allreduce_ready(self, seq: int, nbytes: int) -> None:
        if not 0 <= seq < self._n:
            raise ValueError(f"allreduce {seq} outside this step's 0..{self._n - 1}")
        if seq in self._ready or seq < self._next:
            raise ValueError(f"allreduce {seq} was already ready")
        self._ready[seq] = nbytes

    def allreduce_done(self, seq: int) -> None:
        if seq not in self._ar_inflight:
            raise ValueError(f"allreduce {seq} finished but was never launched")
        del self._ar_inflight[seq]
        self._ar_done += 1

    def block_begin(self) -> None:
        if not self._ended:
            self._block += 1

    def block_end(self) -> None:
        self._block = max(0, self._block - 1)

    def end_backward(self) -> None:
        """No more all-to-all this step: launch the remaining allreduce as it becomes ready."""
        self._ended = True
        self._block = 0

    # ------------------------------------------------------------------ queries
    @property
    def a2a_busy(self) -> bool:
        return bool(self._a2a_wait or self._a2a_inflight)

    @property
    def allreduce_inflight_bytes(self) -> int:
        return sum(self._ar_inflight.values())

    @property
    def allreduce_pending(self) -> int:
        """Allreduce operations not yet launched (ready or not)."""
        return self._n - self._next

    @property
    def finished(self) -> bool:
        return self._ar_done == self._n and not self.a2a_busy

    def _may_launch(self, nbytes: int) -> bool:
        if self.defer_to_end and not self._ended:
            return False
        if self.hold_for_a2a and self.a2a_busy:
            return False
        if self.hold_in_block and self._block > 0:
            return False
        if self.gap_budget is not None:
            return self._ended or self._gap_launched < self.gap_budget
        if self.credit_bytes is not None and self._ar_inflight and not self._ended:
            return self.allreduce_inflight_bytes + nbytes <= self.credit_bytes
        return True

    def next_ops(self) -> list[Launch]:
        """Operations to launch now, in order: waiting all-to-alls, then allreduce in sequence."""
        out = []
        while self._a2a_wait:
            key, nb = self._a2a_wait.popleft()
            self._a2a_inflight.add(key)
            out.append(Launch("a2a", key, nb))
        while self._next in self._ready and self._may_launch(self._ready[self._next]):
            nb = self._ready.pop(self._next)
            self._ar_inflight[self._next] = nb
            out.append(Launch("allreduce", self._next, nb))
            self._next += 1
            self._gap_launched += 1
        return out


class OverlapPolicy(Policy):
    """``lina-overlap`` (module docstring): :class:`Policy` ``lina`` until the backward pass
    ends, then the remaining allreduce in the tail order, under the credit (or the gap
    budget) and behind every all-to-all, across the next forward pass.

    Events beyond :class:`Policy`'s: :meth:`set_priorities` (once the forward order is
    known), :meth:`agree` (the ranks' launched count after :meth:`end_backward`) and
    :meth:`need` (the forward pass waits for these operations now)."""

    def __init__(self, *, credit_bytes: int | None, hold_in_block: bool = True, gap_budget: int | None = None):
        self._prio: tuple[int, ...] | None = None
        super().__init__("lina-overlap", credit_bytes=credit_bytes, hold_in_block=hold_in_block,
                         gap_budget=gap_budget)

    def set_priorities(self, prio_ops: Sequence[int] | None) -> None:
        """``prio_ops[seq]``: when the next forward pass needs operation ``seq``'s parameters
        (smaller first); None: the tail keeps the sequence order. Must be the same on every rank."""
        if prio_ops is not None:
            prio_ops = tuple(int(x) for x in prio_ops)
            if self._n and len(prio_ops) != self._n:
                raise ValueError(f"{len(prio_ops)} priorities for {self._n} allreduce operations")
        self._prio = prio_ops

    def begin_step(self, num_allreduce: int) -> None:
        if self._prio is not None and num_allreduce and len(self._prio) != num_allreduce:
            raise ValueError(f"{len(self._prio)} priorities for {num_allreduce} allreduce operations")
        super().begin_step(num_allreduce)
        self._order: list[int] | None = None  # launch order from the agreed count on
        self._pos = 0
        self._forced = 0  # launches of the order that need() asked for

    @property
    def wants_agreement(self) -> bool:
        """Whether :meth:`end_backward` must be followed by :meth:`agree` with the ranks'
        largest launched count (``completion`` rule), or agrees by itself (``program``)."""
        return self.gap_budget is None

    @property
    def launched_count(self) -> int:
        """Allreduce operations launched so far in sequence order (what the ranks compare)."""
        return self._next

    @property
    def tail_order(self) -> tuple[int, ...] | None:
        """The launch order after the agreement (sequence numbers), None before it."""
        return None if self._order is None else tuple(self._order)

    def end_backward(self) -> None:
        if self._ended:
            return
        super().end_backward()
        self._gap_launched = 0
        if not self.wants_agreement:
            self.agree(self._next)

    def agree(self, launched: int) -> None:
        """Every rank has launched the first ``launched`` operations, or will (the largest
        count any rank launched before its backward pass ended): this rank catches up to
        it in sequence order, then launches the rest by priority."""
        if not self._ended:
            raise ValueError("agree() before end_backward()")
        if self._order is not None:
            raise ValueError("agree() called twice in one step")
        if not self._next <= launched <= self._n:
            raise ValueError(f"agreed count {launched} outside {self._next}..{self._n} (launched here: {self._next})")
        rest = list(range(launched, self._n))
        if self._prio is not None:
            rest.sort(key=lambda s: (self._prio[s], s))
        self._order = list(range(self._next, launched)) + rest
        self._pos = 0

    def need(self, seqs: Sequence[int]) -> None:
        """The forward pass waits for the operations ``seqs``: under the ``program`` rule
        everything up to the last of them in the launch order goes out now (nothing
        completes it otherwise); under ``completion`` they are at the front of the order
        and go as the credit frees (nothing of this rank's is on the wire but allreduce)."""
        if self._order is None or self.gap_budget is None:
            return
        where = {s: i for i, s in enumerate(self._order)}
        last = max((where[s] for s in seqs if s in where), default=-1)
        self._forced = max(self._forced, last + 1)

    @property
    def allreduce_pending(self) -> int:
        if self._order is None:
            return self._n - self._next
        return len(self._order) - self._pos

    def _may_launch_tail(self, nbytes: int) -> bool:
        if self._pos < self._forced:
            return True
        if self.hold_for_a2a and self.a2a_busy:
            return False
        if self.gap_budget is not None:
            return self._gap_launched < self.gap_budget
        if self.credit_bytes is not None and self._ar_inflight:
            return self.allreduce_inflight_bytes + nbytes <= self.credit_bytes
        return True

    def _may_launch(self, nbytes: int) -> bool:
        return not self._ended and super()._may_launch(nbytes)

    def next_ops(self) -> list[Launch]:
        out = super().next_ops()
        if self._order is None:
            return out
        while (self._pos < len(self._order) and self._order[self._pos] in self._ready
               and self._may_launch_tail(self._ready[self._order[self._pos]])):
            seq = self._order[self._pos]
            nb = self._ready.pop(seq)
            self._ar_inflight[seq] = nb
            out.append(Launch("allreduce", seq, nb))
            self._pos += 1
            self._gap_launched += 1
        return out

    @property
    def reduced(self) -> bool:
        """Every allreduce of the step is done (all-to-alls of the next forward pass may run)."""
        return self._ar_done == self._n


# --------------------------------------------------------------------------- the schedules
# --schedule name -> its config class; the command lines' ``--schedule`` choices are its names
SCHEDULES: Registry[type["ScheduleConfig"]] = Registry("schedule", flag="--schedule")

# the refusal of one schedule's option given to another (commsched.configurable.config_of)
_FOREIGN = "{flag} belongs to {selector} {owners}, not to {selector} {name}"


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig(Config):
    """A gradient schedule (one subclass per :data:`SCHEDULES` entry): its options, the fields
    (these are every schedule's: ``launch``, a name of :data:`LAUNCH_RULES` or None for the
    device's default; ``hier_reduce``, reduce over all ranks hierarchically,
    :mod:`commsched.priority.hier`, under ``hier_min_bytes`` flat; ``reduce_address``, the
    local address the reduction's gloo groups bind to, :mod:`commsched.priority.bind`), and
    what it does: its :class:`Policy` (:meth:`make_policy`; an :class:`OverlapPolicy` makes
    the step run the reduction into the next forward pass), the operations it cuts gradients
    into (:meth:`allreduce_ops`) and its probe pairs against fifo's launching (:attr:`probes`).
    The simulator, the executor, :func:`~commsched.priority.step.make_grad_step` and both
    training command lines (the flags: the fields) take it from there."""

    name: ClassVar[str]

    # the name, in records (metrics.json, the ranks' comparison of their configs); not an option
    policy: str = dataclasses.field(init=False, default="", metadata={"cli": False})
    launch: str | None = option(None, "launch rule (default: 'program' on CUDA, 'completion' on the CPU; "
                                      "only lina's decisions depend on it)", choices=LAUNCH_RULES)
    hier_reduce: bool = option(False, "reduce the data-parallel gradients inside each host, across hosts (the "
                                      "phase the schedule gates), then inside again (needs the same ranks on "
                                      "every host)")
    hier_min_bytes: int = option(HIER_MIN_BYTES, "--hier-reduce: operations smaller than this stay flat")
    reduce_address: str | None = option(None, "bind the gradient reduction's gloo groups to this local address "
                                              "(the bench's collective link model gives it its own share of "
                                              "the emulated link; priority/bind.py)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", self.name)
        check(isinstance(self.hier_reduce, bool), f"hier_reduce must be True or False, got {self.hier_reduce!r}")
        check(not isinstance(self.hier_min_bytes, bool) and isinstance(self.hier_min_bytes, int)
              and self.hier_min_bytes >= 0, f"hier_min_bytes must be an integer >= 0, got {self.hier_min_bytes!r}")
        check(self.launch is None or self.launch in LAUNCH_RULES, f"unknown launch rule {self.launch!r}; choose "
              f"one of {LAUNCH_RULES} (or None: 'program' on CUDA devices, 'completion' elsewhere)")

    def build(self, device_type: str | None = None) -> Policy:
        """The policy of this schedule (:func:`make_policy`)."""
        return make_policy(self, device_type)

    def launch_rule(self, device_type: str = "cpu") -> str:
        """The launch rule in force on a device of type ``device_type``: ``launch`` when set,
        else ``program`` on ``cuda`` (NCCL's ordering rule) and ``completion`` elsewhere."""
        if self.launch is not None:
            return self.launch
        return "program" if device_type == "cuda" else "completion"

    def make_policy(self, rule: str) -> Policy:
        """The policy of one step under the launch rule ``rule``."""
        raise NotImplementedError(f"{type(self).__name__} makes no policy")

    def allreduce_ops(self, numels: Sequence[int], element_size: int) -> list[CommOp]:
        """The allreduce operations these gradients (element counts, in readiness order) are cut into."""
        raise NotImplementedError(f"{type(self).__name__} makes no operations")

    @property
    def probes(self) -> int:
        """Probe pairs of the measured A/B against fifo's launching (0: none)."""
        return 0


@dataclass(frozen=True, kw_only=True)
class MicroOpConfig(ScheduleConfig):
    """Base of the schedules that cut gradients into equal micro-ops of ``microop_bytes``."""

    microop_bytes: int = option(256 << 10, "micro-op size (lina, lina-overlap, serial)", foreign=_FOREIGN)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.microop_bytes >= 4, "microop_bytes must be at least one element (4 bytes)")

    def allreduce_ops(self, numels: Sequence[int], element_size: int) -> list[CommOp]:
        return partition(numels, element_size, self.microop_bytes)


@SCHEDULES.register("lina")
@dataclass(frozen=True, kw_only=True)
class LinaConfig(MicroOpConfig):
    """``lina``: micro-ops in the gaps of the all-to-all, under the credit (module docstring).
    ``credit_bytes``: allreduce bytes allowed in flight (default :data:`DEFAULT_CREDIT_MICROOPS`
    micro-ops, :attr:`credit`); ``hold_in_block``: also held inside backward expert blocks;
    ``fallback_probes``: the measured A/B of :mod:`commsched.priority.fallback` (0: off)."""

    name = "lina"

    credit_bytes: int | None = option(None, f"lina: allreduce bytes in flight (default: {DEFAULT_CREDIT_MICROOPS} "
                                            "micro-ops)", foreign=_FOREIGN)
    hold_in_block: bool = option(True, "lina: also hold allreduce during the expert compute of a backward "
                                       "expert block", foreign=_FOREIGN)
    fallback_probes: int = option(2, "lina, lina-overlap on the CPU: after two steps, this many steps each of "
                                     "the schedule and of fifo's launching (P F F P ...); the faster is kept "
                                     "(0: off; priority/fallback.py)", foreign=_FOREIGN)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.credit_bytes is None or self.credit_bytes >= 1, f"credit_bytes must be >= 1, got {self.credit_bytes}")
        check(isinstance(self.fallback_probes, int) and self.fallback_probes >= 0,
              f"--fallback-probes must be a whole number >= 0 (0 turns the probe off), got {self.fallback_probes!r}")

    @property
    def credit(self) -> int:
        """The credit in force: ``credit_bytes``, or :data:`DEFAULT_CREDIT_MICROOPS` micro-ops."""
        return self.credit_bytes if self.credit_bytes is not None else DEFAULT_CREDIT_MICROOPS * self.microop_bytes

    @property
    def gap_budget(self) -> int:
        """Micro-ops launched per gap between all-to-alls under the ``program`` rule: the
        credit in micro-ops (at least one)."""
        return max(1, self.credit // self.microop_bytes)

    @property
    def probes(self) -> int:
        return self.fallback_probes

    def make_policy(self, rule: str) -> Policy:
        return Policy(self.name, credit_bytes=self.credit, hold_in_block=self.hold_in_block,
                      gap_budget=self.gap_budget if rule == "program" else None)


@SCHEDULES.register("fifo")
@dataclass(frozen=True, kw_only=True)
class FifoConfig(ScheduleConfig):
    """``fifo``, DDP's: fused buckets of ``bucket_bytes`` (DDP's first is 1 MiB) launched as
    soon as they are ready."""

    name = "fifo"

    bucket_bytes: int = option(1 << 20, "fifo buckets; also DeepSpeed's reduce bucket", foreign=_FOREIGN)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.bucket_bytes >= 4, "bucket_bytes must be at least one element (4 bytes)")

    def make_policy(self, rule: str) -> Policy:
        return Policy(self.name, credit_bytes=None, hold_for_a2a=False, hold_in_block=False)

    def allreduce_ops(self, numels: Sequence[int], element_size: int) -> list[CommOp]:
        return bucket(numels, element_size, self.bucket_bytes)


@SCHEDULES.register("serial")
@dataclass(frozen=True, kw_only=True)
class SerialConfig(MicroOpConfig):
    """``serial``: allreduce after the backward pass (the all-to-all alone)."""

    name = "serial"

    def make_policy(self, rule: str) -> Policy:
        return Policy(self.name, credit_bytes=None, hold_for_a2a=False, hold_in_block=False, defer_to_end=True)


@SCHEDULES.register("lina-overlap")
@dataclass(frozen=True, kw_only=True)
class LinaOverlapConfig(LinaConfig):
    """``lina``, the reduction's tail under the next forward pass (:class:`OverlapPolicy`)."""

    name = "lina-overlap"

    def __post_init__(self) -> None:
        super().__post_init__()
        check(not self.hier_reduce, "hier_reduce does not combine with the 'lina-overlap' schedule yet (its tail "
              "runs on flat twin groups); use hier_reduce with 'lina' or 'fifo', or the overlap flat")

    def make_policy(self, rule: str) -> Policy:
        return OverlapPolicy(credit_bytes=self.credit, hold_in_block=self.hold_in_block,
                             gap_budget=self.gap_budget if rule == "program" else None)


@SCHEDULES.register("flat")
@dataclass(frozen=True, kw_only=True)
class FlatConfig(ScheduleConfig):
    """``flat``: one allreduce of every gradient (one fused bucket per group and dtype) after
    the backward pass."""

    name = "flat"

    def make_policy(self, rule: str) -> Policy:
        return Policy(self.name, credit_bytes=None, hold_for_a2a=False, hold_in_block=False, defer_to_end=True)

    def allreduce_ops(self, numels: Sequence[int], element_size: int) -> list[CommOp]:
        return bucket(numels, element_size, max(element_size, sum(numels) * element_size))


def make_policy(cfg: ScheduleConfig, device_type: str | None = None) -> Policy:
    """The policy of ``cfg`` under the launch rule ``cfg.launch_rule(device_type)``
    (``device_type`` None: ``cfg.launch``, else ``completion``); see the module docstring."""
    return cfg.make_policy(cfg.launch_rule(device_type or "cpu"))


__all__ = ["DEFAULT_CREDIT_MICROOPS", "FifoConfig", "FlatConfig", "HIER_MIN_BYTES", "LAUNCH_RULES", "Launch",
           "LinaConfig", "LinaOverlapConfig", "MicroOpConfig", "OverlapPolicy", "Policy", "SCHEDULES",
           "ScheduleConfig", "SerialConfig", "make_policy"]
