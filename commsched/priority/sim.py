"""A deterministic discrete-event simulator of one rank's backward pass under a policy.

The script is what the compute thread does, in order: :class:`Compute` (busy for some
seconds, after which some gradient tensors are ready), :class:`AllToAll` (blocking: the
compute thread waits until it is done), and :class:`BlockBegin` / :class:`BlockEnd` around
the expert block of an MoE layer. After the last item the backward pass ends (the policy
is told) and the step ends when every allreduce is done (the optimizer waits for them).

The link is shared fairly (processor sharing): with n operations in flight each moves at
``bandwidth / n``; every operation also costs ``latency_s`` of link time, as though it
were ``latency_s * bandwidth`` bytes longer. Operations are never preempted: once
launched, an allreduce keeps its share until done -- which is why the policy matters.

Gradients become allreduce operations through the schedule's
:meth:`~commsched.priority.policy.ScheduleConfig.allreduce_ops`: micro-ops (``lina``, ``serial``) or fused
buckets (``fifo``), in the order the tensors become ready. The schedule is a
:class:`~commsched.priority.policy.ScheduleConfig`, the very object (and defaults) the
executor runs. Nothing here is random and no clock is read, so a scenario always gives the
same timeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

from .policy import LinaConfig, OverlapPolicy, ScheduleConfig, make_policy

_EPS = 1e-12


@dataclass(frozen=True)
class Compute:
    seconds: float
    grads: tuple[int, ...] = ()  # bytes of the gradient tensors ready when this ends


@dataclass(frozen=True)
class AllToAll:
    nbytes: int


@dataclass(frozen=True)
class BlockBegin:
    pass


@dataclass(frozen=True)
class BlockEnd:
    pass


@dataclass(frozen=True)
class EndBackward:
    """The backward pass ends here; what follows is the next step's forward pass."""


@dataclass(frozen=True)
class Need:
    """The forward pass reaches a module whose parameters are these gradient tensors
    (indices in the order the script's :class:`Compute` items make them ready)."""

    tensors: tuple[int, ...]


Item = Union[Compute, AllToAll, BlockBegin, BlockEnd, EndBackward, Need]


@dataclass(frozen=True)
class Link:
    bandwidth_Bps: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth_Bps}")
        if self.latency_s < 0:
            raise ValueError(f"latency must be >= 0 s, got {self.latency_s}")

    def alone_s(self, nbytes: int) -> float:
        """Time of one operation with the link to itself."""
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass
class SimOp:
    kind: str  # "a2a" or "allreduce"
    key: int   # a2a: its index in the script; allreduce: its sequence number
    nbytes: int
    ready_s: float
    start_s: float = float("nan")
    end_s: float = float("nan")

    @property
    def wait_s(self) -> float:
        return self.start_s - self.ready_s

    def overlaps(self, other: "SimOp") -> bool:
        return self.start_s < other.end_s - _EPS and other.start_s < self.end_s - _EPS


@dataclass
class SimResult:
    schedule: str
    link: Link
    ops: list[SimOp] = field(default_factory=list)
    compute_end_s: float = 0.0
    step_s: float = 0.0
    # the forward pass's waits for parameters: (Need's index in the script, arrival, release)
    needs: list[tuple[int, float, float]] = field(default_factory=list)
    backward_end_s: float = 0.0
    script_end_s: float = 0.0

    @property
    def a2a(self) -> list[SimOp]:
        return [o for o in self.ops if o.kind == "a2a"]

    @property
    def allreduce(self) -> list[SimOp]:
        return [o for o in self.ops if o.kind == "allreduce"]

    @property
    def a2a_time_s(self) -> float:
        """Total time the compute thread waited for all-to-alls (arrival to completion)."""
        return sum(o.end_s - o.ready_s for o in self.a2a)

    def allreduce_during(self, a2a_op: SimOp) -> list[SimOp]:
        """Allreduce operations on the link at some moment while ``a2a_op`` was waiting or moving."""
        window = SimOp("a2a", a2a_op.key, a2a_op.nbytes, a2a_op.ready_s, a2a_op.ready_s, a2a_op.end_s)
        return [o for o in self.allreduce if o.overlaps(window)]

    def link_idle_with_allreduce_pending(self, after_s: float = 0.0) -> float:
        """Seconds after ``after_s`` during which the link carried nothing although some
        allreduce was ready and not yet launched (0 when the policy never starves it)."""
        points = sorted({after_s, *(x for o in self.ops for x in (o.ready_s, o.start_s, o.end_s) if x > after_s)})
        idle = 0.0
        for a, b in zip(points, points[1:]):
            m = (a + b) / 2
            busy = any(o.start_s <= m < o.end_s for o in self.ops)
            waiting = any(o.ready_s <= m < o.start_s for o in self.allreduce)
            if not busy and waiting:
                idle += b - a
        return idle


