"""Docker sandbox where every model-written command runs.

    from sandbox import Sandbox, SandboxConfig, build_image

    build_image()                                   # once; returns at once when the image exists
    with Sandbox(SandboxConfig(), repo=Path("repo")) as sb:
        print(sb.exec("pytest -q", timeout=60).stdout)
"""

from sandbox.cleanup import prune
from sandbox.config import ExecResult, SandboxConfig
from sandbox.container import Sandbox
from sandbox.image import DEFAULT_IMAGE, build_env_image, build_image

__all__ = ["DEFAULT_IMAGE", "ExecResult", "Sandbox", "SandboxConfig", "build_env_image", "build_image", "prune"]
