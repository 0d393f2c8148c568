"""GitHub over the REST API (github.com and GitHub Enterprise): issues and their images, pull requests, comments.

`GitHubClient(api_url, token).get_issue(owner, repo, number)` returns an `Issue` with title, body and
every comment; `create_pull` opens a pull request and `create_comment` comments on an issue (what
`fix --pr` / `--comment` do, `fix.publish`). Failures are one-line errors that say what to do: a
missing issue (404) or a rejected token (401) is a `GitError` (exit 5); a token without the
permission a request needs is `GitHubTokenScope` (11); a pull request that exists for the branch is
`PullRequestExists` (12). A rate limit is waited out when GitHub says when (Retry-After,
x-ratelimit-reset) and the wait fits `max_wait_s`, with a growing pause between tries; past that it
is `GitHubRateLimited` (13).
"""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from m3_agent.errors import GitError, GitHubRateLimited, GitHubTokenScope, PullRequestExists

PUBLIC_API = "https://api.github.com"
PUBLIC_HOST = "github.com"
API_VERSION = "2022-11-28"
MAX_IMAGE_BYTES = 5 * 1024 * 1024
MAX_IMAGES = 8
# How long one request may wait out GitHub's rate limit in all, and how many tries it gets.
MAX_RATE_LIMIT_WAIT_S = 120.0
MAX_TRIES = 4
# GitHub's advice for a secondary limit that names no time: wait a minute, then longer each time.
SECONDARY_LIMIT_WAIT_S = 60.0
# Markdown images ![alt](url "title") and HTML <img src="url">, the two ways GitHub bodies embed images.
_MD_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_IMAGE = re.compile(r"<img\b[^>]*?\bsrc\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_IMAGE_MAGIC = {
    b"\x89PNG\r\n\x1a\n": "image/png",
    b"\xff\xd8\xff": "image/jpeg",
    b"GIF87a": "image/gif",
    b"GIF89a": "image/gif",
}


class GitHubError(GitError):
    """A GitHub API failure; `status` is the HTTP status code."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class IssueComment(BaseModel):
    """One comment on an issue."""

    author: str = ""
    body: str = ""
    created_at: str | None = None


class Issue(BaseModel):
    """An issue to fix, whatever its source: a GitHub issue, a file, or text."""

    source: Literal["github", "file", "text"]
    key: str = Field(description="short id used in the branch and file names: the number, or a slug")
    title: str = ""
    body: str = ""
    number: int | None = None
    repo: str | None = Field(None, description="owner/name for GitHub issues")
    url: str | None = None
    comments: list[IssueComment] = Field(default_factory=list)

    @property
    def reference(self) -> str:
        """How progress and notices name this issue: `#12`, else its title (or key)."""
        if self.number is not None:
            return f"#{self.number}"
        return self.title or self.key

    def text(self) -> str:
        """The issue as the model reads it: files and text verbatim; GitHub issues as heading, body, comments."""
        if self.source != "github":
            return self.body.strip() + "\n"
        head = f"# Issue #{self.number}: {self.title}" if self.number is not None else f"# {self.title or 'Issue'}"
        parts = [head]
        if self.url:
            parts.append(self.url)
        parts.append(self.body.strip() or "(no description)")
        if self.comments:
            parts.append("## Comments")
            for c in self.comments:
                when = f" ({c.created_at})" if c.created_at else ""
                parts.append(f"### @{c.author}{when}\n\n{c.body.strip()}")
        return "\n\n".join(parts) + "\n"

    def image_urls(self) -> list[str]:
        """Image links in the body and comments, in order, without duplicates."""
        seen: dict[str, None] = {}
        for text in [self.body, *(c.body for c in self.comments)]:
            found = sorted((m.start(), m[1]) for pattern in (_MD_IMAGE, _HTML_IMAGE) for m in pattern.finditer(text))
            for _, url in found:
                if url.startswith(("http://", "https://")):
                    seen.setdefault(url, None)
        return list(seen)


@dataclass(frozen=True)
class RepoRef:
    """A repository on a GitHub host: `host` keeps the scheme's host[:port]."""

    host: str
    owner: str
    name: str
    scheme: str = "https"

    @property
    def slug(self) -> str:
        return f"{self.owner}/{self.name}"


class NewPullRequest(BaseModel):
    """What `create_pull` sends: `head` is the branch (`owner:branch` from a fork), `base` the branch it merges into."""

    title: str
    body: str
    head: str
    base: str
    draft: bool = True


class PullRequest(BaseModel):
    """A pull request as GitHub answered it."""

    number: int
    url: str = Field(description="the pull request's web page (html_url)")


