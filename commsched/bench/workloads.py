"""The table of ``commsched bench`` workloads, and the entry point that runs one by name.

A new benchmark is one module of this package defining ``WORKLOAD = Workload(...)`` and
one line in :data:`WORKLOADS`.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .emulation import bench_context
from .gnn import compare as gnn
from .micro import all2all, assign, quant
from .moe import infer as moe_infer
from .moe import train as moe_train
from .runner import RunContext, Workload, run_workload

WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    all2all.WORKLOAD, quant.WORKLOAD, assign.WORKLOAD, gnn.WORKLOAD, moe_train.WORKLOAD,
    moe_infer.WORKLOAD)}


def load_workload(name: str) -> Workload:
    """The workload called ``name``; ValueError naming the known ones otherwise."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    return WORKLOADS[name]


def run_bench(workload: str | Workload, argv: Sequence[str], ctx: RunContext | None = None,
              progress: Callable[[str], None] | None = None) -> dict:
    """Run ``workload`` (a name in :data:`WORKLOADS` or a :class:`Workload`) with the bench
    options ``argv``; write and return its summary.

    Without ``ctx``, the emulation options (``--bandwidth``, ``--hosts``, ``--delay``) are
    taken from ``argv`` by :func:`~commsched.bench.emulation.bench_context`.
    """
    wl = workload if isinstance(workload, Workload) else load_workload(workload)
    argv = list(argv)
    if ctx is None:
        ctx, argv = bench_context(wl, argv)
    return run_workload(wl, argv, ctx, progress)


__all__ = ["WORKLOADS", "load_workload", "run_bench"]
