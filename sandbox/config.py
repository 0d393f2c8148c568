"""The sandbox's configuration and the result of one command: the data that crosses its boundary."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

WORKSPACE = "/workspace"  # where an environment's repository is, as commands and the tools' paths name it
_SIZE = re.compile(r"^\d+([kmg]b?)?$", re.IGNORECASE)
_USER = re.compile(r"^(\d+)(:\d+)?$")


def _default_image() -> str:
    # On first use: the image module loads the Docker SDK, which `m3-agent pack` and the settings never need.
    from m3_agent.sandbox.image import DEFAULT_IMAGE
    return DEFAULT_IMAGE


class SandboxConfig(BaseModel):
    """How a sandbox container is made. Every default is the hardened one; loosen per sandbox."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field(default_factory=_default_image, description="the Docker image the tools run in")
    project_env: Literal["auto", "off"] = Field(
        "auto", description="auto: on the default image, a repository that declares dependencies (pyproject.toml, "
        "setup.py, requirements*.txt, lock files) gets an environment image with them and the project installed "
        "(built once per dependency state; `m3-agent env`); off: the image as it is")
    setup: str | None = Field(None, description="shell command run once, as root, when the environment image is "
                              "built, in a copy of the repository at /workspace (install into the environment: "
                              "changes to /workspace itself are not kept)")
    releases: Literal["commit", "today"] = Field(
        "commit", description="commit: the environment resolves to what was released before the last commit "
        "that changed a dependency file (an old commit gets the releases of its day); today: the newest releases")
    keep_broken_env: bool = Field(
        False, description="keep and use an environment image whose own check failed (the project's packages do "
        "not import, or its tests do not collect), with a notice saying what failed; false: the build stops (exit 7)")
    mount: Literal["copy", "bind", "image"] = Field(
        "copy", description="copy: the repo is copied into an in-memory /workspace; bind: the host directory "
        "itself is mounted read-write (for very large repos; commands then change the host files; set user= to "
        "the owner of the directory so git can write); image: as copy, but into the image's own `workdir` "
        "(SWE-bench instance images: /testbed, where their environment expects the repository), /workspace "
        "a link to it; the root filesystem is then writable (the container's own layer, removed with it)")
    workdir: str = Field("/testbed", description="the image's repository directory, for mount='image'")
    network: str = Field("none", description="Docker network mode; 'none' unless a task really needs one")
    user: str = Field("1000:1000", description="uid:gid every command runs as (never 0); the sandbox's own "
                      "processes run as root, so commands cannot signal them")
    memory: str = Field("4g", description="memory limit; swap is set equal, so there is no extra swap")
    cpus: float = Field(2.0, gt=0)
    pids_limit: int = Field(256, gt=8)
    read_only: bool = Field(True, description="read-only root filesystem; /tmp, home and /workspace stay writable")
    workspace_size: str = Field("2g", description="size of the in-memory /workspace (copy mode)")
    tmp_size: str = "1g"
    timeout: float = Field(600.0, gt=0, description="default per-command timeout, seconds")
    output_limit: int = Field(2 * 1024 * 1024, ge=1024, description="bytes kept per stream (head + tail)")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for every command")
    labels: dict[str, str] = Field(default_factory=dict, description="extra container labels")
    start_timeout: float = Field(60.0, gt=0)
    runtime: str | None = Field(None, description="OCI runtime, e.g. runsc (gVisor) where the engine has it: "
                                "a user-space kernel between commands and the host; None = the engine's default")
    transport: Literal["auto", "attach"] = Field(
        "auto", description="auto: a Unix socket shared read-only with the container when the engine is local "
        "(fastest); attach: always the engine's attach stream")

    @field_validator("user")
    @classmethod
    def _user(cls, v: str) -> str:
        m = _USER.match(v)
        if not m:
            raise ValueError(f"{v!r} is not a numeric uid or uid:gid like 1000:1000")
        if int(m.group(1)) == 0:
            raise ValueError("commands never run as root: pick a non-zero uid")
        return v

    @field_validator("memory", "workspace_size", "tmp_size")
    @classmethod
    def _size(cls, v: str) -> str:
        if not _SIZE.match(v):
            raise ValueError(f"{v!r} is not a size like 512m or 4g")
        return v.lower()


class ExecResult(BaseModel):
    """What one command did. Output over the limit keeps its head and tail with a marker between."""

    stdout: str
    stderr: str
    exit_code: int = Field(description="the shell's exit code; 128+N when killed by signal N; 124 on timeout")
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0
