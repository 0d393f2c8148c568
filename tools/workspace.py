"""Where tools may touch files (the sandbox workspace) and how command results are shown."""

from __future__ import annotations

import hashlib
import posixpath
import uuid
from typing import TYPE_CHECKING

from m3_agent.sandbox.output import head_tail
from m3_agent.tools.tool import ToolCallError, ToolResult

if TYPE_CHECKING:
    from m3_agent.sandbox import Environment, ExecResult

WORKSPACE = "/workspace"
# Scratch files (code to run, JUnit reports) live outside the workspace so they never show in the diff.
SCRATCH = "/tmp/m3-agent-tools"
MAX_TIMEOUT = 600
# What the model sees of one output stream: head and tail, the middle left out.
STREAM_CHARS = 16_000
# Commands the tools run must not leave __pycache__ files that would end up in the patch.
EXEC_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}


def workspace_path(path: str, *, for_write: bool = False) -> str:
    """Normalise a model-given path to one relative to the workspace, or raise ToolCallError."""
    given = path.strip()
    if not given:
        raise ToolCallError("'path' is empty: give a file path relative to the repository root.", kind="bad_args")
    if given.startswith("/"):
        if given != WORKSPACE and not given.startswith(WORKSPACE + "/"):
            raise ToolCallError(
                f"Path {given!r} is outside the workspace: use a path relative to the repository root "
                f"(it is mounted at {WORKSPACE}).",
                kind="bad_args",
            )
        given = given[len(WORKSPACE) :].lstrip("/")
    rel = posixpath.normpath(given) if given else "."
    if rel == ".." or rel.startswith("../"):
        raise ToolCallError(
            f"Path {path!r} escapes the workspace: use a path inside the repository, without '..'.",
            kind="bad_args",
        )
    if rel == ".":
        raise ToolCallError(f"Path {path!r} is the repository root, not a file.", kind="bad_args")
    if for_write and (rel == ".git" or rel.startswith(".git/")):
        raise ToolCallError("Writing inside .git is not allowed: edit the project's files instead.", kind="bad_args")
    return rel


def scratch_file(suffix: str, content: str | None = None) -> str:
    """An absolute path in the sandbox's scratch directory: named after `content` when given, else fresh.

    Naming by content keeps a rerun's output (tracebacks show the path) identical, which stall detection needs.
    """
    name = hashlib.sha256(content.encode()).hexdigest()[:12] if content is not None else uuid.uuid4().hex[:12]
    return f"{SCRATCH}/{name}{suffix}"


def write_text(sandbox: Environment, rel: str, text: str) -> None:
    """Write a workspace file, or raise ToolCallError when the path cannot be written (e.g. it is a directory)."""
    try:
        sandbox.write_file(rel, text)
    except OSError as e:
        raise ToolCallError(f"Cannot write {rel!r}: {e}") from None


def clamp_timeout(requested: int, limit: int) -> tuple[int, str | None]:
    """Keep a model-requested timeout within [1, limit]; the note says so when it was changed."""
    bounded = min(max(requested, 1), limit)
    if bounded == requested:
        return bounded, None
    return bounded, f"timeout {requested} s is outside 1..{limit} s; used {bounded} s"


def still_running(result: ExecResult) -> bool:
    """A command stopped by its timeout while producing output: slow work, not a stall."""
    return bool(result.timed_out and (result.stdout or result.stderr))


def exec_result(result: ExecResult, *, timeout: int, note: str | None = None) -> ToolResult:
    """Turn an environment's ExecResult into the tool result of a command-running tool (bash, code_exec)."""
    lines = [f"exit code: {result.exit_code}"]
    if result.timed_out:
        lines[0] = f"timed out after {timeout} s (the command was stopped; exit code {result.exit_code})"
    for label, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            lines.append(f"{label}:\n{head_tail(text.rstrip(), STREAM_CHARS)}")
    if not result.stdout and not result.stderr:
        lines.append("(no output)")
    if result.truncated:
        lines.append("(output was truncated: the middle part is left out)")
    if note:
        lines.append(f"note: {note}")
    ok = result.exit_code == 0 and not result.timed_out
    kind = "timeout" if result.timed_out else (None if ok else "execution")
    return ToolResult(
        output="\n".join(lines),
        ok=ok,
        error_kind=kind,
        data=result.model_dump(include={"exit_code", "timed_out", "truncated", "duration_s"}),
        running=still_running(result),
    )


def run_command(sandbox: Environment, command: str, *, timeout: int, env: dict[str, str] = EXEC_ENV) -> ToolResult:
    """Run `command` in the workspace with the model's timeout (within MAX_TIMEOUT) and report it as a tool result."""
    bounded, note = clamp_timeout(timeout, MAX_TIMEOUT)
    result = sandbox.exec(command, timeout=bounded, cwd=WORKSPACE, env=env)
    return exec_result(result, timeout=bounded, note=note)


def read_text(sandbox: Environment, rel: str) -> str:
    """Read a workspace file as text, or raise ToolCallError (missing, a directory, binary)."""
    try:
        data = sandbox.read_file(rel)
    except FileNotFoundError:
        raise ToolCallError(
            f"File {rel!r} does not exist. Use bash (e.g. `ls`, `find . -name ...`) to find the right path.",
        ) from None
    except IsADirectoryError:
        raise ToolCallError(f"{rel!r} is a directory: use bash `ls {rel}` to list it.") from None
    except OSError as e:
        raise ToolCallError(f"Cannot read {rel!r}: {e}") from None
    if b"\0" in data[:8192]:
        raise ToolCallError(f"{rel!r} is a binary file ({len(data)} bytes); it cannot be shown as text.")
    return data.decode("utf-8", errors="replace")
