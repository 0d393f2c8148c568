"""Grading the SWE-bench harness's way, through its own code (the `swebench` package, optional extra).

    report = grade_with_harness(task, patch, image=instance_image(task, "swebench", "latest"), sandbox=...)
    workspace = HarnessGrader().prepare(task, eval_config, scratch)   # as an eval run does (evals.instance):
    report = HarnessGrader().grade(task, patch, workspace)            # the `Grader` of harness tasks
    image = offline_image(task)   # no registry: the instance image built here from the task's `testbed` recipe

What comes from the harness (swebench >= 5): `make_test_spec` turns the instance into a TestSpec
(its eval script, with the test command's exit code recorded), `PARSER_REGISTRY` names the log
parsers, `get_eval_report` reads the test log and decides `resolved`, and `ImageSpec` names the
instance images. What is ours: the sandbox the script runs in (the instance image, hardened, commands
as an unprivileged user), applying the model's patch, and composing an eval script for a task that
gives only per-repo facts (image, test_cmd, log_parser) instead of the dataset's `eval_script`.
"""

from __future__ import annotations

import re
import shlex
import shutil
import tarfile
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from m3_agent.agent.context.cache import cache_dir
from m3_agent.errors import SandboxUnavailable, UsageError, first_validation_error
from m3_agent.evals.config import EvalConfig
from m3_agent.evals.grading import (EVAL_DIR, InstanceReport, Outcome, TestsStatus, Workspace, apply_step,
                                    grading_report, grading_sandbox, note_environment_error, patch_files)
from m3_agent.evals.tasks import Task
from m3_agent.sandbox import Sandbox, SandboxConfig

if TYPE_CHECKING:
    from m3_agent.sandbox.env.testbed import TestbedRecipe

TESTBED = "/testbed"
ENV_BIN = "/opt/miniconda3/envs/testbed/bin"
EVAL_SCRIPT = f"{EVAL_DIR}/eval.sh"
HEREDOC = "EOF_M3_AGENT_TEST_PATCH"
NON_TEST_SUFFIXES = (".json", ".png", ".csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")
ENV_PATH = f"{ENV_BIN}:/opt/miniconda3/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
OFFLINE_NAMESPACE = "m3-agent-offline"  # offline images: named as the harness names them, in a namespace of their own
_OFFICIAL_NAME = re.compile(r"(?:.+/)?sweb\.eval\.[^./]+\.[^/:]+(?::[^/]+)?")


def swebench():
    """The harness's modules, or a one-line error saying how to install them."""
    try:
        from swebench.harness import grading, log_parsers, utils
        from swebench.image_builder import image_spec
    except ImportError:
        raise UsageError("grading SWE-bench instances needs the harness: pip install 'm3-agent[swebench]'") from None
    return grading, log_parsers, utils, image_spec


# --- images ------------------------------------------------------------------------------------------

def instance_image_name(instance_id: str, *, namespace: str | None = "swebench", tag: str = "latest") -> str:
    """The instance image's name as the harness gives it (`swebench/sweb.eval.x86_64.django_1776_...:latest`)."""
    *_, image_spec = swebench()
    return image_spec.ImageSpec(instance_id=instance_id, dockerfile="-", namespace=namespace or None, tag=tag).name


def instance_image(task: Task, namespace: str | None, tag: str) -> str:
    """The image to run the task in: its own `image` unless that is an official instance image name,
    which follows `namespace` and `tag` (a registry mirror, a locally built tag)."""
    if task.image and not _OFFICIAL_NAME.fullmatch(task.image):
        return task.image
    return instance_image_name(task.instance_id, namespace=namespace, tag=tag)


def image_here(name: str) -> bool:
    """Whether this machine's Docker engine has the image `name`."""
    from m3_agent.sandbox.engine import docker_client, image_exists

    client = docker_client()
    try:
        return image_exists(client, name)
    finally:
        client.close()


