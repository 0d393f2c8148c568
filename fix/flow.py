"""The flow of `m3-agent fix`: fix an issue in a repository; hands back a branch, a commit and a `.patch`.

    result = fix_issue("123", repo=".", settings=settings)      # the library entry point; fix/cli.py is the command

The flow (`fix_issue`):
1. open the repository and choose the base commit (HEAD on a branch, or `--base REV`);
2. read the issue (GitHub REST API, a file, or text) and its images;
3. export the base tree (HEAD, or the working tree with `--include-uncommitted`) into a temporary
   directory: the agent and its sandbox never see the user's checkout;
4. run the agent loop on that copy;
5. turn the patch into one commit on a new branch `m3-agent/issue-<key>` and a `.patch` file,
   without touching the working tree, the index or the current branch; `--apply` then applies the
   patch to the working tree, only when it is clean;
6. with `--push`, `--pr` or `--comment`, publish it (`fix.publish`): the branch on the remote, a pull
   request, a comment on the issue.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, Field

from m3_agent.fix import gitwork
from m3_agent.agent.config import AgentConfig
from m3_agent.agent.events import AgentEvent, Subscriber
from m3_agent.agent.loop import Agent, RunResult
from m3_agent.errors import EndpointError, GitError, Interrupted, PushRejected, UsageError
from m3_agent.fix.github import (PUBLIC_API, PUBLIC_HOST, GitHubClient, Issue, RepoRef, api_url_for, issue_content,
                                 parse_issue_url, parse_remote)
from m3_agent.fix.publish import Publisher, kept
from m3_agent.fix.result import EXIT_CODES, FixResult, FixStatus
from m3_agent.hostgit import export_tree, submodules
from m3_agent.sandbox.cleanup import claim, prune_scratch
from m3_agent.sandbox.env.build import environment_for
from m3_agent.serving.endpoint import Served
from m3_agent.settings import Settings, load_settings
from m3_agent.tools import Tool

Notice = Callable[[str], None]

# What a text-only endpoint says when handed an image (vLLM: "At most 0 image(s) may be provided").
_IMAGE_REJECTED = re.compile(r"\(400\).*(image|multi-?modal|vision|mm[_ ])", re.IGNORECASE | re.DOTALL)
_ISSUE_NUMBER = re.compile(r"#?(\d+)")
_ISSUE_SHORT_REF = re.compile(r"([\w.-]+)/([\w.-]+)#(\d+)")
_FILE_LIKE = re.compile(r"\S+\.(md|txt|rst|json|markdown)")


# ----- issue sources ------------------------------------------------------------------------------


def _slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].strip("-")


def _title(text: str) -> str:
    """A title from the first non-empty line, markdown heading marks dropped."""
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return first.lstrip("#").strip()[:120]


def _github_client(settings: Settings, api_url: str) -> GitHubClient:
    token = settings.fix.github_token.get_secret_value() if settings.fix.github_token else None
    return GitHubClient(settings.fix.github_api_url or api_url, token, max_wait_s=settings.fix.github_max_wait_s)


def _client_for(issue: Issue, settings: Settings) -> GitHubClient | None:
    """The GitHub client for an `Issue` handed in as an object: from its URL's host, or the configured API."""
    parsed = parse_issue_url(issue.url) if issue.source == "github" and issue.url else None
    if parsed is None and not settings.fix.github_api_url:
        return None
    return _github_client(settings, api_url_for(parsed[0]) if parsed else PUBLIC_API)


