"""JSONL trajectories."""

import typer


def show_command() -> None:
    """Render a trajectory."""
    typer.echo("not yet", err=True)
    raise typer.Exit(2)
