"""`gpuledger`: the one command in front of every component (``main`` is the console script).

One module per command group (``kafka``, ``topics``, ``db``, ``schemas``, ``worker``,
``read`` — sql and trace —, ``audit``, ``collect``, ``receive``, ``release``,
``exercise``, ``replay``); each imports its component inside the command, so ``gpuledger X --help``
loads typer and little else. Only this package catches errors and turns them into exits
(``_common.fail``); nothing outside it imports it.
"""

from __future__ import annotations

import sys

from gpuledger.cli.root import app

__all__ = ["app", "main"]


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
