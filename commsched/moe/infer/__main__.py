"""``python -m commsched.moe.infer``: the command line of :mod:`commsched.moe.infer.cli`."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
