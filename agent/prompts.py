"""Every text the agent writes into a conversation, as `str.format` templates: the `[prompts]` section.

    [prompts]
    reprompt = "No tool call, nothing happened. Use one of: {tools}."

Each template may use only its own placeholders (`PLACEHOLDERS`); `{{` and `}}` are literal braces. A
template naming any other is refused when the configuration is read, not at the turn that would use it.
"""

from __future__ import annotations

from string import Formatter
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

PLACEHOLDERS: dict[str, tuple[str, ...]] = {
    "system": (), "instance": ("pack", "issue"), "reprompt": ("tools",), "cut_off": (),
    "nudge": ("rule", "evidence", "advice"), "stall_advice": (), "restart": ("reason", "restored", "restarts", "limit"),
}


class Prompts(BaseModel):
    """The system and instance prompts, the re-prompts, the stall nudge (with its advice per rule, `other`
    for the rest) and the notice of a sandbox restart, given as the result of the call it died under."""

    model_config = ConfigDict(extra="forbid")

    system: str = (
        "You are m3-agent, an autonomous software engineer working on a code repository.\n"
        "The whole repository (or as much of it as fits) is in the first user message, followed by an issue.\n"
        "Work only through the tools: read and edit files, run commands and tests in the sandbox\n"
        "(the repository is at /workspace; there is no network). Make the smallest correct change that\n"
        "resolves the issue, run the relevant tests to confirm it, then call `submit`.")
    # the repository first, so that issues of one repository share the server's prefix cache
    instance: str = ("{pack}\n\n<issue>\n{issue}\n</issue>\n\nResolve the issue above in /workspace. "
                     "Use the tools; run the tests; call `submit` when the fix is done.")
    reprompt: str = ("Your reply made no tool call, so nothing happened. Work only through tool calls: {tools}. "
                     "A reply without one does not end the task: when the change is made and its tests pass, "
                     "call `submit`.")
    cut_off: str = "Your reply was cut off (max_tokens reached). Reply more briefly, and make one tool call at a time."
    nudge: str = ("Stall detected ({rule}): {evidence}.\n{advice}\n"
                  "Think before you act. If this continues, the run will be stopped as stalled.")
    stall_advice: dict[str, str] = Field(default_factory=lambda: {
        "same_failing_tests": "Your recent changes did not change which tests fail. Re-read the failure "
        "output and the code under test, question your assumption about the cause, and try a different fix.",
        "repeated_action": "Repeating the same action gives the same result. Do something different.",
        "repeated_error": "This action keeps failing. Read the error, change the command or its "
        "arguments, or take another route.",
        "monologue": "You keep sending the same message. Call a tool to make progress, or submit.",
        "alternation": "You are going back and forth between two actions. Stop and decide on one "
        "concrete next step.",
        "condensation": "The context keeps being condensed. Work in smaller steps and keep outputs short.",
        "no_file_change": "Nothing has been edited for a while. Make a concrete change, or submit if done.",
        "other": "Step back and try a different approach.",
    })
    restart: str = (
        "The sandbox died during this tool call ({reason}). m3-agent started a fresh sandbox and restored "
        "/workspace to {restored}. This call's own effects are lost, and so are running processes, files "
        "outside /workspace and anything installed. Re-run what you still need, and avoid what killed it "
        "(memory, processes, output). Restart {restarts} of at most {limit}.")

    @field_validator("*")
    @classmethod
    def _known_placeholders(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse a template that names a placeholder it is not given (or has a lone brace)."""
        allowed = PLACEHOLDERS[str(info.field_name)]
        for text in value.values() if isinstance(value, dict) else [value]:
            unknown = sorted({f for _, f, _, _ in Formatter().parse(text) if f is not None} - set(allowed))
            if unknown:
                known = ", ".join(f"{{{p}}}" for p in allowed) or "none"
                raise ValueError(f"unknown placeholder {{{unknown[0]}}}; this template's placeholders: {known}")
        return value

    def render(self, name: str, **values: Any) -> str:
        """The template `name` filled in with `values`."""
        return getattr(self, name).format(**values)

    def advice(self, rule: str) -> str:
        """The nudge's advice for a stall rule."""
        return self.stall_advice.get(rule, self.stall_advice.get("other", ""))
