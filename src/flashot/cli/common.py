"""What every ``flashot`` command shares: exit codes, the JSON schema, the error type."""

from __future__ import annotations

__all__ = ["EXIT_ERROR", "EXIT_NOT_CONVERGED", "JSON_SCHEMA", "CliError", "parse_device"]

#: exit codes: 0 solved and converged, 1 a user mistake (one-line message), 2 bad
#: arguments (argparse), 3 solved but not converged
EXIT_ERROR, EXIT_NOT_CONVERGED = 1, 3
#: version of the ``--json`` objects: every one holds ``schema`` and ``command``; the
#: solves name values as the API does (``cost`` is the OT value) and report the
#: ``backend`` and ``precision`` that ran (2: renamed ``ot_cost``, added those keys)
JSON_SCHEMA = 2


class CliError(Exception):
    """A user mistake: printed as one line, exit code :data:`EXIT_ERROR`."""


def parse_device(name: str):
    """``--device``'s torch.device; a :class:`CliError` naming it when this machine lacks it.

    (torch imported here: the parsers stay free of it.)
    """
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise CliError(f"--device {name!r}: {err}") from err
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise CliError(f"--device {name}: CUDA is not available on this machine")
        if device.index is not None and device.index >= count:
            raise CliError(f"--device {name}: this machine has {count} CUDA device(s), "
                           f"cuda:0 to cuda:{count - 1}")  # fmt: skip
    return device
