"""The emulated device: a GPU model from public specs and a per-rank device clock.

A :class:`DeviceModel` holds what a roofline needs of one GPU: its peak dense FLOP/s per
dtype, its memory (HBM) bandwidth, the fraction of that roofline each class of kernel
achieves (``efficiency``, per op class of :data:`OP_CLASSES`) and a fixed launch overhead
per kernel. One kernel of class ``op`` moving ``bytes`` and doing ``flops`` takes::

    launch_s + max(flops / (peak_flops[dtype] * eff[op]), bytes / (mem_bw * eff[op]))

A model may also give the GPU's memory (``memory_bytes``) and its host-to-device link
(``host_link_bw``, bytes/s each way, with the achieved fraction ``host_link_eff``): a copy
of ``bytes`` from host memory then takes ``launch_s + bytes / (host_link_bw x
host_link_eff)`` (:meth:`DeviceModel.h2d_time`; the inference runtime's expert loads).

Three models are built in (:data:`DEVICE_MODELS`: ``a100``, ``h100``, ``h200``), each a
small JSON file beside this module (``devices/NAME.json``) that quotes the source of every
number; a user's own file of the same form is accepted by :func:`load_device_model`. The
efficiencies of the built-in files are estimates until a GPU is calibrated with
``commsched calibrate``, which times the same op classes and writes such a file.

A :class:`DeviceClock` is one rank's emulated GPU: work is queued on it like kernels on a
stream (the call returns at once with a token, the perf_counter time the work ends) and the
host waits by sleeping until the clock passes a token, never busy-waiting, so the host's
cores stay free for the communication. Time dilation: every device time is multiplied by a
factor k (``dilation``) while the emulated links' rates are divided by k, so the ratio of
compute to communication is the real cluster's and the predicted time on it is the measured
time / k. :class:`HostCPU` measures the process CPU time of a region over its wall time, to
show that a run stays device- or link-bound rather than bound by the host's cores.

The module is pure: no torch, no process group.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

__all__ = ["DEVICE_MODELS", "DTYPES", "OP_CLASSES", "DeviceModel", "load_device_model",
           "model_path", "dtype_name", "matmul_cost", "attention_cost", "stream_cost", "adam_cost",
           "DeviceClock", "HostCPU", "host_cpu_share", "peak_rss_mib"]

DEVICE_MODELS: tuple[str, ...] = ("a100", "h100", "h200")
# the dtypes a model may give a peak for (dense, no structured sparsity)
DTYPES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")
# classes of kernels, each with its own achieved fraction of the roofline:
# gemm: dense matmuls (linear layers, expert FFNs); attention: batched matmul + softmax;
# elementwise: activations, adds, scaling; reduction: sums, norms, the aggregation of a
# graph layer; optimizer: the parameter update (Adam); quant: quantize / dequantize;
# copy: memory copies (packing, gathers)
OP_CLASSES: tuple[str, ...] = ("gemm", "attention", "elementwise", "reduction", "optimizer",
                               "quant", "copy")
DEVICES_DIR = Path(__file__).resolve().parent / "devices"
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16",
                  "half": "fp16"}
_FIELDS = ("name", "peak_flops", "mem_bw", "efficiency", "launch_s", "sources")
# optional fields of a model file (older files and calibrations may lack them)
_OPTIONAL = ("sources", "calibrated", "description", "memory_bytes", "host_link_bw", "host_link_eff")


def dtype_name(dtype: Any) -> str:
    """The model's name of ``dtype``: one of :data:`DTYPES`, or a torch dtype / its name
    (``torch.bfloat16``, ``"bfloat16"`` -> ``"bf16"``)."""
    s = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(s, s)


def _positive(what: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{what} must be a positive finite number, not {v!r}")
    return float(v)


@dataclass(frozen=True, kw_only=True)
class DeviceModel:
    """One GPU as a roofline (see the module docstring).

    peak_flops: dtype (of :data:`DTYPES`) -> dense FLOP/s; mem_bw: bytes/s of its memory;
    efficiency: op class (every one of :data:`OP_CLASSES`) -> achieved fraction (0, 1] of the
    roofline; launch_s: seconds of overhead per kernel; sources: what each number is and
    where it comes from; calibrated: whether the efficiencies were measured on the GPU
    (``commsched calibrate``) rather than estimated. Optional: memory_bytes, the GPU's
    memory (bytes; what a run may keep resident on it); host_link_bw, the host-to-device
    link's rate each way (bytes/s; PCIe), of which copies achieve ``host_link_eff``
    (:meth:`h2d_time`)."""

    name: str
    peak_flops: Mapping[str, float]
    mem_bw: float
    efficiency: Mapping[str, float]
    launch_s: float
    sources: Mapping[str, str] = field(default_factory=dict)
    calibrated: bool = False
    memory_bytes: float | None = None
    host_link_bw: float | None = None
    host_link_eff: float = 0.8

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a device model needs a name, not {self.name!r}")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise ValueError(f"peak_flops must map dtypes ({', '.join(DTYPES)}) to FLOP/s, "
                             f"not {self.peak_flops!r}")
        bad = sorted(set(self.peak_flops) - set(DTYPES))
        if bad:
            raise ValueError(f"peak_flops names unknown dtypes {bad}; known: {', '.join(DTYPES)}")
        peak = {d: _positive(f"peak_flops[{d!r}]", v) for d, v in self.peak_flops.items()}
        if not isinstance(self.efficiency, Mapping):
            raise ValueError(f"efficiency must map op classes to fractions, not {self.efficiency!r}")
        unknown = sorted(set(self.efficiency) - set(OP_CLASSES))
        missing = [c for c in OP_CLASSES if c not in self.efficiency]
        if unknown or missing:
            raise ValueError(f"efficiency must give every op class ({', '.join(OP_CLASSES)}) "
                             f"and no other; missing {missing}, unknown {unknown}")
        eff = {c: _positive(f"efficiency[{c!r}]", self.efficiency[c]) for c in OP_CLASSES}
        over = [c for c, v in eff.items() if v > 1]
        if over:
            raise ValueError(f"efficiency is a fraction of the roofline (at most 1); {over} exceed it")
        if not isinstance(self.sources, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.sources.items()):
            raise ValueError("sources must map each number's name to a string naming its source")
        if not isinstance(self.calibrated, bool):
            raise ValueError(f"calibrated must be true or false, not {self.calibrated!r}")
        set_ = object.__setattr__
        set_(self, "peak_flops", MappingProxyType(peak))
        set_(self, "efficiency", MappingProxyType(eff))
        set_(self, "sources", MappingProxyType(dict(self.sources)))
        set_(self, "mem_bw", _positive("mem_bw", self.mem_bw))
        lau = self.launch_s
        if isinstance(lau, bool) or not isinstance(lau, (int, float)) or not math.isfinite(lau) or lau < 0:
            raise ValueError(f"launch_s must be a non-negative number of seconds, not {lau!r}")
        set_(self, "launch_s", float(lau))
        for f in ("memory_bytes", "host_link_bw"):
            v = getattr(self, f)
            if v is not None:
                set_(self, f, _positive(f, v))
        eff_h = _positive("host_link_eff", self.host_link_eff)
        if eff_h > 1:
            raise ValueError(f"host_link_eff is the achieved fraction of the host link (at most 1), not {eff_h}")
        set_(self, "host_link_eff", eff_h)

    def h2d_time(self, nbytes: float) -> float:
        """Seconds of one host-to-device copy of ``nbytes`` on the real GPU (an expert's
        weights loaded from host memory): ``launch_s + nbytes / (host_link_bw x
        host_link_eff)``. A model without ``host_link_bw`` cannot say: ValueError."""
        if self.host_link_bw is None:
            raise ValueError(f"device model {self.name!r} gives no host_link_bw (the host-to-device link, "
                             "bytes/s each way): add it to the model file, or give the load time explicitly "
                             "(--load-ms)")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0:
            raise ValueError(f"bytes copied must be a non-negative number, not {nbytes!r}")
        return self.launch_s + nbytes / (self.host_link_bw * self.host_link_eff)

    def op_time(self, op: str, *, flops: float = 0.0, bytes: float = 0.0, dtype: Any = "bf16") -> float:
        """Roofline seconds of one kernel of class ``op`` on the real GPU:
        ``launch_s + max(flops / (peak_flops[dtype] * eff), bytes / (mem_bw * eff))``."""
        if op not in self.efficiency:
            raise ValueError(f"unknown op class {op!r}; choose one of {', '.join(OP_CLASSES)}")
        d = dtype_name(dtype)
        if d not in self.peak_flops:
            raise ValueError(f"device model {self.name!r} has no peak for dtype {dtype!r}; "
                             f"it gives {', '.join(self.peak_flops)}")
        if flops < 0 or bytes < 0:
            raise ValueError(f"flops and bytes are non-negative, not flops={flops}, bytes={bytes}")
        eff = self.efficiency[op]
        return self.launch_s + max(flops / (self.peak_flops[d] * eff), bytes / (self.mem_bw * eff))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form read by :meth:`from_dict` and :func:`load_device_model`."""
        return {"name": self.name, "peak_flops": dict(self.peak_flops), "mem_bw": self.mem_bw,
                "efficiency": dict(self.efficiency), "launch_s": self.launch_s,
                "calibrated": self.calibrated, "memory_bytes": self.memory_bytes,
                "host_link_bw": self.host_link_bw, "host_link_eff": self.host_link_eff,
                "sources": dict(self.sources)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "a device model") -> DeviceModel:
        """The model of a JSON object (``where`` names it in errors); one ValueError saying
        what is wrong for anything malformed."""
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: a device model is a JSON object, not {type(d).__name__}")
        missing = [k for k in _FIELDS if k not in d and k not in _OPTIONAL]
        unknown = sorted(set(d) - set(_FIELDS) - set(_OPTIONAL))
        if missing or unknown:
            raise ValueError(f"{where}: a device model needs the fields {', '.join(_FIELDS[:-1])} "
                             f"(and may give {', '.join(_OPTIONAL)}); missing {missing}, unknown {unknown}")
        try:
            return cls(name=d["name"], peak_flops=d["peak_flops"], mem_bw=d["mem_bw"],
                       efficiency=d["efficiency"], launch_s=d["launch_s"],
                       sources=d.get("sources", {}), calibrated=d.get("calibrated", False),
                       memory_bytes=d.get("memory_bytes"), host_link_bw=d.get("host_link_bw"),
                       host_link_eff=d.get("host_link_eff", 0.8))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    def save(self, path: str | Path) -> Path:
        """Write the model as JSON to ``path`` (loadable by :func:`load_device_model`)."""
        p = Path(path)
        p.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return p


