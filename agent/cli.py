"""The `m3-agent` command line: a thin layer over the library.

Every sub-command lives next to the code it drives and is registered here.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from agent.errors import M3AgentError

app = typer.Typer(
    name="m3-agent",
    help="Agentic coding assistant for self-hosted MiniMax-M3 (vLLM / SGLang).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

err_console = Console(stderr=True, highlight=False)


def _register() -> None:
    from agent import fix as fix_cmd
    from agent import standin as standin_cmd
    from agent import trajectory as trajectory_cmd
    from agent.context import cli as pack_cmd
    from agent.serving import cli as serve_cmd
    from evals import cli as eval_cmd
    from sandbox import cli as sandbox_cmd

    app.command("fix", help="Fix an issue in a repository; hands back a branch and a patch.")(fix_cmd.fix_command)
    app.command("pack", help="Pack a repository into one prompt for the 1M window.")(pack_cmd.pack_command)
    app.command("standin", help="Run the M3 stand-in server (a scripted TEST DOUBLE, not a model).")(
        standin_cmd.standin_command
    )
    app.command("show", help="Render a trajectory (JSONL) file.")(trajectory_cmd.show_command)
    app.add_typer(eval_cmd.app, name="eval", help="SWE-style evaluation: run the agent on tasks, grade predictions.")
    app.add_typer(serve_cmd.app, name="serve", help="Launch, plan and benchmark a self-hosted M3 endpoint.")
    app.add_typer(sandbox_cmd.app, name="sandbox", help="Build the sandbox image, prune leftover containers.")
    if hasattr(fix_cmd, "config_app"):
        app.add_typer(fix_cmd.config_app, name="config", help="Show the effective configuration.")


_register()


def main(argv: list[str] | None = None) -> None:
    """Entry point of the console script: one-line errors, documented exit codes."""
    try:
        app(args=argv)  # standalone: usage errors exit 2, --help exits 0
    except KeyboardInterrupt:
        err_console.print("m3-agent: interrupted: trajectory and results kept", markup=False, soft_wrap=True)
        sys.exit(130)
    except M3AgentError as e:
        err_console.print(f"m3-agent: error: {e}", markup=False, soft_wrap=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
