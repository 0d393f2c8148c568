"""A run survives an environment that dies under it: a fresh one with the workspace restored, a notice to
the model, a `sandbox_restart` event, a count in the result, and a limit that ends a run that keeps dying.

Two tiers, both through the stand-in over real HTTP. Without Docker: a local environment that raises
`SandboxDied` when a command asks it to (the limit logic and the factory + `restore` path). With Docker:
the real sandbox's container is killed from outside with the docker SDK at the moment the model's
marked command is called (deterministic: the `tool_call` event comes before the command runs).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import docker
import pytest

from m3_agent.agent import verdict as verdict_module
from m3_agent.agent.loop import Agent
from m3_agent.agent.trajectory import read_trajectory
from m3_agent.errors import SandboxDied
from m3_agent.sandbox import LocalEnvironment, Recoverable
from m3_agent.standin.server import StandinServer
from tests.agent.test_loop import BUGGY, FIX, call, fast

NOTICE = "The sandbox died during this tool call"


@pytest.fixture(autouse=True)
def _no_pytest_plugins_in_local_commands(monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


class DyingLocal(LocalEnvironment):
    """A local checkout that dies like a container when a command says DIE: every later call raises too."""

    made: list[DyingLocal]
    first_dies_at_diff = 0  # the first environment's Nth diff finds it dead (0: never)

    def __init__(self, repo: Path) -> None:
        super().__init__(repo)
        self.dead = False
        self.diffs = 0
        self.dies_at_diff = 0 if self.made else self.first_dies_at_diff
        self.made.append(self)

    def exec(self, cmd, timeout=None, cwd=None, env=None):
        if self.dead or "DIE" in cmd:
            self.dead = True
            raise SandboxDied("sandbox local is dead: killed by the test, OOM-killed=True; start a new sandbox")
        return super().exec(cmd, timeout=timeout, cwd=cwd, env=env)

    def diff(self) -> str:
        self.diffs += 1
        if self.dead or self.diffs == self.dies_at_diff:
            self.dead = True
            raise SandboxDied("sandbox local is dead")
        return super().diff()

    def restore(self, patch: str) -> None:
        """Base commit + `patch`, as the sandbox's restore does (a fresh checkout is at the base already)."""
        subprocess.run(["git", "apply", "--binary", "-"], input=patch.encode(), cwd=self.root, check=True)


def dying_factory(made: list, first_dies_at_diff: int = 0) -> type[DyingLocal]:
    return type("Recorded", (DyingLocal,), {"made": made, "first_dies_at_diff": first_dies_at_diff})


def scripted(git_repo, tmp_path, turns, env_factory, callbacks=None, **cfg):
    repo = git_repo(BUGGY)
    traj = tmp_path / "traj.jsonl"
    with StandinServer({"turns": turns}) as srv:
        agent = Agent(fast(base_url=srv.base_url, **cfg), env_factory=env_factory, callbacks=callbacks)
        result = agent.run(repo, "add() subtracts instead of adding", trajectory_path=traj)
        requests = list(srv.requests)
    return result, requests, read_trajectory(traj)


def died_once_turns(marker: str) -> list[dict]:
    return [
        {"tool_calls": [call("file_edit", **FIX)]},
        {"tool_calls": [call("bash", command=f"echo {marker}")]},
        {"tool_calls": [call("bash", command="cat calc/ops.py")]},
        {"tool_calls": [call("test_runner", test_file="tests")]},
        {"tool_calls": [call("submit", summary="add adds")]},
    ]


def tool_messages(request: dict) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "tool"]


def test_a_death_restarts_the_environment_with_the_workspace_and_tells_the_model(git_repo, tmp_path):
    made: list[DyingLocal] = []
    result, requests, traj = scripted(git_repo, tmp_path, died_once_turns("DIE"), dying_factory(made))
    assert result.status == "submitted" and result.sandbox_restarts == 1
    assert "-    return a - b\n+    return a + b" in result.patch
    assert len(made) == 2 and made[0].dead and not made[1].dead and not isinstance(made[0], Recoverable)
    notice = tool_messages(requests[2])[-1]
    assert notice.startswith(NOTICE) and "OOM-killed=True" in notice and "1 file(s)" in notice
    assert "return a + b" in tool_messages(requests[3])[-1]  # the fresh checkout holds the edit
    assert result.verdict.source == "agent" and result.verdict.passed  # the tests ran in the fresh one
    restart = [e for e in traj if e["kind"] == "sandbox_restart"]
    assert len(restart) == 1 and restart[0]["turn"] == 2 and restart[0]["restarts"] == 1
    assert restart[0]["restored_diff_bytes"] == len(result.patch.encode()) and restart[0]["restored_files"] == 1
    assert traj[-1]["sandbox_restarts"] == 1
    assert all(e.root is None or not e.root.exists() for e in made)  # both checkouts removed


