"""Docker sandbox where every model-written command runs.

    from m3_agent.sandbox import Sandbox, SandboxConfig, build_image

    build_image()                                   # once; returns at once when the image exists
    with Sandbox(SandboxConfig(), repo=Path("repo")) as sb:
        print(sb.exec("pytest -q", timeout=60).stdout)

Where things happen:
  environment.py  the Environment protocol the tools and the loop use (this Sandbox, or LocalEnvironment)
  local.py        LocalEnvironment: a temporary git checkout on this machine, NO isolation (tests, embedding)
  output.py       head_tail: the one host-side cut of long output (head + tail around a marker)
  config.py       SandboxConfig (hardened defaults: network none, commands as uid 1000 with no
                  capabilities and no-new-privileges, pids/memory/CPU limits, read-only root, init)
                  and ExecResult
  container.py    Sandbox: creates the container, copies the repo in, exec / files / diff, close;
                  SandboxDied when the container is gone, then recreate(patch) / restore(patch)
  server.py       the process inside the container that runs each command (own session, timeout kills
                  the tree, head + tail output cap); a command enters the container in `run()` there;
                  it runs as root with no capabilities, each command as the command user, so commands
                  cannot signal it (`drop_privileges`)
  channel.py      the host end of the server's pipe (a shared Unix socket, or the engine's attach stream)
  cleanup.py      owner labels, close at exit and on SIGINT / SIGTERM, `prune` for what a SIGKILL left
  image.py        the sandbox image (registry or debootstrap + docker import),
                  `prune_images` for the images of older recipes
  env/            a repository's environment image: planned, fetched, built, verified, listed, pruned
  cli.py          `m3-agent sandbox build|prune [--images]`
"""

from importlib import import_module
from typing import Any

# Each name is imported on first use, so that a part that needs only `sandbox.config` (the settings models,
# `m3-agent pack`) does not load Docker, the image recipes and the environment builders.
_HOME = {"SandboxDied": "m3_agent.errors", "prune": "m3_agent.sandbox.cleanup", "ExecResult": "m3_agent.sandbox.config",
         "SandboxConfig": "m3_agent.sandbox.config", "Sandbox": "m3_agent.sandbox.container",
         **dict.fromkeys(["Environment", "EnvironmentFactory", "Recoverable", "Restorable"], "m3_agent.sandbox.environment"),
         "build_env_image": "m3_agent.sandbox.env.recipe", "LocalEnvironment": "m3_agent.sandbox.local",
         **dict.fromkeys(["DEFAULT_IMAGE", "build_image", "prune_images"], "m3_agent.sandbox.image")}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    """`from m3_agent.sandbox import Sandbox`: the name from its module, imported now."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_HOME[name]), name)
