"""GitHub issues through a local HTTP server that serves the same JSON shapes as GitHub's REST API."""

from __future__ import annotations

import base64
import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest

from m3_agent.errors import GitError, GitHubRateLimited, GitHubTokenScope, PullRequestExists
from m3_agent.fix.github import (
    GitHubClient,
    Issue,
    IssueComment,
    NewPullRequest,
    RepoRef,
    api_url_for,
    issue_content,
    parse_issue_url,
    parse_remote,
    rate_limit_wait,
)

# A real 1x1 PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)


class FakeGitHub:
    """GitHub's REST API on 127.0.0.1 under /api/v3 (as on Enterprise), plus an image host.

    `issues[(owner, repo, n)] = {"title", "body", "comments": [(login, body)]}`; `token` is the one
    token accepted (others get 401); `rate_limited` answers 403 with exhausted rate-limit headers.
    Every request is recorded as (path, headers), and every POST's JSON body in `posted`.

    Writes: `POST .../pulls` opens a pull request (kept in `pulls`; 422 when an open one has the same
    head and base, or, given `origin` (a bare repository), when the head branch is not there);
    `POST .../issues/N/comments` adds a comment. Their failures: a token in `read_only_tokens` reads
    but gets GitHub's 403 on writes; each entry of `write_limits` (rate-limit headers) answers one
    write with 429.
    """

    def __init__(self, token: str | None = "good-token", *, origin: Path | None = None) -> None:
        self.token = token
        self.origin = origin
        self.issues: dict[tuple[str, str, int], dict] = {}
        self.files: dict[str, tuple[str, bytes]] = {"/assets/shot.png": ("image/png", PNG)}
        self.rate_limited = False
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.posted: list[tuple[str, dict]] = []
        self.pulls: list[dict] = []
        self.read_only_tokens: set[str] = set()
        self.write_limits: list[dict[str, str]] = []
        self.write_times: list[float] = []
        self.next_id = 1000
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: bytes, headers: dict) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                fake.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                self._answer(*fake.route(self.path, self.headers))

            def do_POST(self):  # noqa: N802
                fake.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                fake.posted.append((self.path, body))
                fake.write_times.append(time.monotonic())
                self._answer(*fake.route_write(self.path, self.headers, body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.web = f"http://127.0.0.1:{self.port}"
        self.api = f"{self.web}/api/v3"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> FakeGitHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_issue(self, owner: str, repo: str, number: int, title: str, body: str, comments=()) -> str:
        self.issues[(owner, repo, number)] = {"title": title, "body": body, "comments": list(comments)}
        return f"{self.web}/{owner}/{repo}/issues/{number}"

    def add_pull(self, owner: str, repo: str, *, head: str, base: str = "main", title: str = "earlier fix") -> dict:
        """An open pull request made elsewhere (by hand, by an earlier run)."""
        number = self._next_number(owner, repo)
        pull = {"owner": owner, "repo": repo, "number": number, "head": head, "base": base, "title": title,
                "body": "", "draft": False, "state": "open", "html_url": f"{self.web}/{owner}/{repo}/pull/{number}"}
        self.pulls.append(pull)
        return pull

    def comments_made(self, owner: str, repo: str, number: int) -> list[str]:
        """The bodies of the comments written through the API on issue `number`."""
        return [body for path, body in self.posted if path == f"/api/v3/repos/{owner}/{repo}/issues/{number}/comments"]

    def _next_number(self, owner: str, repo: str) -> int:
        taken = [n for (o, r, n) in self.issues if (o, r) == (owner, repo)]
        taken += [p["number"] for p in self.pulls if (p["owner"], p["repo"]) == (owner, repo)]
        return max(taken, default=0) + 1

    @staticmethod
    def _json(status: int, obj, **headers) -> tuple[int, bytes, dict]:
        return status, json.dumps(obj).encode(), {"Content-Type": "application/json; charset=utf-8", **headers}

    def _auth_problem(self, headers, *, write: bool) -> tuple[int, bytes, dict] | None:
        auth = headers.get("Authorization")
        read_only = {f"Bearer {t}" for t in self.read_only_tokens}
        if auth is not None and auth != f"Bearer {self.token}" and auth not in read_only:
            return self._json(401, {"message": "Bad credentials", "documentation_url": "https://docs.github.com/rest"})
        if write and auth is None:
            return self._json(401, {"message": "Requires authentication"})
        if write and auth in read_only:
            return self._json(403, {"message": "Resource not accessible by personal access token"},
                              **{"X-OAuth-Scopes": "read:org", "X-Accepted-OAuth-Scopes": "repo"})
        if self.rate_limited:
            reset = int(time.time()) + 600
            return self._json(
                403, {"message": "API rate limit exceeded for 127.0.0.1."},
                **{"x-ratelimit-limit": "60", "x-ratelimit-remaining": "0", "x-ratelimit-reset": str(reset)},
            )
        if write and self.write_limits:
            return self._json(429, {"message": "You have exceeded a secondary rate limit."}, **self.write_limits.pop(0))
        return None

    def route(self, raw_path: str, headers) -> tuple[int, bytes, dict]:
        url = urlparse(raw_path)
        if url.path in self.files:
            mime, data = self.files[url.path]
            return 200, data, {"Content-Type": mime}
        if not url.path.startswith("/api/v3/"):
            return 404, b"not found", {"Content-Type": "text/plain"}
        problem = self._auth_problem(headers, write=False)
        if problem:
            return problem
        parts = url.path.removeprefix("/api/v3/").split("/")
        if len(parts) == 3 and parts[0] == "repos":
            return self._json(200, {"full_name": f"{parts[1]}/{parts[2]}", "default_branch": "main"})
        if len(parts) == 4 and parts[0] == "repos" and parts[3] == "pulls":
            query = dict(p.split("=", 1) for p in url.query.split("&") if "=" in p)
            head = query.get("head", "").replace("%3A", ":").replace("%2F", "/")
            return self._json(200, [p for p in self.pulls if (p["owner"], p["repo"]) == (parts[1], parts[2])
                                    and f"{p['owner']}:{p['head']}" == head and p["state"] == "open"])
        if len(parts) >= 5 and parts[0] == "repos" and parts[3] == "issues" and parts[4].isdigit():
            key = (parts[1], parts[2], int(parts[4]))
            issue = self.issues.get(key)
            if issue is None:
                return self._json(404, {"message": "Not Found", "documentation_url": "https://docs.github.com/rest"})
            if len(parts) == 5:
                return self._json(200, {
                    "number": key[2], "title": issue["title"], "body": issue["body"], "state": "open",
                    "html_url": f"{self.web}/{key[0]}/{key[1]}/issues/{key[2]}",
                    "user": {"login": "reporter"}, "labels": [{"name": "bug"}], "comments": len(issue["comments"]),
                })
            if parts[5:] == ["comments"]:
                page = int(dict(p.split("=") for p in url.query.split("&") if "=" in p).get("page", "1"))
                per_page = 2  # small pages, so pagination is exercised
                chunk = issue["comments"][(page - 1) * per_page: page * per_page]
                link = {}
                if page * per_page < len(issue["comments"]):
                    nxt = f"{self.api}/repos/{key[0]}/{key[1]}/issues/{key[2]}/comments?per_page=2&page={page + 1}"
                    link = {"Link": f'<{nxt}>; rel="next", <{nxt}>; rel="last"'}
                return self._json(200, [
                    {"id": i, "user": {"login": login}, "body": body, "created_at": "2026-01-0%dT10:00:00Z" % (i + 1)}
                    for i, (login, body) in enumerate(chunk, start=(page - 1) * per_page)
                ], **link)
        return self._json(404, {"message": "Not Found"})

    def route_write(self, raw_path: str, headers, body: dict) -> tuple[int, bytes, dict]:
        problem = self._auth_problem(headers, write=True)
        if problem:
            return problem
        parts = urlparse(raw_path).path.removeprefix("/api/v3/").split("/")
        if len(parts) == 4 and parts[0] == "repos" and parts[3] == "pulls":
            return self._open_pull(parts[1], parts[2], body)
        if len(parts) == 6 and parts[0] == "repos" and parts[3] == "issues" and parts[5] == "comments":
            issue = self.issues.get((parts[1], parts[2], int(parts[4])))
            if issue is None:
                return self._json(404, {"message": "Not Found"})
            issue["comments"].append(("m3-agent-bot", body["body"]))
            self.next_id += 1
            return self._json(201, {"id": self.next_id, "body": body["body"],
                                    "html_url": f"{self.web}/{parts[1]}/{parts[2]}/issues/{parts[4]}"
                                                f"#issuecomment-{self.next_id}"})
        return self._json(404, {"message": "Not Found"})

    def _open_pull(self, owner: str, repo: str, body: dict) -> tuple[int, bytes, dict]:
        missing = [k for k in ("title", "head", "base") if not body.get(k)]
        if missing:
            return self._json(422, {"message": "Validation Failed", "errors": [
                {"resource": "PullRequest", "field": k, "code": "missing_field"} for k in missing]})
        head = body["head"].split(":")[-1]
        if any((p["owner"], p["repo"], p["head"], p["base"], p["state"]) == (owner, repo, head, body["base"], "open")
               for p in self.pulls):
            return self._json(422, {"message": "Validation Failed", "errors": [{
                "resource": "PullRequest", "code": "custom",
                "message": f"A pull request already exists for {owner}:{head}."}]})
        if self.origin is not None and subprocess.run(
                ["git", "--git-dir", str(self.origin), "rev-parse", "--verify", "-q", f"refs/heads/{head}"],
                capture_output=True).returncode != 0:
            return self._json(422, {"message": "Validation Failed", "errors": [
                {"resource": "PullRequest", "field": "head", "code": "invalid"}]})
        pull = self.add_pull(owner, repo, head=head, base=body["base"], title=body["title"])
        pull.update(body=body.get("body", ""), draft=bool(body.get("draft", False)))
        return self._json(201, {**pull, "head": {"ref": head}, "base": {"ref": body["base"]}})


@pytest.fixture
def github():
    with FakeGitHub() as fake:
        yield fake


def test_issue_with_paginated_comments_and_token(github):
    github.add_issue("acme", "widgets", 7, "Totals are wrong", "The total ignores discounts.",
                     [("alice", "Seen on 1.2"), ("bob", "Also on 1.3"), ("carol", "Repro attached")])
    issue = GitHubClient(github.api, "good-token").get_issue("acme", "widgets", 7)
    assert (issue.number, issue.title, issue.repo) == (7, "Totals are wrong", "acme/widgets")
    assert issue.url == f"{github.web}/acme/widgets/issues/7"
    assert [c.author for c in issue.comments] == ["alice", "bob", "carol"]
    assert "### @carol (2026-01-03T10:00:00Z)\n\nRepro attached" in issue.text()
    path, headers = github.requests[0]
    assert path == "/api/v3/repos/acme/widgets/issues/7"
    assert headers["authorization"] == "Bearer good-token"
    assert headers["accept"] == "application/vnd.github+json"
    assert headers["x-github-api-version"] == "2022-11-28"
    assert len(github.requests) == 3  # issue + two comment pages


def test_issue_without_comments_does_not_fetch_them(github):
    github.add_issue("acme", "widgets", 8, "t", "b")
    issue = GitHubClient(github.api).get_issue("acme", "widgets", 8)
    assert issue.comments == [] and len(github.requests) == 1
    assert "authorization" not in github.requests[0][1]


def test_missing_issue_is_a_git_error_with_the_issue_named(github):
    with pytest.raises(GitError, match=r"issue #99 not found in acme/widgets \(if the repository is private") as e:
        GitHubClient(github.api).get_issue("acme", "widgets", 99)
    assert e.value.exit_code == 5
    with pytest.raises(GitError) as e:
        parse_remote("https://user:s3cret@example.com/only-one-part")
    assert "s3cret" not in str(e.value)


def test_rate_limit_says_when_it_resets(github):
    github.rate_limited = True
    with pytest.raises(GitError, match=r"rate limit exceeded; it resets at \d\d:\d\d UTC \(in (9|10) min .*set GITHUB_TOKEN"):
        GitHubClient(github.api).get_issue("acme", "widgets", 7)


def test_bad_token_is_reported_as_such(github):
    github.add_issue("acme", "widgets", 7, "t", "b")
    with pytest.raises(GitError, match=r"GitHub rejected the token \(Bad credentials\): check GITHUB_TOKEN"):
        GitHubClient(github.api, "wrong").get_issue("acme", "widgets", 7)


def test_unreachable_api_is_a_git_error(github):
    port = github.port
    github.server.shutdown()
    github.server.server_close()
    with pytest.raises(GitError, match="cannot reach GitHub at"):
        GitHubClient(f"http://127.0.0.1:{port}/api/v3", timeout=2).get_issue("acme", "widgets", 1)


def test_images_become_data_urls_and_the_token_stays_on_the_github_host(github):
    body = (f"Broken layout:\n\n![screenshot]({github.web}/assets/shot.png)\n"
            f'<img width="10" src="http://localhost:{github.port}/assets/shot.png">')
    github.add_issue("acme", "widgets", 7, "Layout", body)
    client = GitHubClient(github.api, "good-token")
    issue = client.get_issue("acme", "widgets", 7)
    assert issue.image_urls() == [f"{github.web}/assets/shot.png", f"http://localhost:{github.port}/assets/shot.png"]
    content, notices = issue_content(issue, client, images=True)
    assert notices == []
    assert content[0]["type"] == "text" and "Broken layout" in content[0]["text"]
    urls = [p["image_url"]["url"] for p in content[1:]]
    assert len(urls) == 2
    assert base64.b64decode(urls[0].removeprefix("data:image/png;base64,")) == PNG
    image_requests = {p.split("?")[0]: h for p, h in github.requests if p.startswith("/assets/")}
    sent = [h.get("authorization") for p, h in github.requests if p.startswith("/assets/")]
    assert image_requests and sent == ["Bearer good-token", None]  # localhost is another host: no token


def test_text_only_endpoint_skips_images_with_a_notice(github):
    issue = Issue(source="text", key="t", title="x", body=f"![a]({github.web}/assets/shot.png)")
    content, notices = issue_content(issue, None, images=False)
    assert content == issue.text()
    assert notices == ["1 image(s) in the issue not sent: the endpoint is text-only"]
    assert github.requests == []


def test_broken_image_is_skipped_with_a_notice(github):
    github.files["/assets/page.html"] = ("text/html", b"<html>login</html>")
    issue = Issue(source="text", key="t", title="x",
                  body=f"![a]({github.web}/assets/missing.png) ![b]({github.web}/assets/page.html)")
    content, notices = issue_content(issue, GitHubClient(github.api), images=True)
    assert content == issue.text()  # nothing downloadable: plain text
    assert len(notices) == 2
    assert "image skipped" in notices[0] and "not an image" in notices[1]


def test_comment_images_and_relative_links():
    issue = Issue(source="github", key="1", number=1, title="t", body="![rel](docs/a.png) text",
                  comments=[IssueComment(author="a", body="![x](https://example.com/x.png) ![x](https://example.com/x.png)")])
    assert issue.image_urls() == ["https://example.com/x.png"]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://github.com/acme/widgets.git", RepoRef("github.com", "acme", "widgets")),
        ("https://github.com/acme/widgets", RepoRef("github.com", "acme", "widgets")),
        ("git@github.com:acme/widgets.git", RepoRef("github.com", "acme", "widgets")),
        ("ssh://git@ghe.corp.example:2222/team/svc.git", RepoRef("ghe.corp.example", "team", "svc")),
        ("http://127.0.0.1:8080/acme/widgets.git", RepoRef("127.0.0.1:8080", "acme", "widgets", "http")),
    ],
)
def test_parse_remote(url, expected):
    assert parse_remote(url) == expected