def ensure_image(name: str) -> str:
    """`name` if it is here, else pulled when a registry answers; else a one-line error saying what to do."""
    import docker.errors

    from m3_agent.sandbox.engine import docker_client

    if image_here(name):
        return name
    client = docker_client()
    try:
        client.images.pull(name)
        return name
    except (docker.errors.DockerException, OSError):
        pass
    finally:
        client.close()
    raise SandboxUnavailable(f"instance image {name} is not here and could not be pulled: `docker pull {name}` "
                             "where a registry answers, or build it here with `m3-agent eval images --tasks FILE` "
                             f"and pass --image-namespace {OFFLINE_NAMESPACE} (docs/evals.md, 'offline images')")


def offline_image(task: Task, *, namespace: str | None = OFFLINE_NAMESPACE, tag: str = "latest",
                  progress=None) -> str:
    """Build (or reuse) the task's offline instance image from its `testbed` recipe, named as the harness
    names it (`sandbox.env.testbed` builds it); returns the name."""
    from m3_agent.sandbox.env.testbed import build_testbed_image

    recipe = testbed_recipe(task)
    name = instance_image_name(task.instance_id, namespace=namespace, tag=tag)
    return build_testbed_image(name, task.instance_id, task.base_commit, recipe, sdists=testbed_sdists(),
                               progress=progress)


def testbed_recipe(task: Task) -> TestbedRecipe:
    """The task's offline recipe (its extension `testbed`); a one-line error when it has none."""
    from m3_agent.sandbox.env.testbed import TestbedRecipe

    raw = (task.model_extra or {}).get("testbed")
    if raw is None:
        raise UsageError(f"{task.instance_id}: no `testbed` recipe: an offline image cannot be built for it")
    try:  # datasets on the hub hold nested records as JSON strings
        return TestbedRecipe.model_validate_json(raw) if isinstance(raw, str) else TestbedRecipe.model_validate(raw)
    except ValueError as e:
        where, why = first_validation_error(e) if isinstance(e, ValidationError) else ("", str(e))
        raise UsageError(f"{task.instance_id}: bad `testbed` recipe{f' ({where})' if where else ''}: {why}") from None


def testbed_sdists() -> Path:
    """Where the offline images' release sdists are kept, in the evals cache."""
    return cache_dir() / "testbed" / "sdists"


def sandbox_for(base: SandboxConfig, image: str) -> SandboxConfig:
    """The hardened sandbox config, on the instance image, its /testbed the workspace, `testbed` active."""
    env = {"PATH": ENV_PATH, "CONDA_DEFAULT_ENV": "testbed", "CONDA_PREFIX": ENV_BIN.rsplit("/", 1)[0],
           **base.env}
    return base.model_copy(update={"image": image, "mount": "image", "workdir": TESTBED, "env": env})


def testbed_tree(image: str) -> Path:
    """The image's /testbed on the host, exported once per image id into the cache (copied into each
    sandbox, as a checkout is; and what the agent packs into its context)."""
    import docker.errors

    from m3_agent.sandbox.engine import docker_client

    client = docker_client()
    container, doing = None, f"inspect {image}"
    try:
        image_id = client.images.get(image).id.split(":")[-1][:16]
        dest = cache_dir() / "testbeds" / image_id
        if (dest / ".git").exists():
            return dest
        doing = f"copy {TESTBED} out of {image}"
        container = client.containers.create(image, command=["true"], network_disabled=True,
                                             labels={"m3-agent.export": "1"})
        stream, _ = container.get_archive(TESTBED)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=image_id + ".", dir=dest.parent))
        with tempfile.TemporaryFile() as buf:
            buf.writelines(stream)
            buf.seek(0)
            with tarfile.open(fileobj=buf) as tar:
                tar.extractall(tmp, filter="data")  # the archive holds one folder, `testbed`
    except docker.errors.DockerException as e:
        raise SandboxUnavailable(f"cannot {doing}: {e}") from None
    finally:
        if container is not None:
            container.remove(force=True)
        client.close()
    try:
        (tmp / "testbed").rename(dest)  # atomic: a concurrent exporter either wins or finds the finished copy
    except OSError:
        pass
    shutil.rmtree(tmp, ignore_errors=True)
    return dest


