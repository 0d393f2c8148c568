"""The examples, run as users run them (`python examples/X.py ...`) against the stand-in and real Docker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import docker
import pytest

from m3_agent.standin.server import StandinServer

pytestmark = pytest.mark.docker

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CALC = {
    "calc.py": "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a + b\n",
    "tests/test_calc.py": "from calc import add, sub\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
                          "def test_sub():\n    assert sub(5, 3) == 2\n",
}


def fixing(old: str, new: str, test: str) -> list[dict]:
    """A scripted run: read, edit `old` -> `new` in calc.py, run `test`, submit."""
    return [
        {"tool_calls": [{"name": "file_read", "arguments": {"path": "calc.py"}}]},
        {"tool_calls": [{"name": "file_edit", "arguments": {"path": "calc.py", "old_str": old, "new_str": new}}]},
        {"tool_calls": [{"name": "test_runner", "arguments": {"test_file": f"tests/test_calc.py::{test}"}}]},
        {"tool_calls": [{"name": "submit", "arguments": {"summary": f"fixed {test}"}}]},
    ]


FIX_ADD = fixing("return a - b", "return a + b", "test_add")
FIX_SUB = fixing("return a + b\n", "return a - b\n", "test_sub")


def run_example(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("M3_AGENT_")}
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**env, "COLUMNS": "200"})


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(git_repo, sandbox_image):
    return git_repo(CALC)


def test_embed_progress_streams_events_and_ends_with_the_result(repo, tmp_path):
    with StandinServer({"turns": FIX_ADD}) as srv:
        proc = run_example(str(EXAMPLES / "embed_progress.py"), "--repo", str(repo), "--issue",
                           "add() subtracts", "--base-url", srv.base_url, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "start" and kinds[-2:] == ["finish", "result"]
    assert kinds.count("turn") == 4
    assert [r["name"] for r in records if r["kind"] == "tool"] == ["file_read", "file_edit", "test_runner", "submit"]
    assert next(r for r in records if r["kind"] == "tests") | {"t": 0} == {
        "t": 0, "kind": "tests", "turn": 3, "passed": 1, "failed": 0}
    result = records[-1]
    assert result["resolved"] is True and result["turns"] == 4
    assert git(repo, "show", f"{result['branch']}:calc.py").startswith("def add(a, b):\n    return a + b")


def test_batch_fixes_each_issue_on_its_own_branch_and_records_failures(repo, tmp_path):
    script = {"conversations": [
        {"match": "ISSUE-ADD", "turns": FIX_ADD},
        {"match": "ISSUE-SUB", "turns": FIX_SUB},
    ]}
    with StandinServer(script) as srv:
        proc = run_example(str(EXAMPLES / "batch_issues.py"), "--repo", str(repo), "--base-url", srv.base_url,
                           "ISSUE-ADD: add() subtracts", "ISSUE-SUB: sub() adds", "12", cwd=tmp_path)
        requests = srv.requests
    assert proc.returncode == 1, proc.stderr  # one of three failed
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert (summary["resolved"], summary["total"]) == (2, 3)
    add, sub, missing = summary["issues"]
    assert add["resolved"] and sub["resolved"]
    assert missing["exit_code"] == 5 and "no 'origin' remote" in missing["error"]
    assert "def sub(a, b):\n    return a + b" in git(repo, "show", f"{add['branch']}:calc.py")  # only add fixed
    assert "def add(a, b):\n    return a - b" in git(repo, "show", f"{sub['branch']}:calc.py")  # only sub fixed
    # Same commit, same packed prefix: the second issue's first request is served mostly from cache.
    first_of_sub = next(i for i, r in enumerate(requests) if "ISSUE-SUB" in json.dumps(r["messages"][1]))
    assert first_of_sub == 4 and sub["cache_hit_share"] > 0
    assert "m3-agent batch" in proc.stderr


PAGER = {
    "src/pager.py": "def pages(items, size):\n    n = -(-len(items) // size)\n"
                    "    return [items[i * size:(i + 1) * size] for i in range(0, n - 1)]\n",
    "tests/test_pager.py": "import sys\nsys.path.insert(0, 'src')\nfrom pager import pages\n\n\n"
                           "def test_last_page_is_kept():\n    assert pages([1, 2, 3], 2) == [[1, 2], [3]]\n",
}


def test_the_fix_off_by_one_script_fixes_a_pager_through_the_agents_tools(git_repo, sandbox_image, tmp_path):
    from m3_agent.standin.server import load_script

    pager = git_repo(PAGER)
    with StandinServer(load_script(EXAMPLES / "scripts" / "fix-off-by-one.json")) as srv:
        proc = run_example("-m", "m3_agent.cli", "fix", "--repo", str(pager), "--issue", "pages() drops the last page",
                           "--base-url", srv.base_url, "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["resolved"] is True and result["run"]["status"] == "submitted"
    assert "range(0, n)]" in git(pager, "show", f"{result['branch']}:src/pager.py")


def test_custom_tool_is_offered_to_the_model_and_runs_in_the_sandbox(repo, tmp_path):
    script = [
        {"tool_calls": [{"name": "find_definition", "arguments": {"symbol": "add"}}]},
        {"tool_calls": [{"name": "find_definition", "arguments": {"symbol": "not an identifier"}}]},
        *FIX_ADD[1:],
    ]
    with StandinServer({"turns": script}) as srv:
        proc = run_example(str(EXAMPLES / "custom_tool.py"), "--repo", str(repo), "--issue", "add() subtracts",
                           "--base-url", srv.base_url, cwd=tmp_path)
        requests = srv.requests
    assert proc.returncode == 0, proc.stderr
    assert "+    return a + b" in proc.stdout
    offered = [t["function"]["name"] for t in requests[0]["tools"]]
    assert "find_definition" in offered and "bash" in offered
    schema = next(t for t in requests[0]["tools"] if t["function"]["name"] == "find_definition")["function"]
    assert schema["parameters"]["required"] == ["symbol"]
    tool_messages = [m["content"] for m in requests[2]["messages"] if m["role"] == "tool"]
    assert tool_messages[0] == "calc.py:1:def add(a, b):"
    assert "not a Python identifier" in tool_messages[1]
    assert "find_definition -> calc.py:1:def add(a, b):" in proc.stderr
    assert git(repo, "status", "--porcelain") == ""  # Agent.run worked on a copy


def test_custom_sandbox_image_carries_the_team_tool(repo, tmp_path):
    tag = f"m3-agent-team-sandbox:test-{uuid.uuid4().hex[:8]}"
    script = [
        {"tool_calls": [{"name": "bash", "arguments": {"command": "team-check calc.py; echo $TEAM_STYLE"}}]},
        *FIX_ADD[1:],
    ]
    try:
        with StandinServer({"turns": script}) as srv:
            proc = run_example(str(EXAMPLES / "custom_sandbox_image" / "run.py"), "--repo", str(repo), "--issue",
                               "add() subtracts", "--base-url", srv.base_url, "--tag", tag, cwd=tmp_path)
            requests = srv.requests
        assert proc.returncode == 0, proc.stderr
        assert f"sandbox image: {tag}" in proc.stderr and "resolved: True" in proc.stdout
        team_output = next(m["content"] for m in requests[1]["messages"] if m["role"] == "tool")
        assert "team-check: 0 problem(s), style strict" in team_output
    finally:
        client = docker.from_env()
        try:
            client.images.remove(tag, force=True)
        except docker.errors.ImageNotFound:
            pass
        client.close()
