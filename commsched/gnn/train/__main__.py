"""``python -m commsched.gnn.train``: the command line of :mod:`commsched.gnn.train.cli`."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
