"""The Ray executor: `eval run --executor ray` places instances on the nodes of a Ray cluster.

    run_eval(tasks, preds, config, RunOptions(workers=8, executor=RayExecutor(address="head:6379", pool=pool)))

Each instance runs `instance.run_instance` (what the local executor runs per instance too: agent, then
grading) as a Ray task that needs one unit of the custom resource `docker`, which node operators
declare on nodes with a Docker engine (`ray start ... --resources '{"docker": 4}'`). Nothing is
shared but the cluster:

- the driver checks each repository out at its base commit, packs that tree (a one-commit git repo,
  no history) and puts it in Ray's object store while instances need it; a node fetches it once;
- the worker sends back the result and the trajectory; the driver writes them (results.jsonl,
  fsynced, by `run_eval`), so `report`, resume and the official harness read the same files;
- while an instance runs, its worker relays the usage of each reply its trajectory records (about
  once a second, through a small actor) so that KV-aware admission (`KvAdmit.watch`) sees the
  running sessions grow, as it does under the local executor;
- a node that dies mid-instance: Ray reruns the task on another node (at most `NODE_RETRIES` times)
  and the driver still records one result; Ctrl-C or a timeout cancels the remote task, and every
  node prunes the sandbox containers whose owner process is gone;
- with an endpoint pool, each instance runs against one endpoint (sticky); an instance whose
  endpoint failed is placed on another one and run again, and that endpoint leaves the pool.
"""

from __future__ import annotations

import io
import json
import shutil
import socket
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3_agent import hostgit
from m3_agent.errors import M3AgentError, SandboxUnavailable, UsageError
from m3_agent.evals.admission import PROGRESS_EVENTS, new_lines
from m3_agent.evals.endpoints import EndpointPool, is_endpoint_failure
from m3_agent.evals.harness import image_here
from m3_agent.evals.config import EvalConfig, trajectory_folder, worker_config_json
from m3_agent.evals.runner import Admission, Event
from m3_agent.evals.instance import InstanceResult, failed_result, grader_for, run_instance
from m3_agent.evals.predictions import Prediction, prediction_of
from m3_agent.evals.tasks import Task, checkout, repo_source

DOCKER_RESOURCE = "docker"
NODE_RETRIES = 2  # reruns of an instance whose node or worker process died
CANCEL_SETTLE_S = 0.5  # before cancelling, this long for tasks already ending to report
CANCEL_GRACE_S = 10.0  # after a polite cancel (KeyboardInterrupt in the task), force-kill the worker
RELAY_S = 1.0  # how often a worker relays its trajectory's new replies to the driver


def import_ray():
    """The `ray` module, or a UsageError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs Ray: pip install 'm3-agent[ray]'") from None
    return ray


# --- on a worker node --------------------------------------------------------------------------------

def pack_tree(tree: Path) -> bytes:
    """A checked-out tree (with its one-commit .git) as gzip'd tar bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        tar.add(str(tree), arcname="repo")
    return buf.getvalue()


