"""Publishing a fix: the branch on the team's remote, a pull request, a comment on the issue.

`m3-agent fix 123 --pr --comment` ends here, after the local branch and `.patch` are made. The rules
(`plan`):

- `--pr` implies `--push`. Only a run with a patch pushes anything.
- A pull request opens for a resolved run; an unverified or failing one opens nothing unless
  `--pr-anyway`, and comments on the issue instead (even without `--comment`).
- `--comment` says what happened: the pull request, or the branch and patch; or why the run did not
  resolve the issue (`why_not`: a stall, a limit, the failing tests by name).

Checks that need no run (a token for GitHub writes, a GitHub issue to write to, the remote) happen in
`Publisher.prepare`, before the agent starts. A failure after the run keeps the local branch and
`.patch` and says so in its one line. The texts (`pull_request_body`, `comment_body`) are pure
functions of the result; the REST calls are `fix.github`'s, the pushes `fix.gitwork`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from m3_agent.agent.verdict import describe_tests, describe_verdict
from m3_agent.errors import GitError, GitHubTokenMissing, M3AgentError, UsageError
from m3_agent.fix import gitwork
from m3_agent.fix.github import GitHubClient, Issue, NewPullRequest, parse_remote
from m3_agent.fix.result import FixResult
from m3_agent.settings import FixConfig

SHOWN_FAILURES = 5
LIMITS = {"turn_limit": "its turn limit", "token_limit": "its token limit", "time_limit": "its time limit",
          "cost_limit": "its cost limit", "context_limit": "the model's context window"}


class Plan(NamedTuple):
    """What publishing does for one result."""

    push: bool
    pull_request: bool
    comment: bool


def plan(config: FixConfig, *, resolved: bool, has_patch: bool) -> Plan:
    """The steps for a result: push with a patch; a pull request when resolved (or `pr_anyway`); else a comment."""
    opens = config.pr and has_patch and (resolved or config.pr_anyway)
    return Plan(push=(config.push or config.pr) and has_patch, pull_request=opens,
                comment=config.comment or (config.pr and not opens))


def verdict_command(result: FixResult) -> str | None:
    """The test command behind the verdict: `pytest tests/test_x.py`, or the configured `test_cmd`."""
    verdict = result.run.verdict
    if verdict is None or verdict.passed is None:
        return None
    tests = verdict.tests or {}
    if tests.get("framework") == "command":
        return verdict.command
    return " ".join(str(part) for part in (tests.get("framework"), tests.get("target")) if part) or verdict.command


def run_lines(result: FixResult, config: FixConfig) -> list[str]:
    """The verdict with its test command and counts, the turns and tokens, and the trajectory, as list items."""
    run, u = result.run, result.run.usage
    command = verdict_command(result)
    tests = f"`{command}`: {describe_verdict(run.verdict)}" if command else describe_verdict(run.verdict)
    lines = [f"- Verdict: **{result.status.replace('_', ' ')}**; tests: {tests}",
             f"- Run: {run.status}, {run.turns} turns, {run.timings.wall_s:.0f} s; base {result.base_commit[:12]}",
             f"- Tokens: {u.prompt_tokens:,} in ({run.cache_hit_share:.0%} cached), {u.completion_tokens:,} out"]
    if config.trajectory_url:  # where the trajectory can be read; {file}: its file name
        name = run.trajectory_path.name if run.trajectory_path else ""
        lines.append(f"- Trajectory: {config.trajectory_url.replace('{file}', name)}")
    return lines


def pull_request_body(result: FixResult, config: FixConfig) -> str:
    """The pull request's body: the agent's summary, the verdict, the run, and `Fixes #N`."""
    summary = result.run.final_message.strip() or "(the agent gave no summary)"
    parts = [summary[:4000], "\n".join(run_lines(result, config)),
             "Made by m3-agent. It is code a model wrote: review it before merging."]
    if result.issue.number is not None:
        parts.append(f"Fixes #{result.issue.number}")
    return "\n\n".join(parts) + "\n"


def why_not(result: FixResult) -> list[str]:
    """Why a run did not resolve its issue, in a few lines: the stall, the limit, the failing tests by name."""
    run = result.run
    if run.status == "stalled" and run.stalls:
        stall = run.stalls[-1]
        reasons = [f"the run stalled at turn {stall.turn}: {stall.rule} ({stall.evidence[:200]})"]
    elif run.status in LIMITS:
        reasons = [f"the run reached {LIMITS[run.status]} after {run.turns} turns"
                   + (f": {run.error[:300]}" if run.error else "")]
    elif run.status == "error":
        reasons = [f"the run failed: {(run.error or 'unknown error')[:300]}"]
    elif not result.patch.strip():
        reasons = ["the agent made no change"]
    elif result.status == "unverified":
        reasons = ["no test ran on its final patch and no test command is known (set test_cmd)"]
    else:
        reasons = [f"tests fail on its final patch: {describe_tests(run.verdict.tests if run.verdict else None)}"]
    failing = ((run.verdict.tests or {}).get("failing") or []) if run.verdict else []
    reasons += [f"`{t.get('id')}`: {str(t.get('message', ''))[:150]}" for t in failing[:SHOWN_FAILURES]]
    if len(failing) > SHOWN_FAILURES:
        reasons.append(f"... and {len(failing) - SHOWN_FAILURES} more failing tests")
    return reasons


def comment_body(result: FixResult, config: FixConfig) -> str:
    """The issue comment: the pull request, or the branch and patch; for a run not resolved, why, first."""
    kind = "a pull request" if config.ready else "a draft pull request"
    if result.resolved:
        head = (f"m3-agent opened {kind} for this issue: {result.pr_url}" if result.pr_url
                else f"m3-agent fixed this issue {where(result)}.")
    else:
        why = why_not(result)
        head = f"m3-agent could not resolve this issue: {why[0]}." + "".join(f"\n- {line}" for line in why[1:])
        if result.pr_url:
            head += f"\n\nIt opened {kind} anyway: {result.pr_url}"
        elif result.branch:
            head += f"\n\nIts attempt is {where(result)}."
    return head + "\n\n" + "\n".join(run_lines(result, config)) + "\n"


def where(result: FixResult) -> str:
    """Where the fix is: the branch (pushed, or local to the machine that ran it) and the `.patch` file."""
    patch = result.patch_path.name if result.patch_path else "a .patch file"
    if result.remote:
        return f"on branch `{result.branch}` (pushed to `{result.remote}`), also as `{patch}`"
    return f"on the local branch `{result.branch}` and in `{patch}` of the machine that ran it (not pushed)"


def kept(result: FixResult) -> str:
    """What a publishing error leaves: the local branch and patch, and what was already published."""
    parts = [f"the local branch {result.branch} and {result.patch_path} are kept"] if result.branch else []
    if result.remote:
        parts.append(f"the branch is pushed to '{result.remote}'")
    if result.pr_url:
        parts.append(f"the pull request is open: {result.pr_url}")
    return "".join(f"; {part}" for part in parts)


class Publisher:
    """The publishing of one fix; `prepare` builds it before the run, `publish` runs it after."""

    def __init__(self, root: Path, config: FixConfig, issue: Issue, client: GitHubClient | None,
                 into: str | None) -> None:
        self.root, self.config, self.issue, self.client, self.into = root, config, issue, client, into

    @classmethod
    def prepare(cls, root: Path, config: FixConfig, issue: Issue, client: GitHubClient | None,
                into: str | None) -> Publisher | None:
        """A publisher when the settings ask for any publishing (else None), once what it needs is there.

        `into` is the branch a pull request merges into (None: the repository's default branch).
        UsageError when a pull request or comment is asked for an issue that is not on GitHub,
        GitHubTokenMissing without a token, GitError when the remote does not exist.
        """
        if not (config.push or config.pr or config.comment):
            return None
        if (config.pr or config.comment) and (issue.source != "github" or not issue.repo or client is None):
            raise UsageError("--pr and --comment need a GitHub issue (a number, owner/repo#N or an issue URL); "
                             "--push works with any issue")
        if (config.pr or config.comment) and not client.token:
            raise GitHubTokenMissing("--pr and --comment write to GitHub and need a token: set GITHUB_TOKEN or "
                                     "GH_TOKEN (permissions it needs: docs/usage.md)")
        if config.push or config.pr:
            gitwork.remote_url(root, config.remote)
        return cls(root, config, issue, client, into)

    def names_taken(self) -> frozenset[str]:
        """Branch names on the remote, so the local branch takes one free there too (none when not pushing)."""
        if not (self.config.push or self.config.pr):
            return frozenset()
        return frozenset(gitwork.remote_branches(self.root, self.config.remote))

    def publish(self, result: FixResult) -> None:
        """Push, open the pull request, comment, as `plan` says; fills `result`. Errors say what is kept."""
        steps = plan(self.config, resolved=result.resolved, has_patch=bool(result.branch))
        try:
            if steps.push:
                gitwork.push_branch(self.root, self.config.remote, result.branch)
                result.remote = self.config.remote
            if steps.pull_request:
                self._open_pull_request(result)
            if steps.comment:
                posted = self.client.create_comment(self.issue.repo, self.issue.number, comment_body(result, self.config))
                result.comment_id, result.comment_url = posted.id, posted.url
        except M3AgentError as e:
            raise e.extended(kept(result)) from None

    def _open_pull_request(self, result: FixResult) -> None:
        into = self.into or self.client.default_branch(self.issue.repo)
        title = f"Fix #{self.issue.number}: {self.issue.title.strip() or 'the issue'}"[:256]
        new = NewPullRequest(title=title, body=pull_request_body(result, self.config), head=self._head(result.branch),
                             base=into, draft=not self.config.ready)
        pull = self.client.create_pull(self.issue.repo, new)
        result.pr_url, result.pr_number = pull.url, pull.number

    def _head(self, branch: str) -> str:
        """The pull request's head: `branch`, or `owner:branch` when the remote is a fork of the issue's repository."""
        try:
            pushed_to = parse_remote(gitwork.remote_url(self.root, self.config.remote))
        except GitError:
            return branch  # not a GitHub URL (a local path, a mirror): the branch is in the issue's repository
        return branch if pushed_to.slug == self.issue.repo else f"{pushed_to.owner}:{branch}"
