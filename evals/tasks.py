"""Tasks in SWE-bench's instance schema, where their repositories come from, and the built-in suite.

    tasks = load_tasks("builtin")                      # or a .json / .jsonl file of instances
    tree = checkout(tasks[0], dest, repos=Path("mirrors"))   # the tree at base_commit, as a fresh git repo

A task's repository is looked up, in order: the `repo_source` extension (a path or git URL), then
`--repos DIR` as `DIR/<owner>__<name>` (a clone or a bare mirror), then `repo` itself when it is a
path or a git URL. Nothing here needs the network unless a task names a remote URL.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import git
from pydantic import BaseModel, ConfigDict, Field, field_validator

from m3_agent import hostgit
from m3_agent.agent.context.cache import cache_dir
from m3_agent.errors import UsageError
from m3_agent.evals.records import validate_record

SUITE_DIR = Path(__file__).parent / "suite"
BUILTIN = "builtin"


class TaskEnvironment(BaseModel):
    """An image recipe for a task (extension): Debian packages and root shell commands, built once per recipe."""

    model_config = ConfigDict(extra="forbid")

    packages: list[str] = Field(default_factory=list)
    setup: list[str] = Field(default_factory=list)


class Task(BaseModel):
    """One SWE-bench instance, plus optional extensions (test_cmd, env_setup, environment, repo_source).

    Unknown fields are kept, so an instance read from a dataset is written back unchanged.
    """

    model_config = ConfigDict(extra="allow")

    instance_id: str
    repo: str
    base_commit: str
    patch: str = ""
    test_patch: str = ""
    problem_statement: str = ""
    hints_text: str = ""
    created_at: str = ""
    version: str = ""
    environment_setup_commit: str | None = None
    FAIL_TO_PASS: list[str] = Field(default_factory=list)
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    test_cmd: str | None = None  # extension: replaces the default pytest command; see grading.test_command
    env_setup: list[str] = Field(default_factory=list)  # extension: shell commands run before the tests
    environment: TaskEnvironment | None = None  # extension: the sandbox image is built from this recipe
    repo_source: str | None = None  # extension: a path or git URL holding `repo`
    # SWE-bench >= 5 instance fields (per-repo facts as data); a custom task may give image + test_cmd + log_parser
    image: str | None = None  # the instance image; official names follow --image-namespace / --image-tag
    eval_script: str | None = None  # the harness's eval script; composed from test_cmd when absent
    log_parser: str | None = None  # a name in the harness's PARSER_REGISTRY: set, the task is graded by the harness
    eval_type: str | None = None  # pass_and_fail (default) or fail_only

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_string_list(cls, v: Any) -> Any:
        return test_ids(v)


def test_ids(value: Any) -> Any:
    """A list of test ids from a list or a JSON-encoded string (SWE-bench's datasets store strings)."""
    if value is None:
        return []
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else []
        except json.JSONDecodeError as e:
            raise ValueError(f"not a JSON list of test ids: {e}") from None
    return value


def load_tasks(spec: str | Path, *, instance_ids: list[str] | None = None, split: str = "test") -> list[Task]:
    """Tasks from `builtin` (the shipped suite), a .json / .jsonl / .parquet file, a dataset folder or a
    hub dataset id (see evals.datasets); optionally only some ids."""
    if str(spec) == BUILTIN:
        tasks = builtin_tasks()
    else:
        from m3_agent.evals.datasets import dataset_rows

        rows = dataset_rows(str(spec), split)
        tasks = [validate_record(Task, row, f"{spec}: instance {i + 1}") for i, row in enumerate(rows)]
    seen: set[str] = set()
    for t in tasks:
        if t.instance_id in seen:
            raise UsageError(f"{spec}: instance_id {t.instance_id!r} appears twice")
        seen.add(t.instance_id)
    if instance_ids:
        missing = sorted(set(instance_ids) - seen)
        if missing:
            raise UsageError(f"{spec}: no task with instance_id {', '.join(missing)}")
        tasks = [t for t in tasks if t.instance_id in set(instance_ids)]
    return tasks


# --- built-in suite ----------------------------------------------------------------------------------

def builtin_names() -> list[str]:
    """Names of the shipped tasks (folders of evals/suite)."""
    return sorted(p.name for p in SUITE_DIR.iterdir() if (p / "task.json").is_file())


def builtin_tasks() -> list[Task]:
    """The shipped suite, each task's repository materialised with a deterministic base commit."""
    return [builtin_task(name) for name in builtin_names()]


def builtin_task(name: str) -> Task:
    """One shipped task: task.json + issue.md + gold.patch + test.patch + repo/ (made a git repo)."""
    src = SUITE_DIR / name
    if not (src / "task.json").is_file():
        raise UsageError(f"no built-in task {name!r}; known: {', '.join(builtin_names())}")
    repo, commit = _materialise_suite_repo(src / "repo")
    meta = json.loads((src / "task.json").read_text())
    return Task(
        **meta,
        base_commit=commit,
        problem_statement=(src / "issue.md").read_text(),
        patch=(src / "gold.patch").read_text(),
        test_patch=(src / "test.patch").read_text(),
        repo_source=str(repo),
    )


def _materialise_suite_repo(files: Path) -> tuple[Path, str]:
    """A git repo of `files` in the cache (keyed by content), committed with fixed identity and dates."""
    digest = hashlib.sha256()
    entries = sorted(p for p in files.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for p in entries:
        digest.update(p.relative_to(files).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    dest = cache_dir() / "suite" / f"{files.parent.name}-{digest.hexdigest()[:16]}"
    if (dest / ".git").is_dir():
        with hostgit.repository(dest) as repo:
            return dest, repo.head.commit.hexsha
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    shutil.copytree(files, tmp, ignore=shutil.ignore_patterns("__pycache__"), copy_function=shutil.copyfile,
                    dirs_exist_ok=True)
    # Fixed identity and date: the same files always give the same base commit.
    commit = hostgit.commit_all(tmp, f"{files.parent.name}: base")
    try:
        tmp.rename(dest)  # atomic: a concurrent loader either wins or finds the finished copy
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest, commit


# --- repositories ------------------------------------------------------------------------------------

def _is_url(s: str) -> bool:
    return "://" in s or s.startswith("git@")


def repo_source(task: Task, repos: Path | None) -> str:
    """Where the task's repository is: a local path (clone or bare mirror) or a git URL."""
    if task.repo_source:
        return task.repo_source
    if repos is not None:
        candidate = Path(repos) / task.repo.replace("/", "__")
        for c in (candidate, candidate.with_name(candidate.name + ".git")):
            if c.exists():
                return str(c)
        raise UsageError(f"{task.instance_id}: no repository {candidate} (expected a clone or mirror of "
                         f"{task.repo} named <owner>__<name>)")
    if _is_url(task.repo) or Path(task.repo).exists():
        return task.repo
    raise UsageError(f"{task.instance_id}: don't know where {task.repo} is: pass --repos DIR holding "
                     f"{task.repo.replace('/', '__')}")


def source_repository(task: Task, repos: Path | None = None) -> Path:
    """A local repository (with its history) holding the task's base commit: the source itself, or a
    mirror in the cache for a URL."""
    source = repo_source(task, repos)
    if not _is_url(source):
        path = Path(source)
        if not path.exists():
            raise UsageError(f"repository not found: {path}")
        return path
    mirror = cache_dir() / "mirrors" / hashlib.sha256(source.encode()).hexdigest()[:16]
    if not mirror.exists():  # (git clone makes the folders above it)
        with hostgit.git_errors(f"cannot mirror {source}"):
            git.Repo.clone_from(source, mirror, mirror=True).close()
    else:
        with hostgit.repository(mirror) as repo:
            if not hostgit.has_commit(repo, task.base_commit):
                repo.git.fetch("-q", "origin")
    return mirror


def checkout(task: Task, dest: Path, *, repos: Path | None = None) -> Path:
    """Write the repository's tree at `task.base_commit` to `dest`, as a fresh one-commit git repo.

    The history is left behind on purpose: the sandbox gets a small .git whatever the repository's size.
    The source repository (maybe a user's clone) is never touched: the files come through a private index.
    """
    source = source_repository(task, repos)
    with hostgit.repository(source) as repo:
        if not hostgit.has_commit(repo, task.base_commit):
            raise UsageError(f"{task.instance_id}: base_commit {task.base_commit} is not in {source}")
    # Without submodules, as SWE-bench's harness checks a task's repository out.
    return hostgit.export_tree(source, task.base_commit, dest, with_submodules=False,
                               message=f"{task.instance_id}: base_commit {task.base_commit}")


def builtin_standin_script(names: list[str] | None = None) -> dict[str, Any]:
    """A stand-in script playing each built-in task's scripted solution through the tools.

    For tests and demos of `eval run` without a model: each conversation is routed by the first line
    of its task's issue. It is a test double; a resolved instance here says the machinery works.
    """
    conversations = [json.loads((SUITE_DIR / n / "solution.json").read_text()) for n in names or builtin_names()]
    return {"on_exhausted": "final", "conversations": conversations}