def test_parse_remote_rejects_local_paths():
    with pytest.raises(GitError, match="is not a GitHub repository URL") as e:
        parse_remote("/srv/git/widgets.git")
    assert e.value.exit_code == 5


def test_issue_urls_and_api_bases():
    ref, n = parse_issue_url("https://github.com/acme/widgets/issues/12")
    assert (ref.slug, n, api_url_for(ref)) == ("acme/widgets", 12, "https://api.github.com")
    ref, n = parse_issue_url("https://ghe.corp.example/team/svc/pull/3/")
    assert (n, api_url_for(ref)) == (3, "https://ghe.corp.example/api/v3")
    assert parse_issue_url("https://github.com/acme/widgets/blob/main/x.py") is None
    assert parse_issue_url("bug.md") is None


# ----- writes: pull requests and comments ---------------------------------------------------------

NEW_PULL = NewPullRequest(title="Fix #7: add() subtracts", body="Fixes #7", head="m3-agent/issue-7", base="main")


def test_a_pull_request_is_opened_as_a_draft_and_a_comment_is_posted(github):
    github.add_issue("acme", "widgets", 7, "add() subtracts", "b")
    client = GitHubClient(github.api, "good-token")
    pull = client.create_pull("acme/widgets", NEW_PULL)
    assert (pull.number, pull.url) == (8, f"{github.web}/acme/widgets/pull/8")
    path, body = github.posted[0]
    assert path == "/api/v3/repos/acme/widgets/pulls"
    assert body == {"title": "Fix #7: add() subtracts", "body": "Fixes #7", "head": "m3-agent/issue-7",
                    "base": "main", "draft": True}
    assert github.requests[0][1]["content-type"] == "application/json"
    comment = client.create_comment("acme/widgets", 7, "Opened a pull request.")
    assert comment.url == f"{github.web}/acme/widgets/issues/7#issuecomment-{comment.id}"
    assert github.comments_made("acme", "widgets", 7) == [{"body": "Opened a pull request."}]
    assert client.get_issue("acme", "widgets", 7).comments[-1].body == "Opened a pull request."


