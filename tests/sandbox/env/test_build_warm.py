"""A warm `m3-agent env build` on a large tree, on the real engine: the environment is found from the commit's
git objects, reading each thing once, with no copy of the tree and no walk of it; a changed dependency file
still gives a new key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from contextlib import closing
from pathlib import Path

import pytest

from m3_agent.sandbox.engine import docker_client
from m3_agent.sandbox.env.build import read_request, request_for, request_key
from m3_agent.sandbox.env.catalogue import prune_environments
from m3_agent.sandbox.config import SandboxConfig
from tests.conftest import make_git_repo

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]  # builds on one host wait for each other

SESSION = uuid.uuid4().hex[:12]
FILES = 3000  # a large tree: a copy or a walk of it would show, and cost seconds
PROJECT = {
    "pyproject.toml": f'# {SESSION}\n[build-system]\nrequires = ["setuptools>=64"]\n'
                      'build-backend = "setuptools.build_meta"\n\n[project]\nname = "warmpkg"\nversion = "0.1"\n',
    # What the tests need comes from the noxfile, which names a requirements file: both key the environment.
    "noxfile.py": 'import nox\n\n\n@nox.session\ndef tests(session):\n    session.install("-r", "requirements-test.txt")\n'
                  '    session.run("pytest")\n',
    "requirements-test.txt": "iniconfig\n",
    "warmpkg/__init__.py": "",
    "tests/test_warm.py": "import iniconfig\n\n\ndef test_warm():\n    assert iniconfig\n",
    **{f"warmpkg/data/d{i // 100:02d}/m{i:04d}.py": f"N = {i}\n" for i in range(FILES)},
}
# The command, run in a process of its own with Python's audit hooks recording what it opens, lists and starts.
AUDITED = """\
import json, os, sys
events = []
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)):
        events.append(["open", os.path.abspath(os.fspath(args[0]))])
    elif event in ("os.scandir", "os.listdir") and not isinstance(args[0], int):  # an int: a folder's fd
        events.append(["list", os.path.abspath(os.fspath(args[0] if args[0] is not None else "."))])
    elif event == "subprocess.Popen":
        events.append(["run", [os.fspath(a) for a in (args[1] or []) if isinstance(a, (str, os.PathLike))]])
    elif event == "tempfile.mkdtemp":
        events.append(["mkdtemp", str(args[0])])
    elif event == "http.client.send" and bytes(args[1][:7]).split(b" ")[0] in (b"GET", b"POST", b"PUT", b"DELETE"):
        events.append(["engine", bytes(args[1]).split(b"\\r\\n")[0].decode()])  # a request's line, not a body
sys.addaudithook(hook)
from m3_agent.cli import main
try:
    main(sys.argv[2:])
finally:
    with open(sys.argv[1], "w") as f:
        json.dump(events, f)
"""
# git commands that copy or walk a whole tree: an export (read-tree + checkout-index), a listing of every file.
TREE_COMMANDS = {"read-tree", "checkout-index", "archive", "clone", "ls-files", "worktree"}


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def env_build(repo: Path, events: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", AUDITED, str(events), "env", "build", "--repo", str(repo)],
                          capture_output=True, text=True, timeout=1500, cwd=events.parent)


@pytest.fixture(scope="module")
def warm_repo(tmp_path_factory, sandbox_image):
    """The project with its environment built (cold, by `env build` itself)."""
    source = f"warm-{SESSION}"
    repo = make_git_repo(tmp_path_factory.mktemp("warm") / source, PROJECT)
    cold = env_build(repo, repo.parent / "cold.json")
    assert cold.returncode == 0 and "built: m3-agent-env:" in cold.stderr, cold.stderr
    yield repo, cold.stdout.strip()
    prune_environments(keep=0, source=source)


def git_commands(events: list) -> list[list[str]]:
    """The git command lines of `events`, each without git's own options (`-c x=y`, `--git-dir=...`)."""
    found = []
    for kind, *rest in events:
        argv = rest[0] if kind == "run" else []
        if argv and Path(argv[0]).name == "git":
            words = argv[1:]
            while words and (words[0].startswith("-") or words[:1] == ["-c"]):
                words = words[2:] if words[0] in ("-c", "-C") else words[1:]
            found.append(words)
    return found


