"""The ``commsched`` command: ``bench``, ``netem``, ``partition``, ``demo``.

Command-line parsing lives here and in the ``__main__`` modules only.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Sequence

USAGE = """usage: commsched COMMAND [ARGS...]

commands:
  bench WORKLOAD [--nproc N] [--bandwidth RATE] [--hosts K] [--repeat R] --out DIR
                  run a workload's variants side by side and write a summary
                  (workloads: {workloads})
  netem --rate RATE [--delay MS] [--hosts K] -- COMMAND...
                  run COMMAND under an emulated link (needs root, ip and tc)
  partition ...   write a graph partition folder (see `commsched partition -h`)
  demo            the main job on the embedded default (what `make demo` runs)

`commsched COMMAND -h` describes each command.
"""

# entry points, imported when their command runs
_COMMANDS = {
    "netem": "commsched.netem:main",
    "partition": "commsched.gnn.partition:main",
    "demo": "commsched.bench.demo:main",
}


def _load(spec: str) -> Callable[[Sequence[str]], int | None]:
    mod, fn = spec.split(":")
    return getattr(importlib.import_module(mod), fn)


def _bench(argv: Sequence[str]) -> int:
    from .bench.workloads import WORKLOADS, run_bench

    if not argv or argv[0] in ("-h", "--help"):
        print("usage: commsched bench WORKLOAD [options]\nworkloads: " + ", ".join(sorted(WORKLOADS))
              + "\n`commsched bench WORKLOAD -h` lists a workload's options.")
        return 0 if argv else 2
    name, rest = argv[0], list(argv[1:])
    try:
        run_bench(name, rest)  # --bandwidth / --hosts / --delay go to the emulator
    except ValueError as e:
        print(f"commsched bench: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"commsched bench: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        from .bench.workloads import WORKLOADS

        print(USAGE.format(workloads=", ".join(sorted(WORKLOADS))))
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        return _bench(rest)
    if cmd in _COMMANDS:
        rc = _load(_COMMANDS[cmd])(rest)
        return int(rc or 0)
    print(f"commsched: unknown command {cmd!r}\n" + USAGE.format(workloads="..."), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
