"""The M3 stand-in server: a scripted TEST DOUBLE that speaks vLLM's wire format. Not a model."""

import typer


def standin_command() -> None:
    """Run the stand-in."""
    typer.echo("not yet", err=True)
    raise typer.Exit(2)
