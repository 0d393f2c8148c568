"""Tasks: SWE-bench's schema in JSON / JSONL, repositories from --repos, paths and the built-in suite."""

from __future__ import annotations

import json
import subprocess

import pytest

from m3_agent.errors import GitError, UsageError
from m3_agent.evals import tasks as tasks_mod
from m3_agent.evals.tasks import Task, builtin_names, builtin_standin_script, checkout, load_tasks


def _git(path, *args) -> str:
    return subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_builtin_suite_has_eight_or_more_complete_tasks():
    tasks = load_tasks("builtin")
    assert len(tasks) >= 8
    for t in tasks:
        assert t.FAIL_TO_PASS and t.PASS_TO_PASS, t.instance_id
        assert t.patch.startswith("diff --git") and t.test_patch.startswith("diff --git"), t.instance_id
        assert t.problem_statement.strip()
        assert _git(t.repo_source, "rev-parse", "HEAD") == t.base_commit


def test_builtin_base_commits_are_the_same_in_any_cache(tmp_path, monkeypatch):
    first = {t.instance_id: t.base_commit for t in load_tasks("builtin")}
    monkeypatch.setenv("M3_AGENT_CACHE_DIR", str(tmp_path / "elsewhere"))
    second = {t.instance_id: t.base_commit for t in load_tasks("builtin")}
    assert first == second
    assert (tmp_path / "elsewhere" / "suite").is_dir()


def test_every_builtin_task_has_a_standin_solution_routed_by_its_issue():
    script = builtin_standin_script()
    matches = {c["match"] for c in script["conversations"]}
    assert len(matches) == len(builtin_names())
    for t in load_tasks("builtin"):
        assert sum(m in t.problem_statement for m in matches) == 1, t.instance_id


def _instance(**over):
    row = {"instance_id": "o__r-1", "repo": "o/r", "base_commit": "abc", "FAIL_TO_PASS": ["t.py::a"],
           "PASS_TO_PASS": ["t.py::b"]}
    row.update(over)
    return row


def test_fail_to_pass_and_pass_to_pass_may_be_json_strings(tmp_path):
    f = tmp_path / "tasks.jsonl"
    row = _instance(FAIL_TO_PASS=json.dumps(["t.py::x", "t.py::y"]), PASS_TO_PASS="[]", hints_text="h", extra_field=3)
    f.write_text(json.dumps(row) + "\n\n")
    [t] = load_tasks(f)
    assert t.FAIL_TO_PASS == ["t.py::x", "t.py::y"]
    assert t.PASS_TO_PASS == []
    assert t.model_dump()["extra_field"] == 3  # unknown SWE-bench fields survive a round trip


@pytest.mark.parametrize("shape", ["list", "dict", "object"])
def test_tasks_load_from_every_json_shape(tmp_path, shape):
    row = _instance()
    data = {"list": [row], "dict": {row["instance_id"]: {k: v for k, v in row.items() if k != "instance_id"}},
            "object": row}[shape]
    f = tmp_path / "tasks.json"
    f.write_text(json.dumps(data))
    [t] = load_tasks(f)
    assert (t.instance_id, t.FAIL_TO_PASS) == ("o__r-1", ["t.py::a"])


def test_bad_task_files_are_usage_errors_naming_the_place(tmp_path):
    f = tmp_path / "tasks.jsonl"
    f.write_text(json.dumps(_instance()) + "\n{not json\n")
    with pytest.raises(UsageError, match=r"tasks.jsonl:2: not valid JSON"):
        load_tasks(f)
    f.write_text(json.dumps({"instance_id": "x", "repo": "o/r"}) + "\n")
    with pytest.raises(UsageError, match=r"instance 1: base_commit: Field required"):
        load_tasks(f)
    f.write_text(json.dumps(_instance()) + "\n" + json.dumps(_instance()) + "\n")
    with pytest.raises(UsageError, match="appears twice"):
        load_tasks(f)
    with pytest.raises(UsageError, match="not found"):
        load_tasks(tmp_path / "missing.json")
    with pytest.raises(UsageError, match="no task with instance_id nope"):
        load_tasks("builtin", instance_ids=["nope"])


