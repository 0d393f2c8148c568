"""`m3-agent sandbox ...`"""

import typer

app = typer.Typer(no_args_is_help=True)


@app.command("build")
def build() -> None:
    """Build the sandbox image."""
    typer.echo("not yet", err=True)
    raise typer.Exit(2)
