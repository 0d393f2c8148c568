"""Project exceptions. Each carries the process exit code the CLI uses for it.

Exit codes (documented in README.md):
  0  success (fix: patch produced and tests that ran on the final patch pass; eval: run completed)
  1  finished but not resolved (fix: no patch or tests still failing)
  2  usage error: bad input (missing repo, non-git directory, bad task file, bad flag)
  3  model endpoint unavailable or answering with errors
  4  Docker engine or sandbox image unavailable
  5  git or GitHub problem (dirty tree, detached HEAD, issue not found, rate limit, bad token)
  6  fix: a patch no test ran on, and no test command known (status `unverified`)
  7  the project's environment could not be built (the message names the step and the package)
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

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(M3AgentError):
    """Bad input from the user: a path, a file, a flag."""

    exit_code = 2


class EndpointError(M3AgentError):
    """The model server cannot be reached or keeps failing."""

    exit_code = 3


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
