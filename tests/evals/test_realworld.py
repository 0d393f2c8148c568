"""Grading SWE-bench-format tasks made from a real project: iniconfig 1.1.1 (MIT), from its PyPI sdist.

Each task reintroduces a bug its changelog records as fixed (0.2: "fix bug in name=value parsing
where value was x=3"; "added ability to ask 'name in iniconfig'") and removes the test that guards it.
The real fix is the gold patch and the real test the test patch, as SWE-bench builds its tasks. The
repository is served from `--repos` as a bare mirror; FAIL_TO_PASS / PASS_TO_PASS are JSON strings,
as in SWE-bench's published datasets. Gold must resolve every task and empty none.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from m3_agent.evals.config import EvalConfig
from m3_agent.evals.predictions import load_predictions
from m3_agent.evals.runner import RunOptions, run_eval
from m3_agent.evals.tasks import load_tasks
from m3_agent.sandbox import SandboxConfig

SDIST = Path(__file__).parent / "data" / "iniconfig-1.1.1.tar.gz"
MODULE = "src/iniconfig/__init__.py"
TESTS = "testing/test_iniconfig.py"
P2P = [f"{TESTS}::{name}" for name in (
    "test_tokenize[value]", "test_tokenize[use of colon for name-values]", "test_tokenize[equality gets precedence]",
    "test_tokenize[value with continuation]", "test_parse_empty", "test_ParseError", "test_iniconfig_from_file",
    "test_iniconfig_duplicate_key_fails", "test_iniconfig_lineof", "test_section_get", "test_config_iter",
    "test_example_pypirc", "test_iscommentline_true[;qwe]",
)]
TEST_CMD = "PYTHONPATH=src python3 -m pytest -rA -p no:cacheprovider -o junit_family=xunit1 --rootdir=. {test_files}"

# instance -> (bug: edits turning the released code back into the buggy one, the issue, FAIL_TO_PASS)
BUGS = {
    "pytest-dev__iniconfig-1": (
        [(MODULE, "name, value = line.split('=', 1)", "name, value = line.split('=')"),
         (TESTS, "    'assignment in value': (\n        'value = x = 3',\n        [(0, None, 'value', 'x = 3')]\n    ),\n", "")],
        "A value containing '=' cannot be parsed: `value = x = 3` raises ParseError 'unexpected line'.",
        [f"{TESTS}::test_tokenize[assignment in value]"],
    ),
    "pytest-dev__iniconfig-2": (
        [(MODULE, "\n    def __contains__(self, arg):\n        return arg in self.sections\n", ""),
         (TESTS, "\n\ndef test_config_contains():\n", "\n\ndef _removed_config_contains():\n")],
        "`'section1' in IniConfig(...)` is False even when the section exists.",
        [f"{TESTS}::test_config_contains"],
    ),
}

GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "safe.directory=*", "-C", str(cwd), *args], check=True, capture_output=True,
                          text=True, env=GIT_ENV).stdout


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} must occur once in {path}"
    path.write_text(text.replace(old, new))


@pytest.fixture(scope="module")
def realworld(tmp_path_factory):
    """(tasks.jsonl, repos dir): one bare mirror holding the release and a bug commit per task."""
    root = tmp_path_factory.mktemp("realworld")
    with tarfile.open(SDIST) as tar:
        # The "data" filter also drops the archive's owner, which git would call dubious when run as root.
        tar.extractall(root, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(root)
    work = root / "iniconfig-1.1.1"
    _git(work, "init", "-q", "-b", "main")
    _git(work, "add", "-A", "-f")
    _git(work, "commit", "-qm", "iniconfig 1.1.1 (sdist)")
    release = _git(work, "rev-parse", "HEAD").strip()
    rows = []
    for iid, (edits, issue, f2p) in BUGS.items():
        _git(work, "checkout", "-q", "-b", iid, release)
        for rel, old, new in edits:
            _edit(work / rel, old, new)
        _git(work, "commit", "-qam", f"{iid}: the bug before its fix")
        base = _git(work, "rev-parse", "HEAD").strip()
        rows.append({
            "instance_id": iid, "repo": "pytest-dev/iniconfig", "base_commit": base, "problem_statement": issue,
            "patch": _git(work, "diff", base, release, "--", "src"),
            "test_patch": _git(work, "diff", base, release, "--", "testing"),
            "FAIL_TO_PASS": json.dumps(f2p), "PASS_TO_PASS": json.dumps(P2P), "version": "1.1",
            "test_cmd": TEST_CMD,
        })
    repos = root / "repos"
    subprocess.run(["git", "clone", "-q", "--mirror", str(work), str(repos / "pytest-dev__iniconfig")], check=True)
    tasks_file = root / "tasks.jsonl"
    tasks_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tasks_file, repos


@pytest.mark.docker
def test_gold_resolves_and_empty_does_not_on_a_real_project(realworld, tmp_path, test_label):
    tasks_file, repos = realworld
    tasks = load_tasks(tasks_file)
    assert all(t.patch.startswith("diff --git a/src/") and t.test_patch.startswith("diff --git a/testing/") for t in tasks)
    # iniconfig 1.1.1's tests use `py.test.mark`, gone from the pytest a derived environment would take today
    # (it declares no test dependency to pin one): they run on the image's own pytest, from 2022.
    config = EvalConfig(output_dir=tmp_path / "gold", repos=repos,
                        sandbox=SandboxConfig(labels=test_label, project_env="off"))
    gold = run_eval(tasks, load_predictions("gold", tasks), config, RunOptions(workers=2))
    assert [r.outcome for r in gold] == ["resolved", "resolved"], [r.report.test_output[-800:] for r in gold]

    config = config.model_copy(update={"output_dir": tmp_path / "empty"})
    empty = run_eval(tasks, load_predictions("empty", tasks), config, RunOptions(workers=2))
    for task, r in zip(tasks, empty):
        assert not r.report.resolved
        assert r.report.tests_status.FAIL_TO_PASS.failure == task.FAIL_TO_PASS
        assert r.report.tests_status.PASS_TO_PASS.success == P2P
