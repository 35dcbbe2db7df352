"""``python -m commsched.moe.train``: the command line of :mod:`commsched.moe.train.cli`."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
