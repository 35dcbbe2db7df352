"""Expert banks of the inference runtime: where a device's experts live and how it runs them.

Legend: E experts of a layer, S slots (experts of one layer a device keeps resident at
once: the run's resident budget, at least a placement's slots), D row width, H expert
hidden width, R rows.

An :class:`ExpertBank` holds every expert of every MoE layer in host memory and per
layer S device slots; :meth:`~ExpertBank.ensure` makes a set of experts resident (the
"loads" of a placement; the least recently held are evicted when more than S would be
resident, :func:`~commsched.moe.infer.policy.keep_resident`, as the strategies count
them), :meth:`~ExpertBank.compute` runs resident experts on their
rows, :meth:`~ExpertBank.reference` runs any expert straight from host memory (the
single-process twin). Two banks:

* :class:`FFNBank` -- real expert FFNs (:func:`~commsched.moe.model.experts.expert_ffn`, the
  arithmetic of the training layer), loaded by copying weights into slot tensors on the
  job's device (on CUDA: pinned host weights, asynchronous copies on a copy stream);
* :class:`EmulatedBank` -- an emulated accelerator: a per-expert affine map per row (cheap,
  distinct per expert so routing errors show), a busy time on an asynchronous device clock
  (:class:`~commsched.cluster.device.DeviceClock`: a set time per row, or the expert FFN's
  kernels on a GPU model) and a sleep per load. It is the CPU model of what :class:`FFNBank`
  does on a GPU, and refuses any other device.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

import torch

from ...clock import Clock
from ...cluster.device import DeviceClock, DeviceModel, dtype_name, matmul_cost
from ..model.experts import expert_ffn
from .placed import AsyncDevice, ExpertCompute
from .policy import keep_resident

__all__ = ["ExpertBank", "FFNBank", "EmulatedBank", "ffn_kernels", "expert_bytes"]


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
        """Make the experts ``held`` resident in ``layer``'s slots (evicting the least
        recently held beyond the slots); returns how many were loaded."""
        ...

    def preload(self, layer: int) -> None:
        """Make every expert of ``layer`` resident at start-up (the slots hold them all),
        outside the timed batches and not counted in ``loaded_L``."""
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

    def load_cost_s(self) -> float:
        """Seconds to load one expert (0: not known; plans are then not weighed against
        their loads)."""
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
    layer), and per layer S slots on ``device`` into which the experts a device holds are
    copied ("loaded") before it computes them.

    On the CPU (the default) a load is a synchronous ``copy_`` into the slot and the host
    weights are the given tensors. On CUDA the slots live on the GPU, the host weights
    are pinned copies, and a load is ``slot.copy_(host, non_blocking=True)`` on the bank's
    own copy stream (the GPU's copy engine, which runs beside the compute kernels): the
    loading thread only enqueues it, an event recorded after the copies marks the slots
    ready, and the compute stream waits for that event (on the GPU, not the host) before
    the first kernel that reads them. A slot is overwritten only after the compute stream
    has finished its last use of the layer's slots (an event recorded after every
    computation), so an eviction never races a kernel still reading the expert."""

    measures_row_cost = True
    device = None  # no AsyncDevice: results are ready in stream order (CUDA) or at return (CPU)

    def __init__(self, weights: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                 slots: int, device: torch.device | str = "cpu"):
        self.on = torch.device(device)  # where the slots live and the experts compute
        self.cuda = self.on.type == "cuda"
        if self.on.type not in ("cpu", "cuda"):
            raise ValueError(f"FFNBank runs on the CPU or a CUDA device, not {self.on}")
        if self.cuda:  # pinned host copies: the loads are then true asynchronous DMA copies
            self.host = [tuple(w.detach().to("cpu").pin_memory() for w in ws) for ws in weights]
        else:
            self.host = [tuple(w.detach() for w in ws) for ws in weights]  # per layer (w1, b1, w2, b2)
        self.S = slots
        self.slot_w = [tuple(torch.empty((slots, *w.shape[1:]), dtype=w.dtype, device=self.on) for w in ws)
                       for ws in self.host]
        self.slot_of: list[dict[int, int]] = [{} for _ in self.host]
        self.order: list[tuple[int, ...]] = [() for _ in self.host]  # resident, most recently held first
        self.loaded_L = [0] * len(self.host)  # per layer: one thread touches a layer at a time
        # CUDA only: the copy stream, per layer and slot the event after its load, per
        # layer the event after the compute stream's last use of its slots
        self.copy_stream = torch.cuda.Stream(self.on) if self.cuda else None
        self._ready: list[dict[int, object]] = [{} for _ in self.host]
        self._used: list[object | None] = [None] * len(self.host)

    @property
    def num_layers(self) -> int:
        return len(self.host)

    def ensure(self, layer: int, held: Sequence[int]) -> int:
        """Make the experts ``held`` resident in ``layer``'s slots, evicting the least
        recently held beyond the S slots (:func:`~commsched.moe.infer.policy.keep_resident`);
        returns how many were loaded (copied from host memory). On CUDA the copies are
        enqueued on the copy stream and this returns at once."""
        order, loaded = keep_resident(self.order[layer], held, self.S)
        self.order[layer] = order
        cur = self.slot_of[layer]
        for e in [e for e in cur if e not in order]:
            del cur[e]
        free = sorted(set(range(self.S)) - set(cur.values()))
        new = [(e, free.pop(0)) for e in loaded]
        if new:
            self._load(layer, new)
        self.loaded_L[layer] += len(new)
        return len(new)

    def preload(self, layer: int) -> None:
        E = self.host[layer][0].shape[0]
        if E > self.S:
            raise ValueError(f"{E} experts do not fit {self.S} slots: nothing to preload")
        n = self.ensure(layer, range(E))
        self.loaded_L[layer] -= n

    def _load(self, layer: int, new: list[tuple[int, int]]) -> None:
        """Copy expert e's host weights into slot s for every (e, s) of ``new``."""
        dst_w, src_w = self.slot_w[layer], self.host[layer]
        cur = self.slot_of[layer]
        if not self.cuda:
            for e, s in new:
                for dst, src in zip(dst_w, src_w):
                    dst[s].copy_(src[e])
                cur[e] = s
            return
        stream = self.copy_stream
        with torch.cuda.device(self.on), torch.cuda.stream(stream):
            used = self._used[layer]
            if used is not None:  # the slots' previous readers are done before they are overwritten
                stream.wait_event(used)
            for e, s in new:
                for dst, src in zip(dst_w, src_w):
                    dst[s].copy_(src[e], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        for e, s in new:  # the event first: whoever sees e resident also finds its event
            self._ready[layer][s] = ready
            cur[e] = s

    def _before_use(self, layer: int, slots: Sequence[int]) -> None:
        """CUDA: the current (compute) stream waits for the loads of ``slots``."""
        stream = torch.cuda.current_stream(self.on)
        seen: set[int] = set()
        for s in slots:
            ev = self._ready[layer].get(s)
            if ev is not None and id(ev) not in seen:
                seen.add(id(ev))
                stream.wait_event(ev)

    def _after_use(self, layer: int) -> None:
        """CUDA: an event after this layer's last computation so far (loads wait for it)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.on))
        self._used[layer] = ev

    def compute(self, layer: int) -> ExpertCompute:
        slots, slot_of = self.slot_w[layer], self.slot_of[layer]

        def run(experts: Sequence[int], counts: Sequence[int], x: torch.Tensor) -> torch.Tensor:
            if not self.cuda:
                return _grouped(lambda e: tuple(w[slot_of[e]] for w in slots), experts, counts, x)
            at = {e: slot_of[e] for e in experts}
            self._before_use(layer, list(at.values()))
            y = _grouped(lambda e: tuple(w[at[e]] for w in slots), experts, counts, x)
            self._after_use(layer)
            return y

        return run

    def reference(self, layer: int) -> ExpertCompute:
        host = self.host[layer]

        def run(experts: Sequence[int], counts: Sequence[int], x: torch.Tensor) -> torch.Tensor:
            if x.device.type != "cpu":  # the twin on another device: each expert's weights moved there
                return _grouped(lambda e: tuple(w[e].to(x.device) for w in host), experts, counts, x)
            return _grouped(lambda e: tuple(w[e] for w in host), experts, counts, x)

        return run

    def row_cost_s(self, rows: int = 512, reps: int = 7) -> float:
        """Seconds per row of one expert FFN on this process's device, the fastest of
        ``reps`` timings (the least disturbed by other processes), for the model latency
        (timed with :class:`~commsched.clock.Clock`: CUDA events on CUDA, after one
        untimed warm-up run; the host clock on the CPU)."""
        w = tuple(t[0] for t in self.host[0])
        clock = Clock(self.on)
        if self.cuda:
            w = tuple(t.to(self.on) for t in w)
        x = torch.randn(rows, w[0].shape[0], device=self.on)
        if self.cuda:
            expert_ffn(x, *w)
        ts = []
        for _ in range(reps):
            a = clock.mark()
            expert_ffn(x, *w)
            ts.append(clock.seconds(a, clock.mark()))
        return min(ts) / rows

    def load_cost_s(self) -> float:
        """0: the real bank does not time its loads (its plans are not weighed against them)."""
        return 0.0


def expert_bytes(d: int, hidden: int, dtype_bytes: int = 2) -> int:
    """Bytes of one expert FFN's weights (w1 [d, hidden], b1 [hidden], w2 [hidden, d],
    b2 [d]) in elements of ``dtype_bytes``: what loading it from host memory copies."""
    if min(d, hidden, dtype_bytes) < 1:
        raise ValueError(f"an expert needs d, hidden and dtype_bytes >= 1, got {d}, {hidden}, {dtype_bytes}")
    return dtype_bytes * (2 * d * hidden + hidden + d)


def ffn_kernels(rows: int, d: int, h: int, dtype_bytes: int = 2) -> list[tuple[float, float]]:
    """(FLOPs, bytes) of each GEMM of one expert FFN over ``rows`` rows of width ``d``,
    hidden width ``h``: x_RD @ w1_DH, then h_RH @ w2_HD; each reads its weights and input
    and writes its output (elements of ``dtype_bytes`` bytes; :func:`~commsched.cluster.device.matmul_cost`)."""
    return [matmul_cost(rows, d, h, dtype_bytes), matmul_cost(rows, h, d, dtype_bytes)]


class EmulatedBank:
    """An emulated accelerator: expert e of a layer maps a row to ``x * scale[e] + shift[e]``
    (cheap, but distinct per expert, so a row sent to the wrong expert shows), and the
    device is busy ``us_per_row`` microseconds per computed row; loading one expert takes
    ``load_ms`` (a sleep of the loading thread, which a GPU's copy engine runs beside the
    compute).

    The device runs like a GPU stream (:class:`~commsched.moe.infer.placed.AsyncDevice`): a
    computation returns its rows at once and queues its busy time on the device's clock
    (it starts when the device is free, or now); ``wait(token)`` sleeps until the clock
    passes the token, as a host waits for a kernel. A run of back-to-back computations
    therefore costs exactly their rows' time, whatever the host's wake-up delays.

    With a GPU model (``device_model``, a :class:`~commsched.cluster.device.DeviceModel`),
    ``us_per_row`` is not used: each expert's rows cost the two GEMM kernels of its FFN
    (:func:`ffn_kernels` of ``d`` and ``hidden``, in ``dtype``) on that model's roofline
    (``gemm`` class: launch, weights read, the rows' FLOPs and bytes), times the time
    dilation k (``dilation``); a load then takes ``load_ms`` times k as well, or (``load_ms``
    None) the expert's bytes (:func:`expert_bytes`) over the model's host-to-device link
    (:meth:`~commsched.cluster.device.DeviceModel.h2d_time`) times k."""

    measures_row_cost = False

    def __init__(self, num_layers: int, num_experts: int, d: int, slots: int, us_per_row: float,
                 load_ms: float | None, seed: int, device: torch.device | str = "cpu", *,
                 device_model: DeviceModel | None = None, dilation: float = 1.0,
                 hidden: int | None = None, dtype: str = "bf16"):
        if torch.device(device).type != "cpu":
            raise ValueError(f"the emulated device (--compute emulated) is the CPU model of an accelerator and "
                             f"runs on the CPU only, not on {torch.device(device)}: use --compute real to run "
                             "the experts on the GPU, or --device cpu")
        g = torch.Generator().manual_seed(seed + 7919)
        self.scale = [1.0 + 0.1 * torch.randn(num_experts, d, generator=g) for _ in range(num_layers)]
        self.shift = [0.1 * torch.randn(num_experts, d, generator=g) for _ in range(num_layers)]
        if device_model is None and dilation != 1.0:
            raise ValueError("the time dilation (--dilation) scales a GPU model's times: give --device-model")
        if device_model is not None and (hidden is None or hidden < 1):
            raise ValueError("the emulated device with a GPU model needs the expert FFN's hidden width "
                             "(--expert-hidden)")
        self.S, self.us_per_row = slots, us_per_row
        self.d, self.hidden, self.dtype = d, hidden, dtype_name(dtype)
        if load_ms is None:  # the expert's bytes over the GPU model's host link
            if device_model is None:
                raise ValueError("give the load time (--load-ms) or a GPU model (--device-model) to derive it from")
            load_ms = 1e3 * device_model.h2d_time(expert_bytes(d, hidden, 4 if self.dtype in ("fp32", "tf32") else 2))
        if load_ms < 0:
            raise ValueError(f"--load-ms must be >= 0, got {load_ms}")
        self.load_ms = float(load_ms)  # one expert's load on the real device (before k)
        self.resident: list[set[int]] = [set() for _ in range(num_layers)]
        self.order: list[tuple[int, ...]] = [() for _ in range(num_layers)]  # most recently held first
        self.loaded_L = [0] * num_layers
        self.clock = DeviceClock(device_model, dilation)  # the device's queue of busy time
        if device_model is not None:  # refuse a dtype the model lacks now, not at the first batch
            device_model.op_time("gemm", dtype=self.dtype)

    @property
    def num_layers(self) -> int:
        return len(self.scale)

    @property
    def device(self) -> AsyncDevice:
        return self

    def ensure(self, layer: int, held: Sequence[int]) -> int:
        order, loaded = keep_resident(self.order[layer], held, self.S)
        n = len(loaded)
        self.order[layer] = order
        self.resident[layer] = set(order) - set(loaded)  # evicted at once; the new ones are resident once loaded
        if n:
            time.sleep(n * self.load_cost_s())
        self.resident[layer] = set(order)
        self.loaded_L[layer] += n
        return n

    def preload(self, layer: int) -> None:
        """Every expert resident at once: a start-up copy (1.8 GB of GPT-2-sized experts over
        a 25 GB/s link: 72 ms) that is not part of serving, so it is not slept."""
        E = self.scale[layer].shape[0]
        if E > self.S:
            raise ValueError(f"{E} experts do not fit {self.S} slots: nothing to preload")
        self.order[layer] = tuple(range(E))
        self.resident[layer] = set(range(E))

    def load_cost_s(self) -> float:
        """Seconds of one expert load on this device: ``load_ms`` times k."""
        return self.load_ms / 1e3 * self.clock.dilation

    def _apply(self, layer: int, experts, counts, x: torch.Tensor) -> torch.Tensor:
        idx = torch.repeat_interleave(torch.tensor(list(experts), dtype=torch.int64),
                                      torch.tensor(list(counts), dtype=torch.int64))
        return x * self.scale[layer][idx] + self.shift[layer][idx]

    def compute(self, layer: int) -> ExpertCompute:
        def run(experts, counts, x):
            assert set(experts) <= self.resident[layer], "expert computed before it was loaded"
            if self.clock.model is None:
                self.clock.occupy(sum(counts) * self.us_per_row / 1e6)
            else:
                for n in counts:
                    if n:
                        for flops, nbytes in ffn_kernels(int(n), self.d, self.hidden, self._dtype_bytes):
                            self.clock.run("gemm", flops=flops, bytes=nbytes, dtype=self.dtype)
            return self._apply(layer, experts, counts, x)

        return run

    @property
    def _dtype_bytes(self) -> int:
        return 4 if self.dtype in ("fp32", "tf32") else 2

    def issued(self) -> float:
        return self.clock.issued()

    def wait(self, token: float) -> None:
        self.clock.wait(token)

    def reference(self, layer: int) -> ExpertCompute:
        return lambda experts, counts, x: self._apply(layer, experts, counts, x)

    def row_cost_s(self) -> float:
        """``us_per_row``; with a GPU model, the marginal device time of one more row of an
        expert (its FLOPs and bytes on the roofline, without the launches and the weights'
        reads that a group of rows shares), times k."""
        m = self.clock.model
        if m is None:
            return self.us_per_row / 1e6
        eff, peak = m.efficiency["gemm"], m.peak_flops[self.dtype]
        flops = sum(f for f, _ in ffn_kernels(1, self.d, self.hidden))
        nbytes = sum(b for _, b in ffn_kernels(1, self.d, self.hidden, self._dtype_bytes)) \
            - 2 * self._dtype_bytes * self.d * self.hidden  # the weights are read once per group
        return max(flops / (peak * eff), nbytes / (m.mem_bw * eff)) * self.clock.dilation
