"""`m3-agent config show`: every setting's effective value and where it came from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from m3_agent.errors import M3AgentError, UsageError
from m3_agent.hostgit import repository
from m3_agent.settings import display_rows, load_settings

config_app = typer.Typer(no_args_is_help=True, help="Show the effective configuration.")


@config_app.command("show")
def config_show(
    repo: Path = typer.Option(Path("."), "--repo", "-C", help="Repository whose config files apply."),
    config: Optional[Path] = typer.Option(None, "--config", help="Config file instead of m3-agent.toml / pyproject."),
    json_out: bool = typer.Option(False, "--json", help="A JSON list of {name, value, source}."),
) -> None:
    """Print every setting's effective value and where it came from (secrets masked)."""
    if not repo.is_dir():
        raise UsageError(f"not a directory: {repo}")
    try:
        with repository(repo) as git_repo:
            root = Path(git_repo.working_tree_dir or repo)
    except M3AgentError:
        root = repo  # config files work outside git repositories too
    settings, sources = load_settings(root, config_file=config)
    rows = display_rows(settings, sources)
    if json_out:
        typer.echo(json.dumps([{"name": n, "value": v, "source": s} for n, v, s in rows], indent=2))
        return
    table = Table(title=f"m3-agent configuration ({root})", title_justify="left")
    for col in ("setting", "value", "source"):
        table.add_column(col)
    for name, value, source in rows:
        table.add_row(Text(name), Text(value), Text(source), style="dim" if source == "default" else None)
    Console(highlight=False).print(table)
