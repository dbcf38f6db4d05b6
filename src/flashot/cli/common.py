"""What every ``flashot`` command shares: exit codes, the JSON schema, the error type."""

from __future__ import annotations

__all__ = ["EXIT_ERROR", "EXIT_NOT_CONVERGED", "JSON_SCHEMA", "CliError"]

#: exit codes: 0 solved and converged, 1 a user mistake (one-line message), 2 bad
#: arguments (argparse), 3 solved but not converged
EXIT_ERROR, EXIT_NOT_CONVERGED = 1, 3
#: version of the ``--json`` objects: every one holds ``schema`` and ``command``; the
#: solves name values as the API does (``cost`` is the OT value) and report the
#: ``backend`` and ``precision`` that ran (2: renamed ``ot_cost``, added those keys)
JSON_SCHEMA = 2


class CliError(Exception):
    """A user mistake: printed as one line, exit code :data:`EXIT_ERROR`."""
