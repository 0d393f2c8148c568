"""Surviving an environment that dies under a run: the last known workspace, a fresh environment, a notice.

    recovery = Recovery(limit=2)
    watched = Watched(env)                         # what the tools get: notes commands and writes
    recovery.last_diff = env.diff()                # after a tool call that ran a command or wrote a file
    fresh = recovery.replace(env, reason_of(env, died), factory, repo)   # on SandboxDied

A Docker sandbox can die whatever it runs (OOM kill of the container, an engine restart, `docker rm`
by someone). The loop keeps the workspace's diff after every tool call that ran a command or wrote a
file (one that only read, or never reached the environment, cannot have changed it); when a
call raises `SandboxDied`, `replace` starts a fresh environment with that diff restored (the
environment's own `recreate(patch)` when it offers one, else the factory's new environment and its
`restore(patch)`), and `notice` is what the model reads in that call's result. After `limit`
restarts the next death ends the run (the loop's `SandboxLost`, status error).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from m3_agent.errors import SandboxDied, SandboxUnavailable
from m3_agent.sandbox.environment import Environment, EnvironmentFactory, Recoverable, Restorable


class Recovery:
    """The workspace's last known state and the restarts a run has made (at most `limit`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.restarts = 0
        self.last_diff = ""  # the workspace after the last completed tool call ("": the base commit)

    @property
    def kept(self) -> str:
        """The patch a run keeps when no environment is left: the last diff, when one is taken per call."""
        return self.last_diff if self.limit else ""

    def replace(self, env: Environment, reason: str, factory: EnvironmentFactory, repo: Path) -> Environment:
        """A fresh, started environment with the last known workspace; SandboxLostError past the limit."""
        if self.restarts >= self.limit:
            env.close()
            raise SandboxLostError(
                f"the sandbox died again after {self.restarts} restart(s) (limits.max_sandbox_restarts="
                f"{self.limit}): {reason}")
        fresh = fresh_environment(env, factory, repo, self.last_diff)
        self.restarts += 1
        return fresh


class Watched:
    """The environment as one tool call sees it; `touched` says whether the call ran a command or wrote a file."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.touched = False

    def exec(self, *args: Any, **kwargs: Any) -> Any:
        """`Environment.exec`, noted."""
        self.touched = True
        return self.env.exec(*args, **kwargs)

    def write_file(self, *args: Any, **kwargs: Any) -> Any:
        """`Environment.write_file`, noted."""
        self.touched = True
        return self.env.write_file(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)


class SandboxLostError(SandboxUnavailable):
    """The environment died more often than the restart limit allows (the loop ends the run with it)."""


def reason_of(env: Environment, died: SandboxDied) -> str:
    """Why the environment died, as the environment says (OOM flag, exit code, last stderr line)."""
    why = (env.death if isinstance(env, Recoverable) else None) or str(died)
    return why.removesuffix("; start a new sandbox")


def fresh_environment(env: Environment, factory: EnvironmentFactory, repo: Path, patch: str) -> Environment:
    """The dead `env` closed and a started replacement holding base commit + `patch`."""
    if isinstance(env, Recoverable):
        return env.recreate(patch)
    env.close()
    fresh = factory(repo).__enter__()
    try:
        if patch:
            if not isinstance(fresh, Restorable):
                raise SandboxUnavailable(f"the {fresh.kind} environment died and cannot restore a workspace "
                                         "(it has neither recreate() nor restore())")
            fresh.restore(patch)
    except BaseException:
        fresh.close()
        raise
    return fresh


def notice(template: str, reason: str, patch: str, restarts: int, limit: int) -> str:
    """The tool result the model reads for the call the environment died under (`template`: prompts.restart)."""
    files = patch.count("diff --git ")
    restored = (f"your changes as of the last completed tool call ({files} file(s), {len(patch.encode())} "
                "bytes of diff)" if patch else "the base commit (no change had been made yet)")
    return template.format(reason=reason, restored=restored, restarts=restarts, limit=limit)
