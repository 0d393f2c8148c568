"""`m3-agent fix --push / --pr / --comment` end to end: the stand-in over HTTP, the real Docker sandbox,
real git pushes into a local bare repository, and the GitHub REST fake for issues, pull requests and
comments. Every error leaves the local branch and `.patch` where they were made.

The user's repository reads its issues from the fake (origin's URL) and pushes to the bare
repository (origin's push URL), as a clone of GitHub with a mirror to push to would.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from m3_agent.fix.flow import fix_issue
from m3_agent.fix.github import GitHubClient
from m3_agent.standin.server import StandinServer
from m3_agent.settings import load_settings
from tests.fix.test_fix import CALC, FIXING, READ, SUBMIT, TEST, edit, git, user_view
from tests.fix.test_fix_sources import assert_one_line_error, cli_main, fix_cli  # noqa: F401, F811 - CLI fixtures
from tests.fix.test_github import FakeGitHub
from tests.fix.test_gitwork import ZERO, bare_origin, pushes

pytestmark = pytest.mark.docker

TOKEN = {"GITHUB_TOKEN": "good-token"}
UNVERIFIED = [READ, edit("return a + b"), SUBMIT]  # no test ever runs on the patch
FAILING = [READ, edit("return a * b"), TEST, SUBMIT]


@dataclass
class Site:
    """The fake GitHub, the bare repository pushes go to, and the user's clone."""

    gh: FakeGitHub
    origin: Path
    repo: Path

    def clone(self, path: Path) -> Path:
        """Another clone of the same repository (a CI runner's fresh checkout), set up like the first."""
        subprocess.run(["git", "clone", "-q", str(self.origin), str(path)], check=True)
        connect(path, self.gh, self.origin)
        return path


def connect(repo: Path, gh: FakeGitHub, origin: Path) -> None:
    """origin reads from the fake GitHub's acme/widgets and pushes to the bare repository."""
    if "origin" in git(repo, "remote").split():
        git(repo, "remote", "set-url", "origin", f"{gh.web}/acme/widgets.git")
    else:
        git(repo, "remote", "add", "origin", f"{gh.web}/acme/widgets.git")
    git(repo, "remote", "set-url", "--push", "origin", str(origin))


@pytest.fixture
def site(git_repo, sandbox_image, tmp_path):
    repo = git_repo(CALC)
    origin = bare_origin(tmp_path / "origin.git")
    with FakeGitHub(origin=origin) as gh:
        gh.add_issue("acme", "widgets", 7, "add() subtracts", "2 + 3 gives -1.")
        connect(repo, gh, origin)
        git(repo, "push", "-q", "origin", "main")
        (origin / "pushes.log").unlink()  # from here on: only what m3-agent pushes
        yield Site(gh, origin, repo)


def local_branches(repo: Path) -> list[str]:
    return git(repo, "branch", "--list", "m3-agent/*", "--format=%(refname:short)").split()


def test_pr_and_comment_push_the_branch_open_a_draft_and_comment_on_the_issue(site, fix_cli):
    before = user_view(site.repo)
    with StandinServer({"turns": FIXING}) as srv:
        code, out, err = fix_cli("7", "--repo", str(site.repo), "--base-url", srv.base_url, "--pr", "--comment",
                                 "--trajectory-url", "https://ci.example.com/runs/1/{file}", env=TOKEN)
    assert code == 0, err
    commit = git(site.repo, "rev-parse", "m3-agent/issue-7").strip()
    assert pushes(site.origin) == [(ZERO, commit, "refs/heads/m3-agent/issue-7")]  # one new branch, nothing else

    (pull,) = site.gh.pulls
    assert (pull["title"], pull["head"], pull["base"], pull["draft"]) == (
        "Fix #7: add() subtracts", "m3-agent/issue-7", "main", True)
    body = pull["body"]
    assert body.startswith("Submitted. Summary: add() subtracted; it adds now.")  # the agent's summary
    assert "- Verdict: **resolved**; tests: `pytest tests/test_calc.py`: 1 passed, 0 failed" in body
    assert "- Run: submitted, 4 turns" in body and "- Tokens: " in body and " out" in body
    trajectory = next((site.repo / ".m3-agent").glob("issue-7-*.jsonl"))
    assert f"- Trajectory: https://ci.example.com/runs/1/{trajectory.name}" in body
    assert body.rstrip().endswith("Fixes #7")

    (comment,) = site.gh.comments_made("acme", "widgets", 7)
    assert comment["body"].startswith(f"m3-agent opened a draft pull request for this issue: {pull['html_url']}")
    flat = " ".join(err.split())
    assert "pushed: m3-agent/issue-7 to origin" in flat and f"pull request: {pull['html_url']}" in flat
    assert f"comment: {site.gh.web}/acme/widgets/issues/7#issuecomment-" in flat
    assert user_view(site.repo) == before


