"""Codec throughput beside ``torch.clone`` (``commsched bench quant``, an inline workload).

Single thread, a float32 matrix [rows, dim] (default [100000, 256]). For each width the
public ``quantize`` (random bits, metadata and checks included) and ``dequantize`` are
timed in rounds interleaved with ``torch.clone`` of the same tensor, and reported as GB/s
of the float32 tensor (rows * dim * 4 bytes per second) and as ratios to the clone rate
of the same round (the median over rounds). The variant ``mixed`` packs and unpacks a
multi-width message (thirds at 2, 4 and 8 bits) with ``pack_groups``/``unpack_groups``.
Decoding is also timed into an existing destination tensor (``dequantize_into``), which
leaves out the page faults of a fresh 100 MB output that ``clone`` and ``dequantize`` pay.
Wall-clock ratios are the headline; ratios of thread CPU time are reported beside them,
since on a shared machine the wall clock also counts time spent waiting for a core.

    commsched bench quant                      # defaults: 100000 x 256, 15 rounds
    commsched bench quant --rows 20000 --rounds 5 --widths 4
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

import torch

from ...clock import Clock
from ...dist import DEVICE_CHOICES, resolve_device
from ...quant.codec import (
    GroupLayout,
    dequantize,
    message_bytes,
    pack_groups,
    quantize,
    unpack_groups,
)
from ...results import median
from ..runner import Workload

GOALS = {"quantize_vs_clone": 1.5, "dequantize_vs_clone": 1.0}
# The bench fails (exit 1, after writing its summary) when a width falls below this share of
# its goal: a regression, not noise. Checked on messages of at least FLOOR_MIN_ELEMENTS
# values (smaller ones measure the per-call overhead, not the codec).
REGRESSION_FLOOR = 0.5
FLOOR_MIN_ELEMENTS = 1 << 20


def _timed(fn: Callable[[], object], clock: Clock | None = None) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this thread, result); on CUDA the wall time runs to a
    device synchronisation (kernels return at launch)."""
    clock = clock or Clock("cpu")
    clock.sync()
    w, c = time.perf_counter(), time.thread_time()
    out = fn()
    clock.sync()
    return time.perf_counter() - w, time.thread_time() - c, out


