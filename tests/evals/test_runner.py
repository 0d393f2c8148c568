"""The runner: resume, durable results, per-instance timeouts, SIGKILL survival, one run per folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from m3_agent.errors import UsageError
from m3_agent.evals.config import EvalConfig
from m3_agent.evals.grading import InstanceReport
from m3_agent.evals.instance import InstanceResult
from m3_agent.evals.predictions import Prediction, load_predictions
from m3_agent.evals.results import RESULTS_FILE, exclusive, load_results, save_result
from m3_agent.evals.runner import RunOptions, run_eval
from m3_agent.evals.tasks import Task, builtin_task
from m3_agent.sandbox import SandboxConfig
from m3_agent.sandbox.cleanup import OWNER_FILE, owner_alive
from tests.conftest import wait_for


def _result(instance_id: str, **kw) -> InstanceResult:
    return InstanceResult(instance_id=instance_id, model_name_or_path="m", model_patch="p", report=InstanceReport(), **kw)


def test_a_line_cut_short_by_a_crash_is_skipped_and_closed_off(tmp_path):
    save_result(tmp_path, _result("a-1"))
    with open(tmp_path / RESULTS_FILE, "a") as f:
        f.write('{"instance_id": "b-1", "model_na')  # SIGKILL in the middle of a write
    assert list(load_results(tmp_path)) == ["a-1"]
    save_result(tmp_path, _result("c-1"))
    assert list(load_results(tmp_path)) == ["a-1", "c-1"]
    lines = (tmp_path / RESULTS_FILE).read_text().splitlines()
    assert json.loads(lines[-1])["instance_id"] == "c-1"
    swe = json.loads((tmp_path / "instances" / "c-1" / "report.json").read_text())
    assert set(swe["c-1"]) == {"patch_is_None", "patch_exists", "patch_successfully_applied", "resolved", "tests_status"}
    preds = [json.loads(x) for x in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert preds[-1] == {"instance_id": "c-1", "model_name_or_path": "m", "model_patch": "p"}


def test_the_last_result_of_an_instance_wins(tmp_path):
    save_result(tmp_path, _result("a-1", error="boom"))
    save_result(tmp_path, _result("a-1"))
    assert load_results(tmp_path)["a-1"].error is None


def test_the_agent_config_is_typed_and_reaches_workers_with_its_key(tmp_path):
    from pydantic import ValidationError

    from m3_agent.agent.config import AgentConfig
    from m3_agent.evals.config import worker_config_json

    config = EvalConfig(output_dir=tmp_path, agent={"model": {"base_url": "http://127.0.0.1:9/v1", "api_key": "sk-k3y"},
                                                    "limits": {"max_turns": 5}})
    assert isinstance(config.agent, AgentConfig) and config.agent.limits.max_turns == 5
    worker = EvalConfig.model_validate_json(worker_config_json(config))  # what the worker process rebuilds
    assert worker.agent == config.agent and worker.agent.model.api_key.get_secret_value() == "sk-k3y"
    assert "sk-k3y" not in config.model_dump_json()  # any other dump (logs, files) masks it
    with pytest.raises(ValidationError, match=r"agent\.limits\.max_turns"):
        EvalConfig(output_dir=tmp_path, agent={"limits": {"max_turns": 0}})
    with pytest.raises(ValidationError, match="max_turns"):
        EvalConfig(output_dir=tmp_path, agent={"max_turns": 5})  # the flat layout is refused
    assert EvalConfig(output_dir=tmp_path).agent is None  # grading runs no agent


def test_one_run_per_output_folder(tmp_path):
    with exclusive(tmp_path):
        with pytest.raises(UsageError, match="another eval is running"):
            run_eval([], None, EvalConfig(output_dir=tmp_path))


@pytest.mark.docker
def test_a_rerun_skips_finished_instances_and_can_retry_errors(tmp_path, test_label):
    roman, chunks = builtin_task("roman"), builtin_task("chunks")
    config = EvalConfig(output_dir=tmp_path, sandbox=SandboxConfig(labels=test_label))
    preds = load_predictions("gold", [roman, chunks])
    run_eval([roman], preds, config)
    save_result(tmp_path, _result(chunks.instance_id, error="sandbox vanished"))
    events: list[tuple[str, str]] = []

    def record(kind, info):
        events.append((kind, info.get("instance_id") or info["result"].instance_id))

    results = run_eval([roman, chunks], preds, config, on_event=record)
    assert [k for k, _ in events] == ["skip", "skip"]
    assert results[1].outcome == "error"
    events.clear()
    results = run_eval([roman, chunks], preds, config, RunOptions(retry_errors=True), on_event=record)
    assert events == [("skip", roman.instance_id), ("start", chunks.instance_id), ("finish", chunks.instance_id)]
    assert [r.outcome for r in results] == ["resolved", "resolved"]


def _hanging_task(git_repo, instance_id: str = "slow-1") -> Task:
    repo = git_repo({"tests/test_slow.py": "import time\n\ndef test_hang():\n    time.sleep(300)\n"}, name="slow")
    base = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return Task(instance_id=instance_id, repo=str(repo), base_commit=base, FAIL_TO_PASS=["tests/test_slow.py::test_hang"])


@pytest.mark.docker
def test_an_instance_timeout_stops_the_worker_its_container_and_its_checkout(tmp_path, git_repo, test_label,
                                                                            sandbox_containers):
    task = _hanging_task(git_repo, f"slow-{uuid.uuid4().hex[:12]}")
    scratch = Path(tempfile.gettempdir())
    config = EvalConfig(output_dir=tmp_path, sandbox=SandboxConfig(labels=test_label), test_timeout=120,
                        instance_timeout=4)
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:  # the worker's checkout, while it runs
        while not done.wait(0.1):
            seen.update(p.name for p in scratch.glob(f"m3-eval-{task.instance_id}-*"))

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    try:
        [result] = run_eval([task], {task.instance_id: Prediction(instance_id=task.instance_id, model_patch="")}, config)
    finally:
        done.set()
        watcher.join()
    assert result.outcome == "error" and result.error == "instance timed out after 4s"
    assert time.monotonic() - start < 30
    assert sandbox_containers(**test_label) == []
    assert len(seen) == 1  # it had one, named after the instance ...
    assert list(scratch.glob(f"m3-eval-{task.instance_id}-*")) == []  # ... which the stopped worker removed


DRIVER = """
import json, sys
from pathlib import Path
from m3_agent.evals.config import EvalConfig
from m3_agent.evals.predictions import Prediction
from m3_agent.evals.runner import run_eval
from m3_agent.evals.tasks import Task
from m3_agent.sandbox import SandboxConfig
args = json.loads(sys.argv[1])
tasks = [Task.model_validate(t) for t in args["tasks"]]
preds = {t.instance_id: Prediction(instance_id=t.instance_id, model_patch=t.patch) for t in tasks}
run_eval(tasks, preds, EvalConfig(output_dir=Path(args["out"]), sandbox=SandboxConfig(labels=args["labels"]),
                                  test_timeout=120))
