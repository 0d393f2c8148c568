"""`m3-agent env build|show|prune`: a repository's environment image, ahead of a run, over the library.

    m3-agent env build --repo .      # what `fix` would build on first use (CI warms it this way)
    m3-agent env show --repo .       # its tag, the files that keyed it, the packages it holds
    m3-agent env prune               # images of older sandbox images, and all but the newest per repository
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from m3_agent.errors import UsageError
from m3_agent.hostgit import head_commit, repository
from m3_agent.sandbox.engine import docker_client, image_exists
from m3_agent.sandbox.env.build import (ENV_REPOSITORY, BuildRequest, ensure_environment, needs_environment,
                                        read_request, request_for, request_key)
from m3_agent.sandbox.env.catalogue import list_environments, prune_environments

app = typer.Typer(no_args_is_help=True)
console = Console(stderr=True, highlight=False, soft_wrap=True)  # a log is not wrapped at 80 columns

REPO = typer.Option(Path("."), "--repo", "-C", help="The repository (its HEAD commit, as `fix` sees it).")
CONFIG = typer.Option(None, "--config", help="Config file instead of m3-agent.toml / pyproject.")


KEEP_BROKEN = typer.Option(None, "--keep-broken-env/--no-keep-broken-env",
                           help="Keep the environment even when its own check fails (a notice says what failed).")


def _head_request(repo: Path, config: Optional[Path], keep_broken: Optional[bool] = None) -> BuildRequest:
    """The request `fix` would make for `repo`'s HEAD, with its [sandbox] settings. Its files are read from
    git's objects: the tree is exported only if a build is needed."""
    from m3_agent.settings import load_settings

    with repository(repo) as git_repo:
        head = head_commit(git_repo)
        if git_repo.working_tree_dir is None or head is None:
            raise UsageError(f"{repo} has no work tree or no commit yet: commit first")
        root = Path(git_repo.working_tree_dir)
    settings, _ = load_settings(root, {"--keep-broken-env": keep_broken}, config_file=config)
    return request_for(None, settings.sandbox, history=(root, head), source=root.name)


@app.command("build")
def build(repo: Path = REPO, config: Optional[Path] = CONFIG, keep_broken: Optional[bool] = KEEP_BROKEN) -> None:
    """Build the repository's environment image (nothing when it exists); prints its tag."""
    last = [0.0]
    request = _head_request(repo, config, keep_broken)
    with console.status("environment") as status:

        def progress(message: str) -> None:
            if not message.startswith("  "):
                console.print(f"[bold]>[/] {message}", markup=True)
            elif console.is_terminal:
                status.update(message.strip()[:120])
            elif time.monotonic() - last[0] > 5:  # a log, not a terminal: a detail line now and then
                last[0] = time.monotonic()
                console.print(message[:160], markup=False)

        env = ensure_environment(request, progress=progress)
    if env is None:
        console.print("nothing to build: the repository declares no dependencies and no setup command is set")
        return
    console.print(f"{'built' if env.built else 'already built'}: {env.tag} ({env.seconds:.1f} s)")
    if env.notice:
        console.print(f"notice: {env.notice}", markup=False, soft_wrap=True)
    typer.echo(env.tag)


def environments_table(envs: list[dict]) -> Table:
    """`env show --all`: one row per image; the tag whole, to copy (the other columns give way)."""
    table = Table(title="m3-agent environment images", title_justify="left")
    table.add_column("tag", no_wrap=True, min_width=max((len(e["tag"]) for e in envs), default=3))
    for col in ("for", "builder", "created", "size", "packages", "on current sandbox image"):
        table.add_column(col)
    for e in envs:
        table.add_row(e["tag"], e["source"], e["builder"], e["created"], f"{e['size_mb']:.0f} MB",
                      str(len(e["packages"])), "yes" if e["base_current"] else "no")
    return table


@app.command("show")
def show(repo: Path = REPO, config: Optional[Path] = CONFIG,
         all_: bool = typer.Option(False, "--all", help="Every environment image on this engine."),
         json_out: bool = typer.Option(False, "--json", help="One JSON object.")) -> None:
    """The repository's environment: its tag, whether it is built, the files that key it, its packages."""
    if all_:
        envs = [asdict(e) for e in list_environments()]
        if json_out:
            typer.echo(json.dumps(envs, indent=2))
            return
        Console(highlight=False).print(environments_table(envs))
        return
    info = _describe(_head_request(repo, config))
    if json_out:
        typer.echo(json.dumps(info, indent=2))
        return
    out = Console(highlight=False)
    if info["tag"] is None:
        out.print("no environment: the repository declares no dependencies; the sandbox image is used as it is")
        return
    out.print(f"environment: {info['tag']}  ({'built' if info['built'] else 'not built yet: m3-agent env build'})")
    out.print(f"base image:  {info['base']}")
    for path, sha in info["files"].items():
        out.print(f"keyed by:    {path}  (blob {sha[:12]})")
    out.print(f"releases:    {'before ' if info['releases'] != 'today' else 'as of '}{info['releases']}")
    if info["setup"]:
        out.print(f"setup:       {info['setup']}")
    for requirement, source in info["sources"].items():
        out.print(f"asked for:   {requirement}  ({source})", markup=False)
    if info["check"]:
        out.print(f"check:       {info['check']}", markup=False, soft_wrap=True)
    for line in info["packages"]:
        out.print(f"  {line}", markup=False)


def _describe(request: BuildRequest) -> dict:
    """What `env show` prints for one repository."""
    info = {"tag": None, "built": False, "base": request.base, "files": {}, "setup": request.setup, "packages": [],
            "releases": None, "sources": {}, "check": None}
    read = read_request(request)
    if not needs_environment(request, read):
        return info
    with contextlib.closing(docker_client()) as client:
        key, info["files"] = request_key(client, request, read)
        info["releases"] = read.cutoff or "today"
        info["tag"] = f"{ENV_REPOSITORY}:{key}"
        info["built"] = image_exists(client, info["tag"])
    found = next((e for e in list_environments() if e.tag == info["tag"]), None) if info["built"] else None
    info["packages"] = found.packages if found else []
    info["sources"] = found.sources if found else {}
    info["check"] = found.check if found else None
    return info


@app.command("prune")
def prune(all_: bool = typer.Option(False, "--all", help="Remove every environment image."),
          keep: int = typer.Option(1, min=0, help="Newest images kept per repository."),
          source: Optional[str] = typer.Option(None, "--source", help="Only this repository's (its folder name).")) -> None:
    """Remove environment images (a repository's, a task recipe's, an offline testbed's) built on an older
    image, and all but the newest per repository, task or instance."""
    removed = prune_environments(keep=keep, all=all_, source=source)
    for tag in removed:
        typer.echo(tag)
    console.print(f"removed {len(removed)} environment image(s)")
