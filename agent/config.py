"""One nested config for a run: each part's own pydantic model is a section of `AgentConfig`.

    config = AgentConfig(
        model=ModelConfig(base_url="http://gpu-node:8000/v1"),
        limits=LimitsConfig(max_turns=30),
    )

The same sections are the tables of `m3-agent.toml` (`[model]`, `[limits]`, `[sandbox]`, ...), the
`M3_AGENT_<SECTION>__<FIELD>` environment variables and the targets of the command-line flags: see
`m3_agent.settings`, which adds what only the commands use.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from m3_agent.agent.context.outline import DEFAULT_OUTLINE_MAX_TOKENS, DEFAULT_OUTLINE_SHARE
from m3_agent.agent.context.selection import DEFAULT_MAX_FILE_BYTES
from m3_agent.agent.model import ModelConfig
from m3_agent.agent.prompts import Prompts
from m3_agent.agent.stall import StallConfig
from m3_agent.agent.thinking import ThinkingConfig
from m3_agent.sandbox.config import SandboxConfig

__all__ = ["AgentConfig", "ContextConfig", "LimitsConfig", "ModelConfig", "SandboxConfig",
           "Prompts", "StallConfig", "ThinkingConfig"]

# Batch knobs that were `[context]` settings and are now `[eval]` ones (m3_agent.settings.ReuseConfig).
MOVED_TO_EVAL = frozenset({"shared_share", "delta"})



class ContextConfig(BaseModel):
    """How the repository is packed into the first message: the `[context]` section."""

    model_config = ConfigDict(extra="forbid")

    budget: int | None = Field(None, ge=0, description="tokens for the packed repository; None = from the window")
    reserve_tokens: int = Field(65_536, ge=0, description="room kept for the conversation to grow")
    include: list[str] = Field(default_factory=list, description="globs: pack only matching files")
    exclude: list[str] = Field(default_factory=list, description="globs: never pack matching files")
    max_file_bytes: int = Field(DEFAULT_MAX_FILE_BYTES, gt=0, description="skip larger files when packing")
    history: str | None = Field(None, description="a git repository whose recent commits order the packed files, "
                                "least changed first (default: the packed repository)")
    outline_share: float = Field(DEFAULT_OUTLINE_SHARE, ge=0, le=0.5,
                                 description="share of the budget for outlines of the files left out; 0 = none")
    outline_max_tokens: int = Field(DEFAULT_OUTLINE_MAX_TOKENS, ge=0, description="most tokens of those outlines")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        """The batch knobs left this section: say where they went rather than only that they are unknown."""
        if isinstance(data, dict):
            if "history_commit" in data:
                raise ValueError("context.history_commit is gone: `eval run` gives each instance's pack its commit")
            moved = sorted(MOVED_TO_EVAL.intersection(data))
            if moved:
                raise ValueError(f"context.{moved[0]} moved: only `eval run` uses it; set eval.{moved[0]} "
                                 "(the [eval] table of m3-agent.toml, or EvalConfig.reuse)")
        return data


class LimitsConfig(BaseModel):
    """When a run stops, and what it costs: the `[limits]` section."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(40, ge=1, description="turn limit")
    max_total_tokens: int | None = Field(None, gt=0, description="prompt + completion tokens over the run")
    max_wall_s: float | None = Field(None, gt=0, description="wall-clock limit of one run, seconds")
    max_cost_usd: float | None = Field(None, gt=0, description="cost limit of one run, USD")
    usd_per_m_input: float | None = Field(None, ge=0, description="price: USD per 1M input tokens")
    usd_per_m_output: float | None = Field(None, ge=0, description="price: USD per 1M output tokens")
    gpu_usd_per_hour: float | None = Field(None, ge=0, description="self-hosted price: GPU USD per hour of wall time")
    max_format_errors: int = Field(3, ge=1, description="turns in a row whose every tool call was malformed")
    max_sandbox_restarts: int = Field(
        2, ge=0, description="fresh sandboxes a run may start after the one in use died (workspace restored); "
        "0: none, and no diff is taken after each tool call"
    )


class TestsConfig(BaseModel):
    """How the project's tests run: the `[tests]` section."""

    __test__ = False  # not a pytest class
    model_config = ConfigDict(extra="forbid")

    command: str | None = Field(
        None, description="the project's own test command; test_runner runs it with the agent's test paths as "
        "labels (after it, or where {tests} stands; `cd DIR && ...` runs it in DIR). Unset: the one the CI, tox or "
        "nox runs when it is not pytest, or Django's tests/runtests.py; else pytest"
    )


class AgentConfig(BaseModel):
    """Everything a run needs, one section per part: model, sandbox, context, thinking, stall, limits, prompts."""

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    context: ContextConfig = Field(default_factory=ContextConfig)
    thinking: ThinkingConfig = Field(default_factory=ThinkingConfig)
    stall: StallConfig = Field(default_factory=StallConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    tests: TestsConfig = Field(default_factory=TestsConfig)
    output_cap_chars: int = Field(10_000, ge=100, description="tool output kept in history: head + tail")
    test_cmd: str | None = Field(
        None, description="shell command whose exit status decides the verdict when the agent ran no tests"
    )
    prompts: Prompts = Field(default_factory=Prompts)
