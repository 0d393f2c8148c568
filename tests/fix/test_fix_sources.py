"""`m3-agent fix` without a model run: issue sources, the commit message, settings -> AgentConfig, early errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.fix.test_github import FakeGitHub

from m3_agent.settings import load_settings
from m3_agent.errors import GitError, UsageError
from m3_agent.agent.verdict import suite_passed
from m3_agent.fix.flow import commit_message, resolve_issue
from m3_agent.agent.access import resolve_endpoint
from m3_agent.serving.endpoint import Served
from m3_agent.fix.github import Issue
from m3_agent.agent.loop import RunResult
from m3_agent.standin.server import StandinServer

CALC = {"calc.py": "def add(a, b):\n    return a - b\n", "tests/test_calc.py": "from calc import add\n"}


def settings_for(root: Path, **overrides):
    """Settings for `root`, with overrides by dotted path (`fix.github_api_url`)."""
    return load_settings(root, overrides, environ={})[0]


def test_issue_number_reads_origins_github_issue(git_repo):
    with FakeGitHub() as gh:
        gh.add_issue("acme", "widgets", 7, "add() subtracts", "2 + 3 gives -1", [("alice", "confirmed")])
        repo = git_repo(CALC)
        subprocess.run(["git", "-C", str(repo), "remote", "add", "origin", f"{gh.web}/acme/widgets.git"], check=True)
        for spec in ("7", "#7"):
            issue, client = resolve_issue(spec, repo, settings_for(repo))
            assert (issue.source, issue.number, issue.key, issue.repo) == ("github", 7, "7", "acme/widgets")
            assert issue.comments[0].body == "confirmed"
            assert client.api_url == gh.api  # derived from the origin host: Enterprise layout /api/v3


def test_issue_url_and_configured_api_base(git_repo):
    with FakeGitHub() as gh:
        gh.add_issue("team", "svc", 3, "Crash on start", "Traceback ...")
        repo = git_repo(CALC)
        issue, _ = resolve_issue(f"{gh.web}/team/svc/issues/3", repo, settings_for(repo))
        assert issue.title == "Crash on start" and issue.url == f"{gh.web}/team/svc/issues/3"
        issue, client = resolve_issue("team/svc#3", repo, settings_for(repo, **{"fix.github_api_url": gh.api}))
        assert issue.number == 3 and client.api_url == gh.api


def test_issue_number_without_origin_is_a_git_error(git_repo):
    repo = git_repo(CALC)
    with pytest.raises(GitError, match="no 'origin' remote") as e:
        resolve_issue("12", repo, settings_for(repo))
    assert e.value.exit_code == 5


def test_issue_file_and_text(git_repo, tmp_path):
    repo = git_repo(CALC)
    f = tmp_path / "Bug Report.md"
    f.write_text("# add() is wrong\n\nIt subtracts.\n")
    issue, client = resolve_issue(str(f), repo, settings_for(repo))
    assert (issue.source, issue.key, issue.title, client) == ("file", "bug-report", "add() is wrong", None)
    assert issue.text() == "# add() is wrong\n\nIt subtracts.\n"  # a file goes to the model verbatim

    for name, key in (("issue-42.md", "42"), ("issue.md", "add-is-wrong"), ("Issue_Perf.txt", "perf")):
        (tmp_path / name).write_text("# add() is wrong\n")
        assert resolve_issue(str(tmp_path / name), repo, settings_for(repo))[0].key == key

    issue, _ = resolve_issue("add() subtracts\nplease fix", repo, settings_for(repo))
    assert issue.source == "text" and issue.title == "add() subtracts"
    again, _ = resolve_issue("add() subtracts\nplease fix", repo, settings_for(repo))
    assert issue.key == again.key and issue.key.startswith("text-")


@pytest.mark.parametrize("spec", ["", "   ", "missing.md", "docs/missing-issue"])
def test_empty_issue_or_missing_file_is_a_usage_error(git_repo, spec):
    repo = git_repo(CALC)
    with pytest.raises(UsageError):
        resolve_issue(spec, repo, settings_for(repo))


def test_non_issue_url_is_a_usage_error(git_repo):
    repo = git_repo(CALC)
    with pytest.raises(UsageError, match="not an issue URL"):
        resolve_issue("https://github.com/acme/widgets/pull", repo, settings_for(repo))


def test_commit_message_references_the_issue():
    run = RunResult(status="submitted", turns=4, final_message="add() subtracted; it adds now.")
    gh = Issue(source="github", key="7", number=7, repo="acme/widgets", title="add() subtracts",
               url="https://github.com/acme/widgets/issues/7")
    msg = commit_message(gh, run)
    assert msg.splitlines()[0] == "Fix #7: add() subtracts"
    assert "add() subtracted; it adds now." in msg
    assert "Issue: https://github.com/acme/widgets/issues/7" in msg
    assert msg.rstrip().endswith("Fixes acme/widgets#7")
    text = commit_message(Issue(source="text", key="text-1", title="x" * 100), run)
    assert len(text.splitlines()[0]) <= 72 and text.startswith("Fix: xxx")


def test_suite_passed_needs_a_clean_green_run():
    assert suite_passed({"passed": 3, "failed": 0, "errors": 0})
    assert not suite_passed(None)
    assert not suite_passed({"passed": 0, "failed": 0})
    assert not suite_passed({"passed": 3, "failed": 1})
    assert not suite_passed({"passed": 3, "errors": 1})
    assert not suite_passed({"passed": 3, "timed_out": True})


def test_settings_tables_reach_the_agent_config_without_a_mapping(tmp_path):
    (tmp_path / "m3-agent.toml").write_text(
        '[limits]\nmax_turns = 9\n[thinking]\npolicy = "enabled"\n[sandbox]\nmemory = "2g"\npids_limit = 64\n'
        "[stall]\nenabled = false\nrepeat_actions = 5\n[model]\nmax_tokens = 1024\n"
    )
    settings = load_settings(tmp_path, {"model.api_key": "k", "--time-limit": 30}, environ={})[0]
    cfg = settings.agent_config(base_url="http://127.0.0.1:9/v1")
    assert (cfg.model.base_url, cfg.model.api_key.get_secret_value(), cfg.model.max_tokens) == (
        "http://127.0.0.1:9/v1", "k", 1024)
    assert (cfg.limits.max_turns, cfg.limits.max_wall_s) == (9, 30)
    assert cfg.thinking.policy == "enabled"
    assert (cfg.stall.enabled, cfg.stall.repeat_actions) == (False, 5)
    assert (cfg.sandbox.memory, cfg.sandbox.pids_limit, cfg.sandbox.network) == ("2g", 64, "none")


def test_bad_agent_table_is_a_usage_error_naming_the_file(tmp_path):
    (tmp_path / "m3-agent.toml").write_text("[model]\nmax_tokens = 'lots'\n")
    with pytest.raises(UsageError, match=r"m3-agent.toml: model.max_tokens: .*integer"):
        load_settings(tmp_path, environ={})
    (tmp_path / "m3-agent.toml").write_text("")
    with pytest.raises(UsageError, match=r"flag --sandbox-image: sandbox.image: "):
        load_settings(tmp_path, {"--sandbox-image": 3}, environ={})


def test_no_endpoint_is_a_usage_error(tmp_path):
    settings = load_settings(tmp_path, environ={})[0]
    with pytest.raises(UsageError, match="no model endpoint: pass --base-url"):
        resolve_endpoint(settings.model.base_url, serving=Served(settings.serve))


def run_fix_process(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`m3-agent fix ...` in its own process, as a user runs it, without M3_AGENT_* / GitHub variables."""
    clean = {k: v for k, v in os.environ.items()
             if not k.upper().startswith("M3_AGENT_") and k not in ("GITHUB_TOKEN", "GH_TOKEN")}
    return subprocess.run([sys.executable, "-m", "m3_agent.cli", "fix", *args], cwd=cwd, capture_output=True,
                          text=True, env={**clean, "COLUMNS": "1000"}, timeout=120)


