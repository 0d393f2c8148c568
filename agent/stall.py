"""Stall detection: notice when the agent repeats itself without progress.

The loop feeds every tool call and its result (or a plain assistant message) to a `StallDetector`,
marks the end of each turn, and asks `check()` after each turn:

    detector = StallDetector(StallConfig(same_failures_runs=3))
    detector.record(Step(turn=4, tool="bash", args={"command": "pytest -q"},
                         output="1 failed in 0.03s", exit_code=1, failing_tests=["t.py::test_x"]))
    detector.end_turn(4)
    if (stall := detector.check()) is not None:
        conversation.say("nudge", rule=stall.rule, evidence=stall.evidence, advice=...)  # agent.prompts
        detector.user_message()          # the window restarts; a second detection means "stop"

Rules, all looking only at history since the last user message (OpenHands' window):
  same_failing_tests  the same failing test set across N consecutive test runs (seed 001)
  repeated_action     the last N actions equal and their observations equal
  repeated_error      the last N actions equal and every one failed (tool error or non-zero exit)
  monologue           the last N assistant messages identical with no tool call between
  alternation         two actions alternating A,B,A,B,... with matching observations
  condensation        N context condensations in a row with nothing else between
  no_file_change      no file changed in K turns

Actions compare by tool name + canonical arguments (sorted JSON), never by the thought text around
them; observations compare by `normalize(output)` + exit code, so timings, pids, addresses, temp
paths and the like cannot hide a loop. A step whose command is still running never counts.
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Stall", "StallConfig", "StallDetector", "Step", "normalize"]


class StallConfig(BaseModel):
    """Stall thresholds. Any threshold set to 0 or None switches that rule off."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    same_failures_runs: int | None = Field(3, ge=0, description="same failing tests across N test runs")
    repeat_actions: int | None = Field(4, ge=0, description="N equal actions with equal observations")
    repeat_errors: int | None = Field(3, ge=0, description="N equal actions, all failing")
    monologue: int | None = Field(3, ge=0, description="N identical assistant messages in a row")
    alternation: int | None = Field(6, ge=0, description="A,B,A,B,... over N actions")
    condensations: int | None = Field(10, ge=0, description="N context condensations in a row")
    no_change_turns: int | None = Field(10, ge=0, description="no file change in K turns")

    @model_validator(mode="after")
    def _comparable(self) -> StallConfig:
        # A comparison needs at least two items (alternation: A,B,A,B); 1 would fire on any step.
        minimums = {"same_failures_runs": 2, "repeat_actions": 2, "repeat_errors": 2, "monologue": 2,
                    "alternation": 4}
        for name, low in minimums.items():
            value = getattr(self, name)
            if value and value < low:
                raise ValueError(f"stall.{name} must be 0 (off) or at least {low}, got {value}")
        return self


@dataclass
class Step:
    """One tool call and its result, or one assistant message with no tool call (`tool` None)."""

    turn: int
    tool: str | None
    args: dict | None  # the call's JSON arguments, decoded
    output: str
    error: bool = False
    exit_code: int | None = None
    running: bool = False
    changed_files: list[str] = field(default_factory=list)
    failing_tests: list[str] | None = None


class Stall(BaseModel):
    """A detected stall: which rule fired, the evidence a human (and the model) can check, when."""

    rule: str
    evidence: str
    turn: int


def _derandomize(match: re.Match[str]) -> str:
    # Inside a temp path, a token mixing letters and digits is a random name (uuid scratch file, mkdtemp).
    return re.sub(r"(?<![A-Za-z0-9])(?=[A-Za-z]*\d)(?=\d*[A-Za-z])[A-Za-z0-9]{6,}(?![A-Za-z0-9])",
                  "<rand>", match.group(0))


