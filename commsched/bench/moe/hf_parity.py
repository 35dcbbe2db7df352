"""Training parity of a transformers MoE model made expert-parallel (commsched.moe.hf):
the same tiny Mixtral trained on N ranks under each gradient schedule and compressed
exchange, and in one process, the loss curves compared.

    python -m commsched.bench.moe.hf_parity --out DIR --steps 55 --seeds 0,1,2 \\
        --variants fifo+ddp,lina+ddp,lina-overlap,lina+ddp+a8,lina+g8 \\
        --corpus /work/shared/data/text/tinyshakespeare.txt

The model: ``MixtralForCausalLM`` (``--hidden`` 128, ``--experts`` 8, top-``--k`` 2,
``--layers`` 4, byte-level tokens: vocabulary 256, the router's auxiliary loss included),
``--optim`` (default Adam), random windows of a byte-level corpus (:mod:`commsched.moe.model.data`; each rank its own
``--batch-size`` windows per step, drawn from the seed, the step and the rank). A variant is
``SCHEDULE[+ddp][+aA][+gB]``: the gradient schedule (``fifo``, ``lina``, ``lina-overlap``,
``serial``), reduced by :func:`commsched.priority.step.make_grad_step` (every schedule) or with
``+ddp`` by :class:`commsched.priority.LinaDDP` (``fifo``, ``lina``, ``serial``: a DDP
communication hook, which cannot leave the reduction running into the next forward pass nor
compress it); ``+a8`` / ``+a16`` the expert all-to-all's rows at 8 / 16 bits
(``expert_parallel(a2a_bits=...)``), ``+g8`` / ``+g16`` the gradient reduction's sums
(:class:`commsched.quant.allreduce.CompressedLauncher`). Lina's probe against fifo's launching
is off: every step runs the schedule named. ``one-process+gB`` (B: 8 or 16) is the reference with
its non-expert gradients encoded and decoded by the gradient reduction's codec once a step (one
quantization, the all-gather's, where N ranks' sums have two), as one tensor whose rows span
parameters as a fused micro-op's do; ``one-process+gB+p`` with each parameter in its own rows:
the codec's effect on training apart from the distributed run.

Each variant is one ``torchrun`` run of ``--nproc`` ranks (every seed in turn); the reference
is one process that holds every expert and runs the ranks' batches of each step one after the
other, each loss divided by the number of ranks (the same global batch, the same seeds and
weights). For each variant and seed the bench reports the largest per-step relative gap of the
training loss to the reference's (:func:`commsched.bench.moe.a2a_parity.gaps`: also the gap of
``--window``-step moving averages and of the last window's mean) and the final losses;
``summary.json``, ``summary.md`` and ``loss.png`` go to ``--out``. The goal: every gap within 1%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ...results import median, write_json
from ..runner import RunContext, Variant, run_variant
from .a2a_parity import gaps, plot

SCHEDULES = ("fifo", "lina", "lina-overlap", "serial")
DDP_SCHEDULES = ("fifo", "lina", "serial")  # what LinaState accepts in a DDP communication hook
REFERENCE = "one-process"
MODEL_FLAGS = {  # the model and data flags, passed to every run, with this bench's defaults
    "--hidden": 128, "--experts": 8, "--k": 2, "--layers": 4, "--heads": 4, "--kv-heads": 2,
    "--intermediate": 256, "--seq-len": 64, "--batch-size": 4, "--lr": 1e-3, "--aux-coef": 0.02,
    "--optim": "adam",
}
OPTIMIZERS = ("adam", "sgd")


@dataclass(frozen=True)
class Spec:
    """One variant: its schedule, reducer (``step``: make_grad_step; ``ddp``: LinaDDP) and widths."""

    schedule: str
    reducer: str = "step"
    a2a_bits: int = 32
    grad_bits: int = 32


    @property
    def label(self) -> str:
        """The variant's text, as :func:`parse_variant` reads it."""
        return (self.schedule + "+ddp" * (self.reducer == "ddp") + f"+a{self.a2a_bits}" * (self.a2a_bits != 32)
                + f"+g{self.grad_bits}" * (self.grad_bits != 32))


_PART = re.compile(r"^([ag])(\d+)$")


