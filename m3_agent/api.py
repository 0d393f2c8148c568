"""The public library API: everything an internal tool embeds, importable from one module.

Run the agent on a directory and watch it work:

    from pathlib import Path
    from m3_agent.api import Agent, AgentConfig, AgentEvent, LimitsConfig, ModelConfig

    def progress(event: AgentEvent) -> None:           # kinds: request, reply, tool_call, tool_result, stall, finish, ...
        print(event.turn, event.kind, event.data.get("name", ""))

    config = AgentConfig(model=ModelConfig(base_url="http://gpu-node:8000/v1"), limits=LimitsConfig(max_turns=30))
    agent = Agent(config, callbacks=[progress])
    result = agent.run(repo=Path("."), issue="parse_date() rejects ISO weeks")   # -> RunResult
    print(result.status, result.patch)

Hand in the parts (`Model`, `Environment`): your own model client, or commands run on this machine
in a temporary checkout instead of the Docker sandbox (no isolation):

    agent = Agent(config, model=my_model, env_factory=LocalEnvironment)

Or do what `m3-agent fix` does (issue sources, git safety, branch + `.patch`) from the same
layered configuration the command uses:

    from m3_agent.api import fix_issue, load_settings

    settings, _ = load_settings("path/to/repo", {"model.base_url": "http://gpu-node:8000/v1"})
    result = fix_issue("123", repo="path/to/repo", settings=settings)          # -> FixResult
    print(result.resolved, result.branch, result.patch_path)

And the eval runner: `run_eval(load_tasks("builtin"), None, EvalConfig(output_dir=..., agent=config))`.

Everything exported here is stable across minor versions; other modules are internals.
"""

from __future__ import annotations

from pathlib import Path

from m3_agent.agent.config import AgentConfig, ContextConfig, LimitsConfig, ModelConfig, StallConfig, ThinkingConfig
from m3_agent.errors import (EndpointAuthError, EndpointError, GitError, GitHubRateLimited, GitHubTokenMissing,
                             GitHubTokenScope, Interrupted, M3AgentError, PullRequestExists, PushRejected,
                             SandboxUnavailable, UsageError)
from m3_agent.fix.flow import FixOptions, fix_issue
from m3_agent.fix.result import FixResult
from m3_agent.fix.github import GitHubClient, Issue
from m3_agent.agent.events import AgentEvent
from m3_agent.agent.loop import Agent, RunResult
from m3_agent.agent.model import ModelReply
from m3_agent.agent.protocols import Environment, EnvironmentFactory, Model
from m3_agent.evals.report import build_report
from m3_agent.evals.config import EvalConfig
from m3_agent.evals.instance import InstanceResult
from m3_agent.evals.runner import RunOptions, run_eval
from m3_agent.evals.tasks import Task, load_tasks
from m3_agent.sandbox import DEFAULT_IMAGE, ExecResult, LocalEnvironment, SandboxConfig, build_image
from m3_agent.serving.endpoint import Served
from m3_agent.settings import Settings, load_settings
from m3_agent.tools import Tool, ToolArgs, ToolCallError, ToolResult, default_tools

__all__ = [
    # the agent, its configuration and its parts
    "Agent", "AgentConfig", "AgentEvent", "ContextConfig", "LimitsConfig", "ModelConfig", "StallConfig",
    "ThinkingConfig", "RunResult", "Model", "ModelReply", "Environment", "EnvironmentFactory", "LocalEnvironment",
    "ExecResult", "SandboxConfig", "DEFAULT_IMAGE", "build_image", "build_agent", "config_from_settings",
    # tools
    "Tool", "ToolArgs", "ToolCallError", "ToolResult", "default_tools",
    # `m3-agent fix` as a library, from the layered settings
    "fix_issue", "FixOptions", "FixResult", "Issue", "GitHubClient", "Settings", "load_settings",
    # evals
    "run_eval", "RunOptions", "EvalConfig", "InstanceResult", "Task", "load_tasks", "build_report",
    # errors: each carries its exit code
    "M3AgentError", "UsageError", "EndpointError", "EndpointAuthError", "SandboxUnavailable", "GitError",
    "PushRejected", "GitHubTokenMissing", "GitHubTokenScope", "PullRequestExists", "GitHubRateLimited",
    "Interrupted",
]


def config_from_settings(settings: Settings) -> AgentConfig:
    """The AgentConfig for `settings` (`model.base_url`, or the endpoint `serve` brings up, with its key)."""
    return settings.resolved_agent_config(Served(settings.serve), check=False)


def build_agent(
    repo: Path | str = ".",
    *,
    overrides: dict | None = None,
    callbacks: list | None = None,
    tools: list[Tool] | None = None,
    model: Model | None = None,
    env_factory: EnvironmentFactory | None = None,
) -> Agent:
    """An Agent configured like `m3-agent fix` in `repo` (config file, M3_AGENT_* env), plus `overrides`.

    `overrides` are settings by dotted path (e.g. `{"limits.max_turns": 10}`) or by flag (`{"--max-turns": 10}`);
    `tools` replaces the default tool set (add yours to `default_tools()`); `model` and `env_factory`
    replace the M3 client and the Docker sandbox (e.g. `env_factory=LocalEnvironment`).
    """
    settings, _ = load_settings(repo, overrides or {})
    return Agent(config_from_settings(settings), callbacks=callbacks, tools=tools, model=model,
                 env_factory=env_factory)