@pytest.fixture
def cli_main(monkeypatch, capsys):
    """Run the console entry point (`m3_agent.cli.main`) in this process: (exit code, stdout, stderr).

    M3_AGENT_* and GitHub token variables from outside are removed; `env` adds some for one call.
    """
    from m3_agent.cli import main

    for name in list(os.environ):
        if name.upper().startswith("M3_AGENT_") or name in ("GITHUB_TOKEN", "GH_TOKEN"):
            monkeypatch.delenv(name)

    def run(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        capsys.readouterr()
        with monkeypatch.context() as m:
            for k, v in (env or {}).items():
                m.setenv(k, v)
            try:
                main(list(argv))
                code = 0
            except SystemExit as e:
                code = e.code or 0
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def fix_cli(cli_main):
    """`m3-agent fix ARGS` in this process: (exit code, stdout, stderr)."""
    return lambda *args, env=None: cli_main("fix", *args, env=env)


def assert_one_line_error(result: tuple[int, str, str], code: int, text: str) -> None:
    """The exit code, and one error line (rich may wrap it for the terminal width) naming the problem."""
    exit_code, _, err = result
    assert exit_code == code, err
    flat = " ".join(err.split())
    assert flat.startswith("m3-agent: error: ") and flat.count("m3-agent: error: ") == 1, err
    assert text in flat
    assert "Traceback" not in err


def test_process_exit_code_and_single_line_for_a_non_git_directory(tmp_path):
    proc = run_fix_process("--repo", str(tmp_path), "--issue", "x", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"m3-agent: error: {tmp_path} is not a git repository: "
                                                "run `git init` there, or pass --repo"]


def test_cli_missing_repo_exit_2(tmp_path, fix_cli):
    assert_one_line_error(fix_cli("--repo", str(tmp_path / "nope"), "--issue", "x"), 2, "repository path does not exist")


def test_cli_requires_an_issue_and_an_endpoint(git_repo, fix_cli):
    repo = git_repo(CALC)
    assert_one_line_error(fix_cli("--repo", str(repo)), 2, "which issue?")
    assert_one_line_error(fix_cli("--repo", str(repo), "1", "--issue", "2"), 2, "give the issue once")
    assert_one_line_error(fix_cli("--repo", str(repo), "--issue", "bug text"), 2, "no model endpoint")


def test_cli_detached_head_exit_5(git_repo, fix_cli):
    repo = git_repo(CALC)
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", "--detach"], check=True)
    assert_one_line_error(fix_cli("--repo", str(repo), "--issue", "bug", "--base-url", "http://127.0.0.1:9/v1"),
                          5, "HEAD is detached")


def test_cli_no_origin_remote_exit_5(git_repo, fix_cli):
    repo = git_repo(CALC)
    assert_one_line_error(fix_cli("--repo", str(repo), "12", "--base-url", "http://127.0.0.1:9/v1"),
                          5, "no 'origin' remote")


def test_cli_apply_on_dirty_tree_exit_5_before_any_work(git_repo, fix_cli):
    repo = git_repo(CALC)
    (repo / "calc.py").write_text("# local edit\n")
    result = fix_cli("--repo", str(repo), "--issue", "bug", "--apply", "--base-url", "http://127.0.0.1:9/v1")
    assert_one_line_error(result, 5, "uncommitted changes")
    assert (repo / "calc.py").read_text() == "# local edit\n"


def test_cli_unreachable_endpoint_exit_3_quickly(git_repo, fix_cli):
    repo = git_repo(CALC)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    result = fix_cli("--repo", str(repo), "--issue", "bug", "--base-url", f"http://127.0.0.1:{port}/v1")
    assert_one_line_error(result, 3, f"cannot reach the model server at http://127.0.0.1:{port}/v1")
    assert time.monotonic() - started < 10


def test_cli_github_errors_exit_5_and_a_rate_limit_13(git_repo, fix_cli):
    with FakeGitHub() as gh:
        repo = git_repo(CALC)
        subprocess.run(["git", "-C", str(repo), "remote", "add", "origin", f"{gh.web}/acme/widgets.git"], check=True)
        args = ("--repo", str(repo), "--base-url", "http://127.0.0.1:9/v1")
        assert_one_line_error(fix_cli("404", *args), 5, "issue #404 not found in acme/widgets")
        gh.add_issue("acme", "widgets", 1, "t", "b")
        assert_one_line_error(fix_cli("1", *args, env={"GITHUB_TOKEN": "expired"}), 5,
                              "GitHub rejected the token (Bad credentials)")
        gh.rate_limited = True
        assert_one_line_error(fix_cli("1", *args), 13, "GitHub API rate limit exceeded; it resets at")


def test_cli_json_mode_reports_errors_as_json(git_repo, fix_cli):
    repo = git_repo(CALC)
    code, out, _ = fix_cli("--repo", str(repo), "12", "--json", "--base-url", "http://127.0.0.1:9/v1")
    assert code == 5
    result = json.loads(out)
    assert result["exit_code"] == 5 and result["resolved"] is False and "origin" in result["error"]


def test_a_refused_key_exits_8_before_any_work_naming_the_key_masked_and_its_source(git_repo, fix_cli):
    repo = git_repo(CALC)
    args = ("--repo", str(repo), "--issue", "add() subtracts")
    with StandinServer({"turns": [{"content": "never served"}]}, api_key="m3-right-key-0123456789") as srv:
        by_flag = fix_cli(*args, "--base-url", srv.base_url, "--api-key", "m3-wrong-key-0123WXYZ")
        by_env = fix_cli(*args, "--base-url", srv.base_url, env={"M3_AGENT_MODEL__API_KEY": "m3-wrong-key-0123ABCD"})
        by_file = fix_cli(*args, "--base-url", srv.base_url, "--config", str(_config(repo, "m3-wrong-key-0123EFGH")))
        without = fix_cli(*args, "--base-url", srv.base_url)
        assert srv.requests == []  # refused at the first request, before the sandbox or the agent
    refused = f"the model server at {srv.base_url} refused the request (HTTP 401): sent "
    assert_one_line_error(by_flag, 8, refused + "the key ****WXYZ (from flag --api-key)")
    assert_one_line_error(by_env, 8, refused + "the key ****ABCD (from env M3_AGENT_MODEL__API_KEY)")
    assert_one_line_error(by_file, 8, refused + "the key ****EFGH (from ")
    assert_one_line_error(without, 8, refused + "no key;")
    for _, out, err in (by_flag, by_env, by_file):
        assert "m3-wrong-key" not in out + err


def _config(repo: Path, key: str) -> Path:
    path = repo.parent / f"{repo.name}-team.toml"
    path.write_text(f'[model]\napi_key = "{key}"\n')
    return path


@pytest.mark.parametrize("command", [["fix", "--issue", "x"], ["eval", "run", "--tasks", "builtin"]])
def test_serve_on_a_machine_without_gpus_names_a_command_that_exists(git_repo, cli_main, monkeypatch, command):
    repo = git_repo(CALC)
    monkeypatch.chdir(repo)
    code, _, err = cli_main(*command, "--serve", "h200-tp8")
    flat = " ".join(err.split())
    assert code == 2 and "no GPU found" in flat, err
    advice = flat.split("`")[1]
    assert advice == "m3-agent serve start --profile h200-tp8 --skip-gpu-check"  # not a flag fix/eval run lack
    assert cli_main(*advice.split()[1:], "--dry-run")[0] == 0
