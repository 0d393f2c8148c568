"""The `m3-agent` command line: a thin layer over the library.

Every sub-command lives next to the code it drives and is registered here, lazily: running one
sub-command imports only its own module.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from m3_agent.errors import M3AgentError, sigterm_as_interrupt

if TYPE_CHECKING:
    import typer


def _fix(app: typer.Typer) -> None:
    from m3_agent.fix import cli as fix

    app.registered_commands += fix.app.registered_commands  # `fix` as fix/cli.py declares it, in --help order


def _config(app: typer.Typer) -> None:
    from m3_agent import config_cli

    app.add_typer(config_cli.config_app, name="config", help="Show the effective configuration.")


def _pack(app: typer.Typer) -> None:
    from m3_agent import pack_cli as pack

    app.registered_commands += pack.app.registered_commands


def _standin(app: typer.Typer) -> None:
    from m3_agent.serving import standin

    app.command("standin", help="Run the M3 stand-in server (a scripted TEST DOUBLE, not a model).")(
        standin.standin_command
    )


def _show(app: typer.Typer) -> None:
    from m3_agent.agent import trajectory

    app.command("show", help="Render a trajectory (JSONL) file.")(trajectory.show_command)


def _eval(app: typer.Typer) -> None:
    from m3_agent.evals import cli

    app.add_typer(cli.app, name="eval", help="SWE-style evaluation: run the agent on tasks, grade predictions.")


def _serve(app: typer.Typer) -> None:
    from m3_agent.serving import cli

    app.add_typer(cli.app, name="serve", help="Launch, plan and benchmark a self-hosted M3 endpoint.")


def _sandbox(app: typer.Typer) -> None:
    from m3_agent.sandbox import cli

    app.add_typer(cli.app, name="sandbox", help="Build the sandbox image, prune leftover containers.")


def _env(app: typer.Typer) -> None:
    from m3_agent import env_cli

    app.add_typer(env_cli.app, name="env", help="A repository's environment image: build, show, prune.")


# Sub-command -> what registers it. Only the one being run is imported: start-up stays fast.
COMMANDS = {"fix": _fix, "pack": _pack, "standin": _standin, "show": _show, "eval": _eval, "serve": _serve,
            "sandbox": _sandbox, "config": _config, "env": _env}


def _root() -> None:
    """Agentic coding assistant for self-hosted MiniMax-M3 (vLLM / SGLang)."""


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
    app.callback()(_root)  # keeps `m3-agent NAME ...` a group even when only one command is registered
    for name, register in COMMANDS.items():
        if only is None or only not in COMMANDS or name == only:
            register(app)
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
