"""One event stream: the loop emits each event once; the trajectory writer, the live progress panel and
user callbacks are its subscribers.

    def progress(event: AgentEvent) -> None:
        if event.kind == "reply":
            print(event.turn, event.data["usage"]["prompt_tokens"])

    Agent(config, callbacks=[progress]).run(repo, issue)

Kinds, in the order a run emits them (`data` holds the fields; the trajectory file writes them flat):

  run_start         repo, model, base_url, config, environment {kind, isolated}
  model             model, max_model_len, context_window, window_source (server | config | None), max_tokens
                    (the served model, discovered; the window the run packs for and the reply budget; `config`
                    is `AgentConfig.model.context_window`, which `fix` and `eval run` fill from the window
                    `serve start` recorded for the endpoint when `[model] context_window` is unset)
  pack              tokens, files, skipped, counter, budget       (again after a repack)
  message           index, message   (a message as it joins the conversation: recorded once, agent.conversation)
  request           thinking_mode, mode_reason, n_messages, tool_choice (auto | required), max_tokens
  tool_choice_fallback  message, tool_choice   (the server refused "required": "auto" from then on)
  thinking_dropped  message   (the server rejected the thinking-mode parameter: none is sent from then on)
  context_overflow  message, input_tokens, limit
  ran_on            input_tokens, limit, sent_estimate   (that overflow was the reply running on to the window's
                    end, not the prompt: the reply counts as cut off at max_tokens and is re-prompted)
  context_window    context_window, window_source (error), max_tokens   (a smaller window an overflow named)
  shrink            how: elided_tool_outputs (count, indices, content) | repacked (budget, index, message)
  reply             finish_reason, usage, total_usage, cache_hit_share, latency_s, attempts
                    (its content, reasoning and tool calls: the assistant `message` after it)
  text_tool_call    name, arguments, repair   (a tool call the reply wrote as text, read as its call)
  reprompt          reason (no_tool_call | cut_off), format_errors, tool_choice
                    (a reply without a tool call that does not end the run: the loop asks again)
  tool_call         id, name, arguments
  tool_result       id, name, ok, error_kind, data, changed_files, tests, duration_s
                    (its output, as the model reads it: the tool `message` before it)
  stall             rule, evidence, nudged
  sandbox_restart   reason, restored_diff_bytes, restored_files, restarts
                    (the environment died under a tool call, before the final diff or under the verdict's
                    test run: a fresh one holds the last known workspace)
  verify            source, passed, tests, command, test_turn, after_last_change, stale_turn, reason
                    (agent.verdict: which test run decides; emitted after the loop, before finish)
  finish            status, error, turns, usage, cache_hit_share, mode_counts, stalls, sandbox_restarts, timings,
                    cost_usd, patch, final_tests, verdict

`m3-agent fix` adds `fix_start` (issue, title, trajectory_path, base_commit, max_turns) before a run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field


class AgentEvent(BaseModel):
    """One thing that happened in a run: its kind, the turn, seconds since the run started, and its fields."""

    kind: str
    turn: int = 0
    t: float = 0.0
    data: dict[str, Any] = Field(default_factory=dict)


Subscriber = Callable[[AgentEvent], None]


class EventStream:
    """Hands each event to every subscriber in order; a subscriber's exception (Ctrl-C) propagates."""

    def __init__(self, subscribers: list[Subscriber]) -> None:
        self.subscribers = list(subscribers)
        self._t0 = time.monotonic()

    def emit(self, kind: str, turn: int = 0, **data: Any) -> None:
        """Make the event and give it to each subscriber."""
        if not self.subscribers:
            return
        # Built without validation: the loop is the only producer and its fields are already typed.
        event = AgentEvent.model_construct(kind=kind, turn=turn, t=round(time.monotonic() - self._t0, 4), data=data)
        for subscriber in self.subscribers:
            subscriber(event)
