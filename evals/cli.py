"""`m3-agent eval ...`"""

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("run")
def run() -> None:
    """Run the agent on tasks, then grade."""
    typer.echo("not yet", err=True)
    raise typer.Exit(2)
