"""The `gpuledger collect` command group, shared by every collector.

Input: the root typer app. Output: one `collect` sub-command group on it, to which
each collector module (`producers.podresources`, `producers.kubernetes`, ...) adds its
own command from its `register(app)`.
Guarantees: `register` is idempotent — however many collectors call it, the group is
added once.
Limits: holds no logic; each collector's command loads its own settings.
"""

from __future__ import annotations

import typer

collect_app = typer.Typer(no_args_is_help=True, help="Run a collector: publish an external system's facts to Kafka.")


@collect_app.callback()
def _collect() -> None:
    """Run a collector: publish an external system's facts to Kafka."""
    # A callback keeps `collect` a group even while only one collector is registered;
    # without it typer would collapse the group into its single command.


def register(app: typer.Typer) -> None:
    """Add the `collect` group to ``app`` unless it is already there."""
    if any(group.typer_instance is collect_app for group in app.registered_groups):
        return
    app.add_typer(collect_app, name="collect")
