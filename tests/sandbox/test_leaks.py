"""No container outlives its run: SIGINT, SIGTERM and SIGKILL of `fix`, `eval run` and a library
embedding, each in a real subprocess against the stand-in and the real Docker engine.

SIGINT goes to the whole process group, as a terminal's Ctrl-C does; SIGTERM to the process alone,
as `kill` does; SIGKILL to the whole group (nothing can clean up), after which `m3-agent sandbox prune`
must leave nothing of the run's behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import docker
import pytest

from m3_agent.sandbox.cleanup import LABEL_PID
from m3_agent.standin.server import StandinServer
from tests.conftest import descendants, wait_for

pytestmark = pytest.mark.docker

# The second request waits a minute: by then the run's sandbox is up and idle.
SLOW = [{"tool_calls": [{"name": "file_read", "arguments": {"path": "calc.py"}}]},
        {"delay_s": 60, "content": "never seen"}]
LIBRARY = """
import sys
from pathlib import Path
from m3_agent.agent.config import AgentConfig, ModelConfig
from m3_agent.agent.loop import Agent
Agent(AgentConfig(model=ModelConfig(base_url=sys.argv[1]))).run(Path(sys.argv[2]), "add() subtracts")
"""


def command(entry: str, base_url: str, repo: Path, out: Path) -> list[str]:
    m3 = [sys.executable, "-m", "m3_agent.cli"]
    if entry == "fix":
        return [*m3, "fix", "--repo", str(repo), "--issue", "add() subtracts", "-q", "--base-url", base_url]
    if entry == "eval":
        return [*m3, "eval", "run", "--tasks", "builtin", "-i", "m3-agent__roman-1", "--base-url", base_url,
                "--workers", "1", "-o", str(out), "-q"]
    return [sys.executable, "-c", LIBRARY, base_url, str(repo)]


def containers_of(pids: set[int]) -> list[str]:
    client = docker.from_env()
    try:  # one list call: inspecting each would race the removal this test waits for (404)
        return [c["Id"] for c in client.api.containers(all=True, filters={"label": "m3-agent.sandbox=1"})
                if int((c.get("Labels") or {}).get(LABEL_PID, "0")) in pids]
    finally:
        client.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["sigint", "sigterm", "sigkill"])
@pytest.mark.parametrize("entry", ["fix", "eval", "library"])
def test_no_container_outlives_a_signalled_run(entry, sig, git_repo, tmp_path, sandbox_image):
    repo = git_repo({"calc.py": "def add(a, b):\n    return a - b\n"})
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("M3_AGENT_")}
    with StandinServer({"turns": SLOW}) as srv:
        proc = subprocess.Popen(command(entry, srv.base_url, repo, tmp_path / "out"), env=env, cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        owners: set[int] = set()
        try:
            def sandbox_up() -> bool:
                owners.update(descendants(proc.pid))
                return len(srv.requests) >= 2 and bool(containers_of(owners))

            wait_for(sandbox_up, 120, "the run's sandbox and its slow request")
            if sig == signal.SIGTERM:
                proc.send_signal(sig)
            else:
                os.killpg(proc.pid, sig)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if sig == signal.SIGKILL:
        subprocess.run([sys.executable, "-m", "m3_agent.cli", "sandbox", "prune"], check=True, capture_output=True,
                       timeout=120)
    elif entry != "library":  # the commands' documented exit code; an embedding program chooses its own
        assert proc.returncode == 130, proc.stderr.read().decode(errors="replace")[-2000:]
    wait_for(lambda: not containers_of(owners), 20, "the run's containers to be removed")