def test_a_pull_request_that_exists_for_the_branch_is_its_own_error_with_its_address(github):
    earlier = github.add_pull("acme", "widgets", head="m3-agent/issue-7")
    with pytest.raises(PullRequestExists, match="a pull request already exists for m3-agent/issue-7 in acme/widgets: "
                                                + earlier["html_url"]) as e:
        GitHubClient(github.api, "good-token").create_pull("acme/widgets", NEW_PULL)
    assert (e.value.exit_code, e.value.url) == (12, earlier["html_url"])


def test_a_token_that_may_read_but_not_write_is_a_scope_error(github):
    github.add_issue("acme", "widgets", 7, "t", "b")
    github.read_only_tokens.add("read-token")
    client = GitHubClient(github.api, "read-token")
    assert client.get_issue("acme", "widgets", 7).title == "t"  # reading works
    with pytest.raises(GitHubTokenScope, match=r"may not open pull requests in acme/widgets \(Resource not "
                                               r"accessible by personal access token\); the token's scopes: "
                                               r"read:org, the request accepts: repo: .*pull-requests: write") as e:
        client.create_pull("acme/widgets", NEW_PULL)
    assert e.value.exit_code == 11
    with pytest.raises(GitHubTokenScope, match="may not comment on issues in acme/widgets .*issues: write"):
        client.create_comment("acme/widgets", 7, "x")
    assert github.pulls == []


