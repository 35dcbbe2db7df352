"""What lina-overlap's machinery costs on the CPU, apart from the link.

Two single-process micro-benchmarks, each comparing the two sides interleaved in one run:

* ``optimizer`` -- one ``torch.optim.Adam`` over every non-expert parameter of the
  moe-train bench model's shape (d_model 256, 4 blocks, FFN 1024) against one Adam per
  module, as :class:`~commsched.priority.runtime.overlap.OverlapOptimizer` steps them;
* ``hooks`` -- a forward pass through 28 small modules with and without the optimizer's
  forward pre-hooks (one per module, unbound: each returns at once).

    python -m commsched.bench.micro.overlap_profile [--repeats 8] [--threads 1]

Prints one line per benchmark (medians; ratios). Not a test: timings only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from ...priority.runtime.overlap import OverlapOptimizer


def _dense_model(d: int = 256, blocks: int = 4, ff: int = 1024, vocab: int = 256, seq: int = 128) -> nn.Module:
    """The moe-train model's non-expert parameters, module by module (experts left out)."""
    parts: list[nn.Module] = [nn.Embedding(vocab, d), nn.Embedding(seq, d)]
    for _ in range(blocks):
        parts.append(nn.ModuleDict({"ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "o": nn.Linear(d, d),
                                    "ln2": nn.LayerNorm(d), "f1": nn.Linear(d, ff), "f2": nn.Linear(ff, d)}))
    parts += [nn.LayerNorm(d), nn.Linear(d, vocab)]
    return nn.ModuleList(parts)


def optimizer_costs(repeats: int) -> tuple[float, float, int]:
    """(median seconds of one Adam step over all parameters, of one Adam per module, modules)."""
    model = _dense_model()
    ps = list(model.parameters())
    leaves = [m for m in model.modules() if list(m.parameters(recurse=False))]
    one = torch.optim.Adam(ps, lr=1e-3)
    many = [torch.optim.Adam(list(m.parameters(recurse=False)), lr=1e-3) for m in leaves]
    a, b = [], []
    for _ in range(repeats):
        for out, step in ((a, one.step), (b, lambda: [o.step() for o in many])):
            for p in ps:
                p.grad = torch.randn_like(p)
            t = time.perf_counter()
            step()
            out.append(time.perf_counter() - t)
    return statistics.median(a), statistics.median(b), len(leaves)


def hook_costs(repeats: int, calls: int = 100) -> tuple[float, float, int]:
    """(median seconds of a forward pass without, with the pre-hooks; modules hooked)."""
    d = 256
    net = nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) for _ in range(14)])
    x = torch.randn(8, d)

    def fwd() -> float:
        t = time.perf_counter()
        with torch.no_grad():
            for _ in range(calls):
                net(x)
        return (time.perf_counter() - t) / calls

    plain, hooked = [], []
    for _ in range(repeats):
        plain.append(fwd())
        opt = OverlapOptimizer(net, lambda ps: torch.optim.Adam(ps))
        hooked.append(fwd())
        opt.close()
    return statistics.median(plain), statistics.median(hooked), 28


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a bench rank has 1 of the 2 cores' share)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    one, many, n = optimizer_costs(a.repeats)
    print(f"optimizer: one Adam {one * 1e3:.1f} ms, {n} Adams (one per module) {many * 1e3:.1f} ms: "
          f"{many / one:.2f}x", flush=True)
    plain, hooked, k = hook_costs(a.repeats)
    print(f"hooks: forward of {k} small modules {plain * 1e6:.0f} us without pre-hooks, {hooked * 1e6:.0f} us with: "
          f"{(hooked - plain) * 1e6 / k:.1f} us per hook call", flush=True)


if __name__ == "__main__":
    main()
