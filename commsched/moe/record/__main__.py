"""``python -m commsched.moe.record``: the command line of :mod:`commsched.moe.record.cli`."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
