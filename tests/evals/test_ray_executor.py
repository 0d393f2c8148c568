"""`eval run --executor ray` on a real Ray cluster made of processes on this machine (loopback addresses).

A head and a worker node (`ray start --head`, `ray start --address`, each declaring the docker
resource), the built-in suite played by the stand-in over real HTTP, real Docker sandboxes. Faults
are real too: a node's every process SIGKILLed mid-run, the driver SIGKILLed, Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from m3_agent.evals.results import RESULTS_FILE, load_results
from m3_agent.evals.tasks import builtin_names, builtin_standin_script
from m3_agent.sandbox.cleanup import LABEL_PID
from m3_agent.standin.server import StandinServer
from tests.conftest import wait_for

pytest.importorskip("ray")
pytestmark = [pytest.mark.docker, pytest.mark.timeout(420)]

from tests.evals.ray_cluster import LocalRayCluster  # noqa: E402

ALL_IDS = sorted(f"m3-agent__{n}-1" for n in builtin_names())
# Differs from run to run: timings, where files are, and cache hits (they depend on the order requests came in).
VOLATILE = {"wall_s", "model_s", "grading_s", "cached_tokens", "cache_hit_share", "trajectory_path", "node"}


@pytest.fixture(scope="module")
def cluster(sandbox_image, eval_cache):
    """A head and one worker node, two sandbox slots each; every process stopped at the end."""
    with LocalRayCluster(nodes=2, docker_slots=2) as c:
        yield c


def _driver(out: Path, base_urls: list[str], *, address: str | None, executor: str = "ray") -> list[str]:
    args = [sys.executable, "-m", "m3_agent.cli", "eval", "run", "--tasks", "builtin", "--workers", "4",
            "--output", str(out), "--json", "-q", "--executor", executor]
    for url in base_urls:
        args += ["--base-url", url]
    return args + (["--ray-address", address] if address else [])


def _env(label: dict, **extra: str) -> dict:
    return {**os.environ, "M3_AGENT_SANDBOX__LABELS": json.dumps(label), **extra}


def _run(args: list[str], label: dict, timeout: float = 300, **extra: str) -> dict:
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=_env(label, **extra))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _stable(value):
    """A report with what differs between two equal runs taken out."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def _results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / RESULTS_FILE).read_text().splitlines()]


def test_the_suite_resolves_on_both_nodes_with_the_local_executors_report(cluster, tmp_path, test_label):
    reports, predictions = {}, {}
    for executor in ("local", "ray"):
        out = tmp_path / executor
        with StandinServer(builtin_standin_script()) as srv:
            summary = _run(_driver(out, [srv.base_url], address=cluster.address if executor == "ray" else None,
                                   executor=executor), test_label)
        assert summary["resolved_ids"] == ALL_IDS
        reports[executor] = _stable(json.loads((out / "report.json").read_text()))
        predictions[executor] = sorted((out / "predictions.jsonl").read_text().splitlines())
        for instance in ALL_IDS:  # written by the driver where the local executor writes them
            assert (out / "trajectories" / f"{instance}.jsonl").stat().st_size > 0
            assert (out / "instances" / instance / "report.json").is_file()
    assert reports["ray"] == reports["local"]
    assert predictions["ray"] == predictions["local"]
    rows = _results(tmp_path / "ray")
    assert len(rows) == 10 and len({r["node"] for r in rows}) == 2  # both nodes ran instances
    assert all(r["agent"]["trajectory_path"].startswith(str(tmp_path / "ray")) for r in rows)


def _owner_pids(label: dict) -> list[int]:
    """Owner pids of the sandboxes carrying `label`, listed without inspecting each (they come and go)."""
    import docker

    client = docker.from_env(timeout=30)
    try:
        boxes = client.containers.list(all=True, sparse=True, filters={"label": [f"{k}={v}" for k, v in label.items()]})
        return [int(b.attrs["Labels"][LABEL_PID]) for b in boxes]
    finally:
        client.close()