def resolve_issue(spec: str, root: Path, settings: Settings) -> tuple[Issue, GitHubClient | None]:
    """The issue `spec` names: a number / `#n` (origin's GitHub repo), `owner/repo#n`, an issue URL, a file, or text.

    Returns the issue and the GitHub client used (None for files and text), for downloading images.
    """
    spec = spec.strip()
    if not spec:
        raise UsageError("the issue is empty: pass a number, an issue URL, a file or text")
    if number := _ISSUE_NUMBER.fullmatch(spec):
        github = parse_remote(gitwork.origin_url(root)), int(number[1])
    elif short := _ISSUE_SHORT_REF.fullmatch(spec):
        github = RepoRef(PUBLIC_HOST, short[1], short[2]), int(short[3])  # `owner/repo#n` names no host
    else:
        github = parse_issue_url(spec)
    if github:
        repo, n = github
        client = _github_client(settings, api_url_for(repo))
        return client.get_issue(repo.owner, repo.name, n), client
    if spec.startswith(("http://", "https://")):
        raise UsageError(f"not an issue URL: {spec} (expected https://HOST/OWNER/REPO/issues/N)")
    path = Path(spec).expanduser()
    if "\n" not in spec and len(spec) < 4096 and path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read issue file {path}: {e}") from None
        if not text.strip():
            raise UsageError(f"issue file {path} is empty")
        title = _title(text)
        # `issue-42.md` -> 42, `issue.md` -> from the title: the branch prefix already says "issue".
        key = re.sub(r"^issue(-|$)", "", _slug(path.stem)) or _slug(title) or "file"
        return Issue(source="file", key=key, title=title, body=text), None
    if _FILE_LIKE.fullmatch(spec) or ("/" in spec and " " not in spec):
        raise UsageError(f"issue file not found: {spec}")
    key = "text-" + hashlib.sha1(spec.encode()).hexdigest()[:8]
    return Issue(source="text", key=key, title=_title(spec), body=spec), None


def commit_message(issue: Issue, run: RunResult) -> str:
    """One commit message that references the issue (GitHub closes it on merge: `Fixes #n`)."""
    title = issue.title.strip() or "the issue"
    subject = f"Fix #{issue.number}: {title}" if issue.number is not None else f"Fix: {title}"
    if len(subject) > 72:
        subject = subject[:71].rstrip() + "…"
    lines = [subject, ""]
    if run.final_message.strip():
        lines += [run.final_message.strip()[:2000], ""]
    if issue.url:
        lines.append(f"Issue: {issue.url}")
    elif issue.source == "file":
        lines.append(f"Issue: from file ({issue.key})")
    lines.append(f"Made by m3-agent: {run.turns} turns, status {run.status}.")
    if issue.number is not None:
        lines += ["", f"Fixes {issue.repo}#{issue.number}" if issue.repo else f"Fixes #{issue.number}"]
    return "\n".join(lines) + "\n"


# ----- the whole flow -----------------------------------------------------------------------------


def fix_status(run: RunResult, patch: str) -> FixStatus:
    """resolved only when tests that ran on the final workspace passed (`agent.verdict`); unverified
    when the run produced a patch but no test ran on it and no test command is known."""
    if not patch.strip() or run.status not in ("submitted", "finished") or run.verdict is None:
        return "not_resolved"
    if run.verdict.passed is None:
        return "unverified"
    return "resolved" if run.verdict.passed else "not_resolved"


@dataclass
class _Job:
    """What one fix works from, once the repository, the issue and the endpoint are settled."""

    root: Path
    settings: Settings
    config: AgentConfig
    issue: Issue
    client: GitHubClient | None
    base_commit: str
    tree: str
    out_dir: Path
    notice: Notice
    callbacks: list[Subscriber]
    tools: list[Tool] | None
    environment: str | None = None
    publisher: Publisher | None = None


class FixOptions(BaseModel):
    """Where one fix starts and where its patch lands, beyond the branch and the `.patch` file.

    Per-run choices, not configuration: `m3-agent fix --base REV --apply` sets them.
    """

    base: str | None = Field(None, description="start from this commit instead of HEAD (e.g. on a detached HEAD)")
    apply: bool = Field(False, description="also apply the patch to the working tree, which must be clean")