def parse_variant(text: str) -> Spec:
    """``"lina+ddp"`` -> Spec("lina", "ddp"), ``"fifo+a8+g8"`` -> Spec("fifo", "step", 8, 8)
    (pure; a ValueError naming the forms and the reason for anything else)."""
    parts = [p.strip() for p in str(text).split("+")]
    sched, rest = parts[0], parts[1:]
    form = "SCHEDULE[+ddp][+aA][+gB] (A: 8 or 16, B: 8 or 16)"
    if sched not in SCHEDULES:
        raise ValueError(f"--variants: {text!r}: unknown schedule {sched!r}; schedules: {', '.join(SCHEDULES)}; "
                         f"a variant is {form}")
    reducer, bits = "step", {"a": 32, "g": 32}
    for p in rest:
        m = _PART.match(p)
        if p == "ddp" and reducer == "step":
            reducer = "ddp"
        elif m and int(m.group(2)) in (8, 16) and bits[m.group(1)] == 32:
            bits[m.group(1)] = int(m.group(2))
        else:
            raise ValueError(f"--variants: {text!r}: {p!r} is not a part of a variant {form}")
    if reducer == "ddp" and sched not in DDP_SCHEDULES:
        raise ValueError(f"--variants: {text!r}: LinaDDP runs {', '.join(DDP_SCHEDULES)} (a DDP communication hook "
                         f"waits for the whole reduction at the end of the backward pass); drop +ddp to run {sched} "
                         "through make_grad_step")
    if reducer == "ddp" and bits["g"] != 32:
        raise ValueError(f"--variants: {text!r}: LinaDDP reduces gradients at full width; drop +ddp to compress "
                         "the reduction (make_grad_step with a CompressedLauncher)")
    return Spec(sched, reducer, bits["a"], bits["g"])


# ---------------------------------------------------------------------------------- training
def build_model(a: argparse.Namespace, seed: int):
    """The tiny float32 Mixtral of the flags (:func:`commsched.moe.hf.tiny_mixtral`), its weights
    drawn from ``seed`` (every rank alike)."""
    from ...moe import hf  # first: it imports transformers past a checkout's own kernels/ folder

    return hf.tiny_mixtral(seed, **{n: getattr(a, n) for n in hf.TINY_MIXTRAL})


def make_optimizer(a: argparse.Namespace, params):
    """``--optim``: Adam (the default) or plain SGD (which, unlike Adam, shows any error of the
    gradients' scale in the losses), at ``--lr``."""
    import torch

    if a.optim not in OPTIMIZERS:
        raise ValueError(f"--optim {a.optim!r}: choose one of {', '.join(OPTIMIZERS)}")
    return (torch.optim.Adam if a.optim == "adam" else torch.optim.SGD)(list(params), lr=a.lr)


def _batch(corpus, a, seed: int, step: int, rank: int, device):
    x, _ = corpus.batch(a.batch_size, a.seq_len, seed=seed, step=step, rank=rank)
    return x.to(device)  # the model shifts its labels itself


def parse_reference(text: str) -> tuple[int, str] | None:
    """``"one-process"`` -> (32, "flat"); ``"one-process+g8"`` -> (8, "flat"); ``"one-process+g8+p"``
    -> (8, "param"): the reference with its non-expert gradients through the codec at that width
    once a step (:func:`reference_curve`); None for a name that is not the reference's (pure; a
    ValueError for a reference name of any other form)."""
    head, _, rest = str(text).partition("+")
    if head != REFERENCE:
        return None
    m = re.fullmatch(r"g(8|16)(\+p)?", rest) if rest else None
    if rest and not m:
        raise ValueError(f"--variants: {text!r}: the reference's forms are {REFERENCE}+gB and {REFERENCE}+gB+p "
                         "(B: 8 or 16; +p: each parameter in its own rows)")
    return (int(m.group(1)), "param" if m.group(2) else "flat") if m else (32, "flat")


