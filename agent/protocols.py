"""The contracts at the loop's seams: what `Agent` needs of a model and of where commands run.

    agent = Agent(config, model=MyModel(), env_factory=lambda repo: LocalEnvironment(repo))

The defaults are the real ones: `ModelClient` (an M3 endpoint through the openai SDK), the Docker
`Sandbox` and the packer of `agent.context` with the model's token counter. Any object with these
members will do; nothing needs to inherit from them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from m3_agent.agent.context.pack import Pack
from m3_agent.agent.context.tokens import TokenCounter
from m3_agent.agent.model import ModelReply
from m3_agent.agent.thinking import ThinkingMode
from m3_agent.sandbox.environment import Environment, EnvironmentFactory

__all__ = ["Environment", "EnvironmentFactory", "Model", "Packer", "TokenCounter"]


@runtime_checkable
class Model(Protocol):
    """A chat model that calls tools: what the loop asks of `agent.model.ModelClient`."""

    @property
    def model(self) -> str:
        """The model's id (recorded in the trajectory); may ask the server the first time."""
        ...

    def token_counter(self) -> TokenCounter:
        """How to count this model's tokens for the packed repository's budget: its server's count, or
        `agent.context.EstimateCounter()` when there is none to ask."""
        ...

    def max_model_len(self) -> int | None:
        """The context window in tokens, or None when unknown (the packed repository is then unbounded)."""
        ...

    def complete(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                 thinking_mode: ThinkingMode | None = None, tool_choice: str = "auto",
                 max_tokens: int | None = None) -> ModelReply:
        """One request: the OpenAI-style history and tool schemas in, the reply (with usage) out.

        `tool_choice` is "auto", or "required" after a reply without a tool call; `max_tokens` the
        completion tokens to ask for (None: the model's own setting); `thinking_mode` None sends none.
        Raise `ContextOverflowError` when the history does not fit (the loop shrinks it and retries),
        `ToolChoiceRefused` when the server cannot force a tool call (the loop asks with "auto" from
        then on), `ThinkingRejected` when it rejects the thinking-mode parameter (the loop sends none
        from then on) and `EndpointError` when the model cannot be reached.
        """
        ...


@runtime_checkable
class Packer(Protocol):
    """What packs the repository into the first message (default: `agent.context.Packer`)."""

    def pack(self, repo: Path, *, issue: str | None = None, budget: int | None = None,
             history: str | None = None) -> Pack:
        """`repo` as one prompt text within `budget` tokens, the files most relevant to `issue` first when
        it does not all fit; `history`: a git repository whose commits order the files."""
        ...
