"""Thinking-mode policy: which `chat_template_kwargs.thinking_mode` each request carries.

MiniMax-M3 takes `enabled`, `disabled` or `adaptive` per request. A fixed policy sends the same mode
every time; the `controller` policy picks one from the loop's state before each request:

    policy = ThinkingPolicy(ThinkingConfig(policy="controller", think_every_n_turns=8))
    mode, reason = policy.decide(LoopState(turn=1))          # ("enabled", "plan the first turn")

Controller rules, first match wins:
  1. a stall was just detected                         -> enabled   (on_stall)
  2. the first turn                                    -> enabled   (plan_first_turn)
  3. a tool call failed in the previous turn           -> enabled   (after_tool_error)
  4. tests failed in the previous turn                 -> enabled   (after_test_failure)
  5. the previous reply could not be parsed            -> enabled   (after_format_error)
  6. every n-th turn, to re-plan                       -> enabled   (think_every_n_turns)
  7. a routine turn after a successful edit or read    -> `routine` (disabled unless configured)
  8. anything else                                     -> `default` (adaptive unless configured)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LoopState", "ThinkingConfig", "ThinkingMode", "ThinkingPolicy"]

# The one definition: the model client and the policy both use it.
ThinkingMode = Literal["enabled", "disabled", "adaptive"]

# Tools that only look at the workspace; a clean turn of these is routine work.
DEFAULT_READ_TOOLS = ("file_read",)


class ThinkingConfig(BaseModel):
    """Which thinking policy to use and, for the controller, when to think."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["enabled", "disabled", "adaptive", "controller"] = Field(
        "controller", description="thinking policy: controller | enabled | disabled | adaptive")
    plan_first_turn: bool = True
    after_test_failure: bool = True
    after_tool_error: bool = True
    after_format_error: bool = True
    on_stall: bool = True
    think_every_n_turns: int | None = Field(None, ge=1, description="re-plan every n turns; None = never")
    routine: ThinkingMode = "disabled"
    default: ThinkingMode = "adaptive"
    read_tools: list[str] = Field(default_factory=lambda: list(DEFAULT_READ_TOOLS))


@dataclass
class LoopState:
    """What the loop knows before sending request number `turn` (1-based)."""

    turn: int
    last_tools: list[str] = field(default_factory=list)
    last_tool_errors: int = 0
    last_tests_failed: bool | None = None
    last_edit_ok: bool = False
    stalled: bool = False
    format_errors_in_row: int = 0


class ThinkingPolicy:
    """Decides the thinking mode of each request; see the module docstring for the controller rules."""

    def __init__(self, config: ThinkingConfig | None = None) -> None:
        self.config = config or ThinkingConfig()

    def decide(self, state: LoopState) -> tuple[ThinkingMode, str]:
        """Return (mode, short reason for the trajectory) for the request about to be sent."""
        c = self.config
        if c.policy != "controller":
            return c.policy, f"fixed policy: {c.policy}"
        if c.on_stall and state.stalled:
            return "enabled", "stall detected"
        if c.plan_first_turn and state.turn <= 1:
            return "enabled", "plan the first turn"
        if c.after_tool_error and state.last_tool_errors > 0:
            return "enabled", f"{state.last_tool_errors} tool error(s) in the previous turn"
        if c.after_test_failure and state.last_tests_failed:
            return "enabled", "tests failed in the previous turn"
        if c.after_format_error and state.format_errors_in_row > 0:
            return "enabled", f"{state.format_errors_in_row} format error(s) in a row"
        if c.think_every_n_turns and state.turn > 1 and (state.turn - 1) % c.think_every_n_turns == 0:
            return "enabled", f"re-plan every {c.think_every_n_turns} turns"
        if self._routine(state):
            return c.routine, "routine turn after a successful edit or read"
        return c.default, "no rule applied"

    def _routine(self, state: LoopState) -> bool:
        # Errors and test outcomes were handled above; only a clean turn of edits or reads is routine.
        if not state.last_tools or state.last_tool_errors or state.last_tests_failed is not None:
            return False
        return state.last_edit_ok or all(name in self.config.read_tools for name in state.last_tools)