def test_an_unverified_run_comments_instead_of_opening_a_pull_request(site, fix_cli):
    with StandinServer({"turns": UNVERIFIED}) as srv:
        code, out, err = fix_cli("7", "--repo", str(site.repo), "--base-url", srv.base_url, "--pr", "--json",
                                 env=TOKEN)
    assert code == 6, err
    result = json.loads(out)
    assert result["status"] == "unverified" and result["pr_url"] is None
    assert site.gh.pulls == [] and not [p for p, _ in site.gh.posted if p.endswith("/pulls")]
    (comment,) = site.gh.comments_made("acme", "widgets", 7)
    assert comment["body"].startswith("m3-agent could not resolve this issue: no test ran on its final patch")
    assert "Its attempt is on branch `m3-agent/issue-7` (pushed to `origin`), also as `issue-7.patch`" in comment["body"]
    assert result["comment_id"] and result["comment_url"].endswith(f"#issuecomment-{result['comment_id']}")
    assert result["remote"] == "origin" and [ref for _, _, ref in pushes(site.origin)] == ["refs/heads/m3-agent/issue-7"]


def test_a_failing_run_names_its_failing_tests_and_opens_only_with_pr_anyway(site, fix_cli):
    with StandinServer({"turns": FAILING}) as srv:
        code, out, err = fix_cli("7", "--repo", str(site.repo), "--base-url", srv.base_url, "--pr", "--pr-anyway",
                                 "--ready", "--comment", "--json", env=TOKEN)
    assert code == 1, err
    result = json.loads(out)
    (pull,) = site.gh.pulls
    assert pull["draft"] is False and result["pr_url"] == pull["html_url"]
    assert "- Verdict: **not resolved**; tests: `pytest tests/test_calc.py`: 0 passed, 1 failed" in pull["body"]
    body = site.gh.comments_made("acme", "widgets", 7)[0]["body"]
    first, *rest = body.splitlines()
    assert first == "m3-agent could not resolve this issue: tests fail on its final patch: 0 passed, 1 failed."
    assert rest[0].startswith("- `tests/test_calc.py::test_add`: ")
    assert f"It opened a pull request anyway: {pull['html_url']}" in body


def test_without_a_token_pr_and_comment_stop_before_the_run(site, fix_cli):
    with StandinServer({"turns": FIXING}) as srv:
        result = fix_cli("7", "--repo", str(site.repo), "--base-url", srv.base_url, "--pr")
        assert srv.requests == []  # not one request to the model: the run never started
    assert_one_line_error(result, 10, "--pr and --comment write to GitHub and need a token: set GITHUB_TOKEN")
    assert local_branches(site.repo) == [] and pushes(site.origin) == []
    text = fix_cli("--repo", str(site.repo), "--issue", "add() subtracts", "--base-url", "http://127.0.0.1:9/v1",
                   "--comment", env=TOKEN)
    assert_one_line_error(text, 2, "--pr and --comment need a GitHub issue")


def refuse_pushes(site: Site) -> None:
    (site.origin / "hooks" / "pre-receive").write_text(
        '#!/bin/sh\ncat >> "$GIT_DIR/pushes.log"\necho "m3-agent/* is protected here" >&2\nexit 1\n')


def lose_the_remote(site: Site) -> None:
    git(site.repo, "remote", "set-url", "--push", "origin", str(site.origin.with_name("gone.git")))


def read_only_token(site: Site) -> dict[str, str]:
    site.gh.read_only_tokens.add("read-token")
    return {"GITHUB_TOKEN": "read-token"}


def earlier_pull_request(site: Site) -> None:
    site.gh.add_pull("acme", "widgets", head="m3-agent/issue-7")  # opened by a run the remote lost the branch of