def test_instance_ids_select_tasks():
    names = [t.instance_id for t in load_tasks("builtin")]
    picked = load_tasks("builtin", instance_ids=[names[2], names[0]])
    assert [t.instance_id for t in picked] == [names[0], names[2]]


@pytest.fixture
def two_commit_repo(git_repo):
    repo = git_repo({"pkg/a.py": "X = 1\n", "tests/test_a.py": "def test_a():\n    pass\n"}, name="upstream")
    first = _git(repo, "rev-parse", "HEAD")
    (repo / "pkg" / "a.py").write_text("X = 2\n")
    (repo / "new.txt").write_text("later\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qam", "second")
    _git(repo, "add", "new.txt")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "third")
    return repo, first


def test_checkout_from_a_bare_mirror_in_repos_dir(tmp_path, two_commit_repo):
    upstream, first = two_commit_repo
    repos = tmp_path / "repos"
    subprocess.run(["git", "clone", "-q", "--mirror", str(upstream), str(repos / "acme__widget")], check=True)
    task = Task(instance_id="acme__widget-1", repo="acme/widget", base_commit=first)
    tree = checkout(task, tmp_path / "tree", repos=repos)
    assert (tree / "pkg" / "a.py").read_text() == "X = 1\n"
    assert not (tree / "new.txt").exists()
    assert _git(tree, "status", "--porcelain") == ""  # a clean one-commit repository
    assert first in _git(tree, "log", "-1", "--format=%s")


def test_checkout_leaves_a_users_clone_untouched(tmp_path, two_commit_repo):
    upstream, first = two_commit_repo
    head = _git(upstream, "rev-parse", "HEAD")
    task = Task(instance_id="x-1", repo=str(upstream), base_commit=first)
    tree = checkout(task, tmp_path / "tree")
    assert (tree / "pkg" / "a.py").read_text() == "X = 1\n"
    assert _git(upstream, "rev-parse", "HEAD") == head
    assert _git(upstream, "status", "--porcelain") == ""


def test_unknown_commit_or_repository_is_a_usage_error(tmp_path, two_commit_repo):
    upstream, _ = two_commit_repo
    with pytest.raises(UsageError, match="base_commit 0{40} is not in"):
        checkout(Task(instance_id="x-1", repo=str(upstream), base_commit="0" * 40), tmp_path / "t1")
    with pytest.raises(UsageError, match="no repository .*acme__other"):
        checkout(Task(instance_id="x-2", repo="acme/other", base_commit="0" * 40), tmp_path / "t2", repos=tmp_path)
    with pytest.raises(UsageError, match="pass --repos DIR"):
        tasks_mod.repo_source(Task(instance_id="x-3", repo="acme/other", base_commit="a"), None)


def test_checkout_from_a_url_mirrors_once_and_fetches_a_missing_commit(tmp_path, two_commit_repo, monkeypatch):
    monkeypatch.setenv("M3_AGENT_CACHE_DIR", str(tmp_path / "cache"))
    upstream, first = two_commit_repo
    url = upstream.resolve().as_uri()
    tree = checkout(Task(instance_id="u-1", repo=url, base_commit=first), tmp_path / "t1")
    assert (tree / "pkg" / "a.py").read_text() == "X = 1\n"
    [mirror] = list((tasks_mod.cache_dir() / "mirrors").iterdir())
    (upstream / "pkg" / "a.py").write_text("X = 3\n")
    _git(upstream, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qam", "fourth")
    later = _git(upstream, "rev-parse", "HEAD")
    assert subprocess.run(["git", "-C", str(mirror), "cat-file", "-e", later]).returncode != 0
    tree = checkout(Task(instance_id="u-2", repo=url, base_commit=later), tmp_path / "t2")
    assert (tree / "pkg" / "a.py").read_text() == "X = 3\n"  # fetched into the same mirror
    assert list((tasks_mod.cache_dir() / "mirrors").iterdir()) == [mirror]


def test_a_url_that_cannot_be_cloned_is_a_one_line_git_error(tmp_path):
    url = (tmp_path / "gone").as_uri()
    with pytest.raises(GitError, match=f"^cannot mirror {url}: git clone failed: ") as e:
        checkout(Task(instance_id="u-3", repo=url, base_commit="0" * 40), tmp_path / "t")
    assert e.value.exit_code == 5 and "\n" not in str(e.value)
