"""What `m3-agent fix` shows: the live progress (a subscriber of the run's event stream) and the summary.

On a terminal it is a live rich panel (turn, thinking mode, current tool call, last tests, tokens
with the cached share, sandbox restarts, elapsed time); elsewhere (CI logs) one plain line per tool
call, test summary, stall and sandbox restart. Every number comes from the events: token counts from each `reply` event's usage.
"""

from __future__ import annotations

import json
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from m3_agent.agent.events import AgentEvent
from m3_agent.agent.verdict import describe_tests, describe_verdict
from m3_agent.fix.result import FixResult


def short(text: Any, n: int = 90) -> str:
    """`text` on one line, at most `n` characters (an ellipsis marks the cut)."""
    s = " ".join(str(text or "").split())
    return s if len(s) <= n else s[: n - 1] + "…"


def call_summary(name: str, arguments: str | None) -> str:
    """A tool call in a few words: its name and its first non-empty string argument."""
    try:
        args = json.loads(arguments or "{}")
    except (json.JSONDecodeError, TypeError):
        return f"{name} {short(arguments, 60)}"
    if not isinstance(args, dict):
        return name
    first = next((v for v in args.values() if isinstance(v, str) and v.strip()), "")
    return f"{name} {short(first, 70)}".strip()


class LiveProgress:
    """A progress subscriber: turn, thinking mode, current tool call, last tests, tokens, elapsed."""

    def __init__(self, console: Console, *, max_turns: int, label: str) -> None:
        self.console = console
        self.max_turns = max_turns
        self.label = label
        self.turn = self.stalls = self.restarts = 0
        self.mode = self.tool = self.tests = "-"
        self.restart_note = ""
        self.env_line_at = 0.0
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.t0 = time.monotonic()
        self.live = Live(self.render(), console=console, refresh_per_second=4, transient=True) \
            if console.is_terminal else None

    def __enter__(self) -> LiveProgress:
        if self.live:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.live.stop()

    def _line(self, text: str) -> None:
        if self.live is None:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def __call__(self, event: AgentEvent) -> None:
        """Take one event and redraw."""
        self.turn = max(self.turn, event.turn)
        handler = getattr(self, "_on_" + event.kind, None)
        if handler is not None:
            handler(event.turn, event.data)
        if self.live:
            self.live.update(self.render())

    def _on_fix_start(self, turn: int, data: dict[str, Any]) -> None:
        self.max_turns = data.get("max_turns", self.max_turns)
        self.label = short(f"{data['issue']} {data['title']}", 60)

    def _on_request(self, turn: int, data: dict[str, Any]) -> None:
        self.mode = data.get("thinking_mode", "-")

    def _on_reply(self, turn: int, data: dict[str, Any]) -> None:
        # Per-reply usage, summed here: a `fix` that runs again without images adds its second run.
        usage = data.get("usage") or {}
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.cached_tokens += usage.get("cached_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)

    def _on_tool_call(self, turn: int, data: dict[str, Any]) -> None:
        self.tool = call_summary(data.get("name", "?"), data.get("arguments"))
        self._line(f"turn {turn}/{self.max_turns} [{self.mode}] {self.tool}")

    def _on_tool_result(self, turn: int, data: dict[str, Any]) -> None:
        if data.get("tests"):  # the call ran tests
            self.tests = describe_tests(data["tests"])
            self._line(f"  tests: {self.tests}")

    def _on_env_build(self, turn: int, data: dict[str, Any]) -> None:
        message = str(data.get("message", ""))
        self.tool = f"environment: {short(message, 80)}"
        # every step, and a detail line (indented) now and then: a log, not a flood
        if not message.startswith("  ") or time.monotonic() - self.env_line_at > 5:
            self.env_line_at = time.monotonic()
            self._line(f"environment: {short(message, 150)}")

    def _on_stall(self, turn: int, data: dict[str, Any]) -> None:
        self.stalls += 1
        self._line(f"  stall: {data.get('rule')}")

    def _on_reprompt(self, turn: int, data: dict[str, Any]) -> None:
        what = "cut off" if data.get("reason") == "cut_off" else "no tool call"
        self.tool = f"({what}: asked again)"
        self._line(f"turn {turn}/{self.max_turns} [{self.mode}] {what}: asked again "
                   f"({data.get('format_errors')} in a row; next tool_choice {data.get('tool_choice')})")

    def _on_tool_choice_fallback(self, turn: int, data: dict[str, Any]) -> None:
        self._line(f"  notice: {short(data.get('message'), 200)}; tool_choice \"auto\" from now on")

    def _on_thinking_dropped(self, turn: int, data: dict[str, Any]) -> None:
        self._line(f"  notice: {short(data.get('message'), 200)}; no thinking mode from now on")

    def _on_context_window(self, turn: int, data: dict[str, Any]) -> None:
        self._line(f"  notice: the server's context window is {data.get('context_window')} tokens (from its error): "
                   f"the repository is packed again, replies get {data.get('max_tokens')} tokens")

    def _on_sandbox_restart(self, turn: int, data: dict[str, Any]) -> None:
        self.restarts = data.get("restarts", self.restarts + 1)
        self.restart_note = f"{data.get('restored_files', 0)} changed file(s) restored"
        self._line(f"  sandbox restart {self.restarts}: {short(data.get('reason'), 200)}; {self.restart_note}")
        self.restart_note += f"; {short(data.get('reason'), 50)}"

    def render(self) -> Table:
        """The progress panel as a two-column grid."""
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan", no_wrap=True)
        grid.add_column()
        elapsed = time.monotonic() - self.t0
        cached = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        stalls = f"   stalls: {self.stalls}" if self.stalls else ""
        rows = [
            ("m3-agent fix", f"{self.label}  ·  {int(elapsed // 60):02d}:{int(elapsed % 60):02d}"),
            ("turn", f"{self.turn}/{self.max_turns}   thinking: {self.mode}{stalls}"),
            ("tool", self.tool),
            ("tests", self.tests),
            ("tokens", f"{self.prompt_tokens:,} in ({cached:.0%} cached) · {self.completion_tokens:,} out"),
        ]
        if self.restarts:  # only once a sandbox died: most runs never see one
            rows.append(("sandbox", f"restarted {self.restarts}x, {self.restart_note}"))
        for name, value in rows:
            grid.add_row(name, Text(value))  # Text: tool arguments may hold [brackets] rich would parse
        return grid


def summary(result: FixResult) -> Group:
    """The end of `m3-agent fix`: verdict, tokens, tests, branch and patch, what was published, error, trajectory."""
    run = result.run
    style = {"resolved": "bold green", "not_resolved": "bold yellow", "unverified": "bold magenta"}[result.status]
    verdict = Text(result.status.replace("_", " "), style=style)
    lines = [Text.assemble(verdict, f"  ({run.status}, {run.turns} turns, {run.timings.wall_s:.1f} s)")]
    u = run.usage
    lines.append(Text(f"tokens: {u.prompt_tokens:,} in ({run.cache_hit_share:.0%} cached) · "
                      f"{u.completion_tokens:,} out · thinking {run.mode_counts}"))
    lines.append(Text(f"tests: {describe_verdict(run.verdict)}"))
    if result.branch:
        lines.append(Text(f"branch: {result.branch} ({result.commit[:12] if result.commit else ''})"))
        lines.append(Text(f"patch:  {result.patch_path}"))
        lines.append(Text("applied to the working tree" if result.applied else
                          f"apply:  git apply {result.patch_path}   or   git merge {result.branch}"))
    else:
        lines.append(Text("no change was made: no branch, no patch"))
    published = {"pushed": result.remote and f"{result.branch} to {result.remote}", "pull request": result.pr_url,
                 "comment": result.comment_url}
    lines += [Text(f"{name}: {value}") for name, value in published.items() if value]
    if run.error:
        lines.append(Text(f"{'error' if run.status == 'error' else 'ended'}: {run.error}", style="red"))
    if run.trajectory_path:
        lines.append(Text(f"trajectory: {run.trajectory_path}  (m3-agent show FILE)"))
    return Group(*lines)