def unpack_tree(data: bytes, dest: Path) -> Path:
    """Undo `pack_tree` under `dest`; returns the repository's path."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: no member may land outside `dest`
            tar.extractall(dest, filter="tar")
        else:
            tar.extractall(dest)
    return dest / "repo"


class Relay:
    """An actor between workers and the driver: the lines of running instances' trajectories that
    admission reads (`run_start`, and each reply's usage), held until the driver takes them."""

    def __init__(self) -> None:
        self.lines: dict[str, list[str]] = {}

    def add(self, instance_id: str, lines: list[str]) -> None:
        self.lines.setdefault(instance_id, []).extend(lines)

    def take(self) -> dict[str, list[str]]:
        taken, self.lines = self.lines, {}
        return taken


def _relayed(line: bytes) -> str | None:
    """The part of a trajectory line admission reads (agent.trajectory), or None for other events."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict) or event.get("kind") not in PROGRESS_EVENTS:
        return None
    return json.dumps({"kind": event["kind"], "usage": event.get("usage")})


def _relay(path: Path, instance_id: str, relay, stop: threading.Event) -> None:
    """Send the trajectory's new whole lines that admission reads to `relay`, every RELAY_S, until `stop`."""
    offset = 0
    while not stop.wait(RELAY_S):
        got = new_lines(path, offset)
        if got is None:  # not written yet
            continue
        read, offset = got
        lines = [r for line in read if (r := _relayed(line)) is not None]
        if lines:
            try:
                relay.add.remote(instance_id, lines)
            except Exception:  # the driver is gone: the instance itself goes on
                return


def run_shipped(task_json: str, pred_json: str | None, config_json: str, tree: bytes | None,
                relay: Any = None) -> dict[str, Any]:
    """Worker body: the instance run on the shipped tree (None: its image holds the repository);
    with `relay` (a `Relay` actor), its trajectory's replies are relayed as it goes."""
    task = Task.model_validate_json(task_json)
    pred = Prediction.model_validate_json(pred_json) if pred_json else None
    config = EvalConfig.model_validate_json(config_json)
    with tempfile.TemporaryDirectory(prefix="m3-ray-", ignore_cleanup_errors=True) as tmp:
        here = task
        if tree is not None:
            repo = unpack_tree(tree, Path(tmp) / "src")
            with hostgit.repository(repo) as r:
                head = r.head.commit.hexsha  # the shipped tree's own commit stands in for base_commit
            here = task.model_copy(update={"repo_source": str(repo), "base_commit": head})
        local = config.model_copy(update={"output_dir": Path(tmp) / "out", "repos": None})
        trajectory = trajectory_folder(local) / f"{task.instance_id}.jsonl"
        stop = threading.Event()
        if relay is not None:
            threading.Thread(target=_relay, args=(trajectory, task.instance_id, relay, stop), daemon=True).start()
        try:
            result = run_instance(here, pred, local)
        finally:
            stop.set()
        if (result.error or "").startswith("Interrupted:"):
            raise KeyboardInterrupt  # ray.cancel: end as a cancelled task, as Ray expects (the sandbox is closed)
        traj = trajectory.read_bytes() if trajectory.is_file() else None
    node = import_ray().get_runtime_context().get_node_id()
    return {"result": result.model_dump_json(), "trajectory": traj, "node": node}


def _prune_here() -> list[str]:
    from m3_agent.sandbox import prune
    from m3_agent.sandbox.cleanup import prune_scratch

    prune_scratch()
    return prune()


# --- on the driver -----------------------------------------------------------------------------------

@dataclass
class _Flight:
    task: Task
    started: float
    endpoint: str | None
    tree: tuple[str, str] | None  # the key of its packed tree (None: a harness task, nothing shipped)


class RayExecutor:
    """An `Executor` for `run_eval` that runs instances as Ray tasks; see the module docstring."""

    def __init__(self, *, address: str | None = None, pool: EndpointPool | None = None) -> None:
        self.address = address
        self.pool = pool
        self._trees: dict[tuple[str, str], Any] = {}  # (source, base commit) -> ObjectRef of the packed tree
        self._tree_users: Counter[tuple[str, str]] = Counter()  # instances in flight per tree: 0 frees it
        self._remote: Any = None
        self._started_ray = False
        self._relay: Any = None  # the Relay actor while a run's admission watches progress
        self._relayed: Path | None = None  # where the driver writes what it relays, for the gate to read

    def __call__(self, tasks: list[Task], predictions: dict[str, Prediction] | None, config: EvalConfig,
                 workers: int, on_event: Event | None, admit: Admission | None = None):
        ray = self._connect(workers)
        queue: deque[Task] = deque(tasks)
        running: dict[Any, _Flight] = {}
        try:
            self._preflight(ray, config, image=any(grader_for(t).checks_out for t in tasks))
            if admit is not None:  # the workers' trajectories are not here: relay their progress
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
                self._relay = ray.remote(num_cpus=0)(Relay).options(scheduling_strategy=here).remote()
                self._relayed = Path(tempfile.mkdtemp(prefix="m3-ray-progress-"))
                admit.watch(self._relayed)
            while queue or running:
                self._write_relayed(ray)
                while queue and len(running) < workers and (
                        not running or admit is None or admit(queue[0], [f.task for f in running.values()])):
                    task = queue.popleft()
                    launched = self._launch(ray, task, predictions, config, running)
                    if isinstance(launched, InstanceResult):
                        yield launched
                    elif on_event:
                        on_event("start", {"instance_id": task.instance_id})
                yield from self._collect(ray, running, queue, predictions, config)
            self._prune_nodes(ray)
        finally:
            self._close(ray, running)

    def _write_relayed(self, ray) -> None:
        """Append what the workers relayed since the last look to `<relayed>/<instance>.jsonl`."""
        if self._relay is None:
            return
        try:
            taken = ray.get(self._relay.take.remote(), timeout=10)
        except Exception as e:  # the actor died: admission goes on learning from finished instances
            print(f"m3-agent: progress relay lost ({type(e).__name__}); admission learns from finished "
                  "instances only", file=sys.stderr)
            self._relay = None
            return
        for instance_id, lines in taken.items():
            with open(self._relayed / f"{instance_id}.jsonl", "a", encoding="utf-8") as fh:
                fh.write("".join(line + "\n" for line in lines))

    def _close(self, ray, running: dict) -> None:
        """Cancel what still runs, prune every node's leftovers, leave a cluster this run started."""
        try:
            if running:
                self._cancel(ray, running)
                self._prune_nodes(ray)
        finally:
            if self._relay is not None:
                try:
                    ray.kill(self._relay)
                except Exception:  # already gone with its node
                    pass
                self._relay = None
            if self._relayed is not None:
                shutil.rmtree(self._relayed, ignore_errors=True)
                self._relayed = None
            if self._started_ray:
                ray.shutdown()
                self._started_ray, self._remote = False, None
                self._trees.clear()
                self._tree_users.clear()

    # -- cluster ----------------------------------------------------------------------------------

    def _connect(self, workers: int):
        ray = import_ray()
        if not ray.is_initialized():
            if self.address:
                _reachable(self.address)
            self._started_ray = True
            try:
                if self.address:
                    ray.init(address=self.address, log_to_driver=False, logging_level="ERROR")
                else:  # a one-machine cluster, gone when the run ends
                    ray.init(num_cpus=max(1, workers), resources={DOCKER_RESOURCE: workers},
                             include_dashboard=False, log_to_driver=False, logging_level="ERROR")
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise UsageError(f"cannot connect to the Ray cluster at {self.address}: {e}") from None
        return ray

    def _on_each_node(self, ray, fn, *args, timeout: float = 120.0) -> dict[str, Any]:
        """`fn(*args)` once on every live Docker node; node id -> its value (or the exception it raised)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(DOCKER_RESOURCE)]
        refs = {node: ray.remote(num_cpus=0, max_retries=0)(fn).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args) for node in nodes}
        out: dict[str, Any] = {}
        for node, ref in refs.items():
            try:
                out[node] = ray.get(ref, timeout=timeout)
            except Exception as e:  # a node that died meanwhile: nothing of ours can run there any more
                out[node] = e
        return out

    def _preflight(self, ray, config: EvalConfig, *, image: bool) -> None:
        """Every Docker node has the sandbox image (`image`); leftovers of a killed run are pruned there."""
        if not ray.cluster_resources().get(DOCKER_RESOURCE):
            raise UsageError(f"no node of the Ray cluster declares the `{DOCKER_RESOURCE}` resource: start nodes "
                             f"that have Docker with: ray start ... --resources '{{\"{DOCKER_RESOURCE}\": 4}}'")
        found = self._on_each_node(ray, image_here, config.sandbox.image) if image else {}
        missing = [n[:12] for n, ok in found.items() if ok is not True]
        if missing:
            raise SandboxUnavailable(f"sandbox image {config.sandbox.image} missing or Docker down on Ray node(s) "
                                     f"{', '.join(missing)}: run `m3-agent sandbox build` there")
        self._prune_nodes(ray)

    def _prune_nodes(self, ray) -> None:
        for node, removed in self._on_each_node(ray, _prune_here).items():
            if isinstance(removed, Exception):
                print(f"m3-agent: could not prune sandboxes on Ray node {node[:12]}: {removed}", file=sys.stderr)

    # -- instances --------------------------------------------------------------------------------

    def _tree(self, ray, task: Task, config: EvalConfig) -> tuple[tuple[str, str], Any]:
        """The packed tree at the task's base commit: put in the object store once while instances need it."""
        key = (repo_source(task, config.repos), task.base_commit)
        if key not in self._trees:
            with tempfile.TemporaryDirectory(prefix="m3-ship-", ignore_cleanup_errors=True) as tmp:
                tree = checkout(task, Path(tmp) / "repo", repos=config.repos)
                self._trees[key] = ray.put(pack_tree(tree))
        return key, self._trees[key]

    def _land(self, flight: _Flight) -> None:
        """An instance left the cluster: its endpoint session ends, its tree is freed when no one needs it."""
        if self.pool:
            self.pool.release(flight.task.instance_id)
        if flight.tree is None:
            return
        self._tree_users[flight.tree] -= 1
        if self._tree_users[flight.tree] <= 0:
            del self._tree_users[flight.tree]
            self._trees.pop(flight.tree, None)  # the last reference: Ray frees the object

    def _launch(self, ray, task: Task, predictions, config: EvalConfig, running: dict) -> InstanceResult | None:
        """Submit one instance; a result instead when it cannot start (bad repository, no endpoint left)."""
        pred = prediction_of(predictions, task)
        try:
            key, tree = self._tree(ray, task, config) if grader_for(task).checks_out else (None, None)
        except M3AgentError as e:  # a missing repository or commit: that instance's error, as locally
            return failed_result(task, pred, f"{type(e).__name__}: {e}", 0.0)
        endpoint = self.pool.acquire(task.instance_id) if self.pool and config.agent else None
        if endpoint:
            model = config.agent.model.model_copy(update={"base_url": endpoint})
            config = config.model_copy(update={"agent": config.agent.model_copy(update={"model": model})})
        if self._remote is None:
            self._remote = ray.remote(run_shipped).options(
                num_cpus=0, resources={DOCKER_RESOURCE: 1}, max_retries=NODE_RETRIES, retry_exceptions=False)
        ref = self._remote.remote(task.model_dump_json(), pred.model_dump_json() if pred else None,
                                  worker_config_json(config), tree, self._relay)
        running[ref] = _Flight(task, time.monotonic(), endpoint, key)
        if key is not None:
            self._tree_users[key] += 1
        return None

    def _collect(self, ray, running: dict, queue: deque, predictions, config: EvalConfig):
        """Results of the instances that finished within a second; timed-out ones are cancelled."""
        ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
        if ready:  # and whatever else is already done
            ready, _ = ray.wait(list(running), num_returns=len(running), timeout=0)
        now = time.monotonic()
        for ref in ready:
            flight = running.pop(ref)
            self._land(flight)
            result = self._result(ray, ref, flight, prediction_of(predictions, flight.task), config, now)
            if self.pool and flight.endpoint and is_endpoint_failure(result.error):
                if flight.endpoint not in self.pool.failed:
                    print(f"m3-agent: endpoint {flight.endpoint} failed, out of the pool: "
                          f"{result.error.splitlines()[0][:200]}", file=sys.stderr)
                self.pool.fail(flight.endpoint, result.error.splitlines()[0][:200])
                queue.appendleft(flight.task)  # placed on another endpoint; none left: the next launch says so
                continue
            yield result
        for ref, flight in list(running.items()):
            if now - flight.started > config.instance_timeout:
                ray.cancel(ref, force=True)  # the worker dies; its sandbox goes with it, prune takes the rest
                del running[ref]
                self._land(flight)
                yield failed_result(flight.task, prediction_of(predictions, flight.task),
                              f"instance timed out after {config.instance_timeout:g}s", now - flight.started)

    def _result(self, ray, ref, flight: _Flight, pred: Prediction | None, config: EvalConfig,
                now: float) -> InstanceResult:
        """The finished task's result, its trajectory written where the local executor writes it."""
        try:
            out = ray.get(ref)
        except ray.exceptions.RayError as e:  # its node or worker died on every try, or the task body broke
            why = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            return failed_result(flight.task, pred, f"Ray task failed ({type(e).__name__}): {why}", now - flight.started)
        result = InstanceResult.model_validate_json(out["result"])
        result.node = out["node"]
        if out["trajectory"] is not None and result.agent is not None:
            path = trajectory_folder(config) / f"{flight.task.instance_id}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_name(path.name + ".part")  # written whole, then renamed into place
            part.write_bytes(out["trajectory"])
            part.replace(path)
            result.agent.trajectory_path = str(path)
        return result

    def _cancel(self, ray, running: dict) -> None:
        """Stop what still runs: KeyboardInterrupt in each task (its sandbox closes), then kill the stragglers."""
        # Ray's core worker aborts when a cancel crosses the reply of a task just ending ("Tried to
        # complete task that was not pending"): let replies in flight land, cancel only the rest.
        _, refs = ray.wait(list(running), num_returns=len(running), timeout=CANCEL_SETTLE_S)
        for ref in refs:
            ray.cancel(ref, force=False)
        _, stragglers = ray.wait(refs, num_returns=len(refs), timeout=CANCEL_GRACE_S) if refs else ([], [])
        for ref in stragglers:
            ray.cancel(ref, force=True)
        for flight in running.values():
            self._land(flight)
        running.clear()


def _reachable(address: str, timeout: float = 5.0) -> None:
    """Fail at once when nothing listens at HOST:PORT (Ray itself would retry for minutes)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--ray-address {address!r}: give the head's HOST:PORT (as `ray start --head` printed)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise UsageError(f"cannot reach the Ray cluster at {address}: {e}; start it with `ray start --head` "
                         "or check --ray-address") from None

