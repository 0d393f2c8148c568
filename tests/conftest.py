"""Shared fixtures. Docker-backed tests use the real engine: under CI=true a missing engine fails them."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

# A run started in the background (`cmd &` without job control) ignores SIGINT, and so would every
# process the tests start, though the Ctrl-C tests send it to them as a terminal would: restore it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Tiers that wait for what `run.sh test` builds in the background while the rest of the suite runs (the
# oracle venv, the llama.cpp server): they run last, in this order, whatever order the paths were given in.
LAST_TIERS = ("conformance", "realmodel")
TESTS = Path(__file__).resolve().parent


def _tier_rank(item: pytest.Item) -> int:
    path = Path(str(item.fspath)).resolve()
    top = path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else ""
    return LAST_TIERS.index(top) + 1 if top in LAST_TIERS else 0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_tier_rank)  # a stable sort: the order within each group is kept


def _docker_error() -> str | None:
    try:
        import docker

        client = docker.from_env(timeout=10)
        client.ping()
        client.close()
        return None
    except Exception as e:  # any failure to reach the engine means "no Docker" here
        return f"Docker engine unreachable: {e}"


@pytest.fixture(scope="session")
def docker_ready() -> None:
    """Require the real Docker engine: fail under CI=true, skip on a developer machine without it."""
    err = _docker_error()
    if err is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{err} (CI=true: Docker tests must run)")
    pytest.skip(err)


@pytest.fixture(scope="session")
def sandbox_image(docker_ready) -> str:
    """The project's sandbox image, built once (idempotently) if missing."""
    from m3_agent.sandbox import DEFAULT_IMAGE, build_image

    return build_image(DEFAULT_IMAGE)


def make_git_repo(path: Path, files: dict[str, str], message: str = "initial") -> Path:
    """Create a real git repository at `path` with `files` committed."""
    path.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        f = path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    subprocess.run(["git", "init", "-q", "-b", "main", str(path)], check=True, env=env)
    subprocess.run(["git", "-C", str(path), "add", "-A"], check=True, env=env)
    subprocess.run(["git", "-C", str(path), "commit", "-qm", message], check=True, env=env)
    return path


@pytest.fixture
def git_repo(tmp_path):
    """Factory: git_repo({"a.py": "..."}) -> Path of a fresh committed repo in tmp."""
    counter = iter(range(1000))

    def make(files: dict[str, str], name: str | None = None) -> Path:
        return make_git_repo(tmp_path / (name or f"repo{next(counter)}"), files)

    return make


def process_parents() -> dict[int, int]:
    """pid -> parent pid of every process on this machine, zombies included (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except OSError:  # the process ended while we looked
            continue
    return parents


def descendants(pid: int) -> set[int]:
    """`pid` and every process below it."""
    parents = process_parents()
    found, frontier = {pid}, [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier and p not in found]
        found.update(kids)
        frontier = kids
    return found


def wait_for(condition, timeout: float, what: str) -> None:
    """Poll `condition` until it holds; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def lan_address() -> str:
    """A non-loopback IPv4 address of this machine (a server bound to 0.0.0.0 answers there); skips
    the test on a machine that has none."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
        except OSError:
            address = "0.0.0.0"
    if not address.startswith(("127.", "0.")):
        return address
    found = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    v4 = [a for a in found if "." in a and not a.startswith("127.")]
    if not v4:
        pytest.skip("this machine has no non-loopback IPv4 address to reach a server over the network")
    return v4[0]


def secrets_found(secrets: list[str], *texts: str, under: list[Path] = ()) -> list[str]:
    """Where any of `secrets` occurs in full: 'text N' for the texts, the path for files under `under`."""
    found = [f"text {i}" for i, text in enumerate(texts) if any(s in text for s in secrets)]
    for root in under:
        for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
            data = path.read_bytes()
            if any(s.encode() in data for s in secrets):
                found.append(str(path))
    return found


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After a run that included the docs test: which documented commands it ran, and which it could not."""
    ran = any("test_docs.py::test_every_runnable" in getattr(report, "nodeid", "")
              for outcome in ("passed", "failed", "error") for report in terminalreporter.stats.get(outcome, []))
    if ran:
        from tests.test_docs import coverage_summary

        terminalreporter.section("documented commands")
        for line in coverage_summary():
            terminalreporter.write_line(line)
