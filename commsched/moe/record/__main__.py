"""``python -m commsched.moe.record``: the command line of :mod:`commsched.moe.record.cli`."""

from .cli import main

raise SystemExit(main())
