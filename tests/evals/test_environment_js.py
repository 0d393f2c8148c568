"""`eval run` on a JavaScript custom task: the instance gets Node and its packages (the repository's lock
file, fetched on the host, installed offline), and its FAIL_TO_PASS / PASS_TO_PASS ids (`file::describe >
test`) are graded from the runner its test script names."""

from __future__ import annotations

import uuid

import pytest

from m3_agent.evals.config import EvalConfig
from m3_agent.evals.predictions import Prediction
from m3_agent.evals.runner import run_eval
from m3_agent.evals.tasks import Task
from m3_agent.sandbox.env.catalogue import prune_environments
from tests.evals.test_environment import git
from tests.sandbox.env.test_node_environment import CALC_TEST, javascript_project, locked

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]  # builds on one host wait for each other


@pytest.fixture
def task_and_gold(tmp_path, sandbox_image):
    name = f"jsdep{uuid.uuid4().hex[:8]}"
    repo = tmp_path / name
    repo.mkdir()
    files = javascript_project(name)
    del files["test/calc.test.js"]  # the test comes with the task's test patch
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git(repo, "init", "-q")
    locked(repo)
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "src" / "calc.js").write_text("function add(a, b) {\n  return a + b;\n}\nmodule.exports = { add };\n")
    gold = git(repo, "diff")
    git(repo, "checkout", "-q", "--", ".")
    (repo / "test").mkdir()
    (repo / "test" / "calc.test.js").write_text(CALC_TEST)
    git(repo, "add", "-N", "test")
    test_patch = git(repo, "diff")
    task = Task(instance_id=f"acme__{name}-1", repo=f"acme/{name}", base_commit=base, patch=gold,
                test_patch=test_patch, FAIL_TO_PASS=["test/calc.test.js::add > adds two numbers"],
                PASS_TO_PASS=["test/calc.test.js::add > adds zero"], repo_source=str(repo))
    yield task, gold
    prune_environments(keep=0, source=f"acme__{name}")


def test_a_javascript_custom_task_is_graded_by_its_own_runner(task_and_gold, tmp_path):
    task, gold = task_and_gold
    config = EvalConfig(output_dir=tmp_path / "out")
    [result] = run_eval([task], {task.instance_id: Prediction(instance_id=task.instance_id, model_patch=gold)},
                        config)
    assert result.error is None and result.report.environment_error is None, result.report.test_output[-800:]
    assert result.report.resolved
    assert result.report.tests_status.FAIL_TO_PASS.success == task.FAIL_TO_PASS
    assert result.report.tests_status.PASS_TO_PASS.success == task.PASS_TO_PASS

    # The empty patch in the same environment: the test fails on its merits, not for want of jest.
    [again] = run_eval([task], {task.instance_id: Prediction(instance_id=task.instance_id, model_patch="")},
                       config.model_copy(update={"output_dir": tmp_path / "out2"}))
    assert not again.report.resolved and again.report.environment_error is None
    assert again.report.tests_status.FAIL_TO_PASS.failure == task.FAIL_TO_PASS
    assert again.report.tests_status.PASS_TO_PASS.success == task.PASS_TO_PASS
