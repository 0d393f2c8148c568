"""The `m3-agent` command itself, as a shell runs it."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version


def test_version_prints_the_installed_version_and_exits_0():
    proc = subprocess.run([sys.executable, "-m", "m3_agent.cli", "--version"], capture_output=True, text=True)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"m3-agent {version('m3-agent')}\n", "")
    helped = subprocess.run([sys.executable, "-m", "m3_agent.cli", "--help"], capture_output=True, text=True)
    assert "--version" in helped.stdout
