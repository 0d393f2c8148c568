"""What `m3-agent fix` hands back: `FixResult`, plain data that the flow fills and the texts read."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from m3_agent.agent.loop import RunResult
from m3_agent.fix.github import Issue

FixStatus = Literal["resolved", "not_resolved", "unverified"]
EXIT_CODES: dict[str, int] = {"resolved": 0, "not_resolved": 1, "unverified": 6}


class FixResult(BaseModel):
    """The outcome of `fix_issue` / `m3-agent fix`: what was made, where, and the run behind it."""

    status: FixStatus = Field(description="resolved | not_resolved | unverified (no test ran on the final patch)")
    resolved: bool = Field(description="a patch was produced and tests that ran on it, after the last change, passed")
    exit_code: int = Field(description="0 resolved, 1 not resolved, 6 unverified")
    issue: Issue
    branch: str | None = None
    commit: str | None = None
    patch_path: Path | None = None
    patch: str = ""
    applied: bool = False
    base_commit: str
    included_uncommitted: bool = False
    images_sent: int = 0
    notices: list[str] = Field(default_factory=list)
    environment: str | None = Field(None, description="the environment image the sandbox ran (m3-agent env show)")
    remote: str | None = Field(None, description="the remote the branch was pushed to (--push, --pr); None: not pushed")
    pr_url: str | None = Field(None, description="the pull request opened for the fix (--pr)")
    pr_number: int | None = None
    comment_id: int | None = Field(None, description="the comment posted on the issue (--comment)")
    comment_url: str | None = None
    run: RunResult