def test_a_warm_env_build_reads_the_commit_once_and_neither_copies_nor_walks_the_tree(warm_repo, tmp_path):
    repo, tag = warm_repo
    r = env_build(repo, tmp_path / "warm.json")
    assert r.returncode == 0 and r.stdout.strip() == tag and "already built" in r.stderr, r.stderr
    events = json.loads((tmp_path / "warm.json").read_text())
    work_tree = [e for e in events if e[0] in ("open", "list") and e[1].startswith(f"{repo}/")
                 and not e[1].startswith(f"{repo}/.git/")]
    # Of the work tree, only the configuration is read (m3-agent.toml, pyproject's [tool.m3-agent]); no
    # folder of it is listed, no copy of it is made.
    assert {Path(e[1]).name for e in work_tree} <= {"pyproject.toml", "m3-agent.toml"}, work_tree
    assert all(e[0] == "open" for e in work_tree), work_tree
    assert not [e for e in events if e[0] == "mkdtemp"]
    commands = [c for c in git_commands(events) if c[:1] != ["version"]]  # GitPython's own check on import
    assert not [c for c in commands if c[:1] and c[0] in TREE_COMMANDS or c[:2] == ["ls-tree", "-r"]], commands
    # The repository is opened twice (HEAD; the commit's files, every file of the key read through it), the
    # release date is one `git log`: before, every reader opened it anew (8 times on this tree). HEAD is read
    # from the ref files and the commit by its id, so no `cat-file --batch-check` asks what an object is.
    assert sum(c[:2] == ["rev-parse", "--git-dir"] for c in commands) <= 2, commands
    assert ["cat-file", "--batch-check"] not in commands and len(commands) <= 4, commands
    # The engine is asked three things: its API version (which is the reachability check), the sandbox image's
    # id (for the key), the environment's labels. Before: a ping after the version, the sandbox image twice.
    engine = [e[1] for e in events if e[0] == "engine"]
    assert len(engine) == 3 and len(set(engine)) == 3, engine
    assert engine[0].startswith("GET /version") and engine[-1].split()[1].endswith(f"/images/{tag}/json"), engine


def test_a_changed_dependency_file_gives_a_new_key_and_an_ordinary_change_the_same(warm_repo, tmp_path):
    """In one process, as `eval run` keys many commits: what the key read before is not reused for another
    commit (the noxfile's parse, the files it names)."""
    repo, tag = warm_repo
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))

    def key() -> tuple[str, dict[str, str]]:
        request = request_for(None, SandboxConfig(), history=(clone, git(clone, "rev-parse", "HEAD")),
                              source=repo.name)
        with closing(docker_client()) as client:
            found, files = request_key(client, request, read_request(request))
        return f"m3-agent-env:{found}", files

    assert key()[0] == tag
    (clone / "README.md").write_text("An ordinary change.\n")
    git(clone, "add", "-A")
    git(clone, "commit", "-qm", "docs")
    assert key()[0] == tag  # the release date is the last change of a dependency file, not of the commit
    noxfile = PROJECT["noxfile.py"].replace("requirements-test.txt", "requirements-nox.txt")
    (clone / "noxfile.py").write_text(noxfile)
    (clone / "requirements-nox.txt").write_text("iniconfig\npluggy\n")
    git(clone, "add", "-A")
    git(clone, "commit", "-qm", "nox")
    changed, files = key()
    assert changed != tag and "requirements-nox.txt" in files and "requirements-test.txt" not in files
    (clone / "requirements-nox.txt").write_text("iniconfig\n")
    git(clone, "commit", "-qam", "fewer")
    assert key()[0] not in (tag, changed)