def model_path(name: str) -> Path:
    """The JSON file of the built-in model ``name``."""
    if name not in DEVICE_MODELS:
        raise ValueError(f"no built-in device model {name!r}; built in: {', '.join(DEVICE_MODELS)}")
    return DEVICES_DIR / f"{name}.json"


def load_device_model(name_or_path: str | Path) -> DeviceModel:
    """A built-in model by name (:data:`DEVICE_MODELS`) or a model file (JSON, the form of
    :meth:`DeviceModel.to_dict`). ValueError naming the choices for an unknown name, or
    saying what is wrong with a malformed file."""
    s = str(name_or_path)
    if s.lower() in DEVICE_MODELS and not isinstance(name_or_path, Path):
        p = model_path(s.lower())
    else:
        p = Path(s).expanduser()
        if not p.is_file():
            raise ValueError(f"unknown device model {s!r}: give a built-in name "
                             f"({', '.join(DEVICE_MODELS)}) or the path of a model file (JSON)")
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"device model file {p}: not readable JSON ({e})") from None
    return DeviceModel.from_dict(d, where=f"device model file {p}")


# ------------------------------------------------------------------ FLOPs and bytes of kernels
# The counting conventions of the op classes (``commsched calibrate`` measures with the same
# ones, so a calibrated efficiency applies to work counted this way). Each returns
# (flops, bytes); ``b`` is bytes per element.