def fix_issue(
    issue: str | Issue,
    *,
    repo: Path | str = ".",
    settings: Settings | None = None,
    options: FixOptions | None = None,
    callbacks: list[Subscriber] | None = None,
    on_notice: Notice | None = None,
    tools: list[Tool] | None = None,
) -> FixResult:
    """Fix `issue` in `repo` and return what was made; the user's checkout is left as it was.

    `issue` is a spec (number, `owner/repo#n`, URL, file, text) or an `Issue`. `settings` defaults
    to the layered configuration of `repo`; `options` (a `FixOptions`) the base commit and `apply`;
    the settings' `[fix]` section also says what to publish
    (`push`, `remote`, `pr`, `ready`, `pr_anyway`, `comment`, `trajectory_url`; `fix.publish`),
    and the result carries the pull request's URL and the comment's id. Progress goes to
    `callbacks`: the loop's AgentEvents, preceded by a `fix_start` event (issue, title,
    trajectory_path, base_commit, max_turns). Notices (skipped images, excluded changes) go to
    `on_notice`. `tools` replaces the default tool set. Raises the project errors: UsageError,
    EndpointError, SandboxUnavailable, GitError (and its kinds PushRejected, GitHubTokenMissing,
    GitHubTokenScope, PullRequestExists, GitHubRateLimited), Interrupted.
    """
    notices: list[str] = []

    def notice(text: str) -> None:
        notices.append(text)
        if on_notice:
            on_notice(text)

    options = options or FixOptions()
    job = _prepare(issue, repo, settings, options, notice=notice)
    job.callbacks, job.tools = list(callbacks or []), tools
    content, image_notices = issue_content(job.issue, job.client, images=job.settings.fix.images != "off")
    for text in image_notices:
        notice(text)
    run, content, sub_paths = _run_on_copy(job, content)
    images_sent = sum(1 for p in content if p.get("type") == "image_url") if isinstance(content, list) else 0
    patch, dropped = gitwork.drop_paths(run.patch, sub_paths)
    if dropped:
        notice(f"left out of the patch, being inside a submodule: {', '.join(dropped)}")
    status = fix_status(run, patch)
    result = FixResult(
        status=status, resolved=status == "resolved", exit_code=EXIT_CODES[status], issue=job.issue,
        base_commit=job.base_commit, included_uncommitted=job.settings.fix.include_uncommitted,
        images_sent=images_sent, notices=notices, run=run, patch=patch, environment=job.environment,
    )
    if patch.strip():
        _deliver(job, result, apply=options.apply)
    if job.publisher:
        job.publisher.publish(result)
    return result


def _prepare(issue: str | Issue, repo: Path | str, settings: Settings | None, options: FixOptions, *,
             notice: Notice) -> _Job:
    """Check the repository state, read the issue, reach the endpoint and choose the tree to work on."""
    state = gitwork.open_repo(repo)
    root = state.root
    if settings is None:
        settings, _ = load_settings(root)
    base_commit = gitwork.resolve_base(state, options.base)
    include = settings.fix.include_uncommitted
    dirty = gitwork.dirty_paths(root)
    if options.apply and dirty and not include:
        raise GitError(
            f"working tree has uncommitted changes ({len(dirty)} file(s)): commit or stash them to use --apply, "
            "or run without --apply (the fix still goes to a branch and a .patch file)"
        )
    if include and base_commit != state.head:
        raise UsageError("--include-uncommitted works on top of HEAD: drop --base, or commit your changes")

    if isinstance(issue, Issue):
        the_issue, client = issue, _client_for(issue, settings)
    else:
        the_issue, client = resolve_issue(issue, root, settings)
    # Before the run: a missing token or remote must not cost a whole run to find out.
    publisher = Publisher.prepare(root, settings.fix, the_issue, client, into=state.branch)
    # checked: a refused key is exit 8 before any work
    config = settings.resolved_agent_config(Served(settings.serve, notice), warn=lambda w: notice(f"warning: {w}"))

    out_dir = settings.fix.output_dir if settings.fix.output_dir.is_absolute() else root / settings.fix.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    gitwork.exclude_from_status(root, out_dir)
    if include:
        tree = gitwork.snapshot_tree(root)
        if tree != gitwork.tree_of(root, base_commit):
            notice("uncommitted changes are included in the run (--include-uncommitted)")
    else:
        tree = gitwork.tree_of(root, base_commit)
        if dirty:
            notice(f"{len(dirty)} uncommitted change(s) not included: the fix starts from the last commit "
                   "(use --include-uncommitted to include them)")
    return _Job(root=root, settings=settings, config=config, issue=the_issue, client=client, base_commit=base_commit,
                tree=tree, out_dir=out_dir, notice=notice, callbacks=[], tools=None, publisher=publisher)


