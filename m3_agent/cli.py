"""The `m3-agent` command line: a thin layer over the library.

Every sub-command lives next to the code it drives and is registered here, lazily: running one
sub-command imports only its own module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import import_module
from typing import TYPE_CHECKING, Any

from m3_agent.errors import M3AgentError, sigterm_as_interrupt

if TYPE_CHECKING:
    import typer

# Sub-command -> (what declares it, help). A Typer app with help becomes a group (`m3-agent eval run`); one
# without gives its commands to `m3-agent` (`fix` as fix/cli.py declares it); a function is one command.
# Only the one being run is imported: start-up stays fast.
COMMANDS: dict[str, tuple[Callable[[], Any], str | None]] = {
    "fix": (lambda: import_module("m3_agent.fix.cli").app, None),
    "pack": (lambda: import_module("m3_agent.pack_cli").app, None),
    "standin": (lambda: import_module("m3_agent.standin.server").standin_command,
                "Run the M3 stand-in server (a scripted TEST DOUBLE, not a model)."),
    "show": (lambda: import_module("m3_agent.agent.trajectory").show_command, "Render a trajectory (JSONL) file."),
    "eval": (lambda: import_module("m3_agent.evals.cli").app,
             "SWE-style evaluation: run the agent on tasks, grade predictions."),
    "serve": (lambda: import_module("m3_agent.serving.cli").app,
              "Launch, plan and benchmark a self-hosted M3 endpoint."),
    "sandbox": (lambda: import_module("m3_agent.sandbox.cli").app,
                "Build the sandbox image, prune leftover containers."),
    "config": (lambda: import_module("m3_agent.config_cli").config_app, "Show the effective configuration."),
    "env": (lambda: import_module("m3_agent.env_cli").app, "A repository's environment image: build, show, prune."),
}


def _print_version(asked: bool) -> None:
    if asked:
        import typer
        from importlib.metadata import version

        typer.echo(f"m3-agent {version('m3-agent')}")
        raise typer.Exit()


def build_app(only: str | None = None) -> typer.Typer:
    """The `m3-agent` app with every sub-command, or just `only` when it names one."""
    import typer

    app = typer.Typer(
        name="m3-agent",
        help="Agentic coding assistant for self-hosted MiniMax-M3 (vLLM / SGLang).",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )

    # A callback keeps `m3-agent NAME ...` a group even when only one command is registered.
    @app.callback()
    def root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                          help="Print the installed m3-agent's version and exit.")) -> None:
        """Agentic coding assistant for self-hosted MiniMax-M3 (vLLM / SGLang)."""

    for name, (load, help_text) in COMMANDS.items():
        if only in COMMANDS and name != only:
            continue
        declared = load()
        if not isinstance(declared, typer.Typer):
            app.command(name, help=help_text)(declared)
        elif help_text is None:
            app.registered_commands += declared.registered_commands  # in --help order
        else:
            app.add_typer(declared, name=name, help=help_text)
    return app


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script: one-line errors, documented exit codes."""
    args = sys.argv[1:] if argv is None else list(argv)
    from rich.console import Console

    err_console = Console(stderr=True, highlight=False)
    app = build_app(args[0] if args else None)
    try:
        with sigterm_as_interrupt():  # every command: SIGTERM stops it as Ctrl-C does (exit 130)
            app(args=args, prog_name="m3-agent")  # standalone: usage errors exit 2, --help exits 0
    except KeyboardInterrupt:
        err_console.print("m3-agent: interrupted: trajectory and results kept", markup=False, soft_wrap=True)
        sys.exit(130)
    except M3AgentError as e:
        err_console.print(f"m3-agent: error: {e}", markup=False, soft_wrap=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
