"""`m3-agent fix` on the bundled demo repository, driven by SmolLM2 through the llama.cpp server."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_git_repo
from tests.realmodel.conftest import MAX_TOKENS, ROOT, WINDOW, agent_env, left_containers, utc_now
from tests.realmodel.invariants import check_end, check_trajectory, check_verdict

pytestmark = pytest.mark.timeout(2400)  # the first test may build the server (conftest)
DEMO = ROOT / "examples" / "demo"
MAX_TURNS = 6


def _demo_repo(tmp_path: Path) -> Path:
    files = {str(p.relative_to(DEMO / "repo")): p.read_text() for p in (DEMO / "repo").rglob("*") if p.is_file()}
    return make_git_repo(tmp_path / "inventory", files)


def test_fix_on_the_demo_ends_for_a_stated_reason_with_a_whole_trajectory_and_no_container(
    real_server, run_label, tmp_path, sandbox_image
):
    repo, out, since = _demo_repo(tmp_path), tmp_path / "out", utc_now()
    argv = [sys.executable, "-m", "m3_agent.cli", "fix", "--repo", str(repo), "--issue", str(DEMO / "issue.md"),
            "--base-url", real_server.base_url, "--max-turns", str(MAX_TURNS), "--output-dir", str(out), "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=agent_env(real_server, run_label))
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode in (0, 1, 6), proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    run = result["run"]
    assert result["exit_code"] == proc.returncode
    assert 1 <= run["turns"] <= MAX_TURNS

    check_end(run["status"], run["error"], result["patch"], run["verdict"])
    events = check_trajectory(Path(run["trajectory_path"]), run["status"], run["turns"])
    check_verdict(run["verdict"], result["patch"], result["status"])
    # the window `serve start` gave the server, from the serve state: no context_window was configured
    (model,) = [e for e in events if e["kind"] == "model"]
    assert (model["context_window"], model["max_tokens"]) == (WINDOW, min(MAX_TOKENS, WINDOW // 4))
    assert result["resolved"] == (result["status"] == "resolved")
    # the model under test is a real one: its replies came from the server, not from a script
    replies = [e for e in events if e["kind"] == "reply"]
    assert all(r["usage"]["completion_tokens"] > 0 for r in replies)
    assert left_containers(run_label, since) == []


def test_serve_status_and_logs_see_the_cpu_tiny_server(real_server):
    status = real_server.serve("status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert "cpu-tiny (llama-cpp, native" in status.stdout
    assert "phase: ready; models: smollm2-135m-instruct" in status.stdout
    assert "access: loopback only (127.0.0.1)" in status.stdout
    started = real_server.started.stderr
    assert "will not fix real issues" in started and "model listed: smollm2-135m-instruct" in started
    log_path = Path(status.stdout.split("log: ", 1)[1].splitlines()[0].strip())
    first = log_path.read_text().splitlines()[0]  # launch writes the command it ran first
    assert first.startswith("$ OMP_WAIT_POLICY=PASSIVE ") and " -m llama_cpp.server --model " in first
    assert f"--chat_format chatml-function-calling --n_ctx {WINDOW}" in first and "--seed 42" in first
    logs = real_server.serve("logs", "-n", "5")
    assert logs.returncode == 0 and 'GET /v1/models HTTP/1.1" 200' in logs.stdout  # the probes that saw it ready
