"""What must hold for a run whatever the model answered: the tier's assertions, one function each."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from m3_agent.agent.trajectory import read_trajectory
from m3_agent.agent.verdict import suite_passed

# how a run may end: a submit, a limit or a stall rule (format errors end it with status "error")
LIMIT_ENDS = {"submitted", "stalled", "turn_limit", "token_limit", "time_limit", "context_limit"}
FORMAT_ERROR_ENDS = ("in a row",)  # FormatError: "N turns in a row without a well-formed tool call", ...


def check_end(status: str, error: str | None, patch: str, verdict: dict[str, Any] | None) -> None:
    """A run ends by submit, a limit, a stall or a format-error bound; a reply without a tool call ends it
    only when tests passed on a non-empty diff, never before anything was done."""
    if status == "finished":
        assert patch.strip(), "the run ended on a reply without a tool call and no change was made"
        assert verdict and verdict.get("passed") is True, f"the run finished without passing tests: {verdict}"
        return
    if status == "error":
        assert error and any(s in error for s in FORMAT_ERROR_ENDS), f"the run failed: {error}"
        return
    assert status in LIMIT_ENDS, f"unexpected end {status!r} ({error})"
    if status == "context_limit":  # the window it outgrew is named, not the packer's budget alone
        assert error and error.startswith("the conversation no longer fits the model's"), error


def check_trajectory(path: Path, status: str, turns: int) -> list[dict[str, Any]]:
    """The trajectory reads back whole: run_start first, finish last with the run's status, a request and
    a reply for every turn, and a result for every tool call. Its events."""
    events = read_trajectory(path)
    kinds = [e["kind"] for e in events]
    assert "run_start" in kinds and kinds[-1] == "finish", kinds
    finish = events[-1]
    assert finish["status"] == status and finish["turns"] == turns
    for kind in ("request", "reply"):
        per_turn = Counter(e["turn"] for e in events if e["kind"] == kind)
        # a conversation that outgrew the window ends on a request that got no reply
        last = turns - 1 if kind == "reply" and status == "context_limit" else turns
        assert sorted(per_turn) == list(range(1, last + 1)), f"{kind} events by turn: {dict(per_turn)}"
    calls = [e["id"] for e in events if e["kind"] == "tool_call"]
    results = [e["id"] for e in events if e["kind"] == "tool_result"]
    assert sorted(calls) == sorted(results), f"tool calls {calls} against results {results}"
    return events


def check_verdict(verdict: dict[str, Any] | None, patch: str, fix_status: str | None = None) -> None:
    """The verdict agrees with the test run it names; `fix`'s status agrees with the verdict."""
    if verdict and verdict.get("passed") is not None and not verdict.get("preexisting"):
        assert verdict["passed"] == suite_passed(verdict.get("tests")), verdict
    if fix_status is None:
        return
    if not patch.strip():
        assert fix_status == "not_resolved"
    elif fix_status == "resolved":
        assert verdict and verdict["passed"] is True
    elif fix_status == "unverified":
        assert verdict and verdict["passed"] is None
