"""Expert banks of the inference runtime: where a device's experts live and how it runs them.

Legend: E experts of a layer, S slots (experts of one layer a device may hold at once),
D row width, H expert hidden width, R rows.

An :class:`ExpertBank` holds every expert of every MoE layer in host memory and per
layer S device slots; :meth:`~ExpertBank.ensure` makes a set of experts resident (the
"loads" of a placement), :meth:`~ExpertBank.compute` runs resident experts on their
rows, :meth:`~ExpertBank.reference` runs any expert straight from host memory (the
single-process twin). Two banks:

* :class:`FFNBank` -- real expert FFNs (:func:`~commsched.moe.experts.expert_ffn`, the
  arithmetic of the training layer), loaded by copying weights into slot tensors;
* :class:`EmulatedBank` -- an emulated accelerator: a per-expert affine map per row (cheap,
  distinct per expert so routing errors show), a busy time per row on an asynchronous
  device clock and a sleep per load.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

import torch

from .experts import expert_ffn
from .placed import AsyncDevice, ExpertCompute

__all__ = ["ExpertBank", "FFNBank", "EmulatedBank"]


class ExpertBank(Protocol):
    """What the runtime needs of the experts (see the module docstring).

    loaded_L: per layer, how many experts were loaded so far; device: the asynchronous
    device the computations run on (None: ``compute`` is synchronous); measures_row_cost:
    ``row_cost_s`` times this process (ranks then take turns so that they do not disturb
    each other) rather than returning a set figure."""

    loaded_L: list[int]
    measures_row_cost: bool

    @property
    def num_layers(self) -> int: ...

    @property
    def device(self) -> AsyncDevice | None: ...

    def ensure(self, layer: int, held: Sequence[int]) -> int:
        """Make exactly the experts ``held`` resident in ``layer``'s slots; returns how many
        were loaded."""
        ...

    def compute(self, layer: int) -> ExpertCompute:
        """The device computation of ``layer`` (experts must be resident)."""
        ...

    def reference(self, layer: int) -> ExpertCompute:
        """Every expert of ``layer`` straight from host memory (the single-process twin)."""
        ...

    def row_cost_s(self) -> float:
        """Seconds per computed row of one expert on a dedicated device."""
        ...


def _grouped(expert_at, experts: Sequence[int], counts: Sequence[int], x_RD: torch.Tensor) -> torch.Tensor:
    """Rows grouped by expert (``counts[i]`` rows for ``experts[i]``, in order) through
    :func:`expert_ffn` with the weights ``expert_at(e)`` = (w1_DH, b1_H, w2_HD, b2_D)."""
    outs, off = [], 0
    for e, n in zip(experts, counts):
        outs.append(expert_ffn(x_RD[off:off + n], *expert_at(e)))
        off += n
    return torch.cat(outs) if outs else x_RD.new_zeros((0, x_RD.shape[1]))


class FFNBank:
    """Real expert FFNs: every expert's weights in host memory (``w1_EDH`` etc. per
    layer), and per layer S device slots into which the experts a device holds are
    copied ("loaded") before it computes them."""

    measures_row_cost = True
    device = None  # synchronous: each computation returns when it is done

    def __init__(self, weights: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                 slots: int):
        self.host = [tuple(w.detach() for w in ws) for ws in weights]  # per layer (w1, b1, w2, b2)
        self.S = slots
        self.slot_w = [tuple(torch.empty((slots, *w.shape[1:]), dtype=w.dtype) for w in ws) for ws in self.host]
        self.slot_of: list[dict[int, int]] = [{} for _ in self.host]
        self.loaded_L = [0] * len(self.host)  # per layer: one thread touches a layer at a time

    @property
    def num_layers(self) -> int:
        return len(self.host)

    def ensure(self, layer: int, held: Sequence[int]) -> int:
        """Make exactly the experts ``held`` resident in ``layer``'s slots (evicting the
        others); returns how many were loaded (copied from host memory)."""
        want = set(int(e) for e in held)
        if len(want) > self.S:
            raise ValueError(f"{len(want)} experts do not fit {self.S} slots")
        cur = self.slot_of[layer]
        for e in [e for e in cur if e not in want]:
            del cur[e]
        free = sorted(set(range(self.S)) - set(cur.values()))
        n = 0
        for e in sorted(want - set(cur)):
            s = free.pop(0)
            for dst, src in zip(self.slot_w[layer], self.host[layer]):
                dst[s].copy_(src[e])
            cur[e] = s
            n += 1
        self.loaded_L[layer] += n
        return n

    def compute(self, layer: int) -> ExpertCompute:
        slots, slot_of = self.slot_w[layer], self.slot_of[layer]

        def run(experts: Sequence[int], counts: Sequence[int], x: torch.Tensor) -> torch.Tensor:
            return _grouped(lambda e: tuple(w[slot_of[e]] for w in slots), experts, counts, x)

        return run

    def reference(self, layer: int) -> ExpertCompute:
        host = self.host[layer]

        def run(experts: Sequence[int], counts: Sequence[int], x: torch.Tensor) -> torch.Tensor:
            return _grouped(lambda e: tuple(w[e] for w in host), experts, counts, x)

        return run

    def row_cost_s(self, rows: int = 512, reps: int = 7) -> float:
        """Seconds per row of one expert FFN on this process, the fastest of ``reps``
        timings (the least disturbed by other processes), for the model latency."""
        w = tuple(t[0] for t in self.host[0])
        x = torch.randn(rows, w[0].shape[0])
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            expert_ffn(x, *w)
            ts.append(time.perf_counter() - t)
        return min(ts) / rows


class EmulatedBank:
    """An emulated accelerator: expert e of a layer maps a row to ``x * scale[e] + shift[e]``
    (cheap, but distinct per expert, so a row sent to the wrong expert shows), and the
    device is busy ``us_per_row`` microseconds per computed row; loading one expert takes
    ``load_ms`` (a sleep of the loading thread).

    The device runs like a GPU stream (:class:`~commsched.moe.placed.AsyncDevice`): a
    computation returns its rows at once and queues its busy time on the device's clock
    (it starts when the device is free, or now); ``wait(token)`` sleeps until the clock
    passes the token, as a host waits for a kernel. A run of back-to-back computations
    therefore costs exactly their rows' time, whatever the host's wake-up delays."""

    measures_row_cost = False

    def __init__(self, num_layers: int, num_experts: int, d: int, slots: int, us_per_row: float,
                 load_ms: float, seed: int):
        g = torch.Generator().manual_seed(seed + 7919)
        self.scale = [1.0 + 0.1 * torch.randn(num_experts, d, generator=g) for _ in range(num_layers)]
        self.shift = [0.1 * torch.randn(num_experts, d, generator=g) for _ in range(num_layers)]
        self.S, self.us_per_row, self.load_ms = slots, us_per_row, load_ms
        self.resident: list[set[int]] = [set() for _ in range(num_layers)]
        self.loaded_L = [0] * num_layers
        self._free_at = 0.0  # perf_counter time at which the device finishes its queued work

    @property
    def num_layers(self) -> int:
        return len(self.scale)

    @property
    def device(self) -> AsyncDevice:
        return self

    def ensure(self, layer: int, held: Sequence[int]) -> int:
        want = set(int(e) for e in held)
        if len(want) > self.S:
            raise ValueError(f"{len(want)} experts do not fit {self.S} slots")
        n = len(want - self.resident[layer])
        self.resident[layer] = self.resident[layer] & want  # evicted at once; the new ones are resident once loaded
        if n and self.load_ms > 0:
            time.sleep(n * self.load_ms / 1e3)
        self.resident[layer] = want
        self.loaded_L[layer] += n
        return n

    def _apply(self, layer: int, experts, counts, x: torch.Tensor) -> torch.Tensor:
        idx = torch.repeat_interleave(torch.tensor(list(experts), dtype=torch.int64),
                                      torch.tensor(list(counts), dtype=torch.int64))
        return x * self.scale[layer][idx] + self.shift[layer][idx]

    def compute(self, layer: int) -> ExpertCompute:
        def run(experts, counts, x):
            assert set(experts) <= self.resident[layer], "expert computed before it was loaded"
            self._free_at = max(time.perf_counter(), self._free_at) + sum(counts) * self.us_per_row / 1e6
            return self._apply(layer, experts, counts, x)

        return run

    def issued(self) -> float:
        return self._free_at

    def wait(self, token: float) -> None:
        dt = token - time.perf_counter()
        if dt > 0:
            time.sleep(dt)

    def reference(self, layer: int) -> ExpertCompute:
        return lambda experts, counts, x: self._apply(layer, experts, counts, x)

    def row_cost_s(self) -> float:
        return self.us_per_row / 1e6
