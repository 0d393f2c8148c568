"""`python -m agent.serving ...`: the `m3-agent serve` commands alone, without the rest of the CLI."""

import sys

from m3_agent.errors import M3AgentError
from m3_agent.serving.cli import app, err

try:
    app(prog_name="m3-agent serve")
except M3AgentError as e:
    err.print(f"m3-agent: error: {e}")
    sys.exit(e.exit_code)