def matmul_cost(m: int, k: int, n: int, b: int = 2) -> tuple[float, float]:
    """``gemm``: [m, k] @ [k, n] -> [m, n]: 2mkn FLOPs; both inputs read, the output written."""
    return 2.0 * m * k * n, float(b * (m * k + k * n + m * n))


def attention_cost(batch_heads: int, t_q: int, t_k: int, d_head: int, b: int = 2,
                   causal: bool = False) -> tuple[float, float]:
    """``attention``: softmax(q kᵀ / sqrt(d)) v over ``batch_heads`` heads: 4 t_q t_k d FLOPs
    per head (half of it causal); q, k, v read and the output written once (a fused kernel's
    memory traffic: the score matrix stays on chip)."""
    flops = 4.0 * batch_heads * t_q * t_k * d_head * (0.5 if causal else 1.0)
    return flops, float(b * batch_heads * d_head * (2 * t_q + 2 * t_k))


def stream_cost(numel: int, reads: int = 1, writes: int = 1, b: int = 4,
                flops_per_element: float = 1.0) -> tuple[float, float]:
    """``elementwise`` / ``reduction`` / ``quant`` / ``copy``: a pass over ``numel`` elements
    reading ``reads`` and writing ``writes`` tensors of them (a reduction writes ~0)."""
    return flops_per_element * numel, float(b * numel * (reads + writes))


