"""A throwaway Ray cluster made of processes on this machine: a head and worker nodes, loopback addresses.

    with LocalRayCluster(nodes=2, docker_slots=2) as cluster:   # `ray start --head`, `ray start --address`
        run_eval(..., RunOptions(executor=RayExecutor(address=cluster.address)))
        cluster.kill_node(1)                                     # SIGKILL a worker node's every process

For the tests, `benchmarks/eval_scale.py` and trying `--executor ray` on several nodes before a real
cluster exists (a test helper, not shipped). Each node is one `ray start --block` session (its raylet,
workers and their children) with its own ports, and the cluster its own temporary directory, so two
clusters on one machine do not collide, and stopping one never touches another (`ray stop` would stop
them all).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from m3_agent.errors import UsageError
from m3_agent.evals.ray_executor import DOCKER_RESOURCE

STARTED = "Ray runtime started"
HOST = "127.0.0.2"


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRayCluster:
    """A head node plus `nodes - 1` worker nodes, each declaring `docker_slots` units of the Docker resource."""

    def __init__(self, *, nodes: int = 2, docker_slots: int = 2, env: dict[str, str] | None = None,
                 start_timeout: float = 90.0) -> None:
        self.nodes = nodes
        self.docker_slots = docker_slots
        self.env = {**os.environ, **(env or {}), "RAY_USAGE_STATS_ENABLED": "0"}
        self.start_timeout = start_timeout
        self.root = Path(tempfile.mkdtemp(prefix="m3ray-", dir="/tmp"))  # short: Ray's socket paths have a limit
        self.port = free_port()
        self.procs: list[subprocess.Popen] = []

    @property
    def address(self) -> str:
        """The head's GCS address, for `ray.init(address=...)` and `--ray-address`."""
        return f"{HOST}:{self.port}"

    def __enter__(self) -> LocalRayCluster:
        try:
            self._start(head=True)
            for _ in range(1, self.nodes):
                self.add_node()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_node(self) -> int:
        """Start one more worker node; returns its index (for `kill_node`)."""
        return self._start(head=False)

    def _start(self, *, head: bool) -> int:
        index = len(self.procs)
        ray = str(Path(sys.executable).with_name("ray"))
        resources = json.dumps({DOCKER_RESOURCE: self.docker_slots})
        args = [ray, "start", "--block", "--num-cpus=1", f"--resources={resources}",
                "--object-store-memory=80000000", "--disable-usage-stats",
                f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"]
        # 127.0.0.1 Ray replaces by the machine's address; any other 127.x address is loopback and kept.
        args.append(f"--node-ip-address={HOST}")
        if head:
            args += ["--head", f"--port={self.port}", "--include-dashboard=false",
                     f"--dashboard-port={free_port()}", f"--temp-dir={self.root}"]
        else:
            args += [f"--address={self.address}"]
        env = self.env
        log = open(self.root / f"node-{index}.log", "wb")
        self.procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True))
        log.close()
        self._wait_started(index)
        return index

    def _wait_started(self, index: int) -> None:
        log = self.root / f"node-{index}.log"
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if STARTED in log.read_text(errors="replace"):
                return
            if self.procs[index].poll() is not None:
                break
            time.sleep(0.3)
        tail = log.read_text(errors="replace")[-1500:]
        raise UsageError(f"Ray node {index} did not start: {tail}")

    def node_of(self, pid: int) -> int | None:
        """The index of the node a process belongs to (Ray workers keep their node's session), or None."""
        try:
            sid = os.getsid(pid)
        except ProcessLookupError:
            return None
        return next((i for i, p in enumerate(self.procs) if p.pid == sid), None)

    def kill_node(self, index: int) -> None:
        """SIGKILL every process of node `index` (raylet, its workers, their children): a node that died."""
        _kill_session(self.procs[index].pid, signal.SIGKILL)

    def stop(self) -> None:
        """Stop every node (SIGTERM, SIGKILL after a grace period) and remove the temporary directory."""
        for proc in reversed(self.procs):
            _kill_session(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill_session(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _kill_session(sid: int, sig: signal.Signals) -> None:
    """Signal every process of session `sid` (the node's `ray start`, started as a session leader)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) == sid:
                os.kill(int(entry), sig)
        except (ProcessLookupError, PermissionError):
            continue
