"""Lazy imports: package exports resolved on first use, and the optional dependencies.

A package names where each public name lives, and the submodule is imported on first use
(so importing a package runs nothing and pulls in no torch). The heavy dependencies of
single features (DeepSpeed, torch_geometric, METIS, OR-Tools, Triton, matplotlib) are
optional extras of the distribution: :func:`require` imports one where a feature needs it
and, when it is not installed, raises :class:`MissingExtra` naming the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable, Mapping


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` resolving ``exports`` (name -> submodule)."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(f".{exports[name]}", package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


# optional package (its top-level import name) -> (the pip distribution, the extra of
# commsched that installs it); pyproject.toml's [project.optional-dependencies] lists each
# distribution under its extra, and ``all`` holds every extra
OPTIONAL: dict[str, tuple[str, str]] = {
    "torch_geometric": ("torch_geometric", "gnn"),  # named data sets, gin/gat, distributed()
    "pymetis": ("pymetis", "gnn"),  # METIS partitioning
    "ortools": ("ortools", "gnn"),  # the CP-SAT bit-width models (adaqp, adaptive)
    "scipy": ("scipy", "gnn"),  # reading Planetoid's raw files (cora, citeseer, pubmed)
    "deepspeed": ("deepspeed", "moe"),  # the DeepSpeed-MoE baseline (--impl deepspeed)
    "triton": ("triton", "gpu"),  # the quantization kernels for CUDA tensors
    "matplotlib": ("matplotlib", "plots"),  # figures of benches and topologies
    "transformers": ("transformers", "hf"),  # transformers MoE models made expert-parallel
}


class MissingExtra(ImportError):
    """An optional dependency a feature needs is not installed; the message names the
    feature, the package and the ``pip install 'commsched[EXTRA]'`` that provides it."""

    def __init__(self, message: str, *, name: str, extra: str):
        super().__init__(message, name=name)
        self.extra = extra


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` (a package of :data:`OPTIONAL` or one of its submodules) for
    ``feature`` (what the user asked for, e.g. ``"--impl deepspeed"``) and return it; a
    :class:`MissingExtra` when its package is not installed."""
    top = module.partition(".")[0]
    if top not in OPTIONAL:
        raise ValueError(f"require({module!r}): {top!r} is not an optional dependency; "
                         f"known: {', '.join(sorted(OPTIONAL))}")
    dist, extra = OPTIONAL[top]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = e.name or ""
        if missing != module and not module.startswith(missing + "."):
            raise  # the package is there but something it needs is broken: its own error
        raise MissingExtra(
            f"{feature} needs {dist}, which is not installed; install it with "
            f"pip install 'commsched[{extra}]' (or pip install 'commsched[all]' for every "
            "optional feature)", name=top, extra=extra) from None


__all__ = ["OPTIONAL", "MissingExtra", "lazy_getattr", "require"]
