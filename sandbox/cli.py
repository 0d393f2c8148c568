"""`m3-agent sandbox build|prune`: the image and the leftovers, over the library functions."""

from __future__ import annotations

import time

import typer
from rich.console import Console

from m3_agent.sandbox.cleanup import prune, prune_scratch
from m3_agent.sandbox.env.catalogue import prune_environments
from m3_agent.sandbox.image import DEFAULT_IMAGE, build_image, prune_images

app = typer.Typer(no_args_is_help=True)
console = Console(stderr=True, highlight=False, soft_wrap=True)  # a log is not wrapped at 80 columns


@app.command("build")
def build(
    tag: str = typer.Option(DEFAULT_IMAGE, help="Image tag to build (the default carries the recipe hash)."),
    base: str = typer.Option(None, help="Base image with python3, pytest, git, patch (present or pullable)."),
) -> None:
    """Build the sandbox image (a registry if one answers, else debootstrap + docker import)."""
    last_detail = [0.0]
    with console.status(f"building {tag}") as status:

        def progress(message: str) -> None:
            if not message.startswith(("debootstrap:", "build:", "tar:")):
                console.print(f"[bold]>[/] {message}")
            elif console.is_terminal:
                status.update(message[:120])
            elif time.monotonic() - last_detail[0] > 5:  # a log, not a terminal: a detail line now and then
                last_detail[0] = time.monotonic()
                console.print(f"  {message[:160]}")

        result = build_image(tag, base=base, progress=progress)
    typer.echo(result)


@app.command("prune")
def prune_command(
    all_: bool = typer.Option(False, "--all", help="Remove every sandbox container, not only orphans."),
    images: bool = typer.Option(False, "--images", help="Also remove the images of older sandbox recipes, and the "
                                "environment images built on them (any builder's)."),
) -> None:
    """Remove sandbox containers left by processes that no longer run (all of them with --all), the
    checkouts and copies those processes left in the temp folder, and with --images the images older
    recipes left, with the environment images (of every builder) built on an image no longer current."""
    _report(prune(all=all_), "sandbox container(s)")
    _report(prune_scratch(), "scratch folder(s) of killed runs")
    if images:
        # Environments first: an image that others were built on cannot be removed before them.
        _report(prune_environments(stale_only=True), "environment image(s) built on older images")
        _report(prune_images(), "image tag(s) of older recipes")


def _report(removed: list[str], what: str) -> None:
    """Each name removed on stdout, the count on stderr."""
    for name in removed:
        typer.echo(name)
    console.print(f"removed {len(removed)} {what}")