def adam_cost(numel: int, b: int = 4) -> tuple[float, float]:
    """``optimizer``: one Adam step over ``numel`` parameters: parameter, gradient and the two
    moments read, parameter and moments written; about 12 FLOPs per parameter."""
    return 12.0 * numel, float(b * numel * 7)


class DeviceClock:
    """One rank's emulated GPU: work is queued like kernels on a stream (returns at once),
    the host waits by sleeping (never busy-waiting) until the device clock passes a token.

    A token is the ``time.perf_counter()`` time at which a piece of queued work ends. Work
    starts when the device is free or now, whichever is later, so back-to-back work costs
    exactly the sum of its times whatever the host's wake-up delays. Thread-safe (a loading
    thread and the main thread may queue on the same device). Without a model (None) the
    clock only queues busy times given in seconds (:meth:`occupy`)."""

    def __init__(self, model: DeviceModel | None, dilation: float = 1.0):
        if model is not None and not isinstance(model, DeviceModel):
            raise TypeError(f"DeviceClock needs a DeviceModel (load_device_model), not {type(model).__name__}")
        self.model = model
        self.dilation = _positive("the time dilation k", dilation)
        self._lock = threading.Lock()
        self._free_at = 0.0  # perf_counter time at which the device finishes its queued work
        self.busy_s = 0.0  # total queued device time (dilated)
        self.kernels = 0  # kernels queued by run()
        self.waited_s = 0.0  # host seconds spent sleeping in wait()

    def op_time(self, op: str, *, flops: float = 0.0, bytes: float = 0.0, dtype: Any = "bf16") -> float:
        """Dilated seconds of one kernel on this device (without queueing it)."""
        if self.model is None:
            raise ValueError("this device clock has no device model: queue busy time with occupy()")
        return self.model.op_time(op, flops=flops, bytes=bytes, dtype=dtype) * self.dilation

    def run(self, op: str, *, flops: float = 0.0, bytes: float = 0.0, dtype: Any = "bf16") -> float:
        """Queue one kernel (``model.op_time(...) * dilation`` seconds, starting when the
        device is free or now); return its token (the perf_counter time it ends)."""
        t = self.op_time(op, flops=flops, bytes=bytes, dtype=dtype)
        with self._lock:
            self.kernels += 1
        return self.occupy(t)

    def occupy(self, seconds: float) -> float:
        """Queue ``seconds`` (already dilated) of busy time; return its token."""
        if seconds < 0 or not math.isfinite(seconds):
            raise ValueError(f"busy time must be a non-negative number of seconds, not {seconds!r}")
        with self._lock:
            self._free_at = max(time.perf_counter(), self._free_at) + seconds
            self.busy_s += seconds
            return self._free_at

    def issued(self) -> float:
        """The token of everything queued so far."""
        return self._free_at

    def idle(self) -> bool:
        """Whether all queued work has ended."""
        return time.perf_counter() >= self._free_at

    def wait(self, token: float | None = None) -> None:
        """Sleep until the device clock passes ``token`` (None: all queued work)."""
        end = self._free_at if token is None else token
        dt = end - time.perf_counter()
        if dt > 0:
            time.sleep(dt)
            self.waited_s += dt

    def reset_stats(self) -> None:
        """Zero ``busy_s``, ``kernels`` and ``waited_s`` (the queue is kept)."""
        with self._lock:
            self.busy_s, self.kernels, self.waited_s = 0.0, 0, 0.0


class HostCPU:
    """The process CPU time (every thread) of a region over its wall time::

        with HostCPU() as cpu:
            ...
        cpu.share   # 1.0: one core busy all along; near 0: the host slept (device-bound)

    A rank whose share stays well below the cores it may use is not bound by the host."""

    def __init__(self):
        self.cpu_s = self.wall_s = 0.0
        self._t0 = self._c0 = None

    def __enter__(self) -> HostCPU:
        self._c0, self._t0 = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.cpu_s = time.process_time() - self._c0
        self.wall_s = time.perf_counter() - self._t0

    @property
    def share(self) -> float:
        """CPU seconds per wall second of the region (0 for an empty region)."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


def peak_rss_mib() -> float:
    """This process's peak resident memory, MiB (Linux counts ``ru_maxrss`` in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def host_cpu_share(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``(fn(*args, **kwargs), its host CPU share)`` (see :class:`HostCPU`)."""
    with HostCPU() as cpu:
        out = fn(*args, **kwargs)
    return out, cpu.share
