"""GitHub issues over the REST API (github.com and GitHub Enterprise), and their images.

`GitHubClient(api_url, token).get_issue(owner, repo, number)` returns an `Issue` with title, body and
every comment. Failures become `GitError` (exit 5) with a message that says what to do: a missing
issue (404), a rejected token (401), an exhausted rate limit (403/429 with rate-limit headers).
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

from m3_agent.errors import GitError

PUBLIC_API = "https://api.github.com"
PUBLIC_HOST = "github.com"
API_VERSION = "2022-11-28"
MAX_IMAGE_BYTES = 5 * 1024 * 1024
MAX_IMAGES = 8
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
            found = [(m.start(), m.group(1)) for m in _MD_IMAGE.finditer(text)]
            found += [(m.start(), m.group(1)) for m in _HTML_IMAGE.finditer(text)]
            for _, url in sorted(found):
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
        """`owner/name`."""
        return f"{self.owner}/{self.name}"


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


def _describe_reset(headers: Any) -> str:
    reset = headers.get("x-ratelimit-reset")
    if reset and reset.isdigit():
        wait = max(0, int(reset) - int(time.time()))
        at = time.strftime("%H:%M UTC", time.gmtime(int(reset)))
        return f"; it resets at {at} (in {wait // 60} min {wait % 60} s)"
    retry = headers.get("retry-after")
    return f"; retry after {retry} s" if retry else ""


class GitHubClient:
    """A small client for the GitHub REST API: issues, their comments, and image downloads."""

    def __init__(self, api_url: str = PUBLIC_API, token: str | None = None, *, timeout: float = 20.0) -> None:
        self.api_url = api_url.rstrip("/")
        self.token = token or None
        self.timeout = timeout
        api = urllib.parse.urlparse(self.api_url)
        # The token goes only to the API host and its web host, never to third-party image hosts.
        self._token_hosts = {api.netloc, api.netloc.removeprefix("api.")}

    def _request(self, url: str, *, accept: str, send_token: bool, limit: int = -1) -> tuple[bytes, Any]:
        req = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "m3-agent"})
        req.add_header("X-GitHub-Api-Version", API_VERSION)
        if self.token and send_token:
            # Unredirected: a redirect to object storage must not carry the token along.
            req.add_unredirected_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read(limit), resp.headers
        except urllib.error.HTTPError as e:
            raise self._http_error(e, url) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise GitError(f"cannot reach GitHub at {self.api_url}: {reason} (check --github-api-url)") from None

    def _http_error(self, e: urllib.error.HTTPError, url: str) -> GitHubError:
        try:
            message = json.loads(e.read() or b"{}").get("message", "")
        except (ValueError, AttributeError):
            message = ""
        detail = f" ({message})" if message else ""
        if e.code == 401:
            text = f"GitHub rejected the token{detail}: check GITHUB_TOKEN / GH_TOKEN"
        elif e.code in (403, 429) and (e.headers.get("x-ratelimit-remaining") == "0" or e.headers.get("retry-after")):
            hint = "" if self.token else "; set GITHUB_TOKEN for a higher limit"
            text = f"GitHub API rate limit exceeded{_describe_reset(e.headers)}{hint}"
        elif e.code == 403:
            text = f"GitHub refused access to {url}{detail}: the token may lack access to this repository"
        elif e.code == 404:
            text = f"not found on GitHub: {url}{self._private_hint()}"
        elif e.code == 410:
            text = f"gone from GitHub: {url}{detail} (deleted, or issues are disabled)"
        else:
            text = f"GitHub API error {e.code} for {url}{detail}"
        return GitHubError(text, status=e.code)

    def _private_hint(self) -> str:
        return "" if self.token else " (if the repository is private, set GITHUB_TOKEN)"

    def _get_json(self, path: str) -> tuple[Any, Any]:
        url = path if path.startswith(("http://", "https://")) else self.api_url + path
        body, headers = self._request(url, accept="application/vnd.github+json", send_token=True)
        try:
            return json.loads(body), headers
        except ValueError:
            raise GitError(f"GitHub answered {url} with something that is not JSON (check --github-api-url)") from None

    def get_issue(self, owner: str, repo: str, number: int) -> Issue:
        """Issue `number` of `owner/repo` with title, body and all its comments."""
        try:
            data, _ = self._get_json(f"/repos/{owner}/{repo}/issues/{number}")
        except GitHubError as e:
            if e.status == 404:
                raise GitHubError(f"issue #{number} not found in {owner}/{repo}{self._private_hint()}", status=404) from None
            raise
        comments: list[IssueComment] = []
        if data.get("comments", 1):
            next_url: str | None = f"/repos/{owner}/{repo}/issues/{number}/comments?per_page=100"
            while next_url:
                page, headers = self._get_json(next_url)
                comments += [
                    IssueComment(author=(c.get("user") or {}).get("login", ""), body=c.get("body") or "",
                                 created_at=c.get("created_at"))
                    for c in page
                ]
                next_url = _next_link(headers.get("link", ""))
        return Issue(
            source="github", key=str(number), number=number, repo=f"{owner}/{repo}",
            title=data.get("title") or "", body=data.get("body") or "", url=data.get("html_url"),
            comments=comments,
        )

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


def _next_link(link: str) -> str | None:
    """The `rel="next"` URL of a GitHub Link header (pagination)."""
    for part in link.split(","):
        m = re.search(r'<([^>]+)>\s*;\s*rel="next"', part)
        if m:
            return m.group(1)
    return None


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
