"""`gpuledger schemas generate`: the JSON Schema files under schemas/json/, from the pydantic models."""

from __future__ import annotations

import typer

from gpuledger.cli._common import fail

app = typer.Typer(no_args_is_help=True, help="The shared event schemas.")


@app.command("generate")
def schemas_generate(check: bool = typer.Option(False, "--check", help="Fail if the committed files differ instead of writing.")) -> None:
    """Write JSON Schema files under schemas/json/ from the pydantic models."""
    from schemas.jsonschema import write_all

    changed = write_all(check=check)
    if check and changed:
        fail("JSON Schema files are out of date: " + ", ".join(changed) + " (run `gpuledger schemas generate`)")
    print("\n".join(changed) if changed else "schemas up to date")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="schemas")
