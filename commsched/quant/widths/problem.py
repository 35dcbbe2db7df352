"""The bit-width assignment problem and its checker (the formal specification).

AdaQP sends, in each ring round of one layer's exchange, one message per device pair
(a *channel*); the messages of a channel are cut into *groups* that share one
quantization width. Choosing the widths trades communication time against the gradient
variance that quantization adds:

* bytes(g, b) = count_g * (ceil(dim_g * b / 8) + META_BYTES)
* time of a channel  = gamma + theta * sum_g bytes(g, b_g)
* time of a round    = max over its channels;  T = sum over rounds
* V = sum over all groups of beta_g / (2^b_g - 1)^2
* T_max = T with every group at max(bits); V_max = V with every group at min(bits)
* objective = lam * V / V_max + (1 - lam) * T / T_max, a term whose normaliser is 0
  being dropped.

``evaluate`` computes all of that for any assignment without a solver; every solver in
``assign_greedy`` and ``assign_cpsat`` is checked against it. Pure code: no process group.

Legend for array names: G = groups of one channel, W = candidate widths (``bits``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..wire import BITS, META_BYTES

ALLOWED_BITS = BITS  # widths a problem may offer
DEFAULT_BITS = BITS  # widths offered when none are given


def meta_bytes() -> int:
    """Per-row metadata bytes of the wire format: ``commsched.quant.META_BYTES``."""
    return META_BYTES


def variance_factor(bits: int) -> float:
    """1 / (2^b - 1)^2: the variance a group of weight beta adds at width b, per unit beta."""
    return 1.0 / float((1 << bits) - 1) ** 2


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_real(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value


@dataclass(frozen=True)
class MessageGroup:
    """Messages of one channel that share a width.

    count: messages (rows) in the group, >= 0; dim: elements per message, >= 1;
    beta: the group's variance weight (the sum of its messages' weights), finite, >= 0.
    """

    count: int
    dim: int
    beta: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "count", _check_int(self.count, "MessageGroup.count", 0))
        object.__setattr__(self, "dim", _check_int(self.dim, "MessageGroup.dim", 1))
        object.__setattr__(self, "beta", _check_real(self.beta, "MessageGroup.beta"))

    def nbytes(self, bits: int, meta: int | None = None) -> int:
        """Wire bytes of the group at width ``bits`` (payload plus per-row metadata)."""
        m = meta_bytes() if meta is None else meta
        return self.count * ((self.dim * bits + 7) // 8 + m)


@dataclass(frozen=True)
class Channel:
    """One device pair in one ring round: time = gamma + theta * bytes.

    theta: seconds per byte, gamma: seconds per message (both finite, >= 0);
    groups: the groups of messages this pair sends (may be empty).
    """

    theta: float
    gamma: float
    groups: Sequence[MessageGroup]

    def __post_init__(self) -> None:
        object.__setattr__(self, "theta", _check_real(self.theta, "Channel.theta"))
        object.__setattr__(self, "gamma", _check_real(self.gamma, "Channel.gamma"))
        if isinstance(self.groups, (str, bytes)) or not isinstance(self.groups, Sequence):
            raise TypeError("Channel.groups must be a sequence of MessageGroup, got "
                            f"{type(self.groups).__name__}")
        groups = tuple(self.groups)
        for i, g in enumerate(groups):
            if not isinstance(g, MessageGroup):
                raise TypeError(f"Channel.groups[{i}] must be a MessageGroup, got {type(g).__name__}")
        object.__setattr__(self, "groups", groups)


def check_bits(bits) -> tuple[int, ...]:
    """Validate candidate widths: a non-empty set drawn from {2, 4, 8}; returned sorted."""
    if isinstance(bits, (str, bytes)) or not isinstance(bits, Sequence):
        raise TypeError(f"bits must be a sequence of widths from {ALLOWED_BITS}, got {bits!r}")
    out = []
    for b in bits:
        if isinstance(b, bool) or not isinstance(b, numbers.Integral) or int(b) not in ALLOWED_BITS:
            raise ValueError(f"bits must be drawn from {ALLOWED_BITS}, got {tuple(bits)!r}")
        out.append(int(b))
    if not out:
        raise ValueError(f"bits must hold at least one width from {ALLOWED_BITS}")
    if len(set(out)) != len(out):
        raise ValueError(f"bits must not repeat a width, got {tuple(bits)!r}")
    return tuple(sorted(out))


def check_lam(lam) -> float:
    if isinstance(lam, bool) or not isinstance(lam, numbers.Real):
        raise TypeError(f"lam must be a real number in [0, 1], got {lam!r}")
    lam = float(lam)
    if not 0.0 <= lam <= 1.0:  # also rejects NaN
        raise ValueError(f"lam must be in [0, 1] (weight of the variance term), got {lam}")
    return lam


@dataclass(frozen=True)
class ChannelArrays:
    """Numbers of one channel as arrays: bytes_GW[g, w] = bytes of group g at bits[w]."""

    theta: float
    gamma: float
    count_G: np.ndarray  # int64
    dim_G: np.ndarray  # int64
    beta_G: np.ndarray  # float64
    bytes_GW: np.ndarray  # int64


@dataclass(frozen=True)
class AssignmentProblem:
    """rounds[r][c] is channel c of ring round r; bits the candidate widths (sorted).

    Validates its input (``ValueError``/``TypeError`` naming the field) and keeps the
    numbers as arrays for the solvers. ``meta`` defaults to ``commsched.quant.META_BYTES``.
    """

    rounds: Sequence[Sequence[Channel]]
    bits: Sequence[int] = DEFAULT_BITS
    meta: int | None = None
    arrays: tuple[tuple[ChannelArrays, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", check_bits(self.bits))
        meta = meta_bytes() if self.meta is None else _check_int(self.meta, "meta", 0)
        object.__setattr__(self, "meta", meta)
        if isinstance(self.rounds, (str, bytes)) or not isinstance(self.rounds, Sequence):
            raise TypeError("rounds must be a sequence of rounds, each a sequence of Channel")
        rounds = []
        for r, chans in enumerate(self.rounds):
            if isinstance(chans, (str, bytes)) or not isinstance(chans, Sequence):
                raise TypeError(f"rounds[{r}] must be a sequence of Channel, got {type(chans).__name__}")
            chans = tuple(chans)
            if not chans:
                raise ValueError(f"rounds[{r}] is empty: every round needs at least one channel")
            for c, ch in enumerate(chans):
                if not isinstance(ch, Channel):
                    raise TypeError(f"rounds[{r}][{c}] must be a Channel, got {type(ch).__name__}")
            rounds.append(chans)
        if not rounds:
            raise ValueError("rounds is empty: give at least one round with one channel")
        object.__setattr__(self, "rounds", tuple(rounds))
        payload_W = np.array(self.bits, dtype=np.int64)
        arrays = []
        for chans in rounds:
            row = []
            for ch in chans:
                count_G = np.array([g.count for g in ch.groups], dtype=np.int64)
                dim_G = np.array([g.dim for g in ch.groups], dtype=np.int64)
                beta_G = np.array([g.beta for g in ch.groups], dtype=np.float64)
                bytes_GW = count_G[:, None] * ((dim_G[:, None] * payload_W[None, :] + 7) // 8 + meta)
                row.append(ChannelArrays(ch.theta, ch.gamma, count_G, dim_G, beta_G,
                                         bytes_GW.reshape(len(ch.groups), len(self.bits))))
            arrays.append(tuple(row))
        object.__setattr__(self, "arrays", tuple(arrays))

    @property
    def num_groups(self) -> int:
        return sum(len(ch.groups) for chans in self.rounds for ch in chans)

    def uniform(self, bits: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """The assignment giving every group width ``bits``."""
        if bits not in self.bits:
            raise ValueError(f"width {bits} is not one of this problem's bits {self.bits}")
        return tuple(tuple((bits,) * len(ch.groups) for ch in chans) for chans in self.rounds)

    @property
    def t_max_s(self) -> float:
        """T with every group at the largest width (the time normaliser)."""
        w = len(self.bits) - 1
        return float(sum(max(a.gamma + a.theta * float(a.bytes_GW[:, w].sum()) for a in row)
                         for row in self.arrays))

    @property
    def v_max(self) -> float:
        """V with every group at the smallest width (the variance normaliser)."""
        f = variance_factor(self.bits[0])
        return float(sum(float(a.beta_G.sum()) for row in self.arrays for a in row) * f)

    def weights(self, lam: float) -> tuple[float, float]:
        """(w_time, w_var): objective = w_time * T + w_var * V; a zero normaliser drops its term."""
        lam = check_lam(lam)
        t_max, v_max = self.t_max_s, self.v_max
        w_time = (1.0 - lam) / t_max if t_max > 0 else 0.0
        w_var = lam / v_max if v_max > 0 else 0.0
        return w_time, w_var


@dataclass(frozen=True)
class Evaluation:
    """What the checker computes for one assignment (seconds, variance units)."""

    objective: float
    time_s: float  # T
    variance: float  # V
    round_times_s: tuple[float, ...]
    channel_times_s: tuple[tuple[float, ...], ...]
    t_max_s: float
    v_max: float


def check_assignment(problem: AssignmentProblem, bits) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Validate that ``bits[r][c][g]`` matches the problem's shape and widths; return it as tuples."""
    if len(bits) != len(problem.rounds):
        raise ValueError(f"assignment has {len(bits)} rounds, the problem {len(problem.rounds)}")
    out = []
    for r, (row, chans) in enumerate(zip(bits, problem.rounds)):
        if len(row) != len(chans):
            raise ValueError(f"assignment round {r} has {len(row)} channels, the problem {len(chans)}")
        orow = []
        for c, (bc, ch) in enumerate(zip(row, chans)):
            if len(bc) != len(ch.groups):
                raise ValueError(f"assignment channel [{r}][{c}] has {len(bc)} widths for "
                                 f"{len(ch.groups)} groups")
            bc = tuple(int(b) for b in bc)
            bad = [b for b in bc if b not in problem.bits]
            if bad:
                raise ValueError(f"assignment channel [{r}][{c}] uses width {bad[0]}, not one of "
                                 f"{problem.bits}")
            orow.append(bc)
        out.append(tuple(orow))
    return tuple(out)