@pytest.mark.parametrize("limit", [0, 2])
def test_a_run_that_keeps_dying_ends_as_an_error_at_the_limit(git_repo, tmp_path, limit):
    made: list[DyingLocal] = []
    turns = [{"tool_calls": [call("file_edit", **FIX)]}]
    turns += [{"tool_calls": [call("bash", command=f"echo DIE {n}")]} for n in range(5)]
    result, requests, traj = scripted(git_repo, tmp_path, turns, dying_factory(made), max_sandbox_restarts=limit)
    assert result.status == "error" and result.sandbox_restarts == limit
    assert f"the sandbox died again after {limit} restart(s) (limits.max_sandbox_restarts={limit})" in result.error
    assert "OOM-killed=True" in result.error
    # The last known workspace is kept; with restarts off no diff is taken per call, so none is known.
    assert ("+    return a + b" in result.patch) if limit else result.patch == ""
    assert len(requests) == 2 + limit and len(made) == 1 + limit
    assert [e["restarts"] for e in traj if e["kind"] == "sandbox_restart"] == list(range(1, limit + 1))
    assert traj[-1]["status"] == "error" and result.verdict.source == "none"
    assert all(e.root is None or not e.root.exists() for e in made)


def test_a_death_after_the_last_tool_call_is_recovered_before_the_final_diff_and_the_verdict(git_repo, tmp_path):
    made: list[DyingLocal] = []
    turns = [{"tool_calls": [call("file_edit", **FIX)]}, {"tool_calls": [call("submit", summary="x")]}]
    result, _, traj = scripted(git_repo, tmp_path, turns, dying_factory(made, first_dies_at_diff=2),
                               test_cmd="python3 -m pytest -q tests")
    assert result.status == "submitted" and result.sandbox_restarts == 1 and len(made) == 2
    assert "+    return a + b" in result.patch
    assert result.verdict.source == "test_cmd" and result.verdict.passed  # ran in the fresh checkout
    assert [e["turn"] for e in traj if e["kind"] == "sandbox_restart"] == [2]


def stale_test_turns() -> list[dict]:
    """The agent tests, then edits and submits: the verdict re-runs its test call on the final workspace."""
    return [{"tool_calls": [call("test_runner", test_file="tests")]},
            {"tool_calls": [call("file_edit", **FIX)]},
            {"tool_calls": [call("submit", summary="add adds")]}]


def dies_at_verdict(monkeypatch, kill) -> list:
    """Make the environment die (by `kill(env)`) just before the verdict's first re-run; the calls seen."""
    seen = []
    real = verdict_module.execute_call

    def execute_call(name, arguments, tools, env, **kw):
        seen.append(env)
        if len(seen) == 1:
            kill(env)
        return real(name, arguments, tools, env, **kw)

    monkeypatch.setattr(verdict_module, "execute_call", execute_call)
    return seen


def test_a_death_under_the_verdict_rerun_restarts_and_decides_in_the_fresh_environment(git_repo, tmp_path, monkeypatch):
    made: list[DyingLocal] = []
    seen = dies_at_verdict(monkeypatch, lambda env: setattr(env, "dead", True))
    result, _, traj = scripted(git_repo, tmp_path, stale_test_turns(), dying_factory(made))
    assert result.status == "submitted" and result.sandbox_restarts == 1 and len(made) == 2
    assert seen == [made[0], made[1]]  # re-run once more, in the fresh checkout
    assert "+    return a + b" in result.patch
    assert result.verdict.source == "rerun" and result.verdict.passed and result.verdict.stale_turn == 1
    restart = [e for e in traj if e["kind"] == "sandbox_restart"]
    assert len(restart) == 1 and restart[0]["restored_diff_bytes"] == len(result.patch.encode())
    assert [e["kind"] for e in traj][-3:] == ["sandbox_restart", "verify", "finish"]


def test_a_death_under_the_verdict_rerun_past_the_limit_leaves_it_unverified_and_keeps_the_patch(
        git_repo, tmp_path, monkeypatch):
    made: list[DyingLocal] = []
    dies_at_verdict(monkeypatch, lambda env: setattr(env, "dead", True))
    result, _, traj = scripted(git_repo, tmp_path, stale_test_turns(), dying_factory(made), max_sandbox_restarts=0)
    assert result.status == "submitted" and result.sandbox_restarts == 0 and len(made) == 1
    assert "+    return a + b" in result.patch  # the final diff was taken before the death
    assert result.verdict.source == "none" and result.verdict.passed is None
    assert "died under the verdict's test run" in result.verdict.reason
    assert "limits.max_sandbox_restarts=0" in result.verdict.reason
    assert traj[-1]["status"] == "submitted" and all(e.root is None or not e.root.exists() for e in made)