class HarnessGrader:
    """SWE-bench instances (`evals.instance.grader_for`): the instance image holds the repository at
    /testbed and its environment; the harness's eval script runs the tests and its report decides."""

    checks_out = False
    preload = ("swebench.harness",)

    def prepare(self, task: Task, config: EvalConfig, scratch: Path) -> Workspace:
        """The instance image (pulled if need be) for the agent and the grading; its /testbed, with whatever
        history the image keeps, is the tree (nothing is made under `scratch`)."""
        image = ensure_image(instance_image(task, config.image_namespace, config.image_tag))
        tree = testbed_tree(image)
        agent = None
        if config.agent is not None:
            agent = config.agent.model_copy(update={"sandbox": sandbox_for(config.agent.sandbox, image)})
        sandbox = config.sandbox.model_copy(update={"image": image})
        return Workspace(tree, config.model_copy(update={"sandbox": sandbox, "agent": agent}), str(tree))

    def grade(self, task: Task, model_patch: str | None, workspace: Workspace) -> InstanceReport:
        """`grade_with_harness` in the workspace's instance image."""
        config = workspace.config
        return grade_with_harness(task, model_patch, image=config.sandbox.image, sandbox=config.sandbox,
                                  test_timeout=config.test_timeout, tree=workspace.tree)


# --- the eval script ---------------------------------------------------------------------------------

def compose_eval_script(task: Task) -> str:
    """An eval script in the harness's shape, from the task's per-repo facts (test_cmd, log_parser).

    Between the harness's output markers runs `test_cmd` ({test_files} filled in, else the test
    files appended); around it, the test patch is applied and the test files are reset, as in the
    official scripts.
    """
    grading, *_ = swebench()
    if not task.test_cmd:
        raise UsageError(f"{task.instance_id}: names log_parser {task.log_parser!r} but has no test_cmd or eval_script")
    files = [p for p, existed in patch_files(task.test_patch) if existed]
    # the test files the test patch touches: what the harness runs for most repositories
    files_q = " ".join(shlex.quote(p) for p, _ in patch_files(task.test_patch) if not p.endswith(NON_TEST_SUFFIXES))
    cmd = task.test_cmd.replace("{test_files}", files_q) if "{test_files}" in task.test_cmd else f"{task.test_cmd} {files_q}"
    reset = f"git checkout {task.base_commit} {' '.join(shlex.quote(f) for f in files)}" if files else ":"
    lines = ["source /opt/miniconda3/bin/activate", "conda activate testbed", f"cd {TESTBED}",
             f"git config --global --add safe.directory {TESTBED}", *task.env_setup, reset]
    if task.test_patch.strip():
        lines += [f"git apply -v - <<'{HEREDOC}'", task.test_patch.rstrip("\n"), HEREDOC]
    lines += [f": '{grading.START_TEST_OUTPUT}'", cmd.rstrip(), f": '{grading.END_TEST_OUTPUT}'", reset]
    return "\n".join(["#!/bin/bash", "set -uxo pipefail", *lines]) + "\n"


def test_spec(task: Task, image: str):
    """The harness's TestSpec for the task (its eval script records the tests' exit code)."""
    _, log_parsers, utils, _ = swebench()
    parser = task.log_parser or ""
    if parser not in log_parsers.PARSER_REGISTRY:
        raise UsageError(f"{task.instance_id}: unknown log_parser {parser!r}; the harness has "
                         f"{', '.join(sorted(log_parsers.PARSER_REGISTRY))}")
    return utils.make_test_spec({
        "instance_id": task.instance_id, "image": image, "repo": task.repo, "version": task.version,
        "eval_script": task.eval_script or compose_eval_script(task), "log_parser": parser,
        "eval_type": task.eval_type or "pass_and_fail",
        "FAIL_TO_PASS": task.FAIL_TO_PASS, "PASS_TO_PASS": task.PASS_TO_PASS,
    })


