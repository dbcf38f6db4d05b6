"""``python -m flashot.cli``: the ``flashot`` command."""

from flashot.cli import main

raise SystemExit(main())
