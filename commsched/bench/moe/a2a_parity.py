"""Loss parity of the quantized expert all-to-all (and of the compressed gradient
reduction): the same MoE training run at every width and seed, the loss curves compared
with full precision's.

    python -m commsched.bench.moe.a2a_parity --out DIR --steps 300 --seeds 0,1,2 --bits 32,8 \\
        --corpus /work/shared/data/text/tinyshakespeare.txt

A width is ``A`` (``--a2a-bits A``), ``gB`` (``--grad-bits B``: the gradient reduction
compressed) or ``AgB`` (both); ``32`` is the reference. Every (seed, width) is one ``torchrun`` run of :mod:`commsched.moe.train` (no link
emulation: this measures the maths, not the time), seeds interleaved with widths so that
machine load falls on both alike. Same seed, same weights and same batches at every
width: the only difference is the exchange's rounding. For each seed and width against
32 bits it reports the largest per-step relative gap of the training loss, the gap of a
moving average (``--window`` steps, default 10: per-step losses of two diverged
trajectories differ by batch noise the average removes), the gap of the mean of the last
``--window`` steps, and the held-out loss; ``summary.json``, ``summary.md`` and
``loss.png`` (each width's curve per seed, and the relative gap of the moving averages)
go to ``--out``. The goal: every gap within 1%.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from pathlib import Path

from ...results import write_json
from ..plots import pyplot, save_figure
from ..runner import RunContext, Variant, run_variant

MODEL_FLAGS = {  # the flags passed through to commsched.moe.train, with this bench's defaults
    "--d-model": "128", "--heads": "4", "--layers": "2", "--seq-len": "64", "--d-ff": "256",
    "--expert-hidden": "256", "--experts": "4", "--k": "2", "--moe-every": "2", "--batch-size": "8",
    "--lr": "0.001", "--schedule": "lina", "--chunks": "2",
}


def _moving(xs: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def gaps(loss: list[float], ref: list[float], window: int) -> dict[str, float]:
    """Relative gaps of a loss curve to the reference curve (pure): the largest per step, the
    largest of their ``window``-step moving averages, and of the means of the last window."""
    n = min(len(loss), len(ref))
    loss, ref = loss[:n], ref[:n]
    ma, mr = _moving(loss, window), _moving(ref, window)
    tail = sum(loss[-window:]) / len(loss[-window:])
    tail_ref = sum(ref[-window:]) / len(ref[-window:])
    return {"max_step_gap": max(abs(a - b) / b for a, b in zip(loss, ref)),
            "max_smoothed_gap": max(abs(a - b) / b for a, b in zip(ma, mr)),
            "final_gap": (tail - tail_ref) / tail_ref}


_WIDTH = re.compile(r"^(\d+)?(?:g(\d+))?$")


def parse_width(text: str) -> tuple[int, int]:
    """``"8"`` -> (8, 32), ``"g8"`` -> (32, 8), ``"8g8"`` -> (8, 8): (--a2a-bits,
    --grad-bits) of a width (pure; ValueError naming the forms for anything else)."""
    m = _WIDTH.match(str(text).strip())
    if not m or not (m.group(1) or m.group(2)):
        raise ValueError(f"--bits: {text!r} is not a width: A (--a2a-bits A), gB (--grad-bits B) or AgB (both)")
    return int(m.group(1) or 32), int(m.group(2) or 32)


def width_label(a2a: int, grad: int) -> str:
    """The label of a width: the inverse of :func:`parse_width` (``32`` for the reference)."""
    return (str(a2a) if a2a != 32 or grad == 32 else "") + (f"g{grad}" if grad != 32 else "")


def plot(curves: dict[tuple[int, str], list[float]], window: int, path: Path, *, ref: str = "32",
         unit: str = " bits") -> Path:
    """Each curve's moving average per seed (left) and its relative gap to the ``ref`` curve of
    the same seed (right); ``curves`` keyed (seed, label), ``unit`` after each label."""
    plt = pyplot()
    seeds = sorted({s for s, _ in curves})
    labels = list(dict.fromkeys(b for _, b in sorted(curves, key=lambda k: k[1] != ref)))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    styles = {"32": "-", "16": "--", "8": ":", "g8": "-.", "8g8": (0, (1, 3))}
    others = ["--", ":", "-.", (0, (1, 3)), (0, (5, 1)), (0, (3, 1, 1, 1)), (0, (1, 1))]
    style = {b: "-" if b == ref else styles.get(b, others[i % len(others)]) for i, b in enumerate(labels)}
    for s in seeds:
        for b in labels:
            c = curves.get((s, b))
            if c is None:
                continue
            ax.plot(_moving(c, window), linestyle=style[b], color=f"C{s}", label=f"seed {s}, {b}{unit}")
            r = curves.get((s, ref))
            if r is not None and b != ref:
                ma, mr = _moving(c, window), _moving(r, window)
                bx.plot([100 * (x - y) / y for x, y in zip(ma, mr)], linestyle=style[b], color=f"C{s}",
                        label=f"seed {s}, {b}{unit}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss ({window}-step moving average)")
    ax.legend(fontsize="x-small")
    bx.axhline(1.0, color="grey", lw=0.8)
    bx.axhline(-1.0, color="grey", lw=0.8)
    bx.set_xlabel("step")
    bx.set_ylabel(f"gap to {ref}{unit}, % (moving averages)")
    bx.legend(fontsize="x-small", ncol=2 if len(labels) > 4 else 1)
    save_figure(fig, path)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m commsched.bench.moe.a2a_parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--bits", default="32,8", help="widths to run: A (--a2a-bits A), gB (--grad-bits B), AgB "
                                                  "(both); 32 is the reference and always runs")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--corpus", default=None)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    for flag, default in MODEL_FLAGS.items():
        p.add_argument(flag, default=default)
    p.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=True)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    try:
        parsed = [parse_width(b) for b in a.bits.split(",")]
    except ValueError as e:
        print(f"a2a_parity: {e}", file=sys.stderr)
        return 2
    widths = [width_label(*w) for w in sorted({(32, 32), *parsed}, key=lambda w: (-w[0], -w[1]))]
    passthrough = []
    for flag in MODEL_FLAGS:
        passthrough += [flag, str(getattr(a, flag[2:].replace("-", "_")))]
    passthrough += ["--pipeline" if a.pipeline else "--no-pipeline"]
    if a.corpus:
        passthrough += ["--corpus", a.corpus]
    curves, metrics = {}, {}
    t0 = time.perf_counter()
    for s in seeds:
        for b in widths:
            name = f"seed{s}-bits{b}"
            a2a, grad = parse_width(b)
            v = Variant(name, "commsched.moe.train",
                        ("--impl", "commsched", "--steps", str(a.steps), "--warmup", "1", "--seed", str(s),
                         "--a2a-bits", str(a2a), "--grad-bits", str(grad), "--probe-steps", "0", *passthrough))
            print(f"[a2a-parity] {name} ...", flush=True)
            m = run_variant(v, a.nproc, a.out / name, RunContext(), a.timeout)
            curves[(s, b)] = m["loss"]
            metrics[name] = {"step_time_s": m["step_time_s"], "val_loss": m["val_loss"],
                             "a2a_time_s": m["a2a_time_s"],
                             "a2a_payload_bytes_per_step": m["sizes"]["a2a_payload_bytes_per_step"]}
            print(f"[a2a-parity] {name}: last loss {m['loss'][-1]:.4f}, val {m['val_loss']}, "
                  f"step {m['step_time_s']:.3f} s", flush=True)
    rows = []
    for s in seeds:
        for b in widths:
            if b == "32":
                continue
            g = gaps(curves[(s, b)], curves[(s, "32")], a.window)
            v32, vb = metrics[f"seed{s}-bits32"]["val_loss"], metrics[f"seed{s}-bits{b}"]["val_loss"]
            g["val_gap"] = (vb - v32) / v32 if v32 and vb is not None else None
            rows.append({"seed": s, "bits": b, **g})
    summary = {"command": shlex.join([sys.executable, "-m", "commsched.bench.moe.a2a_parity", *(argv or sys.argv[1:])]),
               "steps": a.steps, "window": a.window, "nproc": a.nproc, "gaps": rows, "runs": metrics,
               "curves": {f"seed{s}-bits{b}": c for (s, b), c in curves.items()},
               "wall_s": time.perf_counter() - t0}
    a.out.mkdir(parents=True, exist_ok=True)
    write_json(a.out / "summary.json", summary)
    png = plot(curves, a.window, a.out / "loss.png")
    lines = [f"`{summary['command']}`", "",
             "| seed | bits | max per-step gap | max gap of the moving averages | gap of the last "
             f"{a.window} steps | held-out loss gap |", "|---|---|---|---|---|---|"]
    for r in rows:
        val = f"{100 * r['val_gap']:+.2f}%" if r["val_gap"] is not None else "-"
        lines.append(f"| {r['seed']} | {r['bits']} | {100 * r['max_step_gap']:.2f}% | "
                     f"{100 * r['max_smoothed_gap']:.2f}% | {100 * r['final_gap']:+.2f}% | {val} |")
    lines += ["", "| run | step time (s) | all-to-all blocked (s) | all-to-all bytes / step | held-out loss |",
              "|---|---|---|---|---|"]
    for n, m in metrics.items():
        lines.append(f"| {n} | {m['step_time_s']:.3f} | {m['a2a_time_s']:.3f} | "
                     f"{m['a2a_payload_bytes_per_step']} | {m['val_loss']:.4f} |")
    lines += ["", f"plot: {png}"]
    (a.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0


__all__ = ["MODEL_FLAGS", "build_parser", "gaps", "main", "parse_width", "plot", "width_label"]


if __name__ == "__main__":
    raise SystemExit(main())
