"""Experiments: the side-by-side benchmark runner, the bandwidth-emulation glue, plots, one
module per workload, the GNN rate sweep and accuracy grid, the placement report and the
demo. The command line (``commsched bench``, ``commsched demo``) imports this package;
no library module does (a test walks the imports).

| module              | what it holds                                                    |
|---------------------|------------------------------------------------------------------|
| runner              | Variant, Workload, RunContext; runs variants, writes summaries   |
| emulation           | ``--bandwidth/--hosts/--delay`` -> a RunContext under netem      |
| plots               | Agg pyplot, save_figure, the stacked breakdown bars              |
| workloads           | WORKLOADS (name -> Workload), load_workload, run_bench           |
| all2all, quant, assign, gnn, moe_train, moe_infer | one module per workload            |
| netem_check         | the torchrun probe the emulator's tests and all2all bench run    |
| gnn_sweep, gnn_accuracy, gnn_kipf, placement_report | sweeps, grids and reports      |
| demo, gnn_demo, moe_demo | ``commsched demo``                                          |

Names are resolved lazily from their submodules; importing ``commsched.bench`` runs nothing.
"""

from __future__ import annotations

from .._lazy import lazy_getattr

_EXPORTS: dict[str, str] = {
    "Variant": "runner",
    "Workload": "runner",
    "RunContext": "runner",
    "build_parser": "runner",
    "machine_info": "runner",
    "median_of": "runner",
    "run_variant": "runner",
    "run_workload": "runner",
    "summarize_runs": "runner",
    "summary_markdown": "runner",
    "torchrun_command": "runner",
    "breakdown_medians": "runner",
    "pyplot": "plots",
    "save_figure": "plots",
    "plot_breakdown": "plots",
    "bench_context": "emulation",
    "netem_prefix": "emulation",
    "EmulationUnavailable": "emulation",
    "WORKLOADS": "workloads",
    "load_workload": "workloads",
    "run_bench": "workloads",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
