"""Repository trees for the environment tests, written from a dict of relative path -> contents."""

from __future__ import annotations

import json
from pathlib import Path


def write(root: Path, files: dict[str, str | dict]) -> Path:
    """Write each file under `root` (folders made as needed; a dict is written as JSON); returns `root`."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(text) if isinstance(text, dict) else text)
    return root