def test_a_node_killed_mid_instance_is_retried_elsewhere_and_counted_once(sandbox_image, eval_cache, tmp_path,
                                                                         test_label, sandbox_containers):
    out = tmp_path / "out"
    with LocalRayCluster(nodes=2, docker_slots=2) as c, StandinServer(builtin_standin_script()) as srv:
        proc = subprocess.Popen(_driver(out, [srv.base_url], address=c.address), env=_env(test_label),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # a sandbox owned by a worker process of that node
            if any(c.node_of(pid) == 1 for pid in _owner_pids(test_label)):
                break
            time.sleep(0.1)
        else:
            proc.kill()
            pytest.fail("no instance started on the worker node")
        finished_before = len(load_results(out))
        c.kill_node(1)
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["resolved_ids"] == ALL_IDS
    rows = _results(out)
    assert sorted(r["instance_id"] for r in rows) == ALL_IDS  # each counted once
    after = {r["node"] for r in rows[finished_before:]}
    assert len(after) == 1 and finished_before < 10  # what was left, the one live node finished
    assert sandbox_containers(**test_label) == []


def test_a_sigkilled_driver_resumes_and_ctrl_c_cancels_remote_work(cluster, tmp_path, test_label):
    out = tmp_path / "out"
    # A fresh stand-in per driver: an instance cut off mid-conversation starts its script again.
    with StandinServer(builtin_standin_script()) as srv:
        proc = subprocess.Popen(_driver(out, [srv.base_url], address=cluster.address), env=_env(test_label),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for(lambda: len(load_results(out)) >= 3 and _owner_pids(test_label), 150,
                     "three results and a running instance")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    finished = (out / RESULTS_FILE).read_text()
    done_before = set(load_results(out))

    with StandinServer(builtin_standin_script()) as srv:
        proc = subprocess.Popen(_driver(out, [srv.base_url], address=cluster.address), env=_env(test_label),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: len(load_results(out)) > len(done_before) and _owner_pids(test_label), 150,
                 "a new result and a running instance")
        proc.send_signal(signal.SIGINT)  # Ctrl-C: remote tasks cancelled, their sandboxes removed
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    wait_for(lambda: not _owner_pids(test_label), 60, "the run's workers to be gone")
    done_twice = set(load_results(out))

    with StandinServer(builtin_standin_script()) as srv:
        summary = _run(_driver(out, [srv.base_url], address=cluster.address), test_label)
    assert summary["resolved_ids"] == ALL_IDS
    assert (out / RESULTS_FILE).read_text().startswith(finished)  # nothing finished was lost or rewritten
    assert sorted(r["instance_id"] for r in _results(out)) == ALL_IDS  # nothing finished was redone
    assert done_before < done_twice < set(ALL_IDS)


def test_a_failing_endpoint_leaves_the_pool_and_its_instances_run_elsewhere(cluster, tmp_path, test_label):
    out = tmp_path / "out"
    with StandinServer(builtin_standin_script()) as good, StandinServer(builtin_standin_script()) as bad:
        proc = subprocess.Popen(_driver(out, [bad.base_url, good.base_url], address=cluster.address),
                                env=_env(test_label, M3_AGENT_MODEL__RETRY_ATTEMPTS="2", M3_AGENT_MODEL__RETRY_MAX_S="5"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: bad.requests, 120, "a request to the failing endpoint")
        bad.stop()  # gone mid-run: its instances are placed on the other endpoint
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
    assert f"endpoint {bad.base_url} failed, out of the pool" in stderr
    # Each instance ran on one endpoint to its end: those placed on the stopped one, again on the other.
    on_bad, on_good = ({_first_user_message(body) for body in srv.requests} for srv in (bad, good))
    assert len(on_good) > 5 and len(on_bad | on_good) == 10
    assert json.loads(stdout.strip().splitlines()[-1])["resolved_ids"] == ALL_IDS
    assert sorted(r["instance_id"] for r in _results(out)) == ALL_IDS


def _first_user_message(body: dict) -> str:
    return next(str(m["content"]) for m in body["messages"] if m["role"] == "user")


def test_a_node_without_the_sandbox_image_stops_the_run_before_any_instance(cluster, tmp_path):
    from m3_agent.errors import SandboxUnavailable
    from m3_agent.evals.config import EvalConfig
    from m3_agent.evals.ray_executor import RayExecutor
    from m3_agent.evals.runner import RunOptions, run_eval
    from m3_agent.evals.tasks import builtin_task
    from m3_agent.sandbox import SandboxConfig

    config = EvalConfig(output_dir=tmp_path, sandbox=SandboxConfig(image="m3-agent-no-such-image:0"))
    with pytest.raises(SandboxUnavailable, match=r"sandbox image m3-agent-no-such-image:0 missing .* on Ray node"):
        run_eval([builtin_task("roman")], None, config, RunOptions(executor=RayExecutor(address=cluster.address)))
    assert not (tmp_path / RESULTS_FILE).exists()


def test_an_unreachable_cluster_is_one_line_at_once(tmp_path):
    from m3_agent.errors import UsageError
    from m3_agent.evals.config import EvalConfig
    from m3_agent.evals.ray_executor import RayExecutor
    from tests.evals.ray_cluster import free_port
    from m3_agent.evals.runner import RunOptions, run_eval
    from m3_agent.evals.tasks import builtin_task

    address = f"127.0.0.2:{free_port()}"
    start = time.monotonic()
    with pytest.raises(UsageError, match=f"cannot reach the Ray cluster at {address}"):
        run_eval([builtin_task("roman")], None, EvalConfig(output_dir=tmp_path),
                 RunOptions(executor=RayExecutor(address=address)))
    assert time.monotonic() - start < 10
    with pytest.raises(UsageError, match="give the head's HOST:PORT"):
        run_eval([builtin_task("roman")], None, EvalConfig(output_dir=tmp_path),
                 RunOptions(executor=RayExecutor(address="head")))


def test_admission_sees_a_running_instance_grow_through_the_workers_relay(cluster, tmp_path, test_label):
    from m3_agent.evals.admission import Progress
    from m3_agent.evals.config import EvalConfig
    from m3_agent.evals.ray_executor import RayExecutor
    from m3_agent.evals.runner import RunOptions, run_eval
    from m3_agent.evals.tasks import builtin_task
    from m3_agent.sandbox.config import SandboxConfig

    script = builtin_standin_script(["roman", "slugify"])
    for conversation in script["conversations"]:
        for turn in conversation["turns"]:
            turn["delay_s"] = 1.5  # each reply takes a while: the instance runs for several looks

    class Gate:  # one instance at a time, so the executor asks each time it looks while one runs
        progress = None

        def __init__(self) -> None:
            self.seen: list[tuple[str, tuple[int, int, int]]] = []

        def watch(self, folder):
            self.progress = Progress(folder)

        def observe(self, first, peak, task=None):  # finished instances: nothing to learn for this gate
            pass

        def __call__(self, task, running):
            self.seen += [(t.instance_id, self.progress.of(t.instance_id)) for t in running]
            return False

    gate = Gate()
    with StandinServer(script) as srv:
        config = EvalConfig(output_dir=tmp_path / "out", sandbox=SandboxConfig(labels=test_label),
                            agent={"model": {"base_url": srv.base_url, "api_key": "unused"}})
        results = run_eval([builtin_task("roman"), builtin_task("slugify")], None, config,
                           RunOptions(workers=2, admit=gate, executor=RayExecutor(address=cluster.address)))
    assert [r.report.resolved for r in results] == [True, True]
    first = results[0].instance_id
    # while the first ran, the gate read its replies (prompt and completion tokens) as the worker relayed them
    grew = [p for iid, p in gate.seen if iid == first and p[2] >= 1]
    assert grew and all(peak >= prompt > 0 for prompt, peak, _ in grew)
    assert min(p[2] for p in grew) < results[0].agent.requests  # some of them before its last reply
    assert not gate.progress.folder.exists()  # the relay's folder goes with the run
