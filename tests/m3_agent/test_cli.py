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


def test_env_show_all_prints_every_tag_whole_on_a_narrow_terminal():
    import io

    from rich.console import Console

    from m3_agent.env_cli import environments_table

    envs = [{"tag": f"m3-agent-env:{n}42a2f217c0de5b9e", "source": "a-repository-with-a-long-name", "builder": "project",
             "files": {},
             "packages": ["attrs==25.1.0"], "created": "2026-12-05T08:00:00Z", "size_mb": 319.0, "base_current": True}
            for n in range(2)]
    out = io.StringIO()
    Console(file=out, width=80).print(environments_table(envs))
    assert all(e["tag"] in out.getvalue() for e in envs), out.getvalue()
