"""Real SWE-bench tasks graded the harness's way (swebench as a library) in offline-built instance images.

The tasks (tests/evals/data/swebench/tasks.jsonl) come from real upstream fix commits applied to
release sdists; benchmarks/swebench_offline_tasks.py regenerates them, FAIL_TO_PASS / PASS_TO_PASS
included, by running them. The images are built once per recipe (cached by Docker under a content hash).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from m3_agent.errors import SandboxUnavailable, UsageError
from m3_agent.evals import harness
from m3_agent.evals.config import EvalConfig
from m3_agent.evals.grading import InstanceReport, grade
from m3_agent.evals.instance import InstanceResult, grader_for
from m3_agent.evals.predictions import load_predictions
from m3_agent.evals.report import build_report
from m3_agent.evals.runner import RunOptions, run_eval
from m3_agent.evals.tasks import Task, load_tasks
from m3_agent.sandbox import Sandbox, SandboxConfig

TASKS = Path(__file__).parent / "data" / "swebench" / "tasks.jsonl"
IDS = ["sympy__sympy-25431", "sphinx-doc__sphinx-10781"]


def m3(*args: str, cwd=None, env=None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "m3_agent.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def patch_standin_script(tasks: list[Task]) -> dict[str, Any]:
    """A stand-in script replaying each task's gold patch through the tools: a `file_edit` per hunk
    (a `file_write` for a new file), then `submit`. Routed by the first line of the task's issue.

    For tests of `eval run` on any task without a model; like `evals.tasks.builtin_standin_script`.
    """
    conversations = []
    for task in tasks:
        calls = [{"name": name, "arguments": args} for name, args in _patch_edits(task.patch)]
        first_line = next(line for line in task.problem_statement.splitlines() if line.strip())
        conversations.append({"match": first_line.strip(), "turns": [
            {"reasoning": "Apply the fix.", "tool_calls": calls},
            {"content": "The fix is in.", "tool_calls": [{"name": "submit", "arguments": {"summary": "gold patch"}}]},
        ]})
    return {"on_exhausted": "final", "conversations": conversations}


def _patch_edits(patch: str) -> list[tuple[str, dict[str, str]]]:
    """(tool, arguments) per hunk of a unified diff: file_edit(old_str -> new_str), or file_write of a new file."""
    edits: list[tuple[str, dict[str, str]]] = []
    for chunk in patch.split("\ndiff --git ")[0:]:
        header = re.search(r"^--- (\S+)\n\+\+\+ b/(\S+)$", chunk, re.M)
        if header is None:
            continue
        path, new_file = header.group(2), header.group(1) == "/dev/null"
        for hunk in re.split(r"^@@[^\n]*@@[^\n]*\n", chunk[header.end() + 1:], flags=re.M)[1:]:
            old, new = [], []
            for line in hunk.splitlines(keepends=True):
                kind, text = line[:1], line[1:]
                if kind in (" ", "-"):
                    old.append(text)
                if kind in (" ", "+"):
                    new.append(text)
            if new_file:
                edits.append(("file_write", {"path": path, "content": "".join(new)}))
            else:
                edits.append(("file_edit", {"path": path, "old_str": "".join(old), "new_str": "".join(new)}))
    return edits


# --- without Docker ----------------------------------------------------------------------------------

def test_the_offline_tasks_are_real_instances_graded_by_different_harness_parsers():
    tasks = {t.instance_id: t for t in load_tasks(TASKS)}
    assert sorted(tasks) == sorted(IDS)
    assert tasks["sympy__sympy-25431"].log_parser == "parse_log_sympy"
    assert tasks["sphinx-doc__sphinx-10781"].log_parser == "parse_log_sphinx"
    for t in tasks.values():
        assert isinstance(grader_for(t), harness.HarnessGrader)
        assert t.FAIL_TO_PASS and t.PASS_TO_PASS and not set(t.FAIL_TO_PASS) & set(t.PASS_TO_PASS)
        assert t.patch.startswith("diff --git") and t.test_patch.startswith("diff --git")
        assert "tests/" not in t.patch and "tests/" in t.test_patch
        recipe = t.model_extra["testbed"]
        assert "==" in recipe["sdist"] and recipe["upstream"]  # a pinned release and where it came from


def test_images_are_named_as_the_harness_names_them():
    assert harness.instance_image_name("django__django-11099") == \
        "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert harness.instance_image_name("django__django-11099", namespace=None, tag="v1") == \
        "sweb.eval.x86_64.django__django-11099:v1"
    official = Task(instance_id="astropy__astropy-12907", repo="astropy/astropy", base_commit="a" * 40,
                    image="swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest")
    # An official name follows the namespace and tag asked for (a mirror, a local build) ...
    assert harness.instance_image(official, "mirror.local/sb", "2025") == \
        "mirror.local/sb/sweb.eval.x86_64.astropy_1776_astropy-12907:2025"
    # ... a custom task's own image is used as it is.
    custom = official.model_copy(update={"image": "acme/widgets-env:3"})
    assert harness.instance_image(custom, "swebench", "latest") == "acme/widgets-env:3"


def test_a_custom_task_gives_its_test_command_and_parser_by_name():
    task = load_tasks(TASKS, instance_ids=["sphinx-doc__sphinx-10781"])[0]
    spec = harness.test_spec(task, "some/image:1")
    script = spec.eval_script
    assert spec.log_parser == "parse_log_sphinx" and spec.image == "some/image:1"
    # The harness's shape: the env activated, test files reset, test patch applied, output markers,
    # the test command's exit code recorded after the end marker (added by the harness's make_test_spec).
    for piece in ("source /opt/miniconda3/bin/activate", "conda activate testbed", "cd /testbed",
                  f"git checkout {task.base_commit} tests/test_domain_std.py",
                  "python -X dev -m pytest -rA --durations 25 tests/test_domain_std.py",
                  ">>>>> Start Test Output", ">>>>> End Test Output", ">>>>> Test Exit Code"):
        assert piece in script, piece
    assert script.index("Start Test Output") < script.index("pytest -rA") < script.index("End Test Output")
    with pytest.raises(UsageError, match="unknown log_parser 'parse_log_nope'"):
        harness.test_spec(task.model_copy(update={"log_parser": "parse_log_nope"}), "x")


def test_the_harness_report_decides_on_a_log(tmp_path):
    task = load_tasks(TASKS, instance_ids=["sympy__sympy-25431"])[0]
    spec = harness.test_spec(task, "img")
    lines = [f"{t} ok" for t in task.FAIL_TO_PASS + task.PASS_TO_PASS]
    log = "+ : '>>>>> Start Test Output'\n" + "\n".join(lines) + "\n+ : '>>>>> End Test Output'\n>>>>> Test Exit Code: 0\n"
    entry, statuses = harness.harness_report(task, spec, task.patch, log)
    assert entry["resolved"] is True and statuses[task.FAIL_TO_PASS[0]] == "PASSED"
    failing = log.replace(f"{task.FAIL_TO_PASS[0]} ok", f"{task.FAIL_TO_PASS[0]} F").replace("Code: 0", "Code: 1")
    entry, _ = harness.harness_report(task, spec, task.patch, failing)
    assert entry["resolved"] is False and entry["tests_status"]["FAIL_TO_PASS"]["failure"] == [task.FAIL_TO_PASS[0]]
    # Claimed passes with a failing exit code: the harness throws the log out.
    entry, _ = harness.harness_report(task, spec, task.patch, log.replace("Code: 0", "Code: 1"))
    assert entry["resolved"] is False and entry["patch_successfully_applied"] is False


def _eval_log(output: str, exit_code: int) -> str:
    """An eval script's log (set -x) around the test command's output, its exit code after the end marker."""
    return ("+ git apply -v -\nChecking patch tests/test_domain_std.py...\n+ : '>>>>> Start Test Output'\n"
            "+ python -X dev -m pytest -rA --durations 25 tests/test_domain_std.py\n" + output
            + f"+ SWEBENCH_TEST_EXIT_CODE={exit_code}\n+ : '>>>>> End Test Output'\n>>>>> Test Exit Code: {exit_code}\n")


def test_a_harness_log_whose_test_command_could_not_start_is_an_environment_error():
    task = load_tasks(TASKS, instance_ids=["sphinx-doc__sphinx-10781"])[0]
    spec = harness.test_spec(task, "img")
    no_docutils = ("ImportError while loading conftest '/testbed/tests/conftest.py'.\n"
                   "tests/conftest.py:7: in <module>\n    import docutils\n"
                   "E   ModuleNotFoundError: No module named 'docutils'\n")
    report = InstanceReport(patch_exists=True, patch_successfully_applied=True)
    harness.read_log(report, task, spec, task.patch, _eval_log(no_docutils, 4))
    assert report.environment_error == "exit 4: ModuleNotFoundError: No module named 'docutils'"
    assert report.error and not report.resolved
    result = InstanceResult(instance_id=task.instance_id, model_name_or_path="m", model_patch=task.patch, report=report)
    summary = build_report([result]).summary
    assert summary.environment_error_ids == summary.error_ids == [task.instance_id]
    assert summary.unresolved_ids == summary.patch_apply_failed_ids == []  # the harness says "not applied": no results

    # The patch's syntax error (sphinx/domains/std.py) stops conftest.py: an unresolved patch.
    syntax = no_docutils.replace("import docutils", "from sphinx.domains.std import StandardDomain").replace(
        "E   ModuleNotFoundError: No module named 'docutils'",
        'E     File "/testbed/sphinx/domains/std.py", line 760\nE   SyntaxError: invalid syntax')
    report = InstanceReport(patch_exists=True, patch_successfully_applied=True)
    harness.read_log(report, task, spec, task.patch, _eval_log(syntax, 4))
    assert report.environment_error is None and report.error is None and not report.resolved
    # Tests that ran and failed: an unresolved patch too.
    failed = "".join(f"FAILED {t} - AssertionError\n" for t in task.FAIL_TO_PASS)
    report = InstanceReport(patch_exists=True, patch_successfully_applied=True)
    harness.read_log(report, task, spec, task.patch, _eval_log(failed, 1))
    assert report.environment_error is None and report.error is None and not report.resolved
    assert report.tests_status.FAIL_TO_PASS.failure == task.FAIL_TO_PASS


def test_a_dataset_folder_in_the_hubs_layout_loads_by_split(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [json.loads(line) for line in TASKS.read_text().splitlines()]
    for row in rows:  # the hub stores the test lists as JSON strings
        row["FAIL_TO_PASS"], row["PASS_TO_PASS"] = json.dumps(row["FAIL_TO_PASS"]), json.dumps(row["PASS_TO_PASS"])
        row["testbed"] = json.dumps(row["testbed"])
    folder = tmp_path / "SWE-bench_Verified"
    (folder / "data").mkdir(parents=True)
    datasets.Dataset.from_list(rows).to_parquet(str(folder / "data" / "test-00000-of-00001.parquet"))
    datasets.Dataset.from_list(rows[:1]).to_parquet(str(folder / "data" / "dev-00000-of-00001.parquet"))

    tasks = load_tasks(str(folder), split="test")
    assert [t.instance_id for t in tasks] == [r["instance_id"] for r in rows]
    assert tasks[0].FAIL_TO_PASS == json.loads(rows[0]["FAIL_TO_PASS"])
    # nested records as JSON strings
    assert harness.testbed_recipe(tasks[0]).sdist == json.loads(rows[0]["testbed"])["sdist"]
    bad = tasks[0].model_copy(update={"testbed": '{"sdist": "x"}'})
    with pytest.raises(UsageError, match=r"bad `testbed` recipe \(upstream\): Field required"):
        harness.testbed_recipe(bad)
    assert [t.instance_id for t in load_tasks(str(folder), split="dev")] == [rows[0]["instance_id"]]
    assert len(load_tasks(str(folder / "data" / "test-00000-of-00001.parquet"))) == 2
    with pytest.raises(UsageError, match=r"cannot load .*split 'nope'"):
        load_tasks(str(folder), split="nope")


def test_a_hub_dataset_that_cannot_be_reached_is_a_one_line_error(tmp_path):
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}
    r = m3("eval", "grade", "--tasks", "princeton-nlp/SWE-bench_Verified", "--split", "test", "-p", "gold",
           cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot load princeton-nlp/SWE-bench_Verified (split 'test')" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_missing_instance_image_says_what_to_pull(docker_ready):
    with pytest.raises(SandboxUnavailable, match=r"instance image swebench/sweb\.eval\.x86_64\.nope_1776_nope-1:latest is not "
                                        r"here .*docker pull"):
        harness.ensure_image(harness.instance_image_name("nope__nope-1"))


# --- in the offline instance images ------------------------------------------------------------------

@pytest.fixture(scope="module")
def offline(sandbox_image):
    """The offline instance images of the tasks (built once per recipe) and the tasks."""
    tasks = load_tasks(TASKS)
    return {t.instance_id: (t, harness.offline_image(t)) for t in tasks}


@pytest.fixture(scope="module")
def graded(offline, tmp_path_factory):
    """gold and empty predictions of every offline task, graded by the runner through the harness."""
    tasks = [t for t, _ in offline.values()]
    out = {}
    for kind in ("gold", "empty"):
        config = EvalConfig(output_dir=tmp_path_factory.mktemp(kind), image_namespace=harness.OFFLINE_NAMESPACE)
        results = run_eval(tasks, load_predictions(kind, tasks), config, RunOptions(workers=2))
        out[kind] = ({r.instance_id: r for r in results}, config.output_dir)
    return out


@pytest.mark.docker
def test_gold_resolves_every_task_and_empty_none_through_the_harness_parsers(graded):
    gold, out = graded["gold"]
    empty, _ = graded["empty"]
    assert sorted(gold) == sorted(IDS) == sorted(empty)
    for iid in IDS:
        g, e = gold[iid], empty[iid]
        assert g.error is None and g.report.error is None, g.report.test_output[-2000:]
        assert g.report.resolved and not g.report.tests_status.FAIL_TO_PASS.failure
        assert not g.report.tests_status.PASS_TO_PASS.failure
        assert e.outcome == "empty_patch" and not e.report.resolved
        assert e.report.tests_status.FAIL_TO_PASS.failure  # the tests really fail at base
        assert ">>>>> Start Test Output" in g.report.test_output
    # The files the official harness and sb-cli read: predictions.jsonl and a report.json per instance.
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert {p["instance_id"] for p in preds} == set(IDS)
    assert all(set(p) == {"instance_id", "model_name_or_path", "model_patch"} for p in preds)
    report = json.loads((out / "instances" / IDS[0] / "report.json").read_text())
    assert report[IDS[0]]["resolved"] is True and set(report[IDS[0]]["tests_status"]) >= {"FAIL_TO_PASS", "PASS_TO_PASS"}


@pytest.mark.docker
def test_junit_grading_gives_the_harness_verdicts_on_the_pytest_task(offline, graded):
    """Our JUnit grading (the built-in suite's) and the harness's parser agree test by test on a pytest repository."""
    task, image = offline["sphinx-doc__sphinx-10781"]
    junit_task = task.model_copy(update={"log_parser": None, "test_cmd": None, "eval_script": None})
    tree = harness.testbed_tree(image)
    config = harness.sandbox_for(SandboxConfig(), image)
    for kind, patch in (("gold", task.patch), ("empty", "")):
        ours = grade(junit_task, patch, repo=tree, sandbox=config)
        theirs = graded[kind][0][task.instance_id].report
        assert ours.error is None, ours.test_output[-2000:]
        assert ours.resolved == theirs.resolved == (kind == "gold")
        assert ours.tests_status == theirs.tests_status, kind


@pytest.mark.docker
def test_a_test_command_missing_from_the_instance_image_is_an_environment_error(offline):
    task, image = offline["sphinx-doc__sphinx-10781"]
    missing = task.model_copy(update={"test_cmd": "m3-agent-absent-runner -rA"})
    report = harness.grade_with_harness(missing, task.patch, image=image, sandbox=SandboxConfig())
    # The exit code is the test command's (recorded after the end marker), not the eval script's.
    assert report.environment_error.startswith("exit 127: "), report.test_output[-2000:]
    assert report.environment_error.endswith(": m3-agent-absent-runner: command not found")
    assert report.error and not report.resolved


@pytest.mark.docker
def test_the_sandbox_in_an_instance_image_keeps_its_hardening(offline):
    task, image = offline["sympy__sympy-25431"]
    with Sandbox(harness.sandbox_for(SandboxConfig(), image), repo=harness.testbed_tree(image)) as sb:
        assert sb.base_commit == task.base_commit  # /testbed at the instance's base commit
        r = sb.exec("pwd -P; readlink /workspace; id -u; command -v python; python -c 'import sympy; print(sympy.__file__)'; "
                    "grep CapEff /proc/self/status")
        lines = r.stdout.splitlines()
        assert lines[:5] == ["/testbed", "/testbed", "1000", "/opt/miniconda3/envs/testbed/bin/python",
                             "/testbed/sympy/__init__.py"], r.stdout + r.stderr
        assert lines[5].split()[1] == "0000000000000000"  # no capability at all
        assert sb.exec("ls /sys/class/net").stdout.split() == ["lo"]  # network none: loopback only
        sb.write_file("sympy/NOTE.txt", "x\n")  # the tools' /workspace paths land in /testbed
        assert "sympy/NOTE.txt" in sb.diff()


@pytest.mark.docker
def test_eval_run_resolves_the_tasks_with_the_standin_replaying_the_gold_patch(offline, tmp_path):
    from m3_agent.standin.server import StandinServer

    tasks = [t for t, _ in offline.values()]
    out = tmp_path / "run"
    with StandinServer(patch_standin_script(tasks)) as srv:
        r = m3("eval", "run", "--tasks", str(TASKS), "--image-namespace", harness.OFFLINE_NAMESPACE,
               "--base-url", srv.base_url, "--workers", "2", "--output", str(out), "--json", "-q", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert srv.requests
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(summary["resolved_ids"]) == sorted(IDS), r.stderr
    preds = {p["instance_id"]: p for p in map(json.loads, (out / "predictions.jsonl").read_text().splitlines())}
    for t in tasks:  # the agent's diff is the gold patch, made through file_edit in the instance image
        assert preds[t.instance_id]["model_patch"].startswith("diff --git")
        changed = {line[6:] for line in preds[t.instance_id]["model_patch"].splitlines() if line.startswith("+++ b/")}
        assert changed == {line[6:] for line in t.patch.splitlines() if line.startswith("+++ b/")}


def test_a_hub_dataset_in_the_schema_before_swebench_5_is_refused_by_name(monkeypatch):
    """princeton-nlp/* rows carry no eval_script / log_parser: the error names the v5 counterpart."""
    from types import SimpleNamespace

    from m3_agent.evals import datasets as ds

    old_row = {"instance_id": "django__django-11099", "repo": "django/django", "base_commit": "a" * 40,
               "version": "3.0", "FAIL_TO_PASS": "[]", "PASS_TO_PASS": "[]"}
    loaded = []
    hub = SimpleNamespace(load_dataset=lambda name, split: loaded.append((name, split)) or [old_row])
    monkeypatch.setattr(ds, "_datasets", lambda: hub)  # the hub is not reachable here: its answer is given
    with pytest.raises(UsageError, match="princeton-nlp/SWE-bench_Verified gives no eval_script.*SWE-bench/SWE-bench_Verified"):
        load_tasks("princeton-nlp/SWE-bench_Verified", split="test")
    assert loaded == [("princeton-nlp/SWE-bench_Verified", "test")]
    v5 = dict(old_row, eval_script="#!/bin/bash\n", log_parser="parse_log_django", image="x")
    hub.load_dataset = lambda name, split: [v5]
    assert load_tasks("SWE-bench/SWE-bench_Verified")[0].log_parser == "parse_log_django"


@pytest.mark.docker
def test_the_exec_server_finds_a_python_where_the_image_keeps_one(offline):
    """No /usr/bin/python3 (an image whose only interpreter is conda's): the server starts on that one."""
    import io

    from m3_agent.sandbox.engine import docker_client

    _, image = offline["sympy__sympy-25431"]
    tag = "m3-agent-test/conda-python-only:1"
    dockerfile = (f"FROM {image}\nUSER root\nRUN cp /usr/bin/python3.11 /opt/miniconda3/bin/python3 "
                  "&& rm /usr/bin/python3\n")
    client = docker_client()
    try:
        for _ in client.api.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True, network_mode="none"):
            pass
        with Sandbox(harness.sandbox_for(SandboxConfig(), tag), repo=harness.testbed_tree(image)) as sb:
            r = sb.exec("test -e /usr/bin/python3 || echo gone; command -v python3; python3 -c 'print(6 * 7)'")
            # the server answered, on conda's interpreter; the testbed env's python3 is a copy (venv --copies),
            # so it, not conda's base one, is first on the PATH and still runs
            assert r.stdout.split() == ["gone", "/opt/miniconda3/envs/testbed/bin/python3", "42"], r.stdout + r.stderr
            assert sb.exec("git rev-parse HEAD").stdout.strip() == offline["sympy__sympy-25431"][0].base_commit
    finally:
        client.images.remove(tag, force=True)
        client.close()


@pytest.mark.docker
def test_eval_images_builds_or_reuses_the_offline_images_and_names_them(offline, tmp_path):
    r = m3("eval", "images", "--tasks", str(TASKS), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [offline[t.instance_id][1] for t in load_tasks(TASKS)]
    r = m3("eval", "images", "--tasks", "builtin", "-i", "m3-agent__roman-1", cwd=tmp_path)
    assert r.returncode == 2 and "m3-agent__roman-1: no `testbed` recipe" in r.stderr, r.stderr