# Volatile text, replaced in order: the earlier patterns would be broken apart by the later ones.
_VOLATILE: list[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]]] = [
    (re.compile(pattern, flags), replacement)
    for pattern, replacement, flags in [
        # ISO timestamps and dates: 2026-11-22T00:08:56.123+00:00, 2026-11-22 00:08:56
        (r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?\b",
         "<time>", 0),
        (r"\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun),?\s+(?:\d{1,2}\s+)?"
         r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)\w*(?:\s+\d{1,2})?\b", "<date>", 0),
        # Clock times and h:mm:ss durations, but not file.py:12:5 locations.
        (r"(?<![\d:])\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?\b", "<time>", 0),
        (r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", "<uuid>", re.I),
        (r"\b0x[0-9a-f]{6,}\b", "0x<addr>", re.I),
        # Temp dirs: pytest's numbered base temp, macOS per-user temp, Python's tmpXXXXXXXX names,
        # then random names anywhere below a temp dir.
        (r"(?:/private)?/tmp/pytest-of-[^/\s]+/pytest-\d+", "<tmp>", 0),
        (r"(?:/private)?/var/folders/[^/\s]+/[^/\s]+/T", "<tmp>", 0),
        (r"(?:<tmp>|(?:/private)?(?:/var)?/tmp)/tmp[\w-]{3,}", "<tmp>", 0),
        (r"(?:<tmp>|(?:/private)?(?:/var)?/tmp)/[^\s'\"():,;]+", _derandomize, 0),
        (r"\\AppData\\Local\\Temp\\[^\\\s]+", r"\\AppData\\Local\\Temp\\<tmp>", re.I),
        (r"\b((?:localhost|\d{1,3}(?:\.\d{1,3}){3}|\[[0-9a-f:]+\])):\d{1,5}\b", r"\1:<port>", re.I),
        (r"\b(port)\s*[:=]?\s*\d{2,5}\b", r"\1 <port>", re.I),
        (r"\b(pid|process|thread|worker)\b([\s:=#]*)\d+", r"\1\2<pid>", re.I),
        (r"^\[\d+\]\s+\d+$", "[<job>] <pid>", re.M),
        (r"\b(seed)\b([\s:=]*)\d+", r"\1\2<seed>", re.I),
        # Durations: 0.03s, 12 ms, 1.5 seconds, 0m1.234s, 12.3it/s.
        (r"\b\d+m\d+(?:\.\d+)?s\b", "<dur>", 0),
        (r"\b\d+(?:\.\d+)?(?:\s?(?:ms|us|µs|ns|secs?|seconds?|mins?|minutes?|hours?)|s|h)\b", "<dur>", 0),
        (r"\b\d+(?:\.\d+)?\s?(?:it|items?|B)/s\b", "<rate>", 0),
        # Memory sizes: 12.3 MiB, 512M, 1024 bytes.
        (r"\b\d+(?:\.\d+)?\s?(?:[KMGT]i?B|kB|bytes)\b", "<size>", 0),
        (r"\b\d+(?:\.\d+)?[KMGT]\b", "<size>", 0),
        # Rule lines padded to the terminal width change length with the text inside them.
        (r"([=_\-*#~])\1{2,}", r"\1\1\1", 0),
        (r"[ \t]+", " ", 0),
        (r" ?\n ?", "\n", 0),
    ]
]


def normalize(text: str) -> str:
    """Return `text` with volatile parts (timings, durations, pids, hex addresses, temp paths,
    timestamps, ports, memory sizes, uuids, seeds) replaced by placeholders, so that two outputs of
    the same command compare equal when only those parts differ."""
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return text.strip()


def _action_key(step: Step) -> str:
    args = json.dumps(step.args or {}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return f"{step.tool}\x00{args}"


def _describe(step: Step, limit: int = 120) -> str:
    text = _action_key(step).replace("\x00", " ", 1)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _turns(steps) -> str:
    return ", ".join(str(t) for t in sorted({s.turn for s in steps}))


def _tail(items: deque, n: int | None) -> list | None:
    """The last `n` items, or None when the rule is off or the window is still shorter than `n`."""
    if not n or len(items) < n:
        return None
    return list(items)[-n:]


def _is_error(step: Step) -> bool:
    return step.error or step.exit_code not in (None, 0)


@dataclass
class _Seen:
    """A recorded step with its comparison keys computed once."""

    step: Step
    action: str
    observation: str


class StallDetector:
    """Accumulates steps since the last user message and reports the first stall rule that holds."""

    def __init__(self, config: StallConfig | None = None) -> None:
        self.config = config or StallConfig()
        c = self.config
        # Only the tail each rule inspects is kept, so a 500-turn run costs no more than a short one.
        self._actions: deque[_Seen] = deque(
            maxlen=max(c.repeat_actions or 0, c.repeat_errors or 0, c.alternation or 0, 1))
        self._messages: deque[_Seen] = deque(maxlen=max(c.monologue or 0, 1))
        self._test_runs: deque[tuple[Step, frozenset[str]]] = deque(maxlen=max(c.same_failures_runs or 0, 1))
        self._condensations = 0
        self._idle_turns = 0
        self._idle_since: int | None = None
        self._turn_changed = False
        self._turn_running = False
        self._last_ended = 0
        self._turn = 0

    def record(self, step: Step) -> None:
        """Add one tool call with its result, or one assistant message without a tool call."""
        if not self.config.enabled:
            return
        self._turn = max(self._turn, step.turn)
        if step.changed_files:
            self._turn_changed = True
        if step.running:
            # A long command still running is progress we cannot judge yet: it neither counts nor resets.
            self._turn_running = True
            return
        self._condensations = 0
        seen = _Seen(step, _action_key(step), f"{step.exit_code}\x00{normalize(step.output)}")
        if step.tool is None:
            self._messages.append(seen)
            return
        self._messages.clear()  # a tool call between messages ends a monologue
        self._actions.append(seen)
        if step.failing_tests is not None:
            self._test_runs.append((step, frozenset(normalize(t) for t in step.failing_tests)))

    def record_condensation(self, turn: int) -> None:
        """Note that the context was condensed (summarised or truncated) before `turn`."""
        if not self.config.enabled:
            return
        self._turn = max(self._turn, turn)
        self._condensations += 1

    def end_turn(self, turn: int) -> None:
        """Close `turn`: count it toward `no_file_change` unless it changed a file or waited on a command."""
        if not self.config.enabled or turn <= self._last_ended:
            return
        self._last_ended = turn
        self._turn = max(self._turn, turn)
        if self._turn_changed:
            self._idle_turns, self._idle_since = 0, None
        elif not self._turn_running:
            self._idle_turns += 1
            if self._idle_since is None:
                self._idle_since = turn
        self._turn_changed = self._turn_running = False

    def user_message(self) -> None:
        """A user or nudge message was added: every rule starts again from an empty window."""
        self._actions.clear()
        self._messages.clear()
        self._test_runs.clear()
        self._condensations = 0
        self._idle_turns, self._idle_since = 0, None
        self._turn_changed = self._turn_running = False

    def check(self) -> Stall | None:
        """Return the stall that holds now (most specific rule first), or None."""
        if not self.config.enabled:
            return None
        rules = [("repeated_action", self._repeated_action), ("repeated_error", self._repeated_error),
                 ("alternation", self._alternation), ("monologue", self._monologue),
                 ("same_failing_tests", self._same_failing_tests), ("condensation", self._condensation),
                 ("no_file_change", self._no_file_change)]
        for name, rule in rules:
            evidence = rule()
            if evidence is not None:
                return Stall(rule=name, evidence=evidence, turn=self._turn)
        return None

    def _repeated_action(self) -> str | None:
        tail = _tail(self._actions, self.config.repeat_actions)
        if tail is None or len({(s.action, s.observation) for s in tail}) != 1:
            return None
        return (f"the same action {_describe(tail[0].step)} returned the same result "
                f"{len(tail)} times in a row (turns {_turns(s.step for s in tail)})")

    def _repeated_error(self) -> str | None:
        tail = _tail(self._actions, self.config.repeat_errors)
        if tail is None or len({s.action for s in tail}) != 1 or not all(_is_error(s.step) for s in tail):
            return None
        return (f"the same action {_describe(tail[0].step)} failed {len(tail)} times in a row "
                f"(turns {_turns(s.step for s in tail)})")

    def _alternation(self) -> str | None:
        tail = _tail(self._actions, self.config.alternation)
        if tail is None or tail[0].action == tail[1].action:
            return None
        for i in range(2, len(tail)):
            if (tail[i].action, tail[i].observation) != (tail[i - 2].action, tail[i - 2].observation):
                return None
        return (f"two actions alternated {len(tail)} times with the same results: "
                f"{_describe(tail[0].step, 80)} and {_describe(tail[1].step, 80)} "
                f"(turns {_turns(s.step for s in tail)})")

    def _monologue(self) -> str | None:
        tail = _tail(self._messages, self.config.monologue)
        if tail is None or len({s.observation for s in tail}) != 1:
            return None
        text = " ".join(tail[0].step.output.split())
        snippet = text if len(text) <= 80 else text[:77] + "..."
        return (f"the same message was sent {len(tail)} times with no tool call between "
                f"(turns {_turns(s.step for s in tail)}): {snippet!r}")

    def _same_failing_tests(self) -> str | None:
        tail = _tail(self._test_runs, self.config.same_failures_runs)
        if tail is None:
            return None
        failing = {names for _, names in tail}
        if len(failing) != 1 or not tail[0][1]:
            return None
        names = sorted(tail[0][1])
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return (f"the same {len(names)} failing test(s) in the last {len(tail)} test runs "
                f"(turns {_turns(s for s, _ in tail)}): {shown}")

    def _condensation(self) -> str | None:
        n = self.config.condensations
        if not n or self._condensations < n:
            return None
        return f"the context was condensed {self._condensations} times in a row with no step between"

    def _no_file_change(self) -> str | None:
        k = self.config.no_change_turns
        if not k or self._idle_turns < k:
            return None
        return f"no file changed in {self._idle_turns} turns (turns {self._idle_since}-{self._last_ended})"
