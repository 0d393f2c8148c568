"""`m3-agent eval grade | run | report` as a user runs them: real processes, the stand-in over real HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from m3_agent.standin.kvsim import B200X8_KV_TOKENS
from m3_agent.standin.server import StandinServer
from m3_agent.evals.tasks import builtin_standin_script, builtin_task
from tests.conftest import lan_address, secrets_found


def m3(*args: str, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "m3_agent.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def _main_error(capsys, *args: str) -> str:
    """Run the CLI entry point in-process; return its error message after checking exit code 2."""
    from m3_agent.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    assert err.startswith("m3-agent: error: "), err
    return "".join(err.strip().splitlines())  # the console wraps long lines at 80 columns in a pipe


def _main_ok(capsys, *args: str) -> str:
    """Run the CLI entry point in-process; return its stdout after checking exit code 0."""
    from m3_agent.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    captured = capsys.readouterr()
    assert exit_info.value.code == 0, captured.err
    return captured.out


def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "nope.json"
    assert _main_error(capsys, "eval", "grade", "--tasks", str(missing), "-p", "gold") == \
        f"m3-agent: error: tasks not found: {missing}"
    assert "predictions not found" in _main_error(capsys, "eval", "grade", "--tasks", "builtin", "-p", str(tmp_path / "p"))
    assert "no results in" in _main_error(capsys, "eval", "report", str(tmp_path))
    (tmp_path / "results.jsonl").write_text("")
    assert "unknown --format 'pdf'" in _main_error(capsys, "eval", "report", str(tmp_path), "--format", "pdf")
    monkeypatch.chdir(tmp_path)
    assert "pass --base-url" in _main_error(capsys, "eval", "run", "--tasks", "builtin")
    # Flags and the config file load the same nested settings `fix` uses, errors naming their layer.
    assert _main_error(capsys, "eval", "run", "--tasks", "builtin", "--thinking", "sometimes").startswith(
        "m3-agent: error: flag --thinking: thinking.policy: ")
    (tmp_path / "m3-agent.toml").write_text("[limits]\nmax_turns = 0\n")
    assert _main_error(capsys, "eval", "run", "--tasks", "builtin").startswith(
        "m3-agent: error: m3-agent.toml: limits.max_turns: ")


def test_the_eval_command_does_not_load_the_fix_command():
    code = ("import sys, m3_agent.evals.cli, m3_agent.serving.endpoint, m3_agent.settings; "
            "print(sorted(m for m in sys.modules if m.startswith('m3_agent.fix')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_run_stops_at_once_when_no_server_listens(tmp_path, capsys, monkeypatch):
    from m3_agent.cli import main

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "run", "--tasks", "builtin", "--base-url", f"http://127.0.0.1:{port}/v1"])
    assert exit_info.value.code == 3
    assert "cannot reach the model server" in capsys.readouterr().err
    assert not (tmp_path / ".m3-agent").exists()  # nothing was started


@pytest.mark.docker
def test_grade_json_ends_with_the_summary_and_report_renders_it(tmp_path, sandbox_image, capsys):
    out = tmp_path / "out"
    preds = tmp_path / "preds.jsonl"  # SWE-bench's format; one stray id, and no prediction for chunks
    rows = [{"instance_id": f"m3-agent__{n}-1", "model_name_or_path": "gold", "model_patch": builtin_task(n).patch}
            for n in ("roman", "lru")] + [{"instance_id": "other__repo-9", "model_patch": ""}]
    preds.write_text("".join(json.dumps(row) + "\n" for row in rows))
    r = m3("eval", "grade", "--tasks", "builtin", "--predictions", str(preds),
           "-i", "m3-agent__roman-1,m3-agent__lru-1", "-i", "m3-agent__chunks-1",
           "--workers", "2", "--output", str(out), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["total_instances"] == 3 and summary["resolved_instances"] == 2
    assert sorted(summary["resolved_ids"]) == ["m3-agent__lru-1", "m3-agent__roman-1"]
    assert summary["incomplete_ids"] == ["m3-agent__chunks-1"]
    assert summary["unresolved_ids"] == [] and summary["error_ids"] == []
    assert "1 prediction(s) name no task" in r.stderr and "resolved" in r.stderr  # progress and table on stderr

    # In-process from here: the same entry point without another interpreter start.
    assert _main_ok(capsys, "eval", "report", str(out), "--format", "md").startswith("# m3-agent eval report")
    said = _main_ok(capsys, "eval", "report", str(out), "--format", "html", "--out", str(tmp_path / "r.html"))
    assert said == f"wrote {tmp_path / 'r.html'}: the html report of 2 instances in {out}\n"
    assert (tmp_path / "r.html").read_text().count("<svg") == 3
    table = _main_ok(capsys, "eval", "report", str(out), "--format", "table", "--tasks", "builtin")
    assert "m3-agent__roman-1" in table and "2/10 (20.0%)" in table  # the whole suite counted: 8 never graded
    for name in ("results.jsonl", "predictions.jsonl", "summary.json", "report.html", "report.md", "run.json"):
        assert (out / name).is_file(), name


WRONG_CHUNKS = {
    "match": "chunked() silently drops the last items",
    "turns": [
        {"tool_calls": [{"name": "file_edit", "arguments": {
            "path": "chunks.py", "old_str": '"""Split sequences into chunks."""', "new_str": '"""Chunks."""'}}]},
        {"content": "Done.", "tool_calls": [{"name": "submit", "arguments": {}}]},
    ],
}


@pytest.mark.docker
def test_run_resolves_what_the_scripted_solutions_solve(tmp_path, sandbox_image):
    solved = ["roman", "lru", "slugify"]
    script = builtin_standin_script(solved)
    script["conversations"].append(WRONG_CHUNKS)
    script["performance"] = {"time_scale": 1e6}  # 8x B200's KV cache on /metrics; timing out of the way
    out = tmp_path / "run"
    ids = ",".join(f"m3-agent__{n}-1" for n in [*solved, "chunks"])
    with StandinServer(script) as srv:
        r = m3("eval", "run", "--tasks", "builtin", "-i", ids, "--base-url", srv.base_url, "--workers", "2",
               "--output", str(out), "--gpu-usd-per-hour", "3.64", "--json", "-q", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert srv.requests, "the agent never reached the stand-in"
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(summary["resolved_ids"]) == sorted(f"m3-agent__{n}-1" for n in solved)
    assert summary["unresolved_ids"] == ["m3-agent__chunks-1"]
    assert summary["prompt_tokens"] > 0 and summary["turns"] >= 4 * 2
    assert sum(summary["mode_counts"].values()) == summary["turns"]
    assert summary["cost_usd"] > 0 and summary["run_cost_usd"] > 0
    assert summary["prefill_computed_tokens"] + summary["prefill_reused_tokens"] == summary["prompt_tokens"]
    assert summary["prefill_reused_tokens"] == summary["cached_tokens"] > 0
    run = json.loads((out / "run.json").read_text())  # admission learned the capacity from /metrics
    assert run["kv_capacity_tokens"] == B200X8_KV_TOKENS // 128 * 128 and run["kv_capacity_source"].endswith("/metrics")

    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert {p["instance_id"] for p in preds} == set(ids.split(","))
    for p in preds:
        assert set(p) == {"instance_id", "model_name_or_path", "model_patch"}
        assert p["model_name_or_path"] == "m3-agent" and p["model_patch"].startswith("diff --git")
        assert (out / "trajectories" / f"{p['instance_id']}.jsonl").stat().st_size > 0
    # The agent's own test verdict follows the fix rule: only tests that ran on its final workspace.
    agents = {r["instance_id"]: r["agent"] for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert set(agents) == set(ids.split(","))
    for name in solved:  # their scripts test after the last edit
        stats = agents[f"m3-agent__{name}-1"]
        assert stats["verdict_source"] == "agent" and stats["final_tests"]["passed"] > 0
    wrong = agents["m3-agent__chunks-1"]  # edits, never tests: no stale or invented test result
    assert wrong["verdict_source"] == "none" and wrong["final_tests"] is None


def test_progress_prints_ids_and_errors_with_brackets_verbatim():
    from rich.console import Console

    from m3_agent.evals.cli import RunProgress
    from m3_agent.evals.grading import InstanceReport
    from m3_agent.evals.instance import InstanceResult

    console = Console(record=True, width=200)
    progress = RunProgress(1, console)
    with progress.progress:
        progress("start", {"instance_id": "o__r-1"})
        progress("finish", {"result": InstanceResult(instance_id="o__r-1[red]", model_name_or_path="m", model_patch="d",
                                                     report=InstanceReport(patch_exists=True), error="boom [/] [bold")})
    text = console.export_text()
    assert "o__r-1[red]: error (boom [/] [bold)" in text
    assert "1/1" in text and "resolved 0" in text


def test_run_with_a_refused_key_exits_8_before_any_instance(tmp_path):
    with StandinServer({"turns": []}, api_key="m3-right-key-0123456789") as srv:
        r = m3("eval", "run", "--tasks", "builtin", "--base-url", srv.base_url, "--api-key", "m3-wrong-key-0123WXYZ",
               "--output", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 8, r.stderr
    flat = " ".join(r.stderr.split())
    assert flat.startswith(f"m3-agent: error: the model server at {srv.base_url} refused the request (HTTP 401)")
    assert "sent the key ****WXYZ (from flag --api-key)" in flat and "Traceback" not in r.stderr
    assert "m3-wrong-key-0123WXYZ" not in r.stdout + r.stderr
    assert not (tmp_path / "out").exists()  # no instance started


@pytest.mark.docker
def test_run_with_serve_reuses_a_healthy_endpoint(tmp_path, sandbox_image):
    out = tmp_path / "run"
    with StandinServer(builtin_standin_script(["roman"])) as srv:
        r = m3("eval", "run", "--tasks", "builtin", "-i", "m3-agent__roman-1", "--serve", "h200-tp8",
               "--base-url", srv.base_url, "--output", str(out), "--json", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert srv.requests
    assert "serve: " in r.stderr and srv.base_url in r.stderr
    # this stand-in's /metrics does not size its cache: admission falls back to the profile's plan
    assert json.loads((out / "run.json").read_text())["kv_capacity_source"] == "serve plan --profile h200-tp8"
    assert json.loads(r.stdout.strip().splitlines()[-1])["resolved_ids"] == ["m3-agent__roman-1"]


@pytest.mark.docker
def test_a_keyed_run_leaves_the_key_in_no_report_trajectory_or_prediction(tmp_path, sandbox_image):
    key = "m3-team-key-0123456789WXYZ"
    out = tmp_path / "run"
    with StandinServer(builtin_standin_script(["roman"]), api_key=key) as srv:
        r = m3("eval", "run", "--tasks", "builtin", "-i", "m3-agent__roman-1", "--base-url", srv.base_url,
               "--api-key", key, "--output", str(out), "--json", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert srv.requests  # the key was sent and accepted
    assert json.loads(r.stdout.strip().splitlines()[-1])["resolved_ids"] == ["m3-agent__roman-1"]
    assert {"results.jsonl", "predictions.jsonl", "run.json"} <= {p.name for p in out.iterdir()}
    assert list(out.rglob("*.jsonl")) and list(out.rglob("*.html"))
    assert secrets_found([key], r.stdout, r.stderr, under=[out]) == []


@pytest.mark.docker
def test_a_plain_http_endpoint_on_another_address_warns_once_per_run(tmp_path, sandbox_image):
    with StandinServer(builtin_standin_script(["roman", "slugify"]), host="0.0.0.0") as srv:
        url = f"http://{lan_address()}:{srv.port}/v1"
        r = m3("eval", "run", "--tasks", "builtin", "-i", "m3-agent__roman-1,m3-agent__slugify-1", "--base-url", url,
               "--output", str(tmp_path / "run"), "--workers", "2", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.strip().splitlines()[-1])["resolved_ids"]) == 2  # two runs of the agent
    flat = " ".join(r.stderr.split())
    assert flat.count("m3-agent: warning: the repository goes to") == 1 and f"over plain http:// ({url})" in flat


@pytest.mark.docker
def test_run_gives_the_instances_of_a_repository_one_base_of_files_and_each_its_diff(tmp_path, sandbox_image):
    repo = tmp_path / "src"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    modules = {f"mod{i}.py": "".join(f"def f{i}_{k}():\n    return {k}\n" for k in range(60)) for i in range(8)}
    commits = []
    for n in range(3):  # each commit fixes one line of one module
        modules[f"mod{n}.py"] = modules[f"mod{n}.py"].replace("return 5\n", f"return -{n}\n")
        for name, text in modules.items():
            (repo / name).write_text(text)
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", f"fix {n}"], check=True)
        commits.append(subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip())
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"instance_id": f"o__r-{n}", "repo": "o/r", "base_commit": c,
                                         "problem_statement": f"Issue {n}: f{n}_5 returns the wrong value.",
                                         "repo_source": str(repo), "test_cmd": "true"}) + "\n"
                             for n, c in enumerate(commits)))
    script = {"turns": [{"content": "Done.", "tool_calls": [{"name": "submit", "arguments": {}}], "repeat": 100}]}
    with StandinServer(script) as srv:
        r = m3("eval", "run", "--tasks", str(tasks), "--base-url", srv.base_url, "--workers", "1",
               "--output", str(tmp_path / "out"), "-q", cwd=tmp_path)
        firsts = [next(m["content"] for m in body["messages"] if m["role"] == "user") for body in srv.requests]
    assert r.returncode in (0, 1), r.stderr
    packs = {n: next(t for t in firsts if f"Issue {n}:" in t) for n in range(3)}
    base = packs[1]  # the middle commit of the run
    sections = base[: base.index("## Tree\n")]
    assert "## Changes to the files above\n" not in base[len(sections):]
    for n in (0, 2):
        assert packs[n].startswith(sections)
        rest = packs[n][len(sections):]
        assert rest.startswith(f"## Changes to the files above\n\nThe files above are those of commit {commits[1]}")
        fixed = {0: ("-    return -1\n", "+    return 5\n"), 2: ("-    return 5\n", "+    return -2\n")}[n]
        assert all(line in rest for line in fixed)  # the fix between the base and this commit, as a diff


def test_standin_script_writes_the_suites_script_for_the_standin_command(tmp_path, capsys):
    assert json.loads(_main_ok(capsys, "eval", "standin-script")) == builtin_standin_script()
    out = tmp_path / "script.json"
    assert _main_ok(capsys, "eval", "standin-script", "-o", str(out), "-i", "roman,m3-agent__slugify-1") == ""
    assert json.loads(out.read_text()) == builtin_standin_script(["roman", "slugify"])
    assert "no built-in task nope: the suite has " in _main_error(capsys, "eval", "standin-script", "-i", "nope")


def test_workers_below_one_and_a_missing_repos_folder_are_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "--workers 0: give at least 1" in _main_error(capsys, "eval", "grade", "--tasks", "builtin", "-p", "gold",
                                                         "--workers", "0")
    missing = tmp_path / "nonexistent"
    for command in (["grade", "-p", "gold"], ["run", "--base-url", "http://127.0.0.1:9/v1"]):
        assert f"--repos {missing} is not a folder" in _main_error(
            capsys, "eval", *command, "--tasks", "builtin", "--repos", str(missing))
    assert not (tmp_path / ".m3-agent").exists()  # nothing was started


@pytest.mark.docker
def test_a_grade_in_which_every_instance_errors_fails_with_the_first_reason(tmp_path, sandbox_image):
    tasks = Path(__file__).parent / "data" / "swebench" / "tasks.jsonl"
    r = m3("eval", "grade", "--tasks", str(tasks), "--predictions", "gold", "--image-namespace",
           "m3-agent-nowhere", "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    last = " ".join(r.stderr.split("m3-agent: error: ")[-1].split())
    assert last.startswith("every instance ended in an error (2 of 2); the first, ")
    assert "could not be pulled" in last and "--image-namespace m3-agent-offline" in last
    assert "(docs/evals.md, 'offline images')" in r.stdout + r.stderr  # the per-instance line is whole too


@pytest.mark.docker
def test_an_output_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, capsys, sandbox_image):
    nowhere = tmp_path / "missing" / "dir" / "x.json"
    (tmp_path / "missing").write_text("a file, not a folder")
    assert f"cannot write {nowhere}: " in _main_error(capsys, "eval", "standin-script", "-o", str(nowhere))
    assert f"cannot make the results folder {nowhere}: " in _main_error(
        capsys, "eval", "grade", "--tasks", "builtin", "-p", "gold", "-o", str(nowhere))
    (tmp_path / "results.jsonl").write_text("")
    assert f"cannot write {nowhere}: " in _main_error(capsys, "eval", "report", str(tmp_path), "--format", "md",
                                                      "--out", str(nowhere))
