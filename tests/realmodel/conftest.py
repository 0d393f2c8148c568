"""The real-model tier: a real LLM, not the scripted stand-in, drives `fix` and `eval run` on the CPU.

The server is llama-cpp-python's, serving SmolLM2-135M-Instruct, started the way a user starts it:
`m3-agent serve start --profile cpu-tiny` (its venv is built once by `serving/llama-server-venv.sh`,
which `run.sh test` runs; `serve start` builds it too when it is missing). Sampling is fixed (server
seed, temperature) and runs are short (few turns, capped tokens), so the tier costs minutes.

What the tests assert must hold for any model, whatever it answers: a run ends by submit, a limit or
a stall rule, never by a reply without a tool call before anything was done; its trajectory is
complete; no container is left; the verdict matches the tests that ran; nothing crashes. Every test
here carries the `realmodel` marker, and a server that cannot be built or started fails the tier:
it never skips.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest

from m3_agent.sandbox import cleanup
from m3_agent.serving import llamacpp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SERVER_SEED = 42
TEMPERATURE = 0.2
MAX_TOKENS = 512  # per reply (llama-cpp-python ignores it when the model may choose a tool: docs/real-model.md)
WINDOW = llamacpp.WINDOW  # the profile's --n_ctx: its /v1/models does not say it, the serve state does
MAX_TOTAL_TOKENS = 60_000  # per run
MAX_WALL_S = 600.0  # per run
START_TIMEOUT_S = 2400  # a cold start builds the server first (about 10 minutes on two cores)
NAME = "realmodel"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # the tier runs last (tests/conftest.py: LAST_TIERS): `run.sh test` builds its server meanwhile
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.realmodel)
            item.add_marker(pytest.mark.docker)


def wait_for_background_build() -> None:
    """Where `run.sh test` builds the server in the background, wait for that build and fail with its
    log if it failed (rather than build again in `serve start`); without it, nothing to wait for."""
    status = os.environ.get("M3_LLAMA_BUILD_STATUS")
    if not status:
        return
    deadline = time.monotonic() + START_TIMEOUT_S
    while not Path(status).is_file():
        if time.monotonic() > deadline:
            pytest.fail(f"the background llama.cpp server build did not finish in {START_TIMEOUT_S}s")
        time.sleep(2)
    rc = Path(status).read_text().strip()
    if rc != "0":
        log = Path(os.environ.get("M3_LLAMA_BUILD_LOG", ""))
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.is_file() else []
        pytest.fail(f"the llama.cpp server build that run.sh started failed (exit {rc}); its log {log} ends:\n"
                    + "\n".join(tail))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RealServer:
    """The running cpu-tiny endpoint and how to ask `m3-agent serve` about it."""

    base_url: str
    env: dict[str, str]
    started: subprocess.CompletedProcess

    def serve(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`m3-agent serve ARGS` in its own process, against this endpoint's state folder."""
        return subprocess.run([sys.executable, "-m", "m3_agent.serving", *args, "--name", NAME], capture_output=True,
                              text=True, timeout=timeout, env=self.env)


@pytest.fixture(scope="module")
def real_server(tmp_path_factory) -> Iterator[RealServer]:
    """`serve start --profile cpu-tiny` on a free loopback port, one per test module (a fresh server
    replays its seed from the start, so a module's runs do not depend on what ran before it)."""
    wait_for_background_build()
    env = {**os.environ, "M3_AGENT_STATE_DIR": str(tmp_path_factory.mktemp("serve-state"))}
    port = _free_port()
    argv = [sys.executable, "-m", "m3_agent.serving", "start", "--profile", "cpu-tiny", "--port", str(port),
            "--name", NAME, "--timeout", "600",
            "--extra-arg=--seed", f"--extra-arg={SERVER_SEED}", "--extra-arg=--n_threads", "--extra-arg=2"]
    try:
        started = subprocess.run(argv, capture_output=True, text=True, timeout=START_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`serve start --profile cpu-tiny` did not finish in {START_TIMEOUT_S}s")
    server = RealServer(base_url=f"http://127.0.0.1:{port}/v1", env=env, started=started)
    try:
        if started.returncode != 0:
            pytest.fail(f"the real-model tier needs the cpu-tiny server; `serve start` exited {started.returncode}:\n"
                        f"{started.stderr[-4000:]}")
        yield server
    finally:
        server.serve("stop", "--grace", "5")


@pytest.fixture
def run_label() -> str:
    """A label value on every sandbox container of one test's runs, to find what they left."""
    return uuid.uuid4().hex


def agent_env(server: RealServer, label: str) -> dict[str, str]:
    """The environment of a `fix` / `eval run` against the real server: fixed sampling, capped tokens."""
    return {**server.env, "M3_AGENT_MODEL__TEMPERATURE": str(TEMPERATURE),
            "M3_AGENT_MODEL__MAX_TOKENS": str(MAX_TOKENS),  # the window: from the serve state
            "M3_AGENT_LIMITS__MAX_TOTAL_TOKENS": str(MAX_TOTAL_TOKENS), "M3_AGENT_LIMITS__MAX_WALL_S": str(MAX_WALL_S),
            "M3_AGENT_SANDBOX__LABELS": json.dumps({"m3-agent.test-run": label})}


def left_containers(label: str, since: str) -> list[str]:
    """Sandbox containers a test's runs left: those with its run label, and those created since `since`
    (an ISO time) whose owner process is gone (a grading sandbox has no run label)."""
    client = docker.from_env()
    try:
        left = client.api.containers(all=True, filters={"label": f"m3-agent.test-run={label}"})
        for c in client.api.containers(all=True, filters={"label": f"{cleanup.LABEL}=1"}):
            labels = c.get("Labels") or {}
            if labels.get(cleanup.LABEL_CREATED, "") >= since and not cleanup.owner_alive(labels):
                left.append(c)
        return sorted({c["Id"][:12] for c in left})
    finally:
        client.close()


def utc_now() -> str:
    """Now, as the sandbox's created label writes it."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
