"""JSONL trajectories: every request, reply, tool call, result, mode, usage and timing, as it happens.

The writer is a subscriber of the run's event stream (`agent.events`): one JSON object per event,
flushed at once, so a crash or Ctrl-C leaves a readable file. Each line has `kind` (`agent.events`),
`t` (seconds since the run started), `turn`, and the event's fields. `m3-agent show FILE` renders one;
`--messages [--turn N]` rebuilds what the model saw (`messages_at`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from m3_agent.agent.events import AgentEvent
from m3_agent.errors import UsageError


class TrajectoryWriter:
    """Appends events to a JSONL file; safe to read while it is written. Subscribe it to an EventStream."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "a", encoding="utf-8")

    def __call__(self, event: AgentEvent) -> None:
        """Append one event of the stream, its fields flat beside kind, t and turn, and flush it to the OS."""
        record = {"kind": event.kind, "t": event.t, "turn": event.turn, **event.data}
        self._fh.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()


def read_trajectory(path: Path) -> list[dict[str, Any]]:
    """Read a trajectory; a torn last line (crash mid-write) is ignored, not fatal."""
    if not path.is_file():
        raise UsageError(f"no trajectory at {path}: pass the .jsonl file a run wrote")
    events = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not text: pass the .jsonl file a run wrote") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):
                break  # a torn final line: the run died mid-write
            raise UsageError(f"{path}:{n} is not JSON: is this a trajectory file?") from None
        if not isinstance(events[-1], dict) or not isinstance(events[-1].get("kind"), str):
            raise UsageError(f"{path}:{n} is not a trajectory event (it has no `kind`): pass the .jsonl file a "
                             f"run wrote (.m3-agent/issue-*.jsonl, or an eval's trajectories/ID.jsonl)")
    return events


def _short(text: Any, n: int = 120) -> str:
    s = str(text if text is not None else "").replace("\n", " ⏎ ")
    return s if len(s) <= n else s[: n - 1] + "…"


def _detail(e: dict[str, Any], legacy: bool, outputs: dict[str, Any]) -> str | None:
    """One event's detail column; None: no row (a message another row already shows)."""
    kind, message = e.get("kind"), e.get("message") or {}
    if kind == "request":
        return f"mode={e.get('thinking_mode')} ({e.get('mode_reason', '')}) messages={e.get('n_messages')}"
    if kind == "reply":
        u = e.get("usage") or {}
        tokens = f"tokens in/out/cached={u.get('prompt_tokens')}/{u.get('completion_tokens')}/{u.get('cached_tokens')}"
        if not legacy:  # its text and calls: the assistant message's row
            return f"finish={e.get('finish_reason')} {tokens}"
        return (f"finish={e.get('finish_reason')} tool_calls={len(e.get('tool_calls') or [])} {tokens} "
                f"{_short(e.get('content'), 60)}")
    if kind == "tool_call":
        return f"{e.get('name')}({_short(e.get('arguments'), 80)})"
    if kind == "tool_result":
        return f"{'ok' if e.get('ok') else 'ERR'} {_short(e.get('output', outputs.get(e.get('id'))), 90)}"
    if kind == "message" and (message.get("role") == "tool" or legacy and message.get("role") == "assistant"):
        return None  # the tool_result row (and in an older file the reply row) shows it
    if kind == "message" and message.get("role") == "assistant":
        return f"assistant: tool_calls={len(message.get('tool_calls') or [])} {_short(message.get('content'), 60)}"
    if kind == "message":
        return f"{message.get('role')}: {_short(message.get('content'), 100)}"
    if kind == "stall":
        return f"[yellow]{e.get('rule')}[/]: {_short(e.get('evidence'))}"
    if kind == "finish":
        return f"[bold]{e.get('status')}[/] {_short(e.get('error') or '', 80)}"
    return _short({k: v for k, v in e.items() if k not in ("kind", "t", "turn")})


def render(events: list[dict[str, Any]], console: Console) -> None:
    """Print a trajectory as a table of turns, then the run's outcome.

    Files written before a reply's text and a tool's output lived only in `message` events (their
    `reply` has `content`, their `tool_result` an `output`) render as they did."""
    table = Table("t (s)", "turn", "kind", "detail", title="trajectory", show_lines=False)
    legacy = any("content" in e for e in events if e.get("kind") == "reply")
    said = [e.get("message") or {} for e in events if e.get("kind") == "message"]
    outputs = {m.get("tool_call_id"): m.get("content") for m in said if m.get("role") == "tool"}
    for e in events:
        detail = _detail(e, legacy, outputs)
        if detail is not None:
            table.add_row(f"{e.get('t', 0):.2f}", str(e.get("turn") or ""), str(e.get("kind")), detail)
    console.print(table)
    finish = next((e for e in reversed(events) if e.get("kind") == "finish"), None)
    if finish is None:
        console.print("[yellow]no finish event: the run was interrupted or is still going[/]")
    else:
        u = finish.get("usage") or {}
        console.print(
            f"status [bold]{finish.get('status')}[/], turns {finish.get('turns')}, "
            f"tokens in {u.get('prompt_tokens')} (cached {u.get('cached_tokens')}) out {u.get('completion_tokens')}, "
            f"modes {finish.get('mode_counts')}"
        )


def messages_at(events: list[dict[str, Any]], turn: int | None = None) -> list[dict[str, Any]]:
    """The messages the model answered at `turn` (default: the last request), rebuilt from the trajectory:
    each `message` event in order, with each `shrink` applied, up to that turn's reply."""
    asked = [e["turn"] for e in events if e["kind"] == "request"]
    if not any(e["kind"] == "message" for e in events):
        raise UsageError("this trajectory was written before runs recorded their messages: `m3-agent show FILE` "
                         "renders it, but what the model saw cannot be rebuilt")
    turn = turn if turn is not None else asked[-1] if asked else 0
    if turn not in asked:
        raise UsageError(f"no request at turn {turn}: " + (f"this run's requests are turns {asked[0]}-{asked[-1]}"
                                                           if asked else "the run made none"))
    messages: list[dict[str, Any]] = []
    for e in events:
        if e["turn"] > turn or e["turn"] == turn and e["kind"] == "reply":
            break
        if e["kind"] == "message":
            messages[e["index"]:e["index"] + 1] = [e["message"]]
        elif e["kind"] == "shrink" and "message" in e:  # a repack
            messages[e["index"]] = e["message"]
        elif e["kind"] == "shrink":  # old tool outputs elided
            for i in e.get("indices", []):
                messages[i] = {**messages[i], "content": e["content"]}
    return messages


def show_command(
    path: Path = typer.Argument(..., help="A trajectory .jsonl file written by a run."),
    messages: bool = typer.Option(False, "--messages", help="Print, as JSON, the messages the model saw."),
    turn: Optional[int] = typer.Option(None, "--turn", help="With --messages: at this turn's request (default: the last)."),
) -> None:
    """Render a trajectory (JSONL) file with rich, or the exact messages of one request."""
    if messages:
        typer.echo(json.dumps(messages_at(read_trajectory(path), turn), ensure_ascii=False, indent=2))
    else:
        render(read_trajectory(path), Console())