def _through_codec(model, bits: int, layout: str, key: tuple[int, ...]) -> None:
    """The non-expert gradients of ``model`` (one process, every expert) encoded and decoded
    by the gradient reduction's codec, as a one-rank :func:`quantized_all_reduce` over the wire
    does (one quantization: the all-gather's): ``flat``, all of them as one tensor in the
    order the backward pass readies them (the launcher's rows span parameters, as in a fused
    micro-op), or ``param``, each parameter alone (no row spans two)."""
    import torch

    from ...moe.hf import EXPERT_PARAMS
    from ...quant.allreduce import quantized_all_reduce
    from ...quant.rowwire import format_seed

    ps = [p for n, p in reversed(list(model.named_parameters())) if not n.endswith(EXPERT_PARAMS)]
    parts = [torch.cat([p.grad.flatten() for p in ps])] if layout == "flat" else [p.grad.flatten() for p in ps]
    for i, g in enumerate(parts):
        quantized_all_reduce(g, bits, seed=format_seed(0x6AD, *key, i), force_wire=True)
    if layout == "flat":
        for p, g in zip(ps, torch.split(parts[0], [p.numel() for p in ps])):
            p.grad.copy_(g.view_as(p))
    else:
        for p, g in zip(ps, parts):
            p.grad.copy_(g.view_as(p))


def reference_curve(a: argparse.Namespace, corpus, seed: int, world: int, device=None,
                    codec: tuple[int, str] = (32, "flat")) -> list[float]:
    """One process, every expert: each step runs the ``world`` ranks' batches in turn (each
    loss / world), then one optimizer step. Returns the mean loss over the ranks' batches per step.
    ``codec`` (bits, layout) other than 32 bits: the non-expert gradients pass through the 8- or
    16-bit codec before each step (:func:`_through_codec`; needs a one-rank process group)."""
    import torch

    device = device or torch.device("cpu")
    model = build_model(a, seed).to(device)
    opt = make_optimizer(a, model.parameters())
    out: list[float] = []
    for step in range(a.steps):
        total = 0.0
        for r in range(world):
            x = _batch(corpus, a, seed, step, r, device)
            loss = model(input_ids=x, labels=x).loss / world
            loss.backward()
            total += float(loss.detach())
        if codec[0] != 32:
            _through_codec(model, codec[0], codec[1], key=(seed, step))
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(total)
    return out


def schedule_config(spec: Spec, options: dict | None = None):
    """The config of ``spec``'s schedule with ``options`` (field -> value, e.g. the bench's
    ``microop_bytes`` or ``reduce_address``) and Lina's probe against fifo's launching off:
    every step runs the schedule named. An option the schedule lacks is a ValueError."""
    from ...priority.policy import SCHEDULES as SCHED_CONFIGS
    from ...priority.policy import LinaConfig

    cls = SCHED_CONFIGS[spec.schedule]
    kw = dict(options or {})
    if issubclass(cls, LinaConfig):
        kw["fallback_probes"] = 0
    try:
        return cls(**kw)
    except TypeError as e:
        raise ValueError(f"schedule {spec.schedule}: {e} (its options: "
                         f"{', '.join(f.name for f in dataclasses.fields(cls) if f.init)})") from None


@dataclass
class Curve:
    """What one N-rank run of a variant measured: the mean loss over the ranks per step (every
    rank's), this rank's step times and all-to-all time per step (seconds)."""

    loss: list[float]
    step_times_s: list[float]
    a2a_times_s: list[float]


