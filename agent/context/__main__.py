"""`python -m agent.context ...`: the `m3-agent pack` command without loading the other commands."""

from __future__ import annotations

import gc
import sys

import typer

from agent.context.cli import pack_command
from agent.errors import M3AgentError


def main(argv: list[str] | None = None) -> None:
    """Run `pack` with the CLI's one-line errors and exit codes."""
    gc.disable()  # a short-lived process with thousands of small objects and no cycles worth collecting
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(help="Pack a repository into one prompt for the 1M window.")(pack_command)
    try:
        app(args=argv, prog_name="m3-agent pack")
    except KeyboardInterrupt:
        print("m3-agent: interrupted", file=sys.stderr)
        sys.exit(130)
    except M3AgentError as e:
        print(f"m3-agent: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