# --- grading -----------------------------------------------------------------------------------------

def harness_report(task: Task, spec, model_patch: str | None, log: str) -> tuple[dict, dict[str, str]]:
    """The harness's report.json entry for the log, and the status map its parser read."""
    grading, *_ = swebench()
    with tempfile.TemporaryDirectory(prefix="m3-harness-", ignore_cleanup_errors=True) as tmp:
        path = Path(tmp) / "test_output.txt"
        path.write_text(log)
        entry = grading.get_eval_report(spec, {"instance_id": task.instance_id, "model_patch": model_patch,
                                               "model_name_or_path": "m3-agent"}, str(path), True)
        statuses, _ = grading.get_logs_eval(spec, str(path))
    return entry[task.instance_id], statuses


def read_log(report: InstanceReport, task: Task, spec, model_patch: str | None, log: str) -> None:
    """Fill `report` from the eval script's log: the harness's verdict and statuses, and whether the
    test command could not start (`evals.grading.could_not_start`, on the output between the markers)."""
    grading, *_ = swebench()
    entry, statuses = harness_report(task, spec, model_patch, log)
    report.patch_successfully_applied = report.patch_successfully_applied and entry["patch_successfully_applied"]
    report.tests_status = TestsStatus(**{k: Outcome(**v) for k, v in entry.get("tests_status", {}).items()})
    report.test_statuses = statuses
    start, end = grading.START_TEST_OUTPUT, grading.END_TEST_OUTPUT
    output = log.split(start, 1)[1].split(end, 1)[0] if start in log and end in log else ""
    # The script's own exit code is its last reset's; the test command's is recorded after the end marker.
    note_environment_error(report, grading.parse_test_exit_code(log), output, has_results=bool(statuses),
                           model_patch=model_patch or "")
    report.resolved = bool(entry["resolved"]) and report.patch_exists and report.error is None


def grade_with_harness(task: Task, model_patch: str | None, *, image: str, sandbox: SandboxConfig,
                       test_timeout: float = 1800.0, tree: Path | None = None) -> InstanceReport:
    """Grade one prediction in the instance image: apply the patch, run the harness's eval script,
    and let its parser and report function decide. An unappliable patch is an error, as in evals.grading,
    and so is a test command that could not start (an environment error)."""
    with grading_report(model_patch) as report:
        spec = test_spec(task, image)
        image = ensure_image(image)
        with grading_sandbox(sandbox_for(sandbox, image), tree or testbed_tree(image), report) as sb:
            log = _run_eval_script(sb, spec, model_patch or "", report, test_timeout)
        if log is not None:
            read_log(report, task, spec, model_patch, log)
    return report


def _run_eval_script(sb: Sandbox, spec, model_patch: str, report: InstanceReport, timeout: float) -> str | None:
    """Apply the patch, run the eval script (stderr into stdout, as the harness reads one stream)."""
    grading, *_ = swebench()
    # An empty patch counts as applied, as the harness reports it.
    report.patch_successfully_applied = apply_step(sb, report, model_patch)
    if not report.patch_successfully_applied:
        return None
    sb.write_file(EVAL_SCRIPT, spec.eval_script)
    clock = time.monotonic()
    r = sb.exec(f"bash {EVAL_SCRIPT} 2>&1", timeout=timeout)
    report.timings["tests_s"] = round(time.monotonic() - clock, 3)
    report.test_exit_code, report.tests_timed_out = r.exit_code, r.timed_out
    log = r.stdout + (f"\n{grading.TESTS_TIMEOUT} after {timeout:g}s\n" if r.timed_out else "")
    report.test_output = log[-20_000:]
    return log