def test_a_rate_limited_write_is_tried_again_after_the_time_github_gives(github):
    github.write_limits = [{"Retry-After": "1"}]
    started = time.monotonic()
    pull = GitHubClient(github.api, "good-token").create_pull("acme/widgets", NEW_PULL)
    assert pull.number == 1 and len(github.posted) == 2
    assert github.write_times[1] - github.write_times[0] >= 1.0 and time.monotonic() - started < 10


def test_a_rate_limit_that_lasts_longer_than_the_wait_allowed_fails_at_once(github):
    reset = str(int(time.time()) + 3600)
    github.write_limits = [{"x-ratelimit-remaining": "0", "x-ratelimit-reset": reset}] * 4
    started = time.monotonic()
    with pytest.raises(GitHubRateLimited, match=r"GitHub API rate limit exceeded; it resets at \d\d:\d\d UTC") as e:
        GitHubClient(github.api, "good-token", max_wait_s=30).create_pull("acme/widgets", NEW_PULL)
    assert e.value.exit_code == 13 and len(github.posted) == 1 and time.monotonic() - started < 5


def test_rate_limit_waits_follow_github_and_grow_between_tries():
    now = time.time()
    assert rate_limit_wait(429, {"retry-after": "5"}, "", 0) == 5.0
    assert rate_limit_wait(429, {"retry-after": "1"}, "", 3) == 8.0  # at least twice the try before
    primary = rate_limit_wait(403, {"x-ratelimit-remaining": "0", "x-ratelimit-reset": str(int(now) + 30)}, "", 0)
    assert 29 <= primary <= 32
    assert rate_limit_wait(403, {}, "You have exceeded a secondary rate limit", 0) == 60.0
    assert rate_limit_wait(403, {}, "Resource not accessible by integration", 0) is None
    assert rate_limit_wait(422, {"retry-after": "5"}, "", 0) is None


def test_a_pull_request_for_a_branch_the_remote_lacks_is_githubs_validation_error(tmp_path):
    origin = tmp_path / "origin.git"
    subprocess.run(["git", "init", "-q", "--bare", str(origin)], check=True)
    with FakeGitHub(origin=origin) as gh:
        with pytest.raises(GitError, match=r"GitHub API error 422 for .*/pulls \(Validation Failed; head invalid\)") as e:
            GitHubClient(gh.api, "good-token").create_pull("acme/widgets", NEW_PULL)
    assert e.value.exit_code == 5 and gh.pulls == []
