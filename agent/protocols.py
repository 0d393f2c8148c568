"""The contracts at the loop's seams: what `Agent` needs of a model and of where commands run.

    agent = Agent(config, model=MyModel(), env_factory=lambda repo: LocalEnvironment(repo))

The defaults are the real ones: `ModelClient` (an M3 endpoint through the openai SDK) and the Docker
`Sandbox`. Any object with these members will do; nothing needs to inherit from them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from m3_agent.agent.model import ModelReply
from m3_agent.agent.thinking import ThinkingMode
from m3_agent.sandbox.environment import Environment, EnvironmentFactory

__all__ = ["Environment", "EnvironmentFactory", "Model"]


@runtime_checkable
class Model(Protocol):
    """A chat model that calls tools: what the loop asks of `agent.model.ModelClient`."""

    @property
    def model(self) -> str:
        """The model's id (recorded in the trajectory); may ask the server the first time."""
        ...

    def max_model_len(self) -> int | None:
        """The context window in tokens, or None when unknown (the packed repository is then unbounded)."""
        ...

    def complete(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                 thinking_mode: ThinkingMode | None = None) -> ModelReply:
        """One request: the OpenAI-style history and tool schemas in, the reply (with usage) out.

        Raise `ContextOverflowError` when the history does not fit (the loop shrinks it and retries)
        and `EndpointError` when the model cannot be reached.
        """
        ...
