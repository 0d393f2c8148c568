"""What an eval run's instances need besides their tasks: one `EvalConfig`, shipped to every worker as JSON."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from m3_agent.agent.config import AgentConfig
from m3_agent.sandbox import SandboxConfig
from m3_agent.settings import ReuseConfig


class EvalConfig(BaseModel):
    """Everything an instance needs besides its task: where repositories are, sandbox, limits, agent."""

    model_config = ConfigDict(protected_namespaces=())

    output_dir: Path
    repos: Path | None = None
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    test_timeout: float = Field(600.0, gt=0, description="seconds for the test command of one instance")
    instance_timeout: float = Field(3600.0, gt=0, description="seconds for one whole instance (agent + grading)")
    model_name: str = "m3-agent"
    agent: AgentConfig | None = Field(None, description="the agent's config: set for `eval run`, None to grade")
    reuse: ReuseConfig = Field(default_factory=ReuseConfig, description="batch reuse (`eval run`): the [eval] section")
    batches: dict[str, str] = Field(default_factory=dict, description="repository -> the id its batch's orders are "
                                    "stored under (set by run_eval: evals.reuse.ordering.order_for_commits)")
    image_namespace: str | None = Field("swebench", description="registry namespace of SWE-bench instance images")
    image_tag: str = Field("latest", description="tag of SWE-bench instance images")


def trajectory_folder(config: EvalConfig) -> Path:
    """Where the agent's trajectories of a run go, one `<instance_id>.jsonl` each."""
    return config.output_dir / "trajectories"


def worker_config_json(config: EvalConfig) -> str:
    """The config for a worker process: secrets (the API key) in clear, as the worker must send them."""
    return config.model_dump_json(context={"secrets": True})
