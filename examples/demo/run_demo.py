"""The demo: a real `m3-agent fix` on a small repository, against the M3 stand-in server.

The stand-in is a scripted TEST DOUBLE that speaks vLLM's wire format for MiniMax-M3; it is not a
model. Everything else is real: the repository is packed into the first prompt, every tool call runs
in the Docker sandbox, and the resulting patch is checked by running the tests on a clean copy.

Run it with `bash run.sh demo` (which sets everything up), or `python examples/demo/run_demo.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from m3_agent.standin.server import StandinServer

HERE = Path(__file__).resolve().parent
WORK = HERE.parents[1] / ".demo"
console = Console(highlight=False)


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "demo", "GIT_AUTHOR_EMAIL": "demo@example.com",
           "GIT_COMMITTER_NAME": "demo", "GIT_COMMITTER_EMAIL": "demo@example.com"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


def pytest_summary(repo: Path) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=repo, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return proc.returncode, (lines[-1] if lines else proc.stderr.strip())


def main() -> int:
    repo, clean = WORK / "inventory", WORK / "inventory-check"
    shutil.rmtree(WORK, ignore_errors=True)
    shutil.copytree(HERE / "repo", repo)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "inventory: initial import")

    console.rule("[bold]m3-agent demo[/]")
    console.print(f"repository: {repo}")
    rc, summary = pytest_summary(repo)
    console.print(f"before the fix: pytest says [red]{summary}[/]")
    if rc == 0:
        console.print("[red]the demo repository's tests already pass; nothing to fix[/]")
        return 1

    script = json.loads((HERE / "standin-script.json").read_text())
    with StandinServer(script) as srv:
        console.print(f"model endpoint: {srv.base_url}  [yellow](the M3 stand-in: a scripted test double, not a model)[/]")
        console.rule("m3-agent fix")
        cmd = [str(Path(sys.executable).with_name("m3-agent")), "fix", "--repo", str(repo),
               "--issue", str(HERE / "issue.md"), "--base-url", srv.base_url, "--output-dir", str(WORK / "out")]
        console.print("$ m3-agent " + " ".join(cmd[1:]))
        fix_rc = subprocess.run(cmd).returncode
    console.rule("verification")
    patches = sorted((WORK / "out").glob("*.patch"))
    if fix_rc != 0 or not patches:
        console.print(f"[red]m3-agent fix exited {fix_rc} and wrote {len(patches)} patch file(s)[/]")
        return 1
    git(repo, "worktree", "add", "-q", "--detach", str(clean), "main")
    git(clean, "apply", str(patches[0]))
    rc, summary = pytest_summary(clean)
    colour = "green" if rc == 0 else "red"
    console.print(f"patch {patches[0].name} applied to a clean checkout of main: pytest says [{colour}]{summary}[/]")
    if rc != 0:
        return 1
    branch = git(repo, "branch", "--list", "m3-agent/*", "--format=%(refname:short)").strip()
    console.print(f"[bold green]demo passed:[/] the failing tests pass with the agent's patch (branch {branch} in {repo}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
