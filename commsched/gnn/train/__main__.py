"""``python -m commsched.gnn.train``: the command line of :mod:`commsched.gnn.train.cli`."""

from .cli import main

raise SystemExit(main())
