"""`m3-agent fix` end to end: the stand-in over HTTP, the real Docker sandbox, real git repositories.

Every test checks the git-safety promise too: the user's branch, HEAD, index and files are as before.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import docker
import pytest

from m3_agent.serving import launcher
from m3_agent.standin.server import StandinServer
from tests.conftest import lan_address, secrets_found
from tests.fix.test_fix_sources import cli_main, fix_cli  # noqa: F401, F811 - the in-process CLI fixtures
from tests.fix.test_github import PNG, FakeGitHub
from tests.serving.fake_engine import install_fake_engine

pytestmark = pytest.mark.docker

CALC = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "tests/test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
    "README.md": "calc\n",
}
READ = {"reasoning": "Read the function first.", "tool_calls": [{"name": "file_read", "arguments": {"path": "calc.py"}}]}
TEST = {"tool_calls": [{"name": "test_runner", "arguments": {"test_file": "tests/test_calc.py"}}]}
SUBMIT = {"tool_calls": [{"name": "submit", "arguments": {"summary": "add() subtracted; it adds now."}}]}


def edit(new: str) -> dict:
    return {"tool_calls": [{"name": "file_edit", "arguments": {
        "path": "calc.py", "old_str": "return a - b", "new_str": new}}]}


FIXING = [READ, edit("return a + b"), TEST, SUBMIT]
EXPECTED_DIFF_LINE = "+    return a + b"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def user_view(repo: Path) -> tuple:
    """What the user could notice: current branch, HEAD, status, index, every tracked/untracked file."""
    files = {str(p.relative_to(repo)): p.read_bytes() for p in sorted(repo.rglob("*"))
             if p.is_file() and not {".git", ".m3-agent"} & set(p.relative_to(repo).parts)}
    return (git(repo, "branch", "--show-current"), git(repo, "rev-parse", "HEAD"),
            git(repo, "status", "--porcelain"), (repo / ".git" / "index").read_bytes(), files)


def first_user_content(srv: StandinServer):
    return srv.requests[0]["messages"][1]["content"]


def containers_of(pid: int) -> list:
    client = docker.from_env()
    try:
        return client.containers.list(all=True, ignore_removed=True, filters={"label": f"m3-agent.owner-pid={pid}"})
    finally:
        client.close()


@pytest.fixture
def repo(git_repo, sandbox_image):
    return git_repo(CALC)


def test_file_issue_is_fixed_on_a_branch_with_a_patch_file(repo, tmp_path, fix_cli):
    issue = tmp_path / "add-bug.md"
    issue.write_text("# add() subtracts\n\n2 + 3 should be 5.\n")
    before = user_view(repo)
    with StandinServer({"turns": FIXING}) as srv:
        code, out, err = fix_cli("--repo", str(repo), "--issue", str(issue), "--base-url", srv.base_url)
    assert code == 0, err
    assert EXPECTED_DIFF_LINE in out  # the diff goes to stdout
    flat = " ".join(err.split())
    assert "resolved (submitted, 4 turns" in flat and "tests: 1 passed, 0 failed" in flat
    assert user_view(repo) == before  # branch, HEAD, index and files untouched

    assert git(repo, "rev-list", "--count", "main..m3-agent/issue-add-bug").strip() == "1"
    message = git(repo, "log", "-1", "--format=%B", "m3-agent/issue-add-bug")
    assert message.startswith("Fix: add() subtracts\n") and "add() subtracted; it adds now." in message
    assert git(repo, "show", "m3-agent/issue-add-bug:calc.py") == "def add(a, b):\n    return a + b\n"
    patch = (repo / ".m3-agent" / "issue-add-bug.patch").read_text()
    assert EXPECTED_DIFF_LINE in patch and patch.strip() == out.strip()
    trajectories = list((repo / ".m3-agent").glob("issue-add-bug-*.jsonl"))
    assert len(trajectories) == 1 and '"kind": "finish"' in trajectories[0].read_text()

    # The model saw the packed repository first, then the issue.
    first = first_user_content(srv)
    assert first.index("return a - b") < first.index("2 + 3 should be 5.")
    assert containers_of(os.getpid()) == []


def test_github_issue_with_an_image_goes_to_the_model_as_an_image(repo, fix_cli):
    with FakeGitHub() as gh, StandinServer({"turns": FIXING}) as srv:
        gh.add_issue("acme", "widgets", 7, "add() subtracts",
                     f"See the screenshot:\n\n![result]({gh.web}/assets/shot.png)", [("alice", "Confirmed on main.")])
        git(repo, "remote", "add", "origin", f"{gh.web}/acme/widgets.git")
        code, out, err = fix_cli("7", "--repo", str(repo), "--base-url", srv.base_url, "--json",
                                 env={"GITHUB_TOKEN": "good-token"})
        assert code == 0, err
        result = json.loads(out)  # --json: one object, nothing else on stdout
        assert result["resolved"] is True and result["exit_code"] == 0
        assert result["branch"] == "m3-agent/issue-7" and result["images_sent"] == 1
        assert result["issue"]["number"] == 7 and result["run"]["status"] == "submitted"
        assert result["run"]["usage"]["prompt_tokens"] > 0

        content = first_user_content(srv)
        assert isinstance(content, list)
        text = content[0]["text"]
        assert "# Issue #7: add() subtracts" in text and "Confirmed on main." in text
        images = [p for p in content if p["type"] == "image_url"]
        assert len(images) == 1
        assert base64.b64decode(images[0]["image_url"]["url"].split(",", 1)[1]) == PNG
    message = git(repo, "log", "-1", "--format=%B", "m3-agent/issue-7")
    assert message.startswith("Fix #7: add() subtracts") and "Fixes acme/widgets#7" in message
    assert f"Issue: {gh.web}/acme/widgets/issues/7" in message


def test_images_off_sends_text_only_with_a_notice(repo, fix_cli):
    with FakeGitHub() as gh, StandinServer({"turns": FIXING}) as srv:
        gh.add_issue("acme", "widgets", 8, "add() subtracts", f"![result]({gh.web}/assets/shot.png)")
        git(repo, "remote", "add", "origin", f"{gh.web}/acme/widgets.git")
        code, _, err = fix_cli("8", "--repo", str(repo), "--base-url", srv.base_url, "--images", "off", "--quiet")
        assert code == 0, err
        assert isinstance(first_user_content(srv), str)
        assert not [p for p, _ in gh.requests if p.startswith("/assets/")]  # not even downloaded
    assert "1 image(s) in the issue not sent: the endpoint is text-only" in " ".join(err.split())


def test_failing_tests_mean_not_resolved_exit_1_but_the_branch_is_kept(repo, fix_cli):
    with StandinServer({"turns": [READ, edit("return a * b"), TEST, SUBMIT]}) as srv:
        code, out, err = fix_cli("--repo", str(repo), "--issue", "add() is wrong", "--base-url", srv.base_url, "-q")
    assert code == 1, err
    assert out == ""  # --quiet: no diff
    flat = " ".join(err.split())
    assert "not resolved" in flat and "tests: 0 passed, 1 failed" in flat
    branch = next(b.strip(" *") for b in git(repo, "branch").splitlines() if "m3-agent/issue-text-" in b)
    assert "return a * b" in git(repo, "show", f"{branch}:calc.py")


def test_no_change_means_no_branch_and_exit_1(repo, fix_cli):
    with StandinServer({"turns": [READ, {"content": "I cannot reproduce this."}]}) as srv:
        code, out, err = fix_cli("--repo", str(repo), "--issue", "add() is wrong", "--base-url", srv.base_url)
    assert code == 1
    assert out == ""
    assert "no change was made" in err
    assert "m3-agent/" not in git(repo, "branch")


def test_apply_changes_the_clean_working_tree_but_not_the_index(repo, fix_cli):
    with StandinServer({"turns": FIXING}) as srv:
        code, _, err = fix_cli("--repo", str(repo), "--issue", "add() is wrong", "--apply", "-q",
                               "--base-url", srv.base_url)
    assert code == 0, err
    assert (repo / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    assert git(repo, "diff", "--cached", "--name-only") == ""
    assert git(repo, "diff", "--name-only").split() == ["calc.py"]
    assert git(repo, "branch", "--show-current").strip() == "main"
    assert "applied to the working tree" in err


def test_uncommitted_changes_are_left_out_unless_asked_for(repo, fix_cli):
    (repo / "README.md").write_text("calc, with a LOCAL-ONLY-NOTE\n")
    (repo / "scratch.py").write_text("UNTRACKED_MARKER = 1\n")
    before = user_view(repo)

    with StandinServer({"turns": FIXING}) as srv:
        code, _, err = fix_cli("--repo", str(repo), "--issue", "add() is wrong", "-q", "--base-url", srv.base_url)
        assert code == 0, err
        assert "LOCAL-ONLY-NOTE" not in first_user_content(srv)
    assert "1 uncommitted change(s) not included" in " ".join(err.split())
    assert user_view(repo) == before

    with StandinServer({"turns": FIXING}) as srv:
        code, out, err = fix_cli("--repo", str(repo), "--issue", "add() is wrong!", "--json", "--include-uncommitted",
                                 "--base-url", srv.base_url)
        assert code == 0, err
        first = first_user_content(srv)
        assert "LOCAL-ONLY-NOTE" in first and "UNTRACKED_MARKER" in first
    assert user_view(repo) == before
    result = json.loads(out)
    branch = result["branch"]
    assert result["included_uncommitted"] is True
    assert git(repo, "show", f"{branch}:README.md") == "calc, with a LOCAL-ONLY-NOTE\n"
    assert git(repo, "show", f"{branch}:scratch.py") == "UNTRACKED_MARKER = 1\n"
    assert git(repo, "rev-parse", f"{branch}^").strip() == before[1].strip()  # one commit on top of HEAD
    patch = Path(result["patch_path"]).read_text()
    assert "calc.py" in patch and "README.md" not in patch  # the .patch holds the agent's change only


def test_no_docker_engine_exit_4(git_repo, fix_cli, tmp_path):
    repo = git_repo(CALC)
    with StandinServer({"turns": FIXING}) as srv:
        code, _, err = fix_cli("--repo", str(repo), "--issue", "bug", "--base-url", srv.base_url,
                               env={"DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock"})
    assert code == 4, err
    assert "m3-agent: error:" in err and "Traceback" not in err
    assert "m3-agent/" not in git(repo, "branch")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupt_stops_cleanly_keeps_the_trajectory_and_removes_the_sandbox(repo, signum):
    slow = [READ, {"delay_s": 60, "content": "never seen"}]
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("M3_AGENT_")}
    with StandinServer({"turns": slow}) as srv:
        proc = subprocess.Popen(
            [sys.executable, "-m", "m3_agent.cli", "fix", "--repo", str(repo), "--issue", "bug", "-q",
             "--base-url", srv.base_url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "COLUMNS": "1000"},
        )
        try:
            deadline = time.monotonic() + 90
            while len(srv.requests) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)  # the second request is the slow one: the sandbox is up by then
            assert len(srv.requests) == 2, proc.stderr.read() if proc.poll() is not None else "no second request"
            assert containers_of(proc.pid), "the run's sandbox should be up"
            proc.send_signal(signum)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted: trajectory kept at" in " ".join(err.split()) and "Traceback" not in err
    trajectories = list((repo / ".m3-agent").glob("issue-text-*.jsonl"))
    assert len(trajectories) == 1 and '"kind": "tool_call"' in trajectories[0].read_text()
    assert containers_of(proc.pid) == []
    assert "m3-agent/" not in git(repo, "branch")
    assert git(repo, "status", "--porcelain") == ""


class TextOnlyFront:
    """A text-only vLLM in front of the stand-in: image inputs get vLLM's 400, the rest is relayed.

    (`vllm serve ... --language-model-only` answers an image part with "At most 0 image(s) ...".)
    """

    def __init__(self, upstream: str) -> None:
        self.rejected = 0
        front = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _relay(self, body: bytes | None) -> None:
                req = urllib.request.Request(upstream + self.path, data=body, method=self.command,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=60) as resp:
                        status, data = resp.status, resp.read()
                except urllib.error.HTTPError as e:
                    status, data = e.code, e.read()
                self._send(status, data)

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._relay(None)

            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                messages = json.loads(body).get("messages", []) if self.path.endswith("/chat/completions") else []
                if any(isinstance(m.get("content"), list) and any(p.get("type") == "image_url" for p in m["content"])
                       for m in messages):
                    front.rejected += 1
                    return self._send(400, json.dumps({"error": {
                        "message": "At most 0 image(s) may be provided in one prompt.",
                        "type": "BadRequestError", "param": None, "code": 400}}).encode())
                self._relay(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_text_only_endpoint_rejecting_images_gets_the_issue_again_without_them(repo, fix_cli):
    with FakeGitHub() as gh, StandinServer({"turns": FIXING}) as srv:
        gh.add_issue("acme", "widgets", 9, "add() subtracts", f"![result]({gh.web}/assets/shot.png)")
        git(repo, "remote", "add", "origin", f"{gh.web}/acme/widgets.git")
        front = TextOnlyFront(srv.root_url)
        try:
            code, out, err = fix_cli("9", "--repo", str(repo), "--base-url", front.base_url, "--json")
        finally:
            front.close()
        assert code == 0, err
        assert front.rejected == 1
        assert isinstance(first_user_content(srv), str)  # what reached the model: text only
    result = json.loads(out)
    assert result["images_sent"] == 0 and result["resolved"] is True
    assert any("rejected the issue's images" in n for n in result["notices"])
    assert len(list((repo / ".m3-agent").glob("issue-9-*.jsonl"))) == 2  # the refused run's trajectory is kept


def test_submodules_are_copied_in_to_read_and_their_changes_stay_out_of_the_patch(repo, tmp_path, fix_cli):
    from tests.fix.test_gitwork import with_submodules

    with_submodules(tmp_path, repo)
    before = user_view(repo)
    inside = {"tool_calls": [{"name": "file_write", "arguments": {
        "path": "libs/core/core.py", "content": "def f():\n    return 42\n"}}]}
    with StandinServer({"turns": [READ, edit("return a + b"), inside, TEST, SUBMIT]}) as srv:
        code, out, err = fix_cli("--repo", str(repo), "--issue", "add() subtracts", "--base-url", srv.base_url)
    assert code == 0, err
    flat = " ".join(err.split())
    assert "submodule(s) copied in to read and run: libs/core" in flat
    assert "submodule docs is not checked out here" in flat
    assert "left out of the patch, being inside a submodule: libs/core/core.py" in flat
    assert EXPECTED_DIFF_LINE in out and "libs/core" not in out  # the patch: the superproject's change only
    branch = git(repo, "branch", "--list", "m3-agent/*").split()[-1]
    assert git(repo, "diff", "--name-only", f"main..{branch}").split() == ["calc.py"]
    assert "### libs/core/core.py" in first_user_content(srv)  # the model saw the submodule's files
    assert user_view(repo) == before


# ----- "resolved" only on tests that ran against the final patch -------------------------------------

EDIT_AGAIN = {"tool_calls": [{"name": "file_edit", "arguments": {
    "path": "calc.py", "old_str": "return a + b", "new_str": "return a + b + 0 * int('x' in 'y') - (a == 2)"}}]}


def test_tests_that_ran_before_the_last_edit_no_longer_make_a_fix_resolved(repo, fix_cli):
    """Reproduces the report: tests pass, the agent edits again (breaking the fix) and submits.
    The old verdict read that stale pass (exit 0); the verdict now comes from a fresh run in the
    same sandbox on the final workspace."""
    with StandinServer({"turns": [READ, edit("return a + b"), TEST, EDIT_AGAIN, SUBMIT]}) as srv:
        code, out, err = fix_cli("--repo", str(repo), "--issue", "add() subtracts", "--base-url", srv.base_url,
                                 "--json")
    assert code == 1, err
    result = json.loads(out)
    assert result["status"] == "not_resolved" and result["resolved"] is False and result["exit_code"] == 1
    verdict = result["run"]["verdict"]
    assert verdict["source"] == "rerun" and verdict["passed"] is False and verdict["after_last_change"] is True
    assert verdict["stale_turn"] == 3 and verdict["tests"]["failed"] == 1
    assert result["run"]["final_tests"] == verdict["tests"]
    trajectory = Path(result["run"]["trajectory_path"])
    kinds = [json.loads(line)["kind"] for line in trajectory.read_text().splitlines()]
    assert kinds[-2:] == ["verify", "finish"]
    assert containers_of(os.getpid()) == []


def test_a_patch_no_test_ran_on_is_unverified_with_its_own_exit_code(repo, fix_cli):
    with StandinServer({"turns": [READ, edit("return a + b"), SUBMIT]}) as srv:
        code, _, err = fix_cli("--repo", str(repo), "--issue", "add() subtracts", "--base-url", srv.base_url)
    assert code == 6, err
    flat = " ".join(err.split())
    assert "unverified (submitted" in flat and "no test command is known (set test_cmd)" in flat
    (branch,) = git(repo, "branch", "--list", "m3-agent/*", "--format=%(refname:short)").split()
    assert git(repo, "show", f"{branch}:calc.py") == "def add(a, b):\n    return a + b\n"  # the patch is still delivered


def test_the_configured_test_cmd_verifies_a_patch_the_agent_did_not_test(repo, fix_cli):
    with StandinServer({"turns": [READ, edit("return a + b"), SUBMIT]}) as srv:
        code, out, err = fix_cli("--repo", str(repo), "--issue", "add() subtracts", "--base-url", srv.base_url,
                                 "--test-cmd", "python3 -m pytest -q tests", "--json")
    assert code == 0, err
    verdict = json.loads(out)["run"]["verdict"]
    assert verdict["source"] == "test_cmd" and verdict["passed"] is True and verdict["tests"]["exit_code"] == 0


# ----- a launched endpoint's key: sent without being told, never written down ----------------------

KEY = "m3-team-key-0123456789WXYZ"
TOKEN = "ghp_0123456789abcdefghijklmnopqrstuvTOKN"


def _unauthorized(base_url: str) -> bool:
    try:
        urllib.request.urlopen(base_url + "/models", timeout=10)
    except urllib.error.HTTPError as e:
        return e.code == 401
    return False


@pytest.fixture
def keyed_endpoint(fix_cli, tmp_path, monkeypatch):
    """`m3-agent serve start --host 0.0.0.0` on the fake engine (so it requires a new key), serving FIXING twice."""
    bin_dir = tmp_path / "bin"
    install_fake_engine(bin_dir)
    turns = tmp_path / "turns.json"
    turns.write_text(json.dumps(FIXING * 2))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("M3_AGENT_STATE_DIR", str(tmp_path / "state"))  # after fix_cli dropped M3_AGENT_*
    monkeypatch.setenv("FAKE_ENGINE_TURNS", str(turns))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = subprocess.run([sys.executable, "-m", "m3_agent.cli", "serve", "start", "--profile", "h200-tp8",
                              "--port", str(port), "--host", "0.0.0.0", "--skip-gpu-check", "--timeout", "60"],
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    try:
        yield launcher.load_state()
    finally:
        launcher.stop(grace_s=2)


def test_fix_takes_the_window_serve_start_gave_a_server_whose_models_do_not_say_it(repo, fix_cli, tmp_path,
                                                                                   monkeypatch):
    # as llama-cpp-python's server: /v1/models has no max_model_len, so only the serve state knows the window
    bin_dir = tmp_path / "bin"
    install_fake_engine(bin_dir)
    turns = tmp_path / "turns.json"
    turns.write_text(json.dumps(FIXING))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("M3_AGENT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FAKE_ENGINE_TURNS", str(turns))
    monkeypatch.setenv("FAKE_ENGINE_QUIRKS", json.dumps({"list_max_model_len": False}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = subprocess.run([sys.executable, "-m", "m3_agent.cli", "serve", "start", "--profile", "h200-tp8",
                              "--port", str(port), "--host", "127.0.0.1", "--skip-gpu-check", "--max-model-len", "6000",
                              "--timeout", "60"], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    try:
        state = launcher.load_state()
        assert launcher.probe(state.base_url)[2] is None  # the server does not say its window
        code, out, err = fix_cli("--repo", str(repo), "--issue", "add() subtracts", "--base-url", state.base_url)
    finally:
        launcher.stop(grace_s=2)
    assert code == 0, err
    (trajectory,) = (repo / ".m3-agent").glob("issue-*.jsonl")
    events = [json.loads(line) for line in trajectory.read_text().splitlines()]
    (model,) = [e for e in events if e["kind"] == "model"]
    assert model["context_window"] == 6000 and model["max_tokens"] == 1500  # a quarter of it, not 8,192
    requests = [e for e in events if e["kind"] == "request"]
    assert requests and {r["max_tokens"] for r in requests} == {1500}


def test_fix_serve_sends_the_key_of_the_endpoint_serve_started_without_being_told(repo, keyed_endpoint, fix_cli):
    assert keyed_endpoint.api_key.source == "generated" and _unauthorized(keyed_endpoint.base_url)
    code, out, err = fix_cli("--repo", str(repo), "--issue", "add() subtracts", "--serve", "h200-tp8")
    assert code == 0, err
    assert f"serve: healthy endpoint 'default' at {keyed_endpoint.base_url}" in " ".join(err.split())
    assert EXPECTED_DIFF_LINE in out
    # the URL `serve start` printed, with no key given: the same key, from the same state
    code, out, err = fix_cli("--repo", str(repo), "--issue", "add() subtracts", "--base-url", keyed_endpoint.base_url)
    assert code == 0, err
    assert secrets_found([keyed_endpoint.api_key.value.get_secret_value()], out, err, under=[repo / ".m3-agent"]) == []


def test_a_plain_http_endpoint_on_another_address_warns_once_and_a_setting_silences_it(repo, fix_cli):
    with StandinServer({"turns": FIXING * 2}, host="0.0.0.0") as srv:
        url = f"http://{lan_address()}:{srv.port}/v1"
        code, out, err = fix_cli("--repo", str(repo), "--issue", "add() subtracts", "--base-url", url)
        assert code == 0, err
        quiet = fix_cli("--repo", str(repo), "--issue", "add() subtracts", "--base-url", url,
                        env={"M3_AGENT_MODEL__WARN_PLAIN_HTTP": "false"})
        assert quiet[0] == 0, quiet[2]
    flat = " ".join(err.split())
    assert flat.count("warning: the repository goes to") == 1
    assert f"goes to {lan_address()} over plain http:// ({url})" in flat and "warn_plain_http = false" in flat
    assert "plain http://" not in quiet[2]


def test_trajectories_patches_results_and_config_show_never_hold_the_key_or_the_token(repo, fix_cli, cli_main):
    env = {"GITHUB_TOKEN": TOKEN, "M3_AGENT_MODEL__API_KEY": KEY}
    with FakeGitHub(token=TOKEN) as gh, StandinServer({"turns": FIXING}, api_key=KEY) as srv:
        gh.add_issue("acme", "widgets", 9, "add() subtracts", "2 + 3 should be 5.")
        git(repo, "remote", "add", "origin", f"{gh.web}/acme/widgets.git")
        run = fix_cli("9", "--repo", str(repo), "--base-url", srv.base_url, "--json", env=env)
        assert run[0] == 0, run[2]
        assert gh.requests[0][1]["authorization"] == f"Bearer {TOKEN}"  # the run used both
    assert json.loads(run[1])["resolved"] is True
    shown = cli_main("config", "show", "--repo", str(repo), env=env)
    as_json = cli_main("config", "show", "--repo", str(repo), "--json", env=env)
    rows = {row["name"]: row for row in json.loads(as_json[1])}
    assert rows["model.api_key"]["value"] == "****WXYZ" and rows["fix.github_token"]["value"] == "****TOKN"
    written = [repo / ".m3-agent"]
    assert list(written[0].glob("issue-9-*.jsonl")) and list(written[0].glob("*.patch"))
    assert secrets_found([KEY, TOKEN], *run[1:], *shown[1:], *as_json[1:], under=written) == []