def parallel_curve(a: argparse.Namespace, corpus, seed: int, spec: Spec, device) -> Curve:
    """This rank's part of the N-rank run of ``spec`` (collective over the default group): the
    model made expert-parallel, its gradients reduced by the schedule (:func:`schedule_config`
    with ``a.schedule_options``, if any); ``a.chunks`` > 1 pipelines each exchange in that many
    chunks with the experts' compute."""
    import torch
    import torch.distributed as dist

    from ...comm.observe import A2AEvents, A2ATimer
    from ...dist import new_group
    from ...moe import hf
    from ...priority.ddp import LinaDDP, grad_group
    from ...priority.step import make_grad_step
    from ...quant.allreduce import CompressedLauncher
    from ...quant.rowwire import format_seed

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = schedule_config(spec, getattr(a, "schedule_options", None))
    events, timer = A2AEvents(), A2ATimer()
    chunks = getattr(a, "chunks", 1)
    model = hf.expert_parallel(build_model(a, seed).to(device), a2a_bits=spec.a2a_bits, observer=events,
                               wire_seed=seed, chunks=chunks, pipeline=chunks > 1)
    losses, times, a2a = [], [], []
    launcher = CompressedLauncher(spec.grad_bits, seed=format_seed(seed, 0x6AD)) if spec.grad_bits != 32 else None
    try:
        events.register(timer)
        if spec.reducer == "ddp":
            ddp = LinaDDP(model, schedule=cfg, events=events)
            opt = make_optimizer(a, ddp.parameters())
            try:
                for step in range(a.steps):
                    t0, a0 = time.perf_counter(), timer.time_s
                    x = _batch(corpus, a, seed, step, rank, device)
                    loss = ddp(input_ids=x, labels=x).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    losses.append(loss.detach())
                    times.append(time.perf_counter() - t0)
                    a2a.append(timer.time_s - a0)
            finally:
                ddp.close()
        else:
            dp = new_group(list(range(world)))  # the reduction's own group: the all-to-all uses the default one
            named = list(reversed(list(model.named_parameters())))  # about the order the backward pass readies them
            entries = [(p, grad_group(p).group if grad_group(p) is not None else dp, 1.0 / world) for _, p in named]
            gs = make_grad_step(model, entries, cfg, lambda ps: make_optimizer(a, ps), device=device,
                                names=[n for n, _ in named], **({"launch": launcher} if launcher else {}))
            with gs, events.register(gs.scheduler):
                for step in range(a.steps):
                    t0, a0 = time.perf_counter(), timer.time_s
                    x = _batch(corpus, a, seed, step, rank, device)
                    gs.before_forward()
                    loss = model(input_ids=x, labels=x).loss
                    gs.before_backward()
                    loss.backward()
                    gs.after_backward(sync=step == a.steps - 1)
                    losses.append(loss.detach())
                    times.append(time.perf_counter() - t0)
                    a2a.append(timer.time_s - a0)
                gs.synchronize()
    finally:
        if launcher is not None:
            launcher.close()
        for m in model.modules():
            if isinstance(m, hf.ExpertParallelExperts):
                m.close()
    curve = torch.stack(losses).float()
    dist.all_reduce(curve)  # once, after the run: no collective of its own between the steps
    return Curve((curve / world).tolist(), times, a2a)


def _worker(a: argparse.Namespace) -> int:
    """Under torchrun: ``--worker VARIANT`` (every seed in turn) or ``--worker one-process``."""
    from ...dist import init_distributed, resolve_device
    from ...moe.model.data import load_corpus

    corpus = load_corpus(a.corpus)
    seeds = [int(s) for s in a.seeds.split(",")]
    codec = parse_reference(a.worker)
    if codec is not None:
        device = init_distributed(device=a.device)[2] if codec[0] != 32 else resolve_device(a.device)[0]
        t0 = time.perf_counter()
        curves = {str(s): reference_curve(a, corpus, s, a.world or a.nproc, device, codec) for s in seeds}
        metrics = {"variant": a.worker, "world_size": 1, "ranks_emulated": a.world or a.nproc, "loss": curves,
                   "grad_bits": codec[0], "codec_layout": codec[1], "wall_s": time.perf_counter() - t0}
    else:
        spec = parse_variant(a.worker)
        rank, world, device = init_distributed(device=a.device)
        if a.world is not None and world != a.world:
            raise ValueError(f"--world {a.world} but torchrun started {world} ranks")
        if not 0 <= a.warmup < a.steps:
            raise ValueError(f"--warmup {a.warmup} must be in 0..--steps - 1 ({a.steps - 1})")
        runs = {str(s): parallel_curve(a, corpus, s, spec, device) for s in seeds}
        step_s = {s: median(c.step_times_s[a.warmup:]) for s, c in runs.items()}
        metrics = {"variant": a.worker, "world_size": world, "schedule": spec.schedule, "reducer": spec.reducer,
                   "a2a_bits": spec.a2a_bits, "grad_bits": spec.grad_bits, "chunks": a.chunks,
                   "loss": {s: c.loss for s, c in runs.items()}, "step_time_by_seed_s": step_s,
                   # medians over the seeds of each seed's steps after --warmup (rank 0's clock)
                   "step_time_s": median(step_s.values()),
                   "a2a_time_s": median(median(c.a2a_times_s[a.warmup:]) for c in runs.values()),
                   "step_times_s": {s: c.step_times_s for s, c in runs.items()}}
        if rank != 0:
            return 0
    write_json(Path(a.out) / "metrics.json", metrics)
    return 0