class PostedComment(BaseModel):
    """A comment as GitHub answered it."""

    id: int
    url: str = Field(description="the comment's web page (html_url)")


def parse_remote(url: str) -> RepoRef:
    """The repository a git remote URL points at (https, ssh, scp-like `git@host:owner/name.git`)."""
    url = url.strip()
    scp = re.fullmatch(r"(?:[^@/]+@)?([^:/]+):(?!//)([^/]+)/([^/]+?)(?:\.git)?/?", url)
    if scp and "://" not in url:
        return RepoRef(scp.group(1), scp.group(2), scp.group(3))
    parsed = urllib.parse.urlparse(url)
    parts = [p for p in parsed.path.split("/") if p]
    if parsed.scheme in ("http", "https", "ssh", "git") and parsed.hostname and len(parts) >= 2:
        host = parsed.hostname + (f":{parsed.port}" if parsed.port and parsed.scheme in ("http", "https") else "")
        name = parts[-1][:-4] if parts[-1].endswith(".git") else parts[-1]
        scheme = parsed.scheme if parsed.scheme in ("http", "https") else "https"
        return RepoRef(host, parts[-2], name, scheme)
    shown = re.sub(r"//[^/@]*@", "//", url)  # never print credentials embedded in the URL
    raise GitError(f"the origin remote '{shown}' is not a GitHub repository URL: pass the issue URL instead")


def parse_issue_url(url: str) -> tuple[RepoRef, int] | None:
    """`https://HOST/OWNER/REPO/issues/N` (or `/pull/N`) -> (repo, N); None when `url` is not one."""
    parsed = urllib.parse.urlparse(url.strip())
    m = re.fullmatch(r"/([^/]+)/([^/]+)/(?:issues|pull)/(\d+)/?", parsed.path)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or not m:
        return None
    host = parsed.hostname + (f":{parsed.port}" if parsed.port else "")
    return RepoRef(host, m.group(1), m.group(2), parsed.scheme), int(m.group(3))


def api_url_for(repo: RepoRef) -> str:
    """The REST API base of the host: api.github.com for github.com, `/api/v3` on Enterprise."""
    if repo.host == PUBLIC_HOST:
        return PUBLIC_API
    return f"{repo.scheme}://{repo.host}/api/v3"


def rate_limit_wait(status: int, headers: Any, message: str, attempt: int) -> float | None:
    """Seconds to wait before trying a rate-limited request again; None when the answer is no rate limit.

    GitHub says when in `Retry-After` (seconds) or, for an exhausted primary limit, `x-ratelimit-reset`
    (epoch seconds); a secondary limit that says neither gets a minute. Each try waits at least
    twice as long as the one before (`attempt` counts from 0).
    """
    if status not in (403, 429):
        return None
    retry = (headers.get("retry-after") or "").strip()
    reset = (headers.get("x-ratelimit-reset") or "").strip()
    if retry.isdigit():
        advised = float(retry)
    elif headers.get("x-ratelimit-remaining") == "0":
        advised = max(0.0, int(reset) - time.time()) + 1 if reset.isdigit() else SECONDARY_LIMIT_WAIT_S
    elif "rate limit" in message.lower():
        advised = SECONDARY_LIMIT_WAIT_S
    else:
        return None
    return max(advised, float(2**attempt))


def _detail(body: bytes) -> str:
    """GitHub's error message with its validation errors (422: "Validation Failed; A pull request already ...")."""
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    errors = [e.get("message") or " ".join(str(e[k]) for k in ("field", "code") if e.get(k))
              for e in data.get("errors") or [] if isinstance(e, dict)]
    return "; ".join(str(part) for part in [data.get("message", ""), *errors] if part)


