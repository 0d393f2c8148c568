"""GitHub issues through a local HTTP server that serves the same JSON shapes as GitHub's REST API."""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import pytest

from m3_agent.errors import GitError
from m3_agent.fix.github import (
    GitHubClient,
    Issue,
    IssueComment,
    RepoRef,
    api_url_for,
    issue_content,
    parse_issue_url,
    parse_remote,
)

# A real 1x1 PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)


class FakeGitHub:
    """GitHub's REST API on 127.0.0.1 under /api/v3 (as on Enterprise), plus an image host.

    `issues[(owner, repo, n)] = {"title", "body", "comments": [(login, body)]}`; `token` is the one
    token accepted (others get 401); `rate_limited` answers 403 with exhausted rate-limit headers.
    Every request is recorded as (path, headers).
    """

    def __init__(self, token: str | None = "good-token") -> None:
        self.token = token
        self.issues: dict[tuple[str, str, int], dict] = {}
        self.files: dict[str, tuple[str, bytes]] = {"/assets/shot.png": ("image/png", PNG)}
        self.rate_limited = False
        self.requests: list[tuple[str, dict[str, str]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                fake.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                status, body, headers = fake.route(self.path, self.headers)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

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

    @staticmethod
    def _json(status: int, obj, **headers) -> tuple[int, bytes, dict]:
        return status, json.dumps(obj).encode(), {"Content-Type": "application/json; charset=utf-8", **headers}

    def route(self, raw_path: str, headers) -> tuple[int, bytes, dict]:
        url = urlparse(raw_path)
        if url.path in self.files:
            mime, data = self.files[url.path]
            return 200, data, {"Content-Type": mime}
        if not url.path.startswith("/api/v3/"):
            return 404, b"not found", {"Content-Type": "text/plain"}
        auth = headers.get("Authorization")
        if auth is not None and auth != f"Bearer {self.token}":
            return self._json(401, {"message": "Bad credentials", "documentation_url": "https://docs.github.com/rest"})
        if self.rate_limited:
            reset = int(time.time()) + 600
            return self._json(
                403, {"message": "API rate limit exceeded for 127.0.0.1."},
                **{"x-ratelimit-limit": "60", "x-ratelimit-remaining": "0", "x-ratelimit-reset": str(reset)},
            )
        parts = url.path.removeprefix("/api/v3/").split("/")
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