# ---------------------------------------------------------------------------------- the bench
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m commsched.bench.moe.hf_parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=55)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--variants", default="fifo+ddp,lina+ddp,lina-overlap,lina+ddp+a8,lina+g8",
                   help="comma-separated SCHEDULE[+ddp][+aA][+gB]: SCHEDULE fifo, lina, lina-overlap or serial "
                        "(reduced by make_grad_step; +ddp: by LinaDDP, fifo, lina, serial); +a8, +a16: the "
                        "all-to-all's rows, +g8, +g16: the gradient reduction's sums at that width; "
                        f"{REFERENCE}+gB[+p]: one process, its gradients through the codec")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--corpus", default=None, help="a text file (default: the Python standard library's sources)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    for flag, default in MODEL_FLAGS.items():
        choices = {"choices": OPTIMIZERS} if flag == "--optim" else {}
        p.add_argument(flag, type=type(default), default=default, **choices)
    p.add_argument("--worker", default=None, help="internal: run one variant under torchrun (every seed), or "
                                                  f"{REFERENCE!r}: the reference")
    p.add_argument("--world", type=int, default=None, help="internal: the ranks of the run (the reference runs "
                                                           "their batches in one process)")
    p.add_argument("--warmup", type=int, default=0, help="steps left out of the step-time medians")
    p.add_argument("--chunks", type=int, default=1, help="each all-to-all cut into this many chunks, pipelined "
                                                         "with the experts' compute (1: one exchange)")
    p.add_argument("--schedule-options", type=json.loads, default=None,
                   help="internal: the schedule config's options as JSON (e.g. {\"microop_bytes\": 65536})")
    return p


def _check(a: argparse.Namespace) -> list[str]:
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        raise ValueError(f"--seeds: {a.seeds!r} is not a comma-separated list of integers") from None
    if not seeds or a.steps < 1 or a.nproc < 1 or a.window < 1:
        raise ValueError("--seeds must name a seed, --steps, --nproc and --window must be >= 1")
    if a.experts % a.nproc:
        raise ValueError(f"--experts {a.experts} do not split evenly over --nproc {a.nproc} ranks")
    if a.chunks < 1 or not 0 <= a.warmup < a.steps:
        raise ValueError(f"--chunks must be >= 1 and --warmup in 0..--steps - 1, got {a.chunks} and {a.warmup}")
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in names:
        if parse_reference(v) is None:
            parse_variant(v)
        elif v == REFERENCE:
            raise ValueError(f"--variants: {REFERENCE!r} is the reference every run is compared with; name a variant")
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--variants: {a.variants!r}: name each variant once")
    return names


def _args_of(a: argparse.Namespace) -> list[str]:
    out = ["--steps", str(a.steps), "--seeds", a.seeds, "--device", a.device, "--world", str(a.nproc)]
    for flag in MODEL_FLAGS:
        out += [flag, str(getattr(a, flag[2:].replace("-", "_")))]
    out += ["--warmup", str(a.warmup), "--chunks", str(a.chunks)]
    return out + (["--corpus", a.corpus] if a.corpus else [])


def _bench(a: argparse.Namespace, argv) -> int:
    names = _check(a)
    seeds = [int(s) for s in a.seeds.split(",")]
    module = "commsched.bench.moe.hf_parity"
    t0 = time.perf_counter()
    runs = {}
    for name in [REFERENCE, *names]:
        nproc = 1 if parse_reference(name) is not None else a.nproc
        v = Variant(name, module, ("--worker", name, *_args_of(a)))
        print(f"[hf-parity] {name} ({nproc} rank{'s' * (nproc > 1)}) ...", flush=True)
        runs[name] = run_variant(v, nproc, a.out / name.replace("+", "-"), RunContext(), a.timeout)
    ref = runs[REFERENCE]["loss"]
    rows = []
    for name in names:
        for s in seeds:
            c, r = runs[name]["loss"][str(s)], ref[str(s)]
            rows.append({"variant": name, "seed": s, **gaps(c, r, a.window), "final_loss": c[-1],
                         "final_loss_ref": r[-1], "step_time_s": runs[name].get("step_time_by_seed_s", {}).get(str(s))})
    worst = {n: max(r["max_step_gap"] for r in rows if r["variant"] == n) for n in names}
    summary = {"command": shlex.join([sys.executable, "-m", module, *argv]), "steps": a.steps, "seeds": seeds,
               "nproc": a.nproc, "window": a.window, "gaps": rows, "worst_step_gap": worst,
               "worst_step_gap_all": max(worst.values()), "curves": {n: m["loss"] for n, m in runs.items()},
               "wall_s": time.perf_counter() - t0}
    a.out.mkdir(parents=True, exist_ok=True)
    write_json(a.out / "summary.json", summary)
    curves = {(s, n): runs[n]["loss"][str(s)] for n in [REFERENCE, *names] for s in seeds}
    png = plot(curves, a.window, a.out / "loss.png", ref=REFERENCE, unit="")
    lines = [f"`{summary['command']}`", "",
             f"{a.nproc} ranks against one process, {a.steps} steps, seeds {a.seeds}.", "",
             "| variant | largest per-step gap (any seed) | per seed | largest gap of the moving averages | "
             f"gap of the last {a.window} steps | final loss | one process's |", "|---|---|---|---|---|---|---|"]
    for n in names:
        rs = [r for r in rows if r["variant"] == n]

        def col(key: str, fmt: str, rs=rs) -> str:
            return ", ".join(format(r[key], fmt) for r in rs)
        lines.append(f"| {n} | {100 * worst[n]:.3f}% | {col('max_step_gap', '.3%')} | "
                     f"{100 * max(r['max_smoothed_gap'] for r in rs):.3f}% | {col('final_gap', '+.3%')} | "
                     f"{col('final_loss', '.4f')} | {col('final_loss_ref', '.4f')} |")
    lines += ["", f"plot: {png}"]
    (a.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0


# ------------------------------------------- commsched bench moe-train --model hf-mixtral-tiny
# --model of ``commsched bench moe-train`` -> what it trains (the model flags: MODEL_FLAGS)
HF_MODELS = {"hf-mixtral-tiny": "a transformers MixtralForCausalLM (commsched.moe.hf.tiny_mixtral: hidden 128, "
                                "8 experts, top-2, 4 layers, byte-level tokens) made expert-parallel by "
                                "commsched.moe.hf.expert_parallel"}


def bench_variants(a: argparse.Namespace, configs: dict) -> list[Variant]:
    """``commsched bench moe-train --model hf-mixtral-tiny``: the bench's commsched variants
    (``configs``: label -> :class:`~commsched.moe.train.training.TrainConfig`) as runs of this
    module's worker on the transformers Mixtral: each config's schedule (its options, Lina's
    probe off), its all-to-all and gradient widths, its pipelined chunks, its steps, warm-up,
    seed, batch size, corpus and device; the model of :data:`MODEL_FLAGS`, trained with
    ``make_grad_step``. DeepSpeed's variant, ``lina-hier`` and the ``-b0-`` A/B are left out
    (DeepSpeed's MoE layer is its own model; the worker's reduction is flat and batched).
    A MissingExtra without transformers, a ValueError for what the worker cannot run."""
    from ..._lazy import require

    require("transformers", f"commsched bench moe-train --model {a.model}")
    experts = MODEL_FLAGS["--experts"]
    if experts % a.nproc:
        raise ValueError(f"--model {a.model}: its {experts} experts do not split evenly over --nproc {a.nproc} ranks")
    if getattr(a, "compute", "real") != "real":
        raise ValueError(f"--model {a.model} computes on real tensors: drop --compute emulated (and --cluster)")
    if getattr(a, "dtype", "float32") != "float32":
        raise ValueError(f"--model {a.model} trains in float32: drop --dtype {a.dtype}")
    out = []
    for name, c in configs.items():
        if c.impl != "commsched" or c.schedule.hier_reduce or c.grad_batch_bytes == 0:
            continue
        spec = Spec(c.schedule.policy, "step", c.dispatch.a2a_bits, c.grad_bits)
        base = type(c.schedule)()
        options = {f.name: getattr(c.schedule, f.name) for f in dataclasses.fields(c.schedule)
                   if f.init and getattr(c.schedule, f.name) != getattr(base, f.name)}
        args = ["--worker", spec.label, "--steps", str(c.steps), "--warmup", str(c.warmup), "--seeds", str(c.seed),
                "--device", c.device, "--world", str(a.nproc),
                "--chunks", str(c.dispatch.chunks if c.dispatch.pipeline else 1)]
        for flag, default in MODEL_FLAGS.items():
            args += [flag, str(c.batch_size if flag == "--batch-size" else default)]
        args += ["--schedule-options", json.dumps(options)] if options else []
        out.append(Variant(name, "commsched.bench.moe.hf_parity", (*args, *(["--corpus", c.corpus] if c.corpus else []))))
    return out


def bench_summary(runs: dict[str, list[dict]], args: argparse.Namespace, out: Path) -> dict:
    """The summary of :func:`bench_variants`' runs: per variant its median step and
    all-to-all time, the median of its per-repeat step-time ratios fifo / variant (repeats
    interleaved), its first and last loss and its loss curve's gaps to fifo's
    (:func:`~commsched.bench.moe.a2a_parity.gaps`, repeat 0: the largest per step, relative,
    and of the last ``min(10, steps)`` steps' means); the loss curves' plot (5-step moving
    averages and their gaps to fifo's: :func:`~commsched.bench.moe.a2a_parity.plot`)."""
    def med(v: str, key: str):
        return median(r.get(key) for r in runs[v])

    def ratio(v: str):
        if "fifo" not in runs:
            return None
        return median(f["step_time_s"] / r["step_time_s"] for f, r in zip(runs["fifo"], runs[v])
                      if f.get("step_time_s") and r.get("step_time_s"))

    seed = next(iter(next(iter(runs.values()))[0]["loss"]))  # the run's one seed (repeat 0)
    curves = {v: rs[0]["loss"][seed] for v, rs in runs.items()}
    window = min(10, len(next(iter(curves.values()))))
    lines = ["| variant | step (s) | step: fifo / variant | all-to-all per step (s) | first loss | last loss | "
             "largest per-step loss gap to fifo | gap of the last steps' mean |", "|---|---|---|---|---|---|---|---|"]
    ratios, loss_gaps = {}, {}
    for v, c in curves.items():
        ratios[v] = ratio(v)
        g = gaps(c, curves["fifo"], window) if "fifo" in curves else None
        loss_gaps[v] = g
        lines.append(f"| {v} | {med(v, 'step_time_s'):.3g} | "
                     + (f"{ratios[v]:.3g}x" if ratios[v] is not None else "-") + " | "
                     + (f"{med(v, 'a2a_time_s'):.3g}" if med(v, "a2a_time_s") is not None else "-")
                     + f" | {c[0]:.4f} | {c[-1]:.4f} | "
                     + (f"{g['max_step_gap']:.3%} | {g['final_gap']:+.3%} |" if g else "- | - |"))
    png = plot({(int(seed), v): c for v, c in curves.items()}, min(5, window), out / "loss.png", ref="fifo", unit="")
    cfg = (f"model: {HF_MODELS[args.model]}; {args.batch_size} x {MODEL_FLAGS['--seq-len']} tokens per rank per "
           f"step, {MODEL_FLAGS['--optim']} at lr {MODEL_FLAGS['--lr']}; gradients reduced by make_grad_step "
           f"(Lina's probe off); lina and lina-overlap: {args.chunks} chunks pipelined; step times: rank 0's, "
           f"steps {min(args.warmup, args.steps - 1) + 1} on")
    return {"extra_tables": {f"{args.model}: the variants side by side": "\n".join(lines), "Configuration": cfg},
            "plots": [str(png)], "hf_ratios": ratios, "hf_loss_gaps": loss_gaps}


def main(argv=None) -> int:
    from ...dist import cli_main

    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    if a.worker is not None:
        return cli_main("hf_parity", lambda: _worker(a), out=lambda: Path(a.out))
    return cli_main("hf_parity", lambda: _bench(a, argv))


__all__ = ["DDP_SCHEDULES", "HF_MODELS", "MODEL_FLAGS", "OPTIMIZERS", "REFERENCE", "SCHEDULES", "Curve", "Spec", "bench_summary",
           "bench_variants", "build_model", "build_parser", "main", "make_optimizer", "parallel_curve", "parse_reference",
           "parse_variant", "reference_curve", "schedule_config"]


if __name__ == "__main__":
    raise SystemExit(main())
