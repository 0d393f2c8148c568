"""Embed m3-agent in an internal tool and stream its progress.

An internal service (a chat bot, a dashboard, a CI job) calls `fix_issue` and forwards the progress
events to its own channel; here, one JSON object per line on stdout, which a dashboard can tail.
The user's checkout is never touched: the fix arrives as a branch and a `.patch` file.

    python examples/embed_progress.py --repo path/to/repo --issue 123 --base-url http://gpu-node:8000/v1

`--issue` takes what `m3-agent fix` takes: a GitHub issue number or URL, a file, or text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TextIO

from m3_agent.api import AgentEvent, M3AgentError, fix_issue, load_settings


class ProgressFeed:
    """A subscriber of the run's event stream: the events a dashboard cares about become JSON status lines."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.t0 = time.monotonic()

    def emit(self, kind: str, **fields: Any) -> None:
        """Write one status line."""
        record = {"t": round(time.monotonic() - self.t0, 3), "kind": kind, **fields}
        print(json.dumps(record, default=str), file=self.out, flush=True)

    def __call__(self, event: AgentEvent) -> None:
        data = event.data
        if event.kind == "fix_start":
            self.emit("start", issue=data["issue"], title=data["title"], trajectory=data["trajectory_path"])
        elif event.kind == "request":  # one request to the model per turn
            self.emit("turn", turn=event.turn, thinking=data.get("thinking_mode"))
        elif event.kind == "tool_call":
            self.emit("tool", turn=event.turn, name=data.get("name"))
        elif event.kind == "tool_result" and data.get("tests"):  # the call ran tests
            tests = data["tests"]
            self.emit("tests", turn=event.turn, passed=tests.get("passed"), failed=tests.get("failed"))
        elif event.kind == "stall":
            self.emit("stall", turn=event.turn, rule=data.get("rule"))
        elif event.kind == "finish":
            self.emit("finish", turn=event.turn, status=data.get("status"))


def main(argv: list[str] | None = None) -> int:
    """Fix one issue, streaming progress; the exit code is `m3-agent fix`'s."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=".")
    parser.add_argument("--issue", required=True)
    parser.add_argument("--base-url", default=os.environ.get("M3_AGENT_MODEL__BASE_URL"))
    parser.add_argument("--max-turns", type=int, default=None)
    args = parser.parse_args(argv)

    feed = ProgressFeed(sys.stdout)
    try:
        settings, _ = load_settings(args.repo, {"--base-url": args.base_url, "--max-turns": args.max_turns})
        result = fix_issue(args.issue, repo=args.repo, settings=settings, callbacks=[feed],
                           on_notice=lambda text: feed.emit("notice", text=text))
    except M3AgentError as e:
        feed.emit("error", error=str(e), exit_code=e.exit_code)
        return e.exit_code
    run = result.run
    feed.emit(
        "result", resolved=result.resolved, branch=result.branch, patch_path=result.patch_path,
        turns=run.turns, prompt_tokens=run.usage.prompt_tokens, cache_hit_share=run.cache_hit_share,
        thinking=run.mode_counts,
    )
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