def measure(rows: int, dim: int, widths: tuple[int, ...], rounds: int, *, impl: str = "auto",
            mixed: bool = True, say: Callable[[str], None] = print,
            device: torch.device | str = "cpu") -> dict[str, dict]:
    """{variant: metrics}; variants ``b2``, ``b4``, ``b8`` (as asked) and ``mixed``. The
    message lives on ``device`` (the codec's ``auto`` then picks Triton on CUDA)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(rows, dim, generator=g).to(device)
        clock = Clock(device)
        gb = x.numel() * 4 / 1e9
        third = rows // 3
        layout = GroupLayout(dim, (third, third, rows - 2 * third), (2, 4, 8))
        dest = torch.empty_like(x)  # an existing destination (already paged in)
        ops: dict[str, tuple[Callable, Callable, Callable]] = {
            f"b{b}": ((lambda b=b: quantize(x, b, generator=g, impl=impl)),
                      (lambda q: dequantize(q, impl=impl)),
                      (lambda q: dequantize(q, out=dest, impl=impl)))
            for b in widths}
        if mixed:
            ops["mixed"] = ((lambda: pack_groups(x, layout, generator=g, impl=impl)),
                            (lambda buf: unpack_groups(buf, layout, impl=impl)),
                            (lambda buf: unpack_groups(buf, layout, out=dest, impl=impl)))
        t0 = time.perf_counter()
        for enc, dec, dec_into in ops.values():  # warm-up: compiles the fast path once
            dec_into(enc())
            dec(enc())
        say(f"[bench quant] warm-up (compilation) {time.perf_counter() - t0:.1f} s")
        samples: dict[str, dict[str, list[float]]] = {
            v: {k: [] for k in ("clone_w", "clone_c", "q_w", "q_c", "d_w", "d_c", "i_w", "i_c")}
            for v in ops}
        for r in range(rounds):
            for name, (enc, dec, dec_into) in ops.items():
                s = samples[name]
                cw, cc, _ = _timed(lambda: x.clone(), clock)
                qw, qc, q = _timed(enc, clock)
                dw, dc, _ = _timed(lambda dec=dec, q=q: dec(q), clock)
                iw, ic, _ = _timed(lambda dec_into=dec_into, q=q: dec_into(q), clock)
                for k, v in zip(s, (cw, cc, qw, qc, dw, dc, iw, ic)):
                    s[k].append(v)
            say(f"[bench quant] round {r + 1}/{rounds}")
        med = median
        out = {}
        for name, s in samples.items():
            def ratio(a: str, b: str, s=s) -> float:
                return med([p / q for p, q in zip(s[a], s[b])])

            out[name] = {
                "rows": rows, "dim": dim, "rounds": rounds, "threads": 1, "impl": impl,
                "bits": [int(name[1:])] if name != "mixed" else list(layout.bits),
                "wire_bytes": (layout.nbytes if name == "mixed"
                               else message_bytes(rows, dim, int(name[1:]))),
                "clone_GBps": gb / med(s["clone_w"]),
                "quantize_GBps": gb / med(s["q_w"]),
                "dequantize_GBps": gb / med(s["d_w"]),
                "quantize_vs_clone": ratio("clone_w", "q_w"),
                "dequantize_vs_clone": ratio("clone_w", "d_w"),
                "quantize_vs_clone_cpu": ratio("clone_c", "q_c"),
                "dequantize_vs_clone_cpu": ratio("clone_c", "d_c"),
                # decoding into an existing tensor: no page faults for a fresh output
                "dequantize_into_GBps": gb / med(s["i_w"]),
                "dequantize_into_vs_clone": ratio("clone_w", "i_w"),
            }
        return out
    finally:
        torch.set_num_threads(threads)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=100000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--widths", default="2,4,8", help="comma-separated bit widths")
    p.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds per repeat")
    p.add_argument("--impl", default="auto", help="codec implementation (auto, eager, compiled, reference)")
    p.add_argument("--no-mixed", action="store_true", help="skip the multi-width pack/unpack variant")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="cpu",
                   help="where the message lives (auto: CUDA when present)")


def _inline(args: argparse.Namespace, out_dir: Path, say: Callable[[str], None]) -> dict[str, dict]:
    widths = tuple(int(w) for w in args.widths.split(","))
    if args.rows < 1 or args.dim < 1 or args.rounds < 1:
        raise ValueError("--rows, --dim and --rounds must be >= 1")
    device, _ = resolve_device(args.device)
    return measure(args.rows, args.dim, widths, args.rounds, impl=args.impl,
                   mixed=not args.no_mixed, say=say, device=device)


def _summarize(runs: dict[str, list[dict]], args, out: Path) -> dict:
    med = median
    lines = ["| variant | clone GB/s | quantize GB/s | dequantize GB/s | quantize / clone | "
             "dequantize / clone | (CPU time) quantize / clone | (CPU time) dequantize / clone | "
             "dequantize into existing / clone |",
             "|---|---|---|---|---|---|---|---|---|"]
    verdicts, regressions = [], []
    checked = all(r["rows"] * r["dim"] >= FLOOR_MIN_ELEMENTS for rs in runs.values() for r in rs)
    for v, rs in runs.items():
        m = {k: med([r[k] for r in rs]) for k in rs[0] if isinstance(rs[0][k], float)}
        lines.append(f"| {v} | {m['clone_GBps']:.2f} | {m['quantize_GBps']:.2f} | "
                     f"{m['dequantize_GBps']:.2f} | {m['quantize_vs_clone']:.2f}x | "
                     f"{m['dequantize_vs_clone']:.2f}x | {m['quantize_vs_clone_cpu']:.2f}x | "
                     f"{m['dequantize_vs_clone_cpu']:.2f}x | {m['dequantize_into_vs_clone']:.2f}x |")
        if v != "mixed":
            for k, goal in GOALS.items():
                verdicts.append(f"- {v} {k.replace('_vs_clone', '')}: {m[k]:.2f}x of clone "
                                f"(goal >= {goal}x): {'met' if m[k] >= goal else 'NOT met'}")
                if checked and m[k] < REGRESSION_FLOOR * goal:
                    regressions.append(f"{v} {k.replace('_vs_clone', '')} at {m[k]:.2f}x of clone, "
                                       f"below {REGRESSION_FLOOR} x its goal ({goal}x)")
    verdicts.append(f"- regression floor ({REGRESSION_FLOOR} x each goal): " + (
        ("FAILED: " + "; ".join(regressions)) if regressions else "held" if checked else
        f"not checked (messages under {FLOOR_MIN_ELEMENTS} values measure call overhead)"))
    return {"extra_tables": {"Throughput (medians over repeats of per-round medians)": "\n".join(lines),
                             "Goals": "\n".join(verdicts)},
            "regressions": regressions}


WORKLOAD = Workload(
    name="quant",
    description="quantize/dequantize throughput per width beside torch.clone (single thread)",
    key_metrics=("quantize_vs_clone", "dequantize_vs_clone", "quantize_GBps", "dequantize_GBps",
                 "clone_GBps"),
    higher_is_better=("quantize_vs_clone", "dequantize_vs_clone", "quantize_GBps",
                      "dequantize_GBps", "clone_GBps"),
    add_arguments=_add_arguments,
    inline=_inline,
    summarize=_summarize,
)