def _run_on_copy(job: _Job, content: str | list[dict]) -> tuple[RunResult, str | list[dict], list[str]]:
    """Export the tree to a temporary directory and run the agent there; without images if they are refused.

    Returns the run, the issue content it finally had, and the submodule paths (left out of the patch).
    """
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    trajectory = job.out_dir / f"issue-{job.issue.key}-{stamp}.jsonl"
    prune_scratch()  # the copies of fixes killed before they could remove them
    work = Path(tempfile.mkdtemp(prefix="m3-agent-fix-"))
    try:
        claim(work)
        copy = export_tree(job.root, job.tree, work / (job.root.name or "repo"))
        sub_paths = _submodule_notices(job, copy)
        agent = Agent(_with_environment(job, copy), tools=job.tools, callbacks=job.callbacks)
        try:
            run = _run_once(job, agent, copy, content, trajectory)
        except EndpointError as e:
            if job.settings.fix.images != "auto" or isinstance(content, str) or not _IMAGE_REJECTED.search(str(e)):
                raise
            job.notice("the endpoint rejected the issue's images (text-only model): running again without them")
            content = job.issue.text()
            run = _run_once(job, agent, copy, content, trajectory.with_name(trajectory.stem + "-text.jsonl"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return run, content, sub_paths


def _with_environment(job: _Job, copy: Path) -> AgentConfig:
    """The run's config with the repository's environment image (built on first use; see sandbox.env.build)."""

    def progress(message: str) -> None:
        for cb in job.callbacks:
            cb(AgentEvent(kind="env_build", turn=0, data={"message": message}))

    sandbox, env = environment_for(copy, job.config.sandbox, history=(job.root, job.base_commit), source=job.root.name,
                                   progress=progress)
    if env is None:
        return job.config
    job.environment = env.tag
    if env.notice:  # kept at the user's request although its own check failed: say so everywhere
        progress(f"notice: {env.notice}")
        job.notice(env.notice)
    if env.built:
        job.notice(f"built the repository's environment {env.tag} in {env.seconds:.0f} s; later runs reuse it "
                   "(m3-agent env show)")
    return job.config.model_copy(update={"sandbox": sandbox})


def _submodule_notices(job: _Job, copy: Path) -> list[str]:
    """The tree's submodule paths, with a notice for those copied in and for those not checked out."""
    sub_paths = [path for path, _ in submodules(job.root, job.tree)]
    missing = [path for path in sub_paths if not (copy / path).is_dir() or not any((copy / path).iterdir())]
    if len(missing) < len(sub_paths):
        job.notice(f"submodule(s) copied in to read and run: {', '.join(p for p in sub_paths if p not in missing)}; "
                   "changes inside them are left out of the patch")
    for path in missing:
        job.notice(f"submodule {path} is not checked out here: the run sees an empty directory "
                   "(git submodule update --init)")
    return sub_paths


def _run_once(job: _Job, agent: Agent, copy: Path, content: str | list[dict], path: Path) -> RunResult:
    start = AgentEvent(kind="fix_start", turn=0, data={
        "issue": job.issue.reference, "title": job.issue.title, "trajectory_path": str(path),
        "base_commit": job.base_commit, "max_turns": job.config.limits.max_turns,
    })
    for cb in job.callbacks:
        cb(start)
    try:
        return agent.run(repo=copy, issue=content, trajectory_path=path)
    except Interrupted:
        raise Interrupted(f"interrupted: trajectory kept at {path}; the sandbox was removed") from None


def _deliver(job: _Job, result: FixResult, *, apply: bool) -> None:
    """The patch as a `.patch` file, one commit on a new branch, and with `apply` on the working tree.

    When the branch is to be pushed, its name is also free on the remote; a remote that cannot be
    read still gets the local branch and patch made first.
    """
    patch = result.patch
    taken, unreadable = frozenset[str](), None
    try:
        taken = job.publisher.names_taken() if job.publisher else frozenset()
    except PushRejected as e:
        unreadable = e
    branch = gitwork.free_branch_name(job.root, job.settings.fix.branch_prefix + job.issue.key, taken)
    # The .patch file first: should the commit fail, the agent's work is still on disk.
    result.patch_path = job.out_dir / (branch.rsplit("/", 1)[-1] + ".patch")
    result.patch_path.write_text(patch if patch.endswith("\n") else patch + "\n", encoding="utf-8")
    try:
        result.commit = gitwork.commit_patch(job.root, base_tree=job.tree, parent=job.base_commit, patch=patch,
                                             message=commit_message(job.issue, result.run))
    except GitError as e:
        raise GitError(f"{e}; the patch is kept at {result.patch_path}") from None
    result.branch = gitwork.create_branch(job.root, branch, result.commit, taken)
    if apply:
        include = job.settings.fix.include_uncommitted
        gitwork.apply_to_worktree(job.root, patch, expected_tree=job.tree if include else None)
        result.applied = True
    if unreadable:
        raise unreadable.extended(kept(result))
