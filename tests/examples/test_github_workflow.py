"""examples/github-workflow/: valid against GitHub's workflow schema, and wired to the events it promises."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from m3_agent.settings import read_env

WORKFLOW = Path(__file__).resolve().parents[2] / "examples" / "github-workflow" / "m3-agent.yml"


def load(text: str) -> dict:
    data = yaml.safe_load(text)
    # YAML 1.1 reads the bare key `on` as true; GitHub reads it as "on".
    data["on"] = data.pop(True, data.get("on"))
    return data


def schema_check(path: Path) -> subprocess.CompletedProcess:
    """GitHub's workflow schema (SchemaStore's, as check-jsonschema ships it) against `path`."""
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
                           str(path)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def workflow() -> dict:
    return load(WORKFLOW.read_text())


@pytest.fixture(scope="module")
def job(workflow) -> dict:
    (only,) = workflow["jobs"].values()
    return only


def steps_using(job: dict, action: str) -> list[dict]:
    return [s for s in job["steps"] if s.get("uses", "").startswith(action + "@")]


def test_the_workflow_is_valid_against_githubs_schema(tmp_path):
    proc = schema_check(WORKFLOW)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOW.read_text().replace("runs-on:", "runs_on:"))  # the check can fail
    assert schema_check(broken).returncode != 0


def test_it_runs_on_a_label_and_on_a_comment(workflow):
    assert workflow["on"]["issues"]["types"] == ["labeled"]
    assert workflow["on"]["issue_comment"]["types"] == ["created"]


def test_only_the_m3_agent_label_or_a_collaborators_command_starts_it(job):
    condition = " ".join(job["if"].split())
    assert "github.event_name == 'issues' && github.event.label.name == 'm3-agent'" in condition
    assert "github.event_name == 'issue_comment' && !github.event.issue.pull_request" in condition
    assert "startsWith(github.event.comment.body, '/m3-agent')" in condition
    allowed = re.search(r"contains\(fromJSON\('(\[.*?\])'\), github\.event\.comment\.author_association\)", condition)
    assert allowed and set(yaml.safe_load(allowed.group(1))) == {"OWNER", "MEMBER", "COLLABORATOR"}


def test_the_token_may_push_open_pull_requests_and_comment(workflow):
    assert workflow["permissions"] == {"contents": "write", "pull-requests": "write", "issues": "write"}


def test_every_job_runs_on_a_self_hosted_runner(workflow):
    for job in workflow["jobs"].values():
        assert "self-hosted" in job["runs-on"]


def test_it_fixes_the_issue_with_a_pull_request_and_a_comment_against_the_teams_endpoint(job):
    (run,) = [" ".join(s["run"].split()) for s in job["steps"] if "m3-agent fix" in s.get("run", "")]
    assert run.startswith("m3-agent fix ${{ github.event.issue.number }} --pr --comment --trajectory-url ")
    assert "${{ github.event.issue.title" not in run and "comment.body" not in run  # no text reaches the shell
    assert job["env"]["GITHUB_TOKEN"] == "${{ secrets.GITHUB_TOKEN }}"
    assert job["env"]["M3_AGENT_MODEL__BASE_URL"].startswith("${{ secrets.")
    settings = read_env({k: "x" for k in job["env"] if k.startswith("M3_AGENT_")})  # real setting names
    assert set(settings) == {"model.base_url", "model.api_key"}


def test_the_command_line_is_one_m3_agent_fix_accepts(job, tmp_path):
    (run,) = [" ".join(s["run"].split()) for s in job["steps"] if "m3-agent fix" in s.get("run", "")]
    argv = re.sub(r"\$\{\{[^}]*\}\}", "7", run).replace('"', "").split()[1:]
    proc = subprocess.run([sys.executable, "-m", "m3_agent.cli", *argv, "--repo", str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "repository path does not exist" in proc.stderr  # the flags parsed


def test_the_trajectory_is_uploaded_even_when_the_run_fails(job):
    (upload,) = steps_using(job, "actions/upload-artifact")
    assert upload["if"] == "always()" and upload["with"]["path"] == ".m3-agent/*.jsonl"
    assert steps_using(job, "actions/checkout")
