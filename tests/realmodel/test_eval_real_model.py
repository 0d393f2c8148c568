"""`m3-agent eval run --tasks builtin` on a built-in task, driven by SmolLM2 through the llama.cpp server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from m3_agent.evals.grading import InstanceReport
from tests.realmodel.conftest import agent_env, left_containers, utc_now
from tests.realmodel.invariants import check_end, check_trajectory, check_verdict

pytestmark = pytest.mark.timeout(2400)  # the first test may build the server (conftest)
# One task: on two busy cores a reply that runs to the window's end takes minutes (docs/real-model.md)
TASKS = ["m3-agent__roman-1"]
MAX_TURNS = 4


def _graded_as_tests_say(report: InstanceReport) -> bool:
    """resolved exactly when the patch applied and every FAIL_TO_PASS and PASS_TO_PASS test passed."""
    status = report.tests_status
    wanted = [status.FAIL_TO_PASS, status.PASS_TO_PASS]
    all_passed = all(not group.failure for group in wanted) and bool(status.FAIL_TO_PASS.success)
    return report.resolved == (report.patch_successfully_applied and all_passed)


def test_eval_on_builtin_tasks_grades_what_the_model_did_and_leaves_nothing(
    real_server, run_label, tmp_path, sandbox_image
):
    out, since = tmp_path / "eval", utc_now()
    argv = [sys.executable, "-m", "m3_agent.cli", "eval", "run", "--tasks", "builtin", "-i", ",".join(TASKS),
            "--base-url", real_server.base_url, "--max-turns", str(MAX_TURNS), "-o", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1500, env=agent_env(real_server, run_label))
    assert "Traceback" not in proc.stderr + proc.stdout, (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode in (0, 1), (proc.stdout + proc.stderr)[-4000:]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    results = {r["instance_id"]: r for r in lines}  # the last line per instance wins
    assert sorted(results) == sorted(TASKS)
    for iid, r in results.items():
        agent = r["agent"]
        assert r["error"] is None and agent is not None, f"{iid}: {r['error']}"
        events = check_trajectory(Path(agent["trajectory_path"]), agent["status"], agent["turns"])
        finish = events[-1]
        check_end(agent["status"], agent["error"], r["model_patch"] or "", finish["verdict"])
        check_verdict(finish["verdict"], r["model_patch"] or "")
        report = InstanceReport.model_validate(r["report"])
        assert report.patch_exists == bool((r["model_patch"] or "").strip())
        assert _graded_as_tests_say(report), f"{iid}: resolved={report.resolved} against {report.tests_status}"
        assert 1 <= agent["turns"] <= MAX_TURNS
    assert left_containers(run_label, since) == []
