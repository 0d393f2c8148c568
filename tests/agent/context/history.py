"""Helpers of the tests that pack one repository at several commits (the packer's order, a batch's reuse)."""

from __future__ import annotations

import os

FILES = {f"pkg/mod{i:02d}.py": f"def f{i}():\n    return {i}\n" * 20 for i in range(20)}


def commit_file(git, root, path: str, text: str | None, message: str) -> str:
    """Write `text` to `path` (None: delete it), commit, and return the new commit's id."""
    if text is None:
        (root / path).unlink()
    else:
        (root / path).write_text(text)
    git(root, "add", "-A")
    git(root, "commit", "-qm", message)
    return git(root, "rev-parse", "HEAD").strip()


def section_paths(text: str) -> list[str]:
    """The paths of a pack's file sections, in order."""
    return [line[4:] for line in text.split("\n") if line.startswith("### ")]


def shared_prefix(a: str, b: str) -> int:
    """How many leading characters two texts share."""
    return len(os.path.commonprefix([a, b]))
