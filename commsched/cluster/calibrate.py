"""Calibration of a device model: ``commsched calibrate`` times each op class of
:data:`~commsched.cluster.device.OP_CLASSES` on the local device and writes a model file.

    commsched calibrate [--device auto|cpu|cuda] [--base h100] [--size N] [--out FILE]

For every class one representative kernel is timed with :class:`~commsched.clock.Clock`
(CUDA events on CUDA, the host clock on the CPU), the median of ``--reps`` runs after a
warm-up:

* gemm -- an [N, N] @ [N, N] matmul (bf16 on CUDA, fp32 on the CPU);
* attention -- ``scaled_dot_product_attention`` (the language model's attention: batched
  matmuls and a softmax) over 4 x 8 heads of N/2 tokens, 64 wide;
* elementwise -- a product of two tensors of 4 N^2 floats;
* reduction -- a row sum over 4 N^2 floats;
* optimizer -- one ``torch.optim.Adam`` step over N^2 parameters;
* quant -- the codec's 8-bit stochastic quantize of 4 N^2 floats (the command line passes
  :func:`commsched.quant.codec.quantize`; without it the class keeps the base model's figure);
* copy -- a copy of 4 N^2 floats.

The work of each kernel is counted with the conventions of :mod:`commsched.cluster.device`
(:func:`~commsched.cluster.device.matmul_cost` and the others), so the efficiency derived
applies to work counted the same way: with the base model's peaks (``--base``), the
roofline time at full efficiency is ``max(flops / peak, bytes / bandwidth)`` and the
achieved efficiency is that over the measured time less the launch overhead (measured as
the time per tiny kernel of a long back-to-back run), capped at 1. The file keeps the base
model's peaks and bandwidth, so a model calibrated on an H100 against ``--base h100`` holds
the datasheet's numbers and the H100's measured efficiencies. On the CPU the command
calibrates the CPU: the file then models this CPU (tiny efficiencies against a GPU's peaks),
which is useful to check the command, not as a GPU model.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ..clock import Clock
from .device import (
    DEVICE_MODELS,
    OP_CLASSES,
    DeviceModel,
    adam_cost,
    attention_cost,
    load_device_model,
    matmul_cost,
    stream_cost,
)

__all__ = ["Sample", "Measured", "samples", "time_sample", "launch_overhead", "derive", "calibrate", "main"]

PROG = "commsched calibrate"
DEFAULT_SIZE = {"cuda": 4096, "cpu": 512}
LAUNCH_KERNELS = 200  # tiny kernels timed back to back for the launch overhead


@dataclass(frozen=True)
class Sample:
    """One timed kernel: its op class, what it is, its counted work and how to run it."""
    op: str
    what: str
    flops: float
    bytes: float
    dtype: str
    run: Callable[[], Any]


@dataclass(frozen=True)
class Measured:
    """A sample's median time, its roofline time at full efficiency, the efficiency derived."""
    sample: Sample
    seconds: float
    ideal_s: float
    efficiency: float
    capped: bool


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def samples(device: torch.device, size: int, quantize: Callable[..., Any] | None = None,
            seed: int = 0) -> list[Sample]:
    """The representative kernel of each op class at base dimension ``size`` (see the module
    docstring); ``quantize``: the codec's ``quantize(x_ND, bits, seed=...)`` (None: no quant
    sample)."""
    if size < 8:
        raise ValueError(f"--size must be >= 8, got {size}")
    g = torch.Generator(device=device).manual_seed(seed)
    mm = torch.bfloat16 if device.type == "cuda" else torch.float32
    mm_name = "bf16" if mm == torch.bfloat16 else "fp32"
    n, b = size, _dtype_bytes(mm)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    a, w = rnd(n, n, dtype=mm), rnd(n, n, dtype=mm)
    bh, heads, t, dh = 4, 8, max(n // 2, 8), 64
    q, k, v = (rnd(bh, heads, t, dh, dtype=mm) for _ in range(3))
    numel = 4 * n * n
    x, y, z = rnd(4 * n, n), rnd(4 * n, n), torch.empty(4 * n, n, device=device)
    p = torch.nn.Parameter(rnd(n, n))
    p.grad = rnd(n, n)
    opt = torch.optim.Adam([p], lr=1e-3)
    out = [
        Sample("gemm", f"[{n}, {n}] @ [{n}, {n}]", *matmul_cost(n, n, n, b), mm_name, lambda: a @ w),
        Sample("attention", f"scaled_dot_product_attention {bh}x{heads} heads, {t} tokens, {dh} wide",
               *attention_cost(bh * heads, t, t, dh, b), mm_name,
               lambda: F.scaled_dot_product_attention(q, k, v)),
        Sample("elementwise", f"product of two [{4 * n}, {n}]", *stream_cost(numel, reads=2), "fp32",
               lambda: torch.mul(x, y, out=z)),
        Sample("reduction", f"row sums of [{4 * n}, {n}]", *stream_cost(numel, writes=0), "fp32",
               lambda: x.sum(dim=1)),
        Sample("optimizer", f"Adam step over {n * n} parameters", *adam_cost(n * n), "fp32", opt.step),
        Sample("copy", f"copy of [{4 * n}, {n}]", *stream_cost(numel, flops_per_element=0), "fp32",
               lambda: z.copy_(x)),
    ]
    if quantize is not None:
        # reads the floats, writes one byte per value and 8 bytes of range per row
        _, nbytes = stream_cost(numel, writes=0)
        out.insert(5, Sample("quant", f"8-bit stochastic quantize of [{4 * n}, {n}]", 5.0 * numel,
                             nbytes + numel + 8 * 4 * n, "fp32", lambda: quantize(x, 8, seed=seed)))
    return out


def time_sample(s: Sample, clock: Clock, reps: int = 5, warmup: int = 2) -> float:
    """Median seconds of ``s.run()`` over ``reps`` runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        s.run()
    clock.sync()
    ts = []
    for _ in range(reps):
        a = clock.mark()
        s.run()
        ts.append(clock.seconds(a, clock.mark()))
    return statistics.median(ts)


def launch_overhead(device: torch.device, clock: Clock, kernels: int = LAUNCH_KERNELS) -> float:
    """Seconds per tiny kernel (a one-element add) of a back-to-back run of ``kernels``:
    what a kernel costs beyond its work (on CUDA, the launch rate; on the CPU, the
    framework's dispatch)."""
    t = torch.zeros(1, device=device)
    for _ in range(10):
        t.add_(1.0)
    clock.sync()
    ts = []
    for _ in range(3):
        a = clock.mark()
        for _ in range(kernels):
            t.add_(1.0)
        ts.append(clock.seconds(a, clock.mark()) / kernels)
    return min(ts)


def derive(base: DeviceModel, measured: dict[str, tuple[Sample, float]], launch_s: float,
           where: str) -> tuple[DeviceModel, list[Measured]]:
    """The calibrated model: ``base``'s peaks and bandwidth, the measured ``launch_s``, and
    per measured class the efficiency ``ideal / (seconds - launch_s)`` (over the whole
    time when that is under twice the launch overhead; capped at 1); the
    classes not measured keep ``base``'s figure. ``where`` names the device in the sources."""
    eff = dict(base.efficiency)
    sources = {k: v for k, v in base.sources.items() if k != "efficiency"}
    rows = []
    for op, (s, sec) in measured.items():
        peak = base.peak_flops.get(s.dtype)
        if peak is None:
            raise ValueError(f"--base {base.name} has no peak for {s.dtype}, which the {op} sample runs in")
        ideal = max(s.flops / peak, s.bytes / base.mem_bw)
        work = sec - launch_s if sec > 2 * launch_s else sec
        e = ideal / work
        capped = e > 1.0
        e = min(max(e, 1e-12), 1.0)
        eff[op] = e
        rows.append(Measured(s, sec, ideal, e, capped))
        sources[f"efficiency.{op}"] = (
            f"measured by commsched calibrate on {where}: {s.what} ({s.dtype}) took {sec * 1e3:.4g} ms "
            f"(median); {base.name}'s roofline at full efficiency {ideal * 1e3:.4g} ms"
            + (" (faster than the roofline: capped at 1; calibrate against the matching --base)" if capped else ""))
    for op in OP_CLASSES:
        if op not in measured:
            sources[f"efficiency.{op}"] = f"not measured: {base.name}'s estimate ({base.efficiency[op]})"
    sources["launch_s"] = (f"measured by commsched calibrate on {where}: seconds per one-element kernel "
                           f"of {LAUNCH_KERNELS} back to back")
    sources["calibration"] = f"peaks and bandwidth of {base.name}; efficiencies and launch overhead of {where}"
    model = DeviceModel(name=f"{base.name}-calibrated", peak_flops=base.peak_flops, mem_bw=base.mem_bw,
                        efficiency=eff, launch_s=launch_s, sources=sources, calibrated=True,
                        memory_bytes=base.memory_bytes, host_link_bw=base.host_link_bw,
                        host_link_eff=base.host_link_eff)
    return model, rows


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"the GPU {torch.cuda.get_device_name(device)}"
    return f"the CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def resolve_device(choice: str) -> torch.device:
    """``auto`` (CUDA when available, else the CPU), ``cpu`` or ``cuda``."""
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {choice!r}")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here; use --device cpu or auto")
    return torch.device(choice)


def calibrate(device: torch.device | str = "auto", base: str = "h100", size: int | None = None,
              reps: int = 5, quantize: Callable[..., Any] | None = None
              ) -> tuple[DeviceModel, list[Measured], str]:
    """Time every op class on ``device`` and derive a model against ``base``'s peaks: (the
    model, each class's measurement, the device's name)."""
    dev = resolve_device(device) if isinstance(device, str) else torch.device(device)
    if reps < 1:
        raise ValueError(f"--reps must be >= 1, got {reps}")
    base_model = load_device_model(base)
    clock = Clock(dev)
    with torch.no_grad():
        ss = samples(dev, DEFAULT_SIZE[dev.type] if size is None else size, quantize)
        launch_s = launch_overhead(dev, clock)
        measured = {s.op: (s, time_sample(s, clock, reps)) for s in ss}
    where = _device_name(dev)
    model, rows = derive(base_model, measured, launch_s, where)
    return model, rows, where


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Time each op class (gemm, attention, elementwise, reduction, optimizer, "
                               "quant, copy) on this machine's device and write a device model file "
                               "(loadable wherever a device model is named) with the achieved efficiencies "
                               "against a base model's peaks. On the CPU it calibrates the CPU.")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="device to time: auto (CUDA when available, else the CPU), cpu or cuda")
    p.add_argument("--base", default="h100",
                   help=f"model whose peaks and bandwidth the efficiencies are measured against: "
                        f"{', '.join(DEVICE_MODELS)} or a model file")
    p.add_argument("--out", type=Path, default=Path("device_model.json"), help="model file to write")
    p.add_argument("--size", type=int, default=None,
                   help=f"base dimension N of the kernels (default {DEFAULT_SIZE['cuda']} on CUDA, "
                        f"{DEFAULT_SIZE['cpu']} on the CPU)")
    p.add_argument("--reps", type=int, default=5, help="timed runs per kernel (the median is kept)")
    return p