def evaluate(problem: AssignmentProblem, bits, lam: float) -> Evaluation:
    """The checker: time, variance and objective of ``bits[r][c][g]``, straight from the spec."""
    lam = check_lam(lam)
    bits = check_assignment(problem, bits)
    index = {b: w for w, b in enumerate(problem.bits)}
    chan_times, round_times = [], []
    variance = 0.0
    for row, arows in zip(bits, problem.arrays):
        times = []
        for bc, a in zip(row, arows):
            w_G = np.array([index[b] for b in bc], dtype=np.int64)
            nbytes = int(a.bytes_GW[np.arange(len(bc)), w_G].sum()) if len(bc) else 0
            times.append(a.gamma + a.theta * nbytes)
            f_G = np.array([variance_factor(b) for b in bc], dtype=np.float64)
            variance += float((a.beta_G * f_G).sum())
        chan_times.append(tuple(times))
        round_times.append(max(times))
    time_s = float(sum(round_times))
    w_time, w_var = problem.weights(lam)
    return Evaluation(objective=w_time * time_s + w_var * variance, time_s=time_s,
                      variance=variance, round_times_s=tuple(round_times),
                      channel_times_s=tuple(chan_times), t_max_s=problem.t_max_s,
                      v_max=problem.v_max)


def group_messages(beta_K: Sequence[float], dim: int, group_size: int
                   ) -> tuple[list[MessageGroup], list[np.ndarray]]:
    """Sort one channel's messages by beta (largest first) and cut them into groups.

    beta_K: the variance weight of each of the K messages; dim: elements per message;
    group_size: messages per group (the last group holds the remainder). Returns the
    groups (each with beta = the sum of its members' betas) and, per group, the indices
    of its messages into ``beta_K`` (int64 arrays), so widths can be mapped back with
    ``expand_group_bits``. Ties keep the messages' original order.
    """
    group_size = _check_int(group_size, "group_size", 1)
    dim = _check_int(dim, "dim", 1)
    beta = np.asarray(beta_K, dtype=np.float64).reshape(-1)
    if not np.isfinite(beta).all() or (beta < 0).any():
        raise ValueError("beta_K must hold finite values >= 0")
    order = np.argsort(-beta, kind="stable")
    members = [order[i:i + group_size] for i in range(0, len(order), group_size)]
    groups = [MessageGroup(len(m), dim, float(beta[m].sum())) for m in members]
    return groups, members


def expand_group_bits(members: Sequence[np.ndarray], bits_g: Sequence[int], num_messages: int
                      ) -> np.ndarray:
    """Widths per message (int64 [K]) from widths per group and ``group_messages``' members."""
    if len(members) != len(bits_g):
        raise ValueError(f"{len(members)} groups but {len(bits_g)} widths")
    out = np.zeros(num_messages, dtype=np.int64)
    seen = 0
    for m, b in zip(members, bits_g):
        out[m] = int(b)
        seen += len(m)
    if seen != num_messages or (out == 0).any():
        raise ValueError(f"the groups cover {seen} messages, expected each of {num_messages} once")
    return out
