"""`m3-agent pack` as a user runs it: a real process, real repositories, a real stand-in server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from m3_agent.agent.context import ServerCounter, pack_repository
from m3_agent.serving.standin import StandinServer

FILES = {"src/app.py": "def main():\n    return 'hi'\n", "logo.png": b"\x89PNG\0\0\0", "yarn.lock": "lock\n",
         "README.md": "# app\n"}


def run_pack(*args: str, entry: tuple[str, ...] = ("m3_agent.agent.context",)) -> subprocess.CompletedProcess:
    """Run the pack command in a fresh process: `python -m agent.context` (the same command as
    `m3-agent pack` without loading the other commands), or `entry=("m3_agent.cli", "pack")`."""
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", *entry, *args], capture_output=True, text=True, env=env, timeout=120)


def test_m3_agent_pack_writes_the_file_and_prints_a_summary(repo, tmp_path):
    root = repo(FILES)
    out = tmp_path / "pack.md"
    proc = run_pack("--repo", str(root), "-o", str(out), entry=("m3_agent.cli", "pack"))
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
    from m3_agent.agent.context.cli import calibrated_estimate

    root = repo({f"m{i}.py": "x = foo(bar, baz)  # call\n" * (5 + i) for i in range(12)})
    with StandinServer({"turns": []}) as srv:
        server = ServerCounter(srv.base_url)
        est = calibrated_estimate(root, server)
        texts = [(root / f"m{i}.py").read_text() for i in range(12)]
        exact = sum(server.count_many(texts))
        assert abs(sum(est.count_many(texts)) - exact) <= 0.05 * exact
        proc = run_pack("--repo", str(root), "--counter", "estimate", "--base-url", srv.base_url)
        assert proc.returncode == 0, proc.stderr
        assert "estimate" in proc.stderr


def test_pack_command_loads_only_the_packer_and_lists_with_the_git_it_started_first(repo, tmp_path):
    root = repo(FILES)
    out = tmp_path / "p.md"
    code = (
        "import sys\n"
        "from m3_agent.agent.context import gitls\n"
        "started = []\n"
        "real = gitls.start\n"
        "gitls.start = lambda root: started.append(root) or real(root)\n"
        "import m3_agent.agent.context.cli\n"
        "light = 'm3_agent.agent.context.pack' not in sys.modules\n"
        "from m3_agent.cli import main\n"
        f"main(['pack', '--repo', {str(root)!r}, '-o', {str(out)!r}])\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'typer', 'rich', 'pydantic', 'click'})\n"
        "print(light, len(started), gitls._prefetched, heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # The command module loads without the packer; git starts once (before the packer loads) and
    # its calls are the ones the listing uses; no CLI framework or model library is loaded.
    assert proc.stdout.split("\n")[0] == "True 1 {} []"
    assert out.read_text() == pack_repository(root).text


def test_the_library_exports_load_on_first_use():
    code = ("import sys, agent.context as c\n"
            "before = 'm3_agent.agent.context.pack' in sys.modules\n"
            "from m3_agent.agent.context import pack_repository, EstimateCounter, PackCache\n"
            "print(before, pack_repository.__module__, EstimateCounter.__module__, 'PackCache' in dir(c))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["False", "m3_agent.agent.context.pack", "m3_agent.agent.context.tokens", "True"], proc.stderr


def test_the_quick_option_parser_agrees_with_argparse(capsys):
    import pytest

    from m3_agent.agent.context.cli import build_parser, parse_args

    lines = [
        [], ["--repo", "r"], ["--repo=r", "-o", "out.md", "--no-cache"], ["--issue", "-"], ["--issue", "-x y"],
        ["--budget", "1000", "--budget=2000"], ["--include", "*.py", "--include=docs/", "--exclude", "tests/"],
        ["--counter", "estimate", "--base-url", "http://127.0.0.1:1/v1", "--model", "m", "--tokenizer", "t.json"],
        ["--max-file-bytes", "10", "--output-reserve=5", "--output", "-"], ["--repo="], ["--budget", "-5"],
        ["-oout.md"],
    ]
    for argv in lines:
        assert vars(parse_args(argv)) == vars(build_parser().parse_args(argv)), argv
    for bad in (["--budget", "many"], ["--counter", "guess"], ["--bogus"], ["extra"], ["--repo"], ["--no-cache=1"],
                ["--re", "x"], ["--issue", "--repo", "x"]):
        with pytest.raises(SystemExit) as exc:
            parse_args(bad)
        assert exc.value.code == 2, bad
    assert "usage: m3-agent pack" in capsys.readouterr().err