def rate_limit_for_an_hour(site: Site) -> None:
    site.gh.write_limits = [{"x-ratelimit-remaining": "0", "x-ratelimit-reset": str(int(time.time()) + 3600)}] * 4


@pytest.mark.parametrize(("fault", "code", "message", "pushed"), [
    (refuse_pushes, 9, "the push of m3-agent/issue-7 to 'origin' failed: remote: m3-agent/* is protected here", False),
    (lose_the_remote, 9, "cannot list the branches of remote 'origin': fatal: ", False),
    (read_only_token, 11, "the GitHub token may not open pull requests in acme/widgets (Resource not accessible", True),
    (earlier_pull_request, 12, "a pull request already exists for m3-agent/issue-7 in acme/widgets: http", True),
    (rate_limit_for_an_hour, 13, "GitHub API rate limit exceeded; it resets at", True),
], ids=["push-rejected", "remote-unreachable", "token-without-scope", "pull-request-exists", "rate-limit"])
def test_each_publishing_error_has_its_exit_code_and_keeps_the_local_branch_and_patch(
        site, fix_cli, fault, code, message, pushed):
    env = fault(site) or TOKEN
    with StandinServer({"turns": FIXING}) as srv:
        result = fix_cli("7", "--repo", str(site.repo), "--base-url", srv.base_url, "--pr", "-q", env=env)
    assert_one_line_error(result, code, message)
    patch = site.repo / ".m3-agent" / "issue-7.patch"
    assert local_branches(site.repo) == ["m3-agent/issue-7"] and "+    return a + b" in patch.read_text()
    assert f"the local branch m3-agent/issue-7 and {patch} are kept" in " ".join(result[2].split())
    on_origin = git(site.origin, "for-each-ref", "--format=%(refname)", "refs/heads/m3-agent")
    assert on_origin.split() == (["refs/heads/m3-agent/issue-7"] if pushed else [])
    assert [p for p in site.gh.pulls if p["title"].startswith("Fix #7")] == []


def test_a_rate_limited_pull_request_is_opened_after_the_wait_github_gives(site, fix_cli):
    site.gh.write_limits = [{"Retry-After": "1"}]
    with StandinServer({"turns": FIXING}) as srv:
        code, out, err = fix_cli("7", "--repo", str(site.repo), "--base-url", srv.base_url, "--pr", "--json", env=TOKEN)
    assert code == 0, err
    assert json.loads(out)["pr_url"] == site.gh.pulls[0]["html_url"]
    assert len(site.gh.write_times) == 2 and site.gh.write_times[1] - site.gh.write_times[0] >= 1.0


def test_a_second_run_on_the_same_issue_pushes_a_new_branch_and_never_forces(site, fix_cli, tmp_path):
    with StandinServer({"turns": FIXING}) as srv:
        code, _, err = fix_cli("7", "--repo", str(site.repo), "--base-url", srv.base_url, "--pr", "-q", env=TOKEN)
    assert code == 0, err
    first = git(site.origin, "rev-parse", "refs/heads/m3-agent/issue-7").strip()

    # The second run comes from a fresh clone, as on a CI runner: no local m3-agent branch to go by.
    runner = site.clone(tmp_path / "runner")
    with StandinServer({"turns": FIXING}) as srv:
        flags = {"--base-url": srv.base_url, "--pr": True, "--comment": True}
        settings, _ = load_settings(runner, flags, environ=TOKEN)
        issue = GitHubClient(site.gh.api).get_issue("acme", "widgets", 7)  # an Issue object: its URL names the API
        result = fix_issue(issue, repo=runner, settings=settings)  # the library takes the same choices
    assert result.resolved and result.branch == "m3-agent/issue-7-2" and result.remote == "origin"
    assert result.pr_url == site.gh.pulls[1]["html_url"] and site.gh.pulls[1]["head"] == "m3-agent/issue-7-2"
    assert result.comment_id and result.comment_url
    second = git(runner, "rev-parse", "m3-agent/issue-7-2").strip()
    assert pushes(site.origin) == [(ZERO, first, "refs/heads/m3-agent/issue-7"),
                                   (ZERO, second, "refs/heads/m3-agent/issue-7-2")]  # two creations, no update
    assert git(site.origin, "rev-parse", "refs/heads/m3-agent/issue-7").strip() == first
