"""Run the agent in a sandbox image of your own.

The image must be built on the project's sandbox image (python3, pytest, git, patch, user 1000,
`/workspace`); add what your repositories need. Registries may be unreachable where the agent
runs, so the Dockerfile here needs no network: it copies a team tool in and sets an environment
variable. With a registry, `RUN pip install ...` works the same way.

    python examples/custom_sandbox_image/run.py --repo path/to/repo --issue 123 --base-url http://gpu-node:8000/v1

The same in configuration, once the image is built: `image = "my-team-sandbox:1"` in the `[sandbox]`
table of `m3-agent.toml`, `M3_AGENT_SANDBOX__IMAGE`, or `m3-agent fix --sandbox-image my-team-sandbox:1`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import docker

from m3_agent.api import DEFAULT_IMAGE, M3AgentError, SandboxUnavailable, build_image, fix_issue, load_settings

HERE = Path(__file__).resolve().parent


def build_team_image(tag: str) -> str:
    """Build ./Dockerfile on top of the project's sandbox image (built first if missing)."""
    base = build_image(DEFAULT_IMAGE)
    try:
        client = docker.from_env()
        client.images.build(path=str(HERE), tag=tag, buildargs={"BASE": base}, network_mode="none", rm=True)
    except docker.errors.DockerException as e:
        raise SandboxUnavailable(f"cannot build {tag}: {e}") from None
    return tag


def main(argv: list[str] | None = None) -> int:
    """Build the team image, then fix the issue with the tools running in it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=".")
    parser.add_argument("--issue", required=True)
    parser.add_argument("--base-url", default=os.environ.get("M3_AGENT_MODEL__BASE_URL"))
    parser.add_argument("--tag", default="m3-agent-team-sandbox:example")
    args = parser.parse_args(argv)
    try:
        image = build_team_image(args.tag)
        print(f"sandbox image: {image}", file=sys.stderr)
        settings, sources = load_settings(args.repo, {"--base-url": args.base_url, "--sandbox-image": image})
        result = fix_issue(args.issue, repo=args.repo, settings=settings)
    except M3AgentError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"resolved: {result.resolved}; branch: {result.branch}; patch: {result.patch_path}")
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
