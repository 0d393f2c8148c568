"""m3-agent: an agentic coding assistant for self-hosted MiniMax-M3.

The data flow is Task -> RepoContext -> Agent loop (Model <-> Tools <-> Sandbox) -> Result ->
Grader -> Report. The parts are subpackages of this one import root: `m3_agent.agent` (the loop),
`m3_agent.tools`, `m3_agent.sandbox`, `m3_agent.evals`, `m3_agent.fix` and `m3_agent.serving`;
`m3_agent.api` is the public library API. See README.md for a runnable example.
"""

__version__ = "0.1.0"
