"""`eval run` / `eval grade` on a custom task whose repository depends on a real package: the
instance runs in the environment its files declare at the task's commit, built once."""

from __future__ import annotations

import subprocess
import uuid

import pytest

from m3_agent.evals.config import EvalConfig
from m3_agent.evals.predictions import Prediction
from m3_agent.evals.runner import run_eval
from m3_agent.evals.tasks import Task
from m3_agent.sandbox.env.catalogue import list_environments, prune_environments

pytestmark = pytest.mark.docker

BUGGY = "import iniconfig\n\n\ndef section_names(text):\n    return []\n"
FIXED = ("import iniconfig\n\n\ndef section_names(text):\n"
         "    return list(iniconfig.IniConfig('x.ini', data=text).sections)\n")
TEST = ("from sections import section_names\n\n\n"
        "def test_sections():\n    assert section_names('[a]\\nk = 1\\n[b]\\n') == ['a', 'b']\n")


def git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout


@pytest.fixture
def task_and_gold(tmp_path):
    name = f"inidep{uuid.uuid4().hex[:8]}"  # its own environment: the build below is a cold one
    repo = tmp_path / name
    repo.mkdir()
    (repo / "pyproject.toml").write_text(f"[build-system]\nrequires = ['setuptools>=64']\n"
                                         f"build-backend = 'setuptools.build_meta'\n\n[project]\nname = '{name}'\n"
                                         "version = '1.0'\ndependencies = ['iniconfig>=2']\n\n"
                                         "[tool.setuptools]\npy-modules = ['sections']\n")
    (repo / "sections.py").write_text(BUGGY)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "sections.py").write_text(FIXED)
    gold = git(repo, "diff")
    git(repo, "checkout", "-q", "--", ".")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_sections.py").write_text(TEST)
    git(repo, "add", "-N", "tests")
    test_patch = git(repo, "diff")
    task = Task(instance_id=f"acme__{name}-1", repo=f"acme/{name}", base_commit=base, patch=gold,
                test_patch=test_patch, FAIL_TO_PASS=["tests/test_sections.py::test_sections"], repo_source=str(repo))
    yield task, gold
    prune_environments(keep=0, source=f"acme__{name}")


def test_a_custom_task_is_graded_in_the_environment_its_repository_declares(task_and_gold, tmp_path, sandbox_image):
    task, gold = task_and_gold
    config = EvalConfig(output_dir=tmp_path / "out")
    preds = {task.instance_id: Prediction(instance_id=task.instance_id, model_patch=gold)}
    [result] = run_eval([task], preds, config)
    assert result.error is None and result.report.environment_error is None, result.report.test_output[-800:]
    assert result.report.resolved and result.report.tests_status.FAIL_TO_PASS.success == [task.FAIL_TO_PASS[0]]
    assert [e.source for e in list_environments()].count(f"acme__{task.repo.split('/')[1]}") == 1

    # The same environment grades the empty patch too (no second build): the test fails on its merits.
    empty = {task.instance_id: Prediction(instance_id=task.instance_id, model_patch="")}
    [again] = run_eval([task], empty, config.model_copy(update={"output_dir": tmp_path / "out2"}))
    assert not again.report.resolved and again.report.environment_error is None
    assert again.report.tests_status.FAIL_TO_PASS.failure == [task.FAIL_TO_PASS[0]]
    assert [e.source for e in list_environments()].count(f"acme__{task.repo.split('/')[1]}") == 1
