"""Solve time and quality of the bit-width assignment (``commsched bench assign``).

The instance is one layer's exchange on ``--devices`` devices: devices - 1 ring rounds
of ``devices`` channels (device pairs), each sending ``--groups`` groups of
``--group-size`` messages of ``--dim`` elements (the last group of a channel holds the
remainder). Message betas are log-normal with a per-channel scale, grouped with
``group_messages`` (sorted by beta, cut into groups); links get a bandwidth drawn from
0.5-2 GB/s and 50 us latency. Variants run in this one process, one after another on
the same instance (a new instance per repeat):

* ``cp-sat``        ``assign_bitwidths`` with its defaults (rel_gap 1e-4, one worker)
* ``cp-sat-1pct``   the same, stopping at a 1% gap (the goal: within 1% in <= 2 s)
* ``cp-sat-threads`` the default, with the rounds solved in ``--threads`` threads
* ``cp-sat-exact``  rel_gap 0: until optimality is proven (or ``--time-limit``)
* ``all-secants``   the threshold model with every secant from the start (no window)
* ``greedy``        the greedy baseline alone
* ``per-group``     the plain model (one Boolean per group and width), limited to
                    ``--plain-time-limit`` seconds (0 leaves it out)

Each reports its wall time (the whole call, greedy hint included), objective, gap to
its own bound, and ``gap_to_bound``: the gap to the best bound any variant proved on
that instance, and ``gain_over_greedy``: how much lower its objective is than the
greedy one's, relative to the latter.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ...quant.widths.assign import (
    AssignmentProblem,
    Channel,
    group_messages,
    meta_bytes,
    solve_problem,
)
from ...results import median
from ..runner import Workload


def make_instance(devices: int, groups: int, group_size: int, dim: int, seed: int):
    """rounds[r][c] for a ring exchange on ``devices`` devices (see the module doc)."""
    rng = np.random.default_rng(seed)
    rounds = []
    for _ in range(devices - 1):
        chans = []
        for _ in range(devices):
            messages = groups * group_size - int(rng.integers(0, group_size))
            beta = rng.lognormal(0.0, 1.0, messages) * rng.lognormal(0.0, 0.5)
            gs, _ = group_messages(beta, dim, group_size)
            chans.append(Channel(theta=1.0 / (rng.uniform(0.5, 2.0) * 1e9), gamma=50e-6, groups=gs))
        rounds.append(chans)
    return rounds


def _metrics(a, t_problem: float) -> dict:
    return {"wall_s": a.wall_s + t_problem, "objective": a.objective, "bound": a.bound,
            "gap": a.gap, "status": a.status, "solver_status": a.solver_status,
            "time_s": a.time_s, "variance": a.variance, "t_max_s": a.t_max_s, "v_max": a.v_max,
            "tolerance": a.tolerance, "counts": {str(k): v for k, v in a.counts.items()},
            "stats": a.stats}


def run_inline(args: argparse.Namespace, out_dir: Path, progress: Callable[[str], None]) -> dict:
    rep = int(out_dir.name[3:]) if out_dir.name.startswith("rep") else 0
    rounds = make_instance(args.devices, args.groups, args.group_size, args.dim, args.seed + rep)
    meta_bytes()  # imports the codec once, outside the timings
    solve_problem(AssignmentProblem(rounds[:1]), lam=args.lam, time_limit_s=args.time_limit)  # warm-up
    t0 = time.perf_counter()
    problem = AssignmentProblem(rounds)
    t_problem = time.perf_counter() - t0  # validation and arrays: part of every variant
    common = dict(lam=args.lam, time_limit_s=args.time_limit, seed=0)
    plan = [
        ("cp-sat", dict(common)),
        ("cp-sat-1pct", dict(common, rel_gap=0.01)),
        ("cp-sat-threads", dict(common, workers=args.threads)),
        ("cp-sat-exact", dict(common, rel_gap=0.0)),
        ("all-secants", dict(common, secant_window=None)),
        ("greedy", dict(common, solver="greedy")),
    ]
    if args.plain_time_limit > 0:
        plan.append(("per-group", dict(common, formulation="per-group",
                                       time_limit_s=args.plain_time_limit)))
    if getattr(args, "variants", None):
        keep = args.variants.split(",")
        unknown = set(keep) - {name for name, _ in plan}
        if unknown:
            raise ValueError(f"unknown variants {sorted(unknown)}; this workload has "
                             f"{[name for name, _ in plan]}")
        plan = [(name, kw) for name, kw in plan if name in keep]
    out = {}
    order = plan[rep % len(plan):] + plan[:rep % len(plan)]  # rotate: no variant always first
    for name, kw in order:
        progress(f"[bench assign] {name}")
        a = solve_problem(problem, **kw)
        out[name] = _metrics(a, t_problem)
        progress(f"[bench assign] {name}: {a.wall_s:.3f} s, objective {a.objective:.6f}, "
                 f"gap {a.gap if a.gap is None else f'{a.gap:.2e}'}, {a.status}")
    out = {name: out[name] for name, _ in plan}
    best = max((m["bound"] for m in out.values() if m["bound"] is not None), default=None)
    greedy = out["greedy"]["objective"] if "greedy" in out else None
    for m in out.values():
        m["gap_to_bound"] = (m["objective"] - best) / m["objective"] if best is not None else None
        m["gain_over_greedy"] = (greedy - m["objective"]) / greedy if greedy else None
        m["groups"] = problem.num_groups
    return out


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=4, help="devices in the ring (default 4)")
    p.add_argument("--groups", type=int, default=2000, help="groups per channel (default 2000)")
    p.add_argument("--group-size", type=int, default=100, help="messages per group (default 100)")
    p.add_argument("--dim", type=int, default=256, help="elements per message (default 256)")
    p.add_argument("--lam", type=float, default=0.5, help="variance weight (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="instance seed (+ repeat index)")
    p.add_argument("--time-limit", type=float, default=10.0, help="seconds per CP-SAT variant")
    p.add_argument("--threads", type=int, default=2, help="threads of cp-sat-threads (default 2)")
    p.add_argument("--plain-time-limit", type=float, default=10.0,
                   help="seconds for the per-group model (0: leave it out)")


def _summarize(runs: dict[str, list[dict]], args, out: Path) -> dict:
    from ..runner import median_of

    lines = ["| variant | median wall s | min | max | median gap (own bound) | "
             "median gap to best bound | median gain over greedy | statuses |",
             "|---|---|---|---|---|---|---|---|"]
    for v, rs in runs.items():
        walls = [r["wall_s"] for r in rs]
        gap = median_of(rs, "gap")
        gtb = median_of(rs, "gap_to_bound")
        gain = median_of(rs, "gain_over_greedy")
        statuses = ", ".join(sorted({r["status"] for r in rs}))
        lines.append(f"| {v} | {median(walls):.3f} | {min(walls):.3f} | {max(walls):.3f} | "
                     f"{'-' if gap is None else f'{gap:.2e}'} | "
                     f"{'-' if gtb is None else f'{gtb:.2e}'} | "
                     f"{'-' if gain is None else f'{gain:.2e}'} | {statuses} |")
    return {"extra_tables": {"Solve time and gap per variant": "\n".join(lines)}}


WORKLOAD = Workload(
    name="assign",
    description="bit-width assignment: CP-SAT solve time and gap to its bound, beside greedy",
    key_metrics=("wall_s", "gap", "gap_to_bound", "gain_over_greedy"),
    higher_is_better=("gain_over_greedy",),
    add_arguments=_add_arguments,
    inline=run_inline,
    summarize=_summarize,
)
