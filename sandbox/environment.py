"""The contract between the tools (and the loop) and where commands run: the `Environment` protocol.

Two implementations ship: `Sandbox` (a hardened Docker container, the default) and
`LocalEnvironment` (a temporary git checkout on this machine, no isolation: tests and embedding).
An embedding program may bring its own; anything with these methods and attributes will do. One that
can die under a run (raising `SandboxDied`) is `Recoverable` when it also offers `death` and
`recreate(patch)`; the loop then replaces it with the workspace restored (`agent.recovery`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from m3_agent.sandbox.config import ExecResult


@runtime_checkable
class Environment(Protocol):
    """A copy of the repository where commands run and files are read and written.

    Paths may be relative (to the repository root) or absolute under `/workspace` (the root as the
    tools name it). `diff()` is the change against the repository's HEAD, new untracked files included.
    """

    kind: str  # "docker", "local", ...: recorded in the trajectory's run_start
    isolated: bool  # False when commands can touch this machine

    def exec(self, cmd: str, timeout: float | None = None, cwd: str | None = None,
             env: dict | None = None) -> ExecResult:
        """Run `cmd` with bash; on timeout its whole process tree is killed and exit_code is 124."""
        ...

    def read_file(self, path: str) -> bytes:
        """The bytes of a file; FileNotFoundError / IsADirectoryError / OSError otherwise."""
        ...

    def write_file(self, path: str, data: str | bytes) -> None:
        """Write a file, creating parent directories; OSError when it cannot be written."""
        ...

    def diff(self) -> str:
        """`git diff --binary` of the copy against the base commit, untracked files included."""
        ...

    def close(self) -> None:
        """Release everything the environment holds (idempotent)."""
        ...

    def __enter__(self) -> Environment: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class Recoverable(Protocol):
    """An environment that can die under a run (`SandboxDied`) and make its own replacement: the Sandbox."""

    @property
    def death(self) -> str | None:
        """Why it died (OOM flag, exit code, last stderr line); None while it is not known to be dead."""
        ...

    def recreate(self, patch: str | None = None) -> Environment:
        """Close this one; return a fresh, started one holding the base commit plus `patch` (a `diff()`)."""
        ...


@runtime_checkable
class Restorable(Protocol):
    """An environment whose workspace can be reset to the base commit plus a patch: the Sandbox (copy
    and image mounts) and LocalEnvironment. The verdict uses it to run failing tests without the change."""

    def restore(self, patch: str) -> None:
        """Make the workspace the base commit plus `patch` (a `diff()`; "" for the base itself)."""
        ...


EnvironmentFactory = Callable[[Path], Environment]
"""Makes the environment for one run from the repository path (entered with `with` by the loop)."""
