"""m3-agent: an agentic coding assistant for self-hosted MiniMax-M3.

The data flow is Task -> RepoContext -> Agent loop (Model <-> Tools <-> Sandbox) -> Result ->
Grader -> Report. See README.md for a runnable example.
"""

__version__ = "0.1.0"