def main(argv: Sequence[str] | None = None, quantize: Callable[..., Any] | None = None) -> int:
    """``commsched calibrate``; ``quantize``: the codec's quantize, timed as the quant class."""
    a = build_parser().parse_args(argv)
    try:
        dev = resolve_device(a.device)
        if dev.type == "cpu":
            print(f"{PROG}: timing the CPU (no GPU is used): the file models this CPU against "
                  f"{a.base}'s peaks, not a GPU", flush=True)
        model, rows, where = calibrate(dev, a.base, a.size, a.reps, quantize)
        model.save(a.out)
    except (ValueError, OSError) as e:
        from ..dist import cli_error

        return cli_error(PROG, e)
    print(f"{where}, against {a.base}'s peaks; launch overhead {model.launch_s * 1e6:.3g} us")
    print(f"{'op class':<12} {'dtype':<5} {'measured ms':>12} {'roofline ms':>12} {'efficiency':>11}  kernel")
    for r in rows:
        print(f"{r.sample.op:<12} {r.sample.dtype:<5} {r.seconds * 1e3:>12.4g} {r.ideal_s * 1e3:>12.4g} "
              f"{r.efficiency:>11.4g}{'*' if r.capped else ' '} {r.sample.what}")
    if any(r.capped for r in rows):
        print("* faster than the base model's roofline: capped at 1 (calibrate against the matching --base)")
    missing = [op for op in OP_CLASSES if op not in {r.sample.op for r in rows}]
    if missing:
        print(f"not measured (the base model's estimates kept): {', '.join(missing)}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