def test_calls_that_run_no_command_and_write_nothing_take_no_diff(git_repo, tmp_path, monkeypatch):
    diffs = []
    real = LocalEnvironment.diff
    monkeypatch.setattr(LocalEnvironment, "diff", lambda self: diffs.append(1) or real(self))
    turns = [{"tool_calls": [call("file_read", path="calc/ops.py"), call("no_such_tool")]},
             {"tool_calls": [call("file_edit", **FIX), call("bash", command="true")]},
             {"tool_calls": [call("submit", summary="x")]}]
    result, _, _ = scripted(git_repo, tmp_path, turns, LocalEnvironment)
    assert result.status == "submitted"
    assert len(diffs) == 3  # after file_edit and bash, and the final patch; none after the read, the typo, submit


# ----- the real engine ------------------------------------------------------------------------------


def containers_of(pid: int) -> list:
    client = docker.from_env(timeout=30)
    try:
        return client.containers.list(all=True, ignore_removed=True, filters={"label": f"m3-agent.owner-pid={pid}"})
    finally:
        client.close()


def killer(marker: str, kills: list):
    """A subscriber that kills this process's sandbox container when the model's command holds `marker`."""
    def on_event(event) -> None:
        if event.kind == "tool_call" and marker in (event.data.get("arguments") or ""):
            (box,) = containers_of(os.getpid())
            kills.append(box.id)
            box.kill()
    return on_event


@pytest.mark.docker
def test_a_killed_container_is_replaced_and_the_run_is_submitted(git_repo, tmp_path, sandbox_image):
    kills: list[str] = []
    result, requests, traj = scripted(git_repo, tmp_path, died_once_turns("KILL-ME"), None,
                                      callbacks=[killer("KILL-ME", kills)])
    assert result.status == "submitted" and result.sandbox_restarts == 1 and len(kills) == 1
    assert "-    return a - b\n+    return a + b" in result.patch
    notice = tool_messages(requests[2])[-1]
    assert notice.startswith(NOTICE) and f"sandbox {kills[0][:12]} is dead" in notice
    assert "return a + b" in tool_messages(requests[3])[-1]
    assert result.verdict.source == "agent" and result.verdict.passed
    restart = [e for e in traj if e["kind"] == "sandbox_restart"]
    assert len(restart) == 1 and restart[0]["restored_diff_bytes"] == len(result.patch.encode())
    assert containers_of(os.getpid()) == []


@pytest.mark.docker
def test_a_container_killed_past_the_limit_ends_the_run(git_repo, tmp_path, sandbox_image):
    kills: list[str] = []
    turns = [{"tool_calls": [call("file_edit", **FIX)]}]
    turns += [{"tool_calls": [call("bash", command=f"echo KILL-ME {n}")]} for n in range(4)]
    result, requests, traj = scripted(git_repo, tmp_path, turns, None, callbacks=[killer("KILL-ME", kills)],
                                      max_sandbox_restarts=1)
    assert result.status == "error" and result.sandbox_restarts == 1 and len(set(kills)) == 2
    assert "(limits.max_sandbox_restarts=1): sandbox" in result.error and "+    return a + b" in result.patch
    assert NOTICE in tool_messages(requests[2])[-1] and len(requests) == 3
    assert [e["kind"] for e in traj].count("sandbox_restart") == 1
    assert containers_of(os.getpid()) == []


@pytest.mark.docker
def test_a_container_killed_under_the_verdict_rerun_is_replaced_and_the_run_is_verified(
        git_repo, tmp_path, sandbox_image, monkeypatch):
    kills: list[str] = []

    def kill(env) -> None:
        (box,) = containers_of(os.getpid())
        assert box.id == env.id
        kills.append(box.id)
        box.kill()

    seen = dies_at_verdict(monkeypatch, kill)
    result, _, traj = scripted(git_repo, tmp_path, stale_test_turns(), None)
    assert result.status == "submitted" and result.sandbox_restarts == 1 and len(kills) == 1
    assert len(seen) == 2 and seen[1].id != kills[0]  # decided in a fresh container
    assert "-    return a - b\n+    return a + b" in result.patch
    assert result.verdict.source == "rerun" and result.verdict.passed
    restart = [e for e in traj if e["kind"] == "sandbox_restart"]
    assert len(restart) == 1 and f"sandbox {kills[0][:12]} is dead" in restart[0]["reason"]
    assert containers_of(os.getpid()) == []