"""


@pytest.mark.docker
def test_a_sigkilled_run_loses_nothing_finished_and_the_next_start_cleans_up(tmp_path, git_repo, test_label,
                                                                            sandbox_containers):
    slow = _hanging_task(git_repo, f"slow-{uuid.uuid4().hex[:12]}")
    tasks = [builtin_task("roman"), builtin_task("chunks"), slow]
    out = tmp_path / "out"
    args = json.dumps({"tasks": [t.model_dump() for t in tasks], "out": str(out), "labels": test_label})
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, args], start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # two finished, the hanging one running in its container
            if len(load_results(out)) == 2 and sandbox_containers(**test_label):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the run did not reach the hanging instance")
        running = [c.id for c in sandbox_containers(**test_label)]
        finished = (out / RESULTS_FILE).read_text()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    [scratch] = Path(tempfile.gettempdir()).glob(f"m3-eval-{slow.instance_id}-*")  # the killed worker's checkout
    # The driver is reaped; its worker may still be exiting a moment after the SIGKILL. The next start
    # comes after the killed run is gone, as a user's would.
    owner = json.loads((scratch / OWNER_FILE).read_text())
    wait_for(lambda: not owner_alive(owner), 30, "the SIGKILLed worker to die")

    config = EvalConfig(output_dir=out, sandbox=SandboxConfig(labels=test_label), test_timeout=2)
    started: list[str] = []
    results = run_eval(tasks, {t.instance_id: Prediction(instance_id=t.instance_id, model_patch=t.patch) for t in tasks},
                       config, on_event=lambda kind, info: kind == "start" and started.append(info["instance_id"]))
    assert started == [slow.instance_id]
    assert not scratch.exists()  # pruned at the start, as its container was
    assert (out / RESULTS_FILE).read_text().startswith(finished)  # nothing finished was lost or rewritten
    assert [r.outcome for r in results] == ["resolved", "resolved", "empty_patch"]
    assert results[2].report.tests_timed_out
    assert not {c.id for c in sandbox_containers(**test_label)} & set(running)


@pytest.mark.docker
def test_a_task_environment_is_built_and_graded_in(tmp_path, git_repo, test_label):
    from m3_agent.evals.instance import evaluate_instance
    from m3_agent.evals.tasks import TaskEnvironment

    repo = git_repo({"tests/test_env.py": "def test_baked():\n    assert open('/opt/m3-env/marker').read() == 'baked\\n'\n"})
    base = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    task = Task(instance_id="env-2", repo=str(repo), base_commit=base, FAIL_TO_PASS=["tests/test_env.py::test_baked"],
                environment=TaskEnvironment(setup=["mkdir -p /opt/m3-env && echo baked > /opt/m3-env/marker"]))
    patch = "diff --git a/n.txt b/n.txt\nnew file mode 100644\n--- /dev/null\n+++ b/n.txt\n@@ -0,0 +1 @@\n+n\n"
    config = EvalConfig(output_dir=tmp_path, sandbox=SandboxConfig(labels=test_label))
    result = evaluate_instance(task, Prediction(instance_id="env-2", model_patch=patch), config)
    assert result.outcome == "resolved", result.report.test_output[-500:] or result.error
    plain = evaluate_instance(task.model_copy(update={"environment": None}),
                              Prediction(instance_id="env-2", model_patch=patch), config)
    assert plain.report.tests_status.FAIL_TO_PASS.failure == task.FAIL_TO_PASS  # the marker exists only in that image

