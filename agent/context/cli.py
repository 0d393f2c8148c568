"""`m3-agent pack`"""

import typer


def pack_command() -> None:
    """Pack a repository."""
    typer.echo("not yet", err=True)
    raise typer.Exit(2)