def simulate(script: Sequence[Item], link: Link, cfg: ScheduleConfig | None = None, *,
             element_size: int = 4, order_tail: bool = True) -> SimResult:
    """Run ``script`` on ``link`` under the schedule ``cfg`` (default: ``LinaConfig()``,
    the executor's default); see the module docstring. Gradient sizes in the script are
    bytes, multiples of ``element_size``. ``order_tail=False``: ``lina-overlap`` keeps its
    tail in sequence order (no forward order known; what ordering it buys).
    """
    cfg = cfg if cfg is not None else LinaConfig()
    grad_bytes = [b for it in script if isinstance(it, Compute) for b in it.grads]
    if any(b % element_size for b in grad_bytes):
        raise ValueError(f"gradient sizes must be multiples of element_size={element_size}")
    ops = cfg.allreduce_ops([b // element_size for b in grad_bytes], element_size)
    pol = make_policy(cfg)
    ops_of_tensor: dict[int, list[int]] = {}
    for op in ops:
        for t in op.tensors:
            ops_of_tensor.setdefault(t, []).append(op.seq)
    for it in script:
        if isinstance(it, Need) and any(not 0 <= t < len(grad_bytes) for t in it.tensors):
            raise ValueError(f"{it} names a tensor outside 0..{len(grad_bytes) - 1}")
    if isinstance(pol, OverlapPolicy) and order_tail:
        first_need: dict[int, int] = {}
        for it in script:
            if isinstance(it, Need):
                for tn in it.tensors:
                    first_need.setdefault(tn, len(first_need))
        pol.set_priorities([min(first_need.get(tn, len(grad_bytes)) for tn in op.tensors) for op in ops])
    pol.begin_step(len(ops))
    missing = [len(op.tensors) for op in ops]
    done: set[int] = set()
    bw = link.bandwidth_Bps
    res = SimResult(cfg.name, link)
    rec: dict[tuple[str, int], SimOp] = {}
    inflight: dict[tuple[str, int], float] = {}  # remaining link work in bytes
    t, pc, next_tensor = 0.0, 0, 0
    busy_until: float | None = None
    pending_grads: tuple[int, ...] = ()
    blocked_on: tuple[str, int] | None = None
    need_wait: tuple[int, float, set[int]] | None = None  # (script index, arrival, seqs awaited)
    ended = script_done = False

    def end_backward() -> None:
        pol.end_backward()
        if isinstance(pol, OverlapPolicy) and pol.wants_agreement:
            pol.agree(pol.launched_count)  # one rank: the count is its own

    def pump() -> None:
        for launch in pol.next_ops():
            k = launch.key if launch.kind == "a2a" else ("allreduce", int(launch.key))  # type: ignore[arg-type]
            rec[k].start_s = t
            inflight[k] = rec[k].nbytes + link.latency_s * bw

    while True:
        while busy_until is None and blocked_on is None and need_wait is None and pc < len(script):
            item = script[pc]
            pc += 1
            if isinstance(item, Compute):
                if item.seconds < 0:
                    raise ValueError(f"compute of {item.seconds} s in the script")
                busy_until, pending_grads = t + item.seconds, item.grads
            elif isinstance(item, AllToAll):
                key = ("a2a", pc - 1)
                rec[key] = SimOp("a2a", pc - 1, item.nbytes, t)
                res.ops.append(rec[key])
                pol.a2a_waiting(key, item.nbytes)
                blocked_on = key
            elif isinstance(item, BlockBegin):
                pol.block_begin()
            elif isinstance(item, BlockEnd):
                pol.block_end()
            elif isinstance(item, EndBackward):
                if not ended:
                    end_backward()
                    ended, res.backward_end_s = True, t
            elif isinstance(item, Need):
                if not ended:
                    raise ValueError(f"script item {pc - 1}: Need before EndBackward")
                seqs = ({s for tn in item.tensors for s in ops_of_tensor.get(tn, [])} if isinstance(pol, OverlapPolicy)
                        else set(range(len(ops))))
                if isinstance(pol, OverlapPolicy):
                    pol.need(sorted(seqs))
                need_wait = (pc - 1, t, seqs)
            else:
                raise TypeError(f"unknown script item {item!r}")
            if need_wait is not None and need_wait[2] <= done:
                res.needs.append((need_wait[0], need_wait[1], t))
                need_wait = None
        if not ended and pc == len(script) and busy_until is None and blocked_on is None:
            end_backward()
            ended, res.backward_end_s = True, t
        if not script_done and pc == len(script) and busy_until is None and blocked_on is None \
                and need_wait is None:
            script_done, res.compute_end_s, res.script_end_s = True, t, t
        pump()
        if ended and script_done and not inflight and pol.allreduce_pending == 0:
            break
        cands = [] if busy_until is None else [busy_until]
        if inflight:
            cands.append(t + min(inflight.values()) * len(inflight) / bw)
        if not cands:
            raise RuntimeError(f"simulation stuck at t={t}: {pol.allreduce_pending} allreduce held, nothing running")
        t_next = max(t, min(cands))
        if inflight:
            moved = (t_next - t) * bw / len(inflight)
            for k in inflight:
                inflight[k] -= moved
        t = t_next
        for k in sorted(k for k, rem in inflight.items() if rem <= _EPS * max(1.0, rec[k].nbytes)):
            del inflight[k]
            rec[k].end_s = t
            if k[0] == "a2a":
                pol.a2a_done(k)
                if blocked_on == k:
                    blocked_on = None
            else:
                pol.allreduce_done(k[1])
                done.add(k[1])
        if need_wait is not None and need_wait[2] <= done:
            res.needs.append((need_wait[0], need_wait[1], t))
            need_wait = None
        if busy_until is not None and busy_until <= t + _EPS:
            busy_until = None
            for _ in pending_grads:
                for seq in ops_of_tensor.get(next_tensor, []):
                    missing[seq] -= 1
                    if missing[seq] == 0:
                        rec[("allreduce", seq)] = SimOp("allreduce", seq, ops[seq].nbytes, t)
                        res.ops.append(rec[("allreduce", seq)])
                        pol.allreduce_ready(seq, ops[seq].nbytes)
                next_tensor += 1
            pending_grads = ()
    res.step_s = max([res.compute_end_s] + [o.end_s for o in res.ops])
    return res


def forward_script(layers: Sequence[str], *, a2a_bytes: int, expert_s: float, dense_s: float, attn_s: float,
                   tensors_per_block: Sequence[Sequence[int]], a2a_chunks: int = 1) -> list[Item]:
    """The next step's forward pass of the model of :func:`moe_backward_script` (blocks
    first to last): each block waits for its parameters' gradient tensors
    (``tensors_per_block[i]``, indices in the backward script's readiness order), then
    runs attention and its FFN (an MoE FFN: dispatch exchanges, expert compute, combine
    exchanges, each cut into ``a2a_chunks``)."""
    out: list[Item] = []
    for i, kind in enumerate(layers):
        out += [Need(tuple(tensors_per_block[i])), Compute(attn_s)]
        if kind == "moe":
            per = a2a_bytes // a2a_chunks
            out += [AllToAll(per) for _ in range(a2a_chunks)]
            out.append(Compute(expert_s))
            out += [AllToAll(per) for _ in range(a2a_chunks)]
        elif kind == "dense":
            out.append(Compute(dense_s))
        else:
            raise ValueError(f"block kind must be 'moe' or 'dense', got {kind!r}")
    return out


def moe_backward_script(layers: Sequence[str], *, a2a_bytes: int, expert_s: float, dense_s: float,
                        attn_s: float, dense_grad_bytes: int, attn_grad_bytes: int,
                        router_grad_bytes: int = 0, a2a_chunks: int = 1) -> list[Item]:
    """The backward pass of a transformer whose blocks are ``"moe"`` or ``"dense"`` (listed
    from the first block; the backward pass visits them last to first). An MoE block is
    the expert block (combine exchange, expert compute, dispatch exchange, each cut into
    ``a2a_chunks``), then its attention; a dense block is its FFN, then its attention."""
    out: list[Item] = []
    for kind in reversed(layers):
        if kind == "moe":
            out.append(BlockBegin())
            per = a2a_bytes // a2a_chunks
            for _ in range(a2a_chunks):
                out.append(AllToAll(per))
            for _ in range(a2a_chunks):
                out += [Compute(expert_s / a2a_chunks), AllToAll(per)]
            out.append(BlockEnd())
            out.append(Compute(0.0, (router_grad_bytes,) if router_grad_bytes else ()))
        elif kind == "dense":
            out.append(Compute(dense_s, (dense_grad_bytes,)))
        else:
            raise ValueError(f"block kind must be 'moe' or 'dense', got {kind!r}")
        out.append(Compute(attn_s, (attn_grad_bytes,)))
    return out


__all__ = ["AllToAll", "BlockBegin", "BlockEnd", "Compute", "EndBackward", "Link", "Need", "SimOp", "SimResult",
           "forward_script", "moe_backward_script", "simulate"]
