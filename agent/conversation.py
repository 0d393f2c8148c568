"""A run's conversation: its messages, the prompts that write into them, and the in-place changes that
make them fit the context window.

Each message is emitted once, as a `message` event, when it joins; each later change to one is a
`shrink` event (old tool outputs elided, or the first user message repacked), so the trajectory alone
rebuilds what the model saw at any turn (`agent.trajectory.messages_at`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from m3_agent.agent.prompts import Prompts

IssueInput = str | list[dict[str, Any]]  # text, or OpenAI content parts (text + image_url)
ELIDED = "[elided by m3-agent to fit the context window; re-run the tool if needed]"


def issue_text(issue: IssueInput) -> str:
    """The issue's text, without its images."""
    return issue if isinstance(issue, str) else "\n".join(p.get("text", "") for p in issue if p.get("type") == "text")


class Conversation:
    """The messages of one run, append-only but for shrinking. `emit(kind, **data)` records each change."""

    def __init__(self, prompts: Prompts, issue: IssueInput, emit: Callable[..., None]) -> None:
        self.prompts, self.issue, self.emit = prompts, issue, emit
        self.messages: list[dict[str, Any]] = []

    def add(self, message: dict[str, Any]) -> None:
        """Append a message; it is recorded as it is now."""
        self.messages.append(message)
        self.emit("message", index=len(self.messages) - 1, message=message)

    def say(self, prompt: str, **values: Any) -> None:
        """Append a user message written by the template `prompt`."""
        self.add({"role": "user", "content": self.prompts.render(prompt, **values)})

    def start(self, pack_text: str, system_note: str = "") -> None:
        """The system prompt (and `system_note`) and the first user message: the packed repository, then the issue."""
        self.add({"role": "system", "content": self.prompts.system + system_note})
        self.add({"role": "user", "content": self._instance(pack_text)})

    def _instance(self, pack_text: str) -> Any:
        text = self.prompts.render("instance", pack=pack_text, issue=issue_text(self.issue))
        if isinstance(self.issue, str):
            return text
        return [{"type": "text", "text": text}, *(p for p in self.issue if p.get("type") != "text")]

    def repack(self, pack_text: str, budget: int) -> None:
        """Replace the first user message with a smaller pack."""
        self.messages[1] = {"role": "user", "content": self._instance(pack_text)}
        self.emit("shrink", how="repacked", budget=budget, index=1, message=self.messages[1])

    def elide(self, keep: int = 2) -> int:
        """Replace the outputs of all tool results but the last `keep` with a note; how many changed."""
        tools = [i for i, m in enumerate(self.messages) if m.get("role") == "tool"][:-keep]
        indices = [i for i in tools if self.messages[i]["content"] != ELIDED]
        for i in indices:
            self.messages[i]["content"] = ELIDED
        if indices:
            self.emit("shrink", how="elided_tool_outputs", count=len(indices), indices=indices, content=ELIDED)
        return len(indices)
