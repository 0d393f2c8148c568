"""benchmarks/envbench.py: how it reads each runner's summary, and one corpus entry end to end on the real engine."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from m3_agent.sandbox.env.catalogue import prune_environments
from tests.conftest import make_git_repo

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "envbench.py"
spec = importlib.util.spec_from_file_location("envbench", BENCH)
envbench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(envbench)


def test_pytest_summary_counts_and_network_failures_apart():
    out = ("FAILED tests/test_a.py::test_get - urllib3.exceptions.NewConnectionError: Failed to establish\n"
           "FAILED tests/test_a.py::test_math - assert 1 == 2\n3 failed, 40 passed, 2 errors in 1.2s\n")
    assert envbench.count("pytest", out, 1) == {"passed": 40, "failed": 3, "errors": 2, "network": 1}


def test_pytest_summary_is_found_when_a_plugins_warning_on_stderr_follows_it():
    """pyzmq's old commit: pytest-asyncio 0.24 warns on stderr, which the benchmark reads after stdout; the counts were
    read from the last three lines, the warning's, and its 19 passing tests counted as none."""
    out = ("tests/test_message.py ...s....\n=== 19 passed, 1 skipped in 6.29s ===\n\n"
           "plugin.py:208: PytestDeprecationWarning: unset.\nThe event loop scope for asynchronous fixtures ...\n\n"
           "  warnings.warn(PytestDeprecationWarning(_DEFAULT_FIXTURE_LOOP_SCOPE_UNSET))\n")
    assert envbench.count("pytest", out, 0) == {"passed": 19, "failed": 0, "errors": 0, "network": 0}


def test_pytest_prettys_summary_counts_when_stderr_follows_it():
    """scikit-image's test extra has pytest-pretty, and pooch's download retries go to stderr after it."""
    out = ("FAILED t.py::test_a\nERROR t.py::test_b\nResults (195.70s):\n         1 failed\n       315 passed\n"
           "        30 errors\n\nFailed to download 'x.npz'. Will attempt the download again 3 more times.\n"
           "Failed to download 'x.npz'. Will attempt the download again 2 more times.\n")
    assert envbench.count("pytest", out, 1) == {"passed": 315, "failed": 1, "errors": 30, "network": 0}


def test_pytest_network_failures_are_read_from_their_sections_when_the_summary_gives_no_reason():
    """scikit-image's short summary names its 31 failing tests without a reason; the sections above say each
    download failed to resolve its host (the sandbox has no network)."""
    section = "_____ ERROR at setup of test_cube[{0}] _____\n\n>   sock = create_connection()\nE   socket.gaierror: " \
              "[Errno -3] Temporary failure in name resolution\n"
    out = ("= ERRORS =\n" + "".join(section.format(i) for i in range(2)) + "= FAILURES =\n"
           "_____ test_math _____\n\nE   assert 1 == 2\n= short test summary info =\nFAILED t.py::test_math\n"
           "ERROR t.py::test_cube[0]\nERROR t.py::test_cube[1]\n= 1 failed, 5 passed, 2 errors in 1.0s =\n")
    assert envbench.count("pytest", out, 1) == {"passed": 5, "failed": 1, "errors": 2, "network": 2}


def test_unittest_summary_counts_failures_errors_and_skips():
    out = "...\n" + "=" * 70 + "\nFAIL: test_x (m.T)\n" + "-" * 70 + "\nAssertionError\n\nRan 12 tests in 0.1s\n\n" \
          "FAILED (failures=1, errors=2, skipped=3)\n"
    assert envbench.count("unittest", out, 1) == {"passed": 6, "failed": 1, "errors": 2, "network": 0}
    assert envbench.count("unittest", "Ran 7 tests in 0.0s\n\nOK\n", 0)["passed"] == 7


def test_a_plain_script_passes_by_its_exit_code():
    assert envbench.count("script", "", 0)["passed"] == 1 and envbench.count("script", "boom", 1)["failed"] == 1


