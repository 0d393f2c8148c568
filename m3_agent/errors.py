"""Project exceptions. Each carries the process exit code the CLI uses for it.

Exit codes (documented in README.md):
  0  success (fix: patch produced and tests that ran on the final patch pass; eval: run completed)
  1  finished but not resolved (fix: no patch or tests still failing)
  2  usage error: bad input (missing repo, non-git directory, bad task file, bad flag)
  3  model endpoint unavailable or answering with errors
  4  Docker engine or sandbox image unavailable
  5  git or GitHub problem (dirty tree, detached HEAD, issue not found, bad token)
  6  fix: a patch no test ran on, and no test command known (status `unverified`)
  7  the project's environment could not be built (the message names the step and the package)
  8  the model endpoint refused the API key (HTTP 401; the message names the key, masked, and its source)
  9  fix --push: the remote rejected the push (the local branch and .patch are kept)
  10 fix --pr / --comment: no GitHub token (GITHUB_TOKEN / GH_TOKEN)
  11 the GitHub token lacks the permission (scope) a request needs
  12 fix --pr: a pull request already exists for the branch
  13 GitHub's rate limit, still exhausted after the waits GitHub asked for
  130 interrupted (Ctrl-C / SIGTERM); trajectory and results are kept
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class M3AgentError(Exception):
    """Base error: a one-line message that tells the user what to do next."""

    exit_code = 1

    def extended(self, more: str) -> M3AgentError:
        """This error with `more` added to its message; class, exit code and fields stay. Returns it."""
        self.args = (f"{self.args[0] if self.args else ''}{more}", *self.args[1:])
        return self


class EvalFailed(M3AgentError):
    """An eval in which every instance ended in an error: nothing was graded (exit 1)."""


class UsageError(M3AgentError):
    """Bad input from the user: a path, a file, a flag."""

    exit_code = 2


class EndpointError(M3AgentError):
    """The model server cannot be reached or keeps failing."""

    exit_code = 3


class EndpointAuthError(EndpointError):
    """The model server answered 401: the key sent (or its absence) is not one it accepts.

    Its own exit code: retrying cannot help, and the fix is a setting, not the server.
    """

    exit_code = 8


class SandboxUnavailable(M3AgentError):
    """No Docker engine, or the sandbox image is missing."""

    exit_code = 4


class SandboxDied(SandboxUnavailable):
    """A running sandbox's container is gone (OOM-killed, removed, engine restarted), not a failing command.

    Recoverable: `Sandbox.recreate(patch)` starts a fresh one with the workspace restored.
    """


class EnvironmentBuildError(SandboxUnavailable):
    """The repository's environment image could not be built: a package that does not exist, a setup
    command that fails. Nothing half-built is left behind."""

    exit_code = 7

    def __init__(self, message: str, *, step: str) -> None:
        super().__init__(f"environment build failed at step '{step}': {message}")
        self.step = step


class GitError(M3AgentError):
    """A git or GitHub problem the user has to resolve."""

    exit_code = 5


class PushRejected(GitError):
    """`fix --push`: the remote refused the branch (a hook, a protected name, no write access, a race)."""

    exit_code = 9


class GitHubTokenMissing(GitError):
    """A GitHub write (a pull request, a comment) was asked for, and no token is set."""

    exit_code = 10


class GitHubTokenScope(GitError):
    """GitHub refused a request the token is not allowed to make (403): it lacks a scope or permission.

    `detail` is what GitHub said, with the token's scopes when GitHub names them.
    """

    exit_code = 11

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


class PullRequestExists(GitError):
    """`fix --pr`: an open pull request already exists for the branch; `url` is that pull request's, if known."""

    exit_code = 12

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class GitHubRateLimited(GitError):
    """GitHub's rate limit, still exhausted after the waits it asked for (Retry-After, x-ratelimit-reset)."""

    exit_code = 13


class Interrupted(M3AgentError):
    """Ctrl-C or SIGTERM: the run stopped cleanly and kept what it had."""

    exit_code = 130


def first_validation_error(error: Exception, *, top: str = "") -> tuple[str, str]:
    """(dotted location, message) of a pydantic ValidationError's first error, for one-line messages."""
    first = error.errors()[0]  # type: ignore[attr-defined]
    return ".".join(str(p) for p in first["loc"]) or top, first["msg"]


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM (a cancelled CI job, `kill`) like Ctrl-C: runs stop cleanly and remove their sandboxes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