class GitHubClient:
    """A small client for the GitHub REST API: issues and their comments, pull requests, image downloads."""

    def __init__(self, api_url: str = PUBLIC_API, token: str | None = None, *, timeout: float = 20.0,
                 max_wait_s: float = MAX_RATE_LIMIT_WAIT_S) -> None:
        self.api_url = api_url.rstrip("/")
        self.token = token or None
        self.timeout = timeout
        self.max_wait_s = max_wait_s
        api = urllib.parse.urlparse(self.api_url)
        # The token goes only to the API host and its web host, never to third-party image hosts.
        self._token_hosts = {api.netloc, api.netloc.removeprefix("api.")}

    def _request(self, url: str, *, accept: str, send_token: bool, limit: int = -1,
                 payload: dict[str, Any] | None = None) -> tuple[bytes, Any]:
        """GET `url`, or POST `payload` as JSON; an API request waits out a rate limit GitHub times."""
        attempt, waited = 0, 0.0
        while True:
            try:
                return self._send(url, accept=accept, send_token=send_token, limit=limit, payload=payload)
            except urllib.error.HTTPError as e:
                detail = _detail(e.read())
                wait = rate_limit_wait(e.code, e.headers, detail, attempt) if url.startswith(self.api_url) else None
                if wait is None:
                    raise self._http_error(e.code, e.headers, detail, url) from None
                if waited + wait > self.max_wait_s or attempt + 1 >= MAX_TRIES:
                    raise self._rate_limited(e.headers, waited) from None
                time.sleep(wait)
                attempt, waited = attempt + 1, waited + wait

    def _send(self, url: str, *, accept: str, send_token: bool, limit: int,
              payload: dict[str, Any] | None) -> tuple[bytes, Any]:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(url, data=data, headers={"Accept": accept, "User-Agent": "m3-agent"})
        req.add_header("X-GitHub-Api-Version", API_VERSION)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token and send_token:
            # Unredirected: a redirect to object storage must not carry the token along.
            req.add_unredirected_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read(limit), resp.headers
        except urllib.error.HTTPError:
            raise  # GitHub answered: `_request` reads the answer (an HTTPError is also a URLError)
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise GitError(f"cannot reach GitHub at {self.api_url}: {reason} (check --github-api-url)") from None

    def _rate_limited(self, headers: Any, waited: float) -> GitHubRateLimited:
        hint = "" if self.token else "; set GITHUB_TOKEN for a higher limit"
        after = f" after waiting {waited:.0f} s" if waited else ""
        reset, retry = headers.get("x-ratelimit-reset"), headers.get("retry-after")
        if reset and reset.isdigit():
            wait = max(0, int(reset) - int(time.time()))
            at = time.strftime("%H:%M UTC", time.gmtime(int(reset)))
            after += f"; it resets at {at} (in {wait // 60} min {wait % 60} s)"
        elif retry:
            after += f"; retry after {retry} s"
        return GitHubRateLimited(f"GitHub API rate limit exceeded{after}{hint}")

    def _http_error(self, status: int, headers: Any, message: str, url: str) -> GitError:
        detail = f" ({message})" if message else ""
        if status == 401:
            return GitHubError(f"GitHub rejected the token{detail}: check GITHUB_TOKEN / GH_TOKEN", status=status)
        if status == 403 and self.token:
            # A classic token's scopes and the ones the request accepts, when GitHub sends them.
            have, need = headers.get("x-oauth-scopes"), headers.get("x-accepted-oauth-scopes")
            why = detail + (f"; the token's scopes: {have or 'none'}, the request accepts: {need}"
                            if have is not None and need else "")
            return GitHubTokenScope(f"GitHub refused the token for {url}{why}: it lacks a permission "
                                    "(docs/usage.md: pull requests and comments)", detail=why)
        if status == 403:
            text = f"GitHub refused access to {url}{detail}: the token may lack access to this repository"
        elif status == 404:
            text = f"not found on GitHub: {url}{self._private_hint()}"
        elif status == 410:
            text = f"gone from GitHub: {url}{detail} (deleted, or issues are disabled)"
        else:
            text = f"GitHub API error {status} for {url}{detail}"
        return GitHubError(text, status=status)

    def _private_hint(self) -> str:
        return "" if self.token else " (if the repository is private, set GITHUB_TOKEN)"

    def _json(self, path: str, payload: dict[str, Any] | None = None) -> tuple[Any, Any]:
        """The JSON GitHub answers to a GET of `path` (an API path or a full URL), or to a POST of `payload`."""
        url = path if path.startswith(("http://", "https://")) else self.api_url + path
        body, headers = self._request(url, accept="application/vnd.github+json", send_token=True, payload=payload)
        try:
            return json.loads(body), headers
        except ValueError:
            raise GitError(f"GitHub answered {url} with something that is not JSON (check --github-api-url)") from None

    def get_issue(self, owner: str, repo: str, number: int) -> Issue:
        """Issue `number` of `owner/repo` with title, body and all its comments."""
        try:
            data, _ = self._json(f"/repos/{owner}/{repo}/issues/{number}")
        except GitHubError as e:
            if e.status == 404:
                raise GitHubError(f"issue #{number} not found in {owner}/{repo}{self._private_hint()}", status=404) from None
            raise
        comments: list[IssueComment] = []
        if data.get("comments", 1):
            next_url: str | None = f"/repos/{owner}/{repo}/issues/{number}/comments?per_page=100"
            while next_url:
                page, headers = self._json(next_url)
                comments += [
                    IssueComment(author=(c.get("user") or {}).get("login", ""), body=c.get("body") or "",
                                 created_at=c.get("created_at"))
                    for c in page
                ]
                next_link = re.search(r'<([^>]+)>\s*;\s*rel="next"', headers.get("link", ""))  # pagination
                next_url = next_link[1] if next_link else None
        return Issue(
            source="github", key=str(number), number=number, repo=f"{owner}/{repo}",
            title=data.get("title") or "", body=data.get("body") or "", url=data.get("html_url"),
            comments=comments,
        )

    def default_branch(self, slug: str) -> str:
        """The default branch of repository `slug` (`owner/name`)."""
        data, _ = self._json(f"/repos/{slug}")
        return data.get("default_branch") or "main"

    def create_pull(self, slug: str, new: NewPullRequest) -> PullRequest:
        """Open a pull request in `slug`; PullRequestExists when an open one has the same head."""
        try:
            data, _ = self._json(f"/repos/{slug}/pulls", new.model_dump())
        except GitHubTokenScope as e:
            raise GitHubTokenScope(f"the GitHub token may not open pull requests in {slug}{e.detail}: a workflow's "
                                   "GITHUB_TOKEN needs `pull-requests: write`, a classic token the repo scope",
                                   detail=e.detail) from None
        except GitHubError as e:
            # GitHub tells this 422 from its other validation failures only by its message.
            if e.status != 422 or "already exists" not in str(e):
                raise
            url = self.find_pull(slug, new.head)
            where = f": {url}" if url else ""
            raise PullRequestExists(f"a pull request already exists for {new.head} in {slug}{where}",
                                    url=url) from None
        return PullRequest(number=data["number"], url=data.get("html_url", ""))

    def find_pull(self, slug: str, head: str) -> str | None:
        """The web address of the open pull request whose head is `head` (`branch` or `owner:branch`), if any."""
        owner_head = head if ":" in head else f"{slug.split('/')[0]}:{head}"
        query = urllib.parse.urlencode({"head": owner_head, "state": "open"})
        data, _ = self._json(f"/repos/{slug}/pulls?{query}")
        return data[0].get("html_url") if isinstance(data, list) and data else None

    def create_comment(self, slug: str, number: int, body: str) -> PostedComment:
        """Comment on issue (or pull request) `number` of `slug`."""
        try:
            data, _ = self._json(f"/repos/{slug}/issues/{number}/comments", {"body": body})
        except GitHubTokenScope as e:
            raise GitHubTokenScope(f"the GitHub token may not comment on issues in {slug}{e.detail}: a workflow's "
                                   "GITHUB_TOKEN needs `issues: write`, a classic token the repo scope",
                                   detail=e.detail) from None
        return PostedComment(id=data["id"], url=data.get("html_url", ""))

    def download_image(self, url: str) -> str:
        """The image at `url` as a `data:` URL; GitError when it cannot be fetched or is not an image."""
        host = urllib.parse.urlparse(url).netloc
        body, headers = self._request(
            url, accept="image/*", send_token=host in self._token_hosts, limit=MAX_IMAGE_BYTES + 1
        )
        if len(body) > MAX_IMAGE_BYTES:
            raise GitError(f"image larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB: {url}")
        mime = (headers.get("content-type") or "").split(";")[0].strip().lower()
        if not mime.startswith("image/"):
            mime = next((m for magic, m in _IMAGE_MAGIC.items() if body.startswith(magic)), "")
            if body[:4] == b"RIFF" and body[8:12] == b"WEBP":
                mime = "image/webp"
        if not mime:
            raise GitError(f"not an image: {url}")
        return f"data:{mime};base64,{base64.b64encode(body).decode('ascii')}"


def issue_content(issue: Issue, client: GitHubClient | None, *, images: bool) -> tuple[str | list[dict], list[str]]:
    """What the model receives for `issue`, and the notices to show the user.

    With `images`, the issue's images are downloaded into data URLs and sent as `image_url` parts
    after the text; images that fail to download are skipped with a notice. Without, every image
    is skipped with one notice and the text goes alone.
    """
    text = issue.text()
    urls = issue.image_urls()
    if not urls:
        return text, []
    if not images:
        return text, [f"{len(urls)} image(s) in the issue not sent: the endpoint is text-only"]
    fetcher = client or GitHubClient()
    notices: list[str] = []
    parts: list[dict] = [{"type": "text", "text": text}]
    for url in urls:
        if len(parts) > MAX_IMAGES:
            notices.append(f"more than {MAX_IMAGES} images in the issue: the rest are not sent")
            break
        try:
            parts.append({"type": "image_url", "image_url": {"url": fetcher.download_image(url)}})
        except GitError as e:
            notices.append(f"image skipped: {e}")
    return (parts if len(parts) > 1 else text), notices
