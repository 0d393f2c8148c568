"""`m3-agent serve ...`"""

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("start")
def start() -> None:
    """Start an M3 server."""
    typer.echo("not yet", err=True)
    raise typer.Exit(2)
