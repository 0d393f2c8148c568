"""`m3-agent pack` as a user runs it: a real process, real repositories, a real stand-in server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from m3_agent.agent.context import StableOrder, ServerCounter, pack_repository
from m3_agent.standin.server import StandinServer
from tests.conftest import lan_address

FILES = {"src/app.py": "def main():\n    return 'hi'\n", "logo.png": b"\x89PNG\0\0\0", "yarn.lock": "lock\n",
         "README.md": "# app\n"}


def run_pack(*args: str) -> subprocess.CompletedProcess:
    """Run `m3-agent pack` in a fresh process."""
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "m3_agent.cli", "pack", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_m3_agent_pack_writes_the_file_and_prints_a_summary(repo, tmp_path):
    root = repo(FILES)
    out = tmp_path / "pack.md"
    proc = run_pack("--repo", str(root), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == pack_repository(root).text
    for line in ("packed", "skipped: binary", "skipped: lockfile", "counter", "estimate", "time"):
        assert line in proc.stderr
    assert "token counts are estimates" in proc.stderr


def test_pack_to_stdout_with_issue_file_and_budget(repo, tmp_path):
    root = repo(FILES | {f"pkg/m{i}.py": f"VALUE_{i} = {i}\n" * 40 for i in range(10)})
    issue = tmp_path / "issue.md"
    issue.write_text("pkg/m7.py gives the wrong VALUE_7\n")
    budget = pack_repository(root).tokens // 3
    proc = run_pack("--repo", str(root), "--issue", str(issue), "--budget", str(budget))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == pack_repository(root, issue=issue.read_text(), budget=budget).text
    assert "### pkg/m7.py" in proc.stdout
    assert "skipped: budget" in proc.stderr
    assert f"of {budget:,} budget" in proc.stderr


def test_pack_include_and_exclude_flags(repo):
    root = repo(FILES)
    proc = run_pack("--repo", str(root), "--include", "src/**", "--exclude", "*.md")
    assert proc.returncode == 0, proc.stderr
    assert "### src/app.py" in proc.stdout and "### README.md" not in proc.stdout
    assert "skipped: not-included" in proc.stderr


def test_pack_counts_through_the_server_and_takes_its_budget(repo, tmp_path):
    root = repo(FILES)
    with StandinServer({"max_model_len": 40_000, "turns": []}) as srv:
        out = tmp_path / "p.md"
        proc = run_pack("--repo", str(root), "--base-url", srv.base_url, "--output-reserve", "1000", "-o", str(out))
        assert proc.returncode == 0, proc.stderr
        assert "server" in proc.stderr
        default_budget = 40_000 - 1000 - 6000  # max_model_len less output and 15% growth reserves
        assert f"of {default_budget:,} budget" in proc.stderr
        assert f"{ServerCounter(srv.base_url).count(out.read_text()):,}" in proc.stderr


def test_pack_through_a_plain_http_server_elsewhere_warns_unless_the_setting_silences_it(repo, tmp_path):
    root = repo(FILES)
    with StandinServer({"max_model_len": 40_000, "turns": []}, host="0.0.0.0") as srv:
        url = f"http://{lan_address()}:{srv.port}/v1"
        loud = run_pack("--repo", str(root), "--base-url", url, "-o", str(tmp_path / "a.md"))
        (root / "m3-agent.toml").write_text("[model]\nwarn_plain_http = false\n")
        silenced = run_pack("--repo", str(root), "--base-url", url, "-o", str(tmp_path / "b.md"))
        local = run_pack("--repo", str(root), "--base-url", srv.base_url.replace("0.0.0.0", "127.0.0.1"),
                         "-o", str(tmp_path / "c.md"))
    assert loud.returncode == silenced.returncode == local.returncode == 0, loud.stderr
    assert loud.stderr.count("m3-agent: warning: the repository goes to") == 1 and re.search(r"counter +server", loud.stderr)
    assert "plain http://" not in silenced.stderr + local.stderr


def test_pack_falls_back_to_the_estimate_when_the_server_is_down(repo):
    root = repo(FILES)
    proc = run_pack("--repo", str(root), "--base-url", "http://127.0.0.1:9/v1")
    assert proc.returncode == 0, proc.stderr
    assert "warning" in proc.stderr and "estimate" in proc.stderr


def test_bad_input_is_a_one_line_usage_error(tmp_path, repo):
    proc = run_pack("--repo", str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert "repository not found" in proc.stderr and "Traceback" not in proc.stderr
    root = repo(FILES)
    proc = run_pack("--repo", str(root), "--budget", "5")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    proc = run_pack("--repo", str(root), "--counter", "server")
    assert proc.returncode == 2 and "needs --base-url" in proc.stderr


def test_estimate_with_a_server_is_calibrated_against_tokenize(repo):
    from m3_agent.agent.context.estimate import estimate_tokens

    root = repo({f"m{i}.py": "x = foo(bar, baz)  # call\n" * (5 + i) for i in range(12)})
    with StandinServer({"turns": []}) as srv:
        server = ServerCounter(srv.base_url)
        est = estimate_tokens(root, None, server).counter  # what `--counter estimate` uses
        texts = [(root / f"m{i}.py").read_text() for i in range(12)]
        exact = sum(server.count_many(texts))
        assert abs(sum(est.count_many(texts)) - exact) <= 0.05 * exact
        proc = run_pack("--repo", str(root), "--counter", "estimate", "--base-url", srv.base_url)
        assert proc.returncode == 0, proc.stderr
        assert "estimate" in proc.stderr


def test_bad_flags_are_usage_errors_and_help_lists_the_options(repo):
    root = repo(FILES)
    for bad in (["--budget", "many"], ["--counter", "guess"], ["--bogus"], ["extra"], ["--repo"]):
        proc = run_pack("--repo", str(root), *bad) if bad != ["--repo"] else run_pack(*bad)
        assert proc.returncode == 2, (bad, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stdout == ""
    proc = run_pack("--help")
    assert proc.returncode == 0
    for flag in ("--repo", "--issue", "--budget", "--output", "--include", "--exclude", "--base-url", "--model",
                 "--tokenizer", "--counter", "--max-file-bytes", "--output-reserve", "--no-cache"):
        assert flag in proc.stdout, flag


def test_repeated_and_equals_spellings_of_the_flags(repo, tmp_path):
    root = repo(FILES | {"docs/guide.md": "# guide\n"})
    out = tmp_path / "p.md"
    proc = run_pack(f"--repo={root}", "--include", "src/**", "--include=docs/", f"--output={out}", "--no-cache",
                    "--counter=estimate")
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == pack_repository(root, include=("src/**", "docs/")).text


def test_pack_takes_the_shared_part_and_history_from_the_settings(repo, tmp_path):
    root = repo(FILES | {f"pkg/m{i}.py": f"VALUE_{i} = {i}\n" * 40 for i in range(10)})
    issue = tmp_path / "issue.md"
    issue.write_text("pkg/m7.py gives the wrong VALUE_7\n")
    budget = pack_repository(root).tokens // 2
    (root / "m3-agent.toml").write_text("[eval]\nshared_share = 0.5\n")
    proc = run_pack("--repo", str(root), "--issue", str(issue), "--budget", str(budget))
    assert proc.returncode == 0, proc.stderr
    shared = pack_repository(root, issue=issue.read_text(), budget=budget,
                             order=StableOrder(str(root), None, shared_share=0.5)).text
    assert proc.stdout == shared != pack_repository(root, issue=issue.read_text(), budget=budget).text


def test_pack_summary_counts_the_outline_tier_and_the_share_is_a_flag_and_a_setting(repo, tmp_path):
    modules = {f"pkg/m{i}.py": "".join(f"def step_{i}_{n}(value):\n    return value + {n}\n\n" for n in range(60))
               for i in range(8)}
    root = repo(FILES | modules)
    budget = pack_repository(root).tokens // 3
    proc = run_pack("--repo", str(root), "--issue", "step_3_1 is wrong", "--budget", str(budget), "-o", str(tmp_path / "p"))
    assert proc.returncode == 0, proc.stderr
    default = pack_repository(root, issue="step_3_1 is wrong", budget=budget)
    assert (tmp_path / "p").read_bytes() == default.data
    assert default.outlined
    assert re.search(rf"outlined \(left out\) +{len(default.outlined):,} files +{default.outline_tokens:,} tokens",
                     proc.stderr)
    off = run_pack("--repo", str(root), "--issue", "step_3_1 is wrong", "--budget", str(budget), "--outline-share", "0")
    assert off.returncode == 0 and "## Outlines" not in off.stdout and "outlined" not in off.stderr
    (root / "m3-agent.toml").write_text("[context]\noutline_share = 0.2\n")
    wide = run_pack("--repo", str(root), "--issue", "step_3_1 is wrong", "--budget", str(budget))
    assert wide.returncode == 0
    assert wide.stdout.encode() == pack_repository(root, issue="step_3_1 is wrong", budget=budget, outline_share=0.2).data
    bad = run_pack("--repo", str(root), "--budget", str(budget), "--outline-share", "0.9")
    assert bad.returncode == 2 and "outline share" in bad.stderr and "Traceback" not in bad.stderr


def test_a_dead_base_url_is_named_as_the_reason_the_counts_are_estimates(repo, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    proc = run_pack("--repo", str(repo(FILES)), "--base-url", dead, "-o", str(tmp_path / "pack.md"))
    assert proc.returncode == 0, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"token counts are estimates (the server at {dead} did not count them (see above): start it, " \
                   f"or pass --tokenizer FILE)"
    assert "no server /tokenize or tokenizer.json given" not in proc.stderr