def test_the_command_names_the_test_file_or_its_module():
    assert envbench.command_for({}, "tests/test_a.py").endswith("tests/test_a.py")
    # cleo's addopts hold -q: one more would be -qq, which prints no summary line to count from
    assert "-q" not in envbench.command_for({}, "tests/test_a.py").split()
    assert envbench.command_for({"command": "python -m unittest {module}"}, "pkg/tests/test_a.py") == \
        "python -m unittest pkg.tests.test_a"


def test_a_builds_progress_is_timed_into_its_log_and_its_steps(tmp_path):
    log = tmp_path / "build.log"
    took, proc = envbench.m3("--help", log=log)
    assert proc.returncode == 0 and "env" in proc.stdout and took > 0
    assert re.match(r"^\s+\d+\.\d s  ", log.read_text())
    timed = "   0.5 s  > planning\n   0.9 s    detail\n  12.0 s  > install the dependencies\n  40.5 s  built: x\n"
    assert envbench.steps(timed) == [["planning", 11.5], ["install the dependencies", 28.5]]


def test_a_clone_without_a_blob_checks_out_the_rest_and_names_the_missing_file(tmp_path):
    clone = make_git_repo(tmp_path / "clone", {"pkg/a.py": "A = 1\n", "Tests/big.otf": "a large font\n"})
    head = subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    blob = subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD:Tests/big.otf"], capture_output=True,
                          text=True).stdout.strip()
    (clone / ".git" / "objects" / blob[:2] / blob[2:]).unlink()  # as a mirror that left out its largest blobs
    repo, missing = envbench.checkout(clone, head, tmp_path / "work")
    assert missing == ["Tests/big.otf"]
    assert (repo / "pkg" / "a.py").read_text() == "A = 1\n" and not (repo / "Tests" / "big.otf").exists()
    # committed without it, so an export of the tree from git (env build's) finds every blob
    listed = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", "--name-only", "HEAD"], capture_output=True,
                            text=True).stdout.split()
    assert listed == ["pkg/a.py"]
    with pytest.raises(subprocess.CalledProcessError):  # any other failure still stops the row
        envbench.checkout(clone, "0" * 40, tmp_path / "work2")


@pytest.mark.docker
@pytest.mark.timeout(1800)  # two builds on a shared machine
def test_one_entry_end_to_end_prints_its_row_and_the_summary_last(tmp_path, sandbox_image):
    name = f"envbenchtiny{tmp_path.name[-6:].replace('_', '')}"
    repo = make_git_repo(tmp_path / "clones" / name, {
        "pyproject.toml": f'[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n\n'
                          f'[project]\nname = "{name}"\nversion = "0.1"\ndependencies = ["six"]\n',
        f"{name}/__init__.py": "import six\n\n\ndef one():\n    return 1\n",
        "tests/test_one.py": f"from {name} import one\n\n\ndef test_one():\n    assert one() == 1\n"})
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    at = {"commit": head, "date": "2026-12-05", "test": "tests/test_one.py"}
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps({"repositories": [{"name": name, "github": f"example/{name}", "backend": "setuptools",
                                                    "compiles": False, "runner": "pytest", "head": at, "old": at}]}))
    try:
        r = subprocess.run([sys.executable, str(BENCH), "--clones", str(tmp_path / "clones"), "--corpus", str(corpus),
                            "--which", "head", "--markdown", str(tmp_path / "t.md")],
                           capture_output=True, text=True, timeout=1700)
    finally:
        prune_environments(keep=0, source=name)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    (row,) = out["runs"]
    assert row["build_exit"] == 0 and row["cold_s"] > row["warm_s"] > 0 and row["size_mb"] > 0, row
    assert row["tests"] == {"passed": 1, "failed": 0, "errors": 0, "network": 0, "runs": True}
    assert row["floor"]["runs"] is False  # the plain image has no six: the floor is really measured apart
    assert out["summary"]["heads_run"] == 1.0 and out["summary"]["floor_heads_run"] == 0.0
    assert f"| {name} | head 2026-12-05 | setuptools |" in (tmp_path / "t.md").read_text()
