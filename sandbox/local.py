"""`LocalEnvironment`: commands run on THIS machine, in a temporary git checkout. No isolation.

    with LocalEnvironment(Path("repo")) as env:
        print(env.exec("pytest -q", timeout=60).stdout)
        patch = env.diff()

The repository's files (uncommitted changes and untracked files included, `.git` excluded) are
copied into a temporary directory that shares the repository's objects (`git clone --shared`) and
starts at its HEAD, so `diff()` means what the Docker sandbox's does. Commands run with bash as this
user, with this process's environment, network and file system: a command can read and write
anything this user can. Use it for tests and for embedding programs that run their own isolation;
the agent's default is the Docker sandbox. `isolated` is False and the trajectory records `local`.

Paths: relative ones and `/workspace/...` are the checkout; other absolute paths are this machine's.
The directory of the running Python comes first on PATH, so `python3` is the interpreter in use.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from m3_agent import hostgit
from m3_agent.errors import GitError, UsageError
from m3_agent.sandbox.config import WORKSPACE, ExecResult
from m3_agent.sandbox.output import head_tail

TIMEOUT_EXIT = 124  # what the Docker sandbox and coreutils' `timeout` report for a command stopped by its timeout
DRAIN_S = 5.0  # how long to wait for output after a timed-out command's group was killed
GIT_IDENTITY = ["-c", "user.name=m3-agent", "-c", "user.email=m3-agent@localhost", "-c", "commit.gpgsign=false"]
# Interpreter caches never belong in a patch (the sandbox keeps them out the same way).
IGNORED = "__pycache__/\n*.py[co]\n.pytest_cache/\n"


class LocalEnvironment:
    """A temporary git checkout of `repo` on this machine; commands run in it with subprocess.

    NOT isolated: commands run as this user with full access to this machine (see the module doc).
    """

    kind = "local"
    isolated = False

    def __init__(self, repo: Path, *, timeout: float = 600.0, output_limit: int = 2 * 1024 * 1024) -> None:
        self.repo = Path(repo)
        if not self.repo.is_dir():
            raise UsageError(f"repository {self.repo} is not a directory: pass an existing folder")
        self.timeout = timeout
        self.output_limit = output_limit  # characters kept per stream: head + tail
        self.root: Path | None = None
        self.base_commit: str | None = None
        self._tmp: Path | None = None

    def __enter__(self) -> LocalEnvironment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> LocalEnvironment:
        """Make the checkout: the repository's HEAD, then its working files on top."""
        if self.root is not None:
            return self
        self._tmp = Path(tempfile.mkdtemp(prefix="m3-agent-local-"))
        (self._tmp / "ignore").write_text(IGNORED)
        root = self._tmp / "workspace"
        try:
            head = _head_of(self.repo)
            if head:
                self._git(self._tmp, "clone", "-q", "--shared", "--no-checkout", str(self.repo.resolve()), str(root))
                self._git(root, "reset", "-q", head)  # index = HEAD, even when the repository's HEAD is detached
            else:
                root.mkdir()
                self._git(root, "init", "-q")
            shutil.copytree(self.repo, root, symlinks=True, dirs_exist_ok=True,
                            ignore=lambda d, names: [".git"] if Path(d) == self.repo else [])
            if not head:
                self._git(root, "add", "-A")
                self._git(root, "commit", "-q", "--allow-empty", "--no-verify", "-m", "m3-agent: base")
            self.base_commit = self._git(root, "rev-parse", "HEAD").strip()
        except BaseException:
            self.close()
            raise
        self.root = root
        return self

    def close(self) -> None:
        """Remove the checkout (idempotent)."""
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    # commands and files

    def path(self, path: str) -> Path:
        """Where `path` is on this machine: relative and /workspace paths are in the checkout."""
        root = self._checkout()
        if path == WORKSPACE or path.startswith(WORKSPACE + "/"):
            path = path[len(WORKSPACE):].lstrip("/")
        return Path(path) if os.path.isabs(path) else root / path

    def exec(self, cmd: str, timeout: float | None = None, cwd: str | None = None,
             env: dict | None = None) -> ExecResult:
        """Run `cmd` with bash in its own process group; on timeout the whole group is killed (exit 124)."""
        timeout = self.timeout if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, not {timeout}")
        where = self.path(cwd or WORKSPACE)
        path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        extra = {str(k): str(v) for k, v in (env or {}).items()}
        full_env = {**os.environ, "PATH": path, **self._ignore_env(), **extra}
        t0 = time.monotonic()
        proc = subprocess.Popen(["bash", "-c", cmd], cwd=where, env=full_env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            out, err = _kill_group(proc)
            timed_out = True
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        capped = head_tail(stdout, self.output_limit), head_tail(stderr, self.output_limit)
        code = 128 - proc.returncode if proc.returncode < 0 else proc.returncode  # 128+N: killed by signal N
        return ExecResult(stdout=capped[0], stderr=capped[1], exit_code=TIMEOUT_EXIT if timed_out else code,
                          timed_out=timed_out, truncated=capped != (stdout, stderr),
                          duration_s=round(time.monotonic() - t0, 6))

    def read_file(self, path: str) -> bytes:
        """The bytes of a file; FileNotFoundError when missing, IsADirectoryError for a directory."""
        return self.path(path).read_bytes()

    def write_file(self, path: str, data: str | bytes) -> None:
        """Write a file, creating parent directories."""
        target = self.path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else bytes(data))

    def diff(self) -> str:
        """`git diff` of the checkout against the base commit, new untracked (not ignored) files included.

        Staged in a temporary index, so the checkout's own index is untouched.
        """
        root = self._checkout()
        index = self._tmp / "diff-index"
        if (root / ".git" / "index").is_file():
            shutil.copy2(root / ".git" / "index", index)  # its mtime too: git re-checks entries as new as the index
        else:
            index.unlink(missing_ok=True)
        env = {"GIT_INDEX_FILE": str(index), **self._ignore_env()}
        self._git(root, "add", "-A", env=env)
        return self._git(root, "diff", "--cached", "--binary", "--no-color", "--no-ext-diff",
                         self.base_commit or "HEAD", env=env)

    def restore(self, patch: str) -> None:
        """Make the checkout the base commit plus `patch` (a `diff()`); GitError when it does not apply."""
        root = self._checkout()
        self._git(root, "reset", "-q", "--hard", self.base_commit or "HEAD")
        self._git(root, "clean", "-fdq", env=self._ignore_env())
        if patch.strip():
            (self._tmp / "restore.patch").write_text(patch)
            self._git(root, "apply", "--binary", "--whitespace=nowarn", str(self._tmp / "restore.patch"))

    # plumbing

    def _ignore_env(self) -> dict[str, str]:
        """Git in the checkout (the model's commands and diff) ignores interpreter caches, as in the sandbox."""
        return {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "core.excludesFile",
                "GIT_CONFIG_VALUE_0": str(self._tmp / "ignore")}

    def _checkout(self) -> Path:
        if self.root is None or self._tmp is None:
            raise UsageError("the local environment is not started: use it as a context manager")
        return self.root

    def _git(self, cwd: Path, *args: str, env: dict | None = None) -> str:
        r = subprocess.run(["git", *GIT_IDENTITY, *args], cwd=cwd, capture_output=True, text=True,
                           env={**os.environ, **(env or {})})
        if r.returncode != 0:
            raise GitError(f"git {args[0]} failed in the local environment: {r.stderr.strip()[-300:]}")
        return r.stdout


def _head_of(repo: Path) -> str | None:
    """The commit HEAD names in `repo`, or None when it is no git repository (or has no commit yet)."""
    try:
        with hostgit.repository(repo) as r:
            # A folder inside a bigger repository is copied as a repository of its own, like the sandbox does.
            if r.working_tree_dir is None or Path(r.working_tree_dir).resolve() != repo.resolve():
                return None
            return r.head.commit.hexsha if hostgit.has_commit(r, "HEAD") else None
    except (UsageError, GitError):  # not a repository, or one git refuses: copied as a fresh one
        return None


def _kill_group(proc: subprocess.Popen) -> tuple[bytes, bytes]:
    """Kill the command's process group, then take what it printed (bounded: a child may have left the group)."""
    with contextlib.suppress(ProcessLookupError):  # the group is already gone
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        return proc.communicate(timeout=DRAIN_S)
    except subprocess.TimeoutExpired:
        with proc:  # the shell is killed already: its pipes are closed unread and it is reaped
            return b"", b""
