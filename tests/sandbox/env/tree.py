"""Repository trees for the environment tests, written from a dict of relative path -> contents; what a
shell command prints in a built image."""

from __future__ import annotations

import json
from pathlib import Path

import docker


def write(root: Path, files: dict[str, str | dict]) -> Path:
    """Write each file under `root` (folders made as needed; a dict is written as JSON); returns `root`."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(text) if isinstance(text, dict) else text)
    return root


def in_image(tag: str, script: str) -> str:
    """What `sh -c SCRIPT` prints in a throwaway container of image `tag` (no network)."""
    client = docker.from_env()
    try:
        return client.containers.run(tag, ["sh", "-c", script], remove=True, network_mode="none").decode()
    finally:
        client.close()
