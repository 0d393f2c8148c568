"""Process management, for real: a fake engine on PATH that serves the stand-in slowly, or crashes."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from m3_agent.errors import EndpointAuthError, EndpointError, UsageError
from m3_agent.serving import launcher
from m3_agent.agent.access import ApiKey
from m3_agent.agent.access import Endpoint, key_value, resolve_endpoint
from m3_agent.serving.endpoint import Launch, Served, ensure_endpoint, prepare
from m3_agent.serving.gpus import GPU
from m3_agent.serving.profiles import Overrides, build_command, get_profile
from m3_agent.standin.server import StandinServer

pytestmark = pytest.mark.timeout(120)


def _cmd(port: int, profile: str = "h200-tp8"):
    return build_command(
        get_profile(profile), "native", Overrides(port=port, host="127.0.0.1", served_model_name="minimax-m3")
    )


def _serve(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`m3-agent serve ARGS` in a second process (its own interpreter, same state dir), no key in its env
    unless `env` gives one."""
    clean = {k: v for k, v in os.environ.items() if k not in ("M3_AGENT_MODEL__API_KEY", "VLLM_API_KEY")}
    return subprocess.run(
        [sys.executable, "-m", "m3_agent.serving", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean, **(env or {})},
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dead(pid: int) -> bool:
    return not launcher._pid_alive(pid)


def test_start_goes_through_loading_to_model_listed_and_stop_from_another_process(
    fake_bin, cleanup_endpoints, tmp_path, monkeypatch
):
    worker_file = tmp_path / "worker.pid"
    monkeypatch.setenv("FAKE_ENGINE_CHILD_PID_FILE", str(worker_file))
    monkeypatch.setenv("FAKE_ENGINE_LOADING_S", "1.0")
    phases: list[str] = []
    port = free_port()
    state = launcher.start(_cmd(port), timeout_s=30, progress=lambda phase, msg: phases.append(phase))
    main = [p for p in phases if p != "log"]
    assert main == ["launching", "loading", "healthy", "model listed"]
    assert state.base_url == f"http://127.0.0.1:{port}/v1"
    log = Path(state.log_path).read_text()
    assert "fake engine argv: serve MiniMaxAI/MiniMax-M3 --tensor-parallel-size 8 --block-size 128" in log
    assert "--enable-prompt-tokens-details" in log

    st = launcher.status()
    assert st.running and st.phase == "ready" and st.models == ["minimax-m3"]
    shown = _serve("status")
    assert shown.returncode == 0, shown.stderr
    assert "phase: ready; models: minimax-m3" in shown.stdout
    assert "access: loopback only (127.0.0.1): no other machine can reach it, so no key" in shown.stdout
    logs = _serve("logs", "-n", "3")
    assert "Application startup complete" in logs.stdout

    worker = int(worker_file.read_text())
    stopped = _serve("stop", "--grace", "5")
    assert stopped.returncode == 0 and "stopped default" in stopped.stdout
    assert _dead(state.pid) and _dead(worker)  # the whole group, the worker included
    assert launcher.load_state() is None
    assert _serve("status").returncode == 3


def _unauthorized(base_url: str, key: str | None = None) -> bool:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        urllib.request.urlopen(urllib.request.Request(base_url + "/models", headers=headers), timeout=10)
    except urllib.error.HTTPError as e:
        return e.code == 401
    return False


def test_a_reachable_start_requires_a_new_key_kept_0600_and_never_shown(fake_bin, cleanup_endpoints):
    port = free_port()
    r = _serve("start", "--profile", "h200-tp8", "--port", str(port), "--host", "0.0.0.0", "--skip-gpu-check",
               "--timeout", "30")
    assert r.returncode == 0, r.stderr
    state = launcher.load_state()
    key = key_value(state.api_key)
    assert key and state.api_key.source == "generated" and state.host == "0.0.0.0"
    assert key not in r.stdout + r.stderr and f"key: {state.api_key.shown}, kept in " in r.stdout
    assert "access: keyed: listens on 0.0.0.0; requests need the key ****" in r.stderr
    path = launcher.state_path("default")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and key in path.read_text()
    assert stat.S_IMODE(Path(state.log_path).stat().st_mode) == 0o600
    log = Path(state.log_path).read_text()
    assert key not in log and "VLLM_API_KEY=****" in log  # the key went through vLLM's variable, not argv
    assert _unauthorized(state.base_url) and _unauthorized(state.base_url, "wrong")
    assert not _unauthorized(state.base_url, key)

    shown = _serve("status")  # probes /v1/models with the recorded key: ready
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "access: keyed: listens on 0.0.0.0; requests need the key ****" in shown.stdout and key not in shown.stdout
    as_json = _serve("status", "--json")
    assert as_json.returncode == 0 and key not in as_json.stdout
    assert json.loads(as_json.stdout)["state"]["api_key"] == {"value": state.api_key.shown.split()[0],
                                                               "source": "generated"}


def test_a_key_in_the_environment_is_the_one_a_reachable_server_requires(fake_bin, cleanup_endpoints):
    key = "m3-team-key-0123456789WXYZ"
    r = _serve("start", "--profile", "h200-tp8", "--port", str(free_port()), "--host", "0.0.0.0",
               "--skip-gpu-check", "--timeout", "30", env={"M3_AGENT_MODEL__API_KEY": key})
    assert r.returncode == 0, r.stderr
    assert "key: ****WXYZ (env M3_AGENT_MODEL__API_KEY)" in r.stdout and key not in r.stdout + r.stderr
    assert key_value(launcher.load_state().api_key) == key and not _unauthorized(launcher.load_state().base_url, key)


def test_clients_take_the_key_of_an_endpoint_serve_started_and_theirs_elsewhere(fake_bin, cleanup_endpoints):
    mine = ApiKey.model_validate({"value": "m3-my-own-key-0123456789", "source": "env M3_AGENT_MODEL__API_KEY"})
    r = _serve("start", "--profile", "h200-tp8", "--port", str(free_port()), "--host", "0.0.0.0",
               "--skip-gpu-check", "--timeout", "30")
    assert r.returncode == 0, r.stderr
    state = launcher.load_state()
    for url in (state.base_url, state.base_url + "/", state.base_url.replace("127.0.0.1", "localhost")):
        endpoint = resolve_endpoint(url, key=mine, serving=Served())
        assert endpoint.key.value.get_secret_value() == key_value(state.api_key)
        assert endpoint.key.source == f"the serve state of endpoint 'default' ({launcher.state_path('default')})"
        endpoint.check()  # accepted
    with pytest.raises(EndpointAuthError, match=r"sent the key \*\*\*\*6789 \(from env M3_AGENT_MODEL__API_KEY\)"):
        Endpoint(base_url=state.base_url, key=mine).check()
    served = resolve_endpoint(None, key=mine, serving=Served("h200-tp8"))  # --serve: the recorded endpoint, with its key
    assert served.base_url == state.base_url and served.key_secret.get_secret_value() == key_value(state.api_key)
    other = resolve_endpoint(f"http://127.0.0.1:{free_port()}/v1", key=mine, serving=Served())
    assert other.key == mine
    launcher.stop(grace_s=5)
    assert resolve_endpoint(state.base_url, key=mine, serving=Served()).key == mine  # not running any more: not its key


def test_logs_and_failures_mask_a_key_the_engine_wrote_into_its_own_log(fake_bin, cleanup_endpoints, monkeypatch):
    key = "m3-team-key-0123456789WXYZ"
    monkeypatch.setenv("FAKE_ENGINE_LOG_KEY", "1")
    r = _serve("start", "--profile", "h200-tp8", "--port", str(free_port()), "--host", "0.0.0.0",
               "--skip-gpu-check", "--timeout", "30", env={"M3_AGENT_MODEL__API_KEY": key})
    assert r.returncode == 0, r.stderr
    assert key in Path(launcher.load_state().log_path).read_text()  # the engine's own line: the file is 0600
    logs = _serve("logs", "-n", "50")
    assert "server_args=ServerArgs(api_key='****WXYZ')" in logs.stdout and key not in logs.stdout
    launcher.stop(grace_s=5)
    monkeypatch.setenv("FAKE_ENGINE_MODE", "crash")
    r = _serve("start", "--profile", "h200-tp8", "--port", str(free_port()), "--host", "0.0.0.0",
               "--skip-gpu-check", "--timeout", "30", env={"M3_AGENT_MODEL__API_KEY": key})
    assert r.returncode == 3 and "| INFO server_args=ServerArgs(api_key='****WXYZ')" in r.stderr
    assert key not in r.stdout + r.stderr


def test_crash_ends_with_last_log_lines_and_likely_cause(fake_bin, cleanup_endpoints, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_MODE", "crash")
    with pytest.raises(EndpointError) as e:
        launcher.start(_cmd(free_port()), timeout_s=30)
    msg = str(e.value)
    assert "exited during start-up" in msg
    assert "| torch.OutOfMemoryError: CUDA out of memory" in msg
    assert "likely cause: GPU memory" in msg and "serve plan" in msg
    assert launcher.load_state() is None  # nothing left to stop


def test_timeout_reports_and_leaves_the_server_for_stop(fake_bin, cleanup_endpoints, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_MODE", "never-ready")
    start = time.monotonic()
    with pytest.raises(EndpointError, match=r"not ready after 2s; the server keeps running") as e:
        launcher.start(_cmd(free_port()), timeout_s=2)
    assert time.monotonic() - start < 10
    assert "last log lines" in str(e.value)
    state = launcher.load_state()
    assert state is not None and launcher.is_running(state)
    assert launcher.status().phase == "loading"
    launcher.stop(grace_s=5)
    assert _dead(state.pid)


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(fake_bin, cleanup_endpoints, tmp_path, monkeypatch):
    worker_file = tmp_path / "worker.pid"
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ignore-term")
    monkeypatch.setenv("FAKE_ENGINE_CHILD_PID_FILE", str(worker_file))
    state = launcher.start(_cmd(free_port()), timeout_s=30)
    worker = int(worker_file.read_text())
    t0 = time.monotonic()
    launcher.stop(grace_s=1)
    assert time.monotonic() - t0 >= 1  # SIGTERM was ignored for the whole grace period
    assert _dead(state.pid) and _dead(worker)


def test_seed_001_profile_starts_through_vllm_serve(fake_bin, cleanup_endpoints):
    cmd = build_command(get_profile("h200x4-fp8"), "native", Overrides(port=free_port(), host="127.0.0.1"))
    state = launcher.start(cmd, timeout_s=30)
    assert state.served_model_name == "minimax-m3"  # the seed's --served-model-name, read by the engine
    argv_line = next(line for line in launcher.tail(state.log_path, 50) if "fake engine argv:" in line)
    engine_args = argv_line.split("fake engine argv: ", 1)[1].split()
    assert engine_args[:2] == ["serve", "MiniMaxAI/MiniMax-M3"] and "--model" not in engine_args
    assert engine_args[2:4] == ["--served-model-name", "minimax-m3"]
    launcher.stop(grace_s=5)


def test_second_start_under_the_same_name_is_refused(fake_bin, cleanup_endpoints):
    launcher.start(_cmd(free_port()), timeout_s=30)
    with pytest.raises(UsageError, match="already running"):
        launcher.launch(_cmd(free_port()))


def test_missing_engine_is_an_endpoint_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("M3_AGENT_STATE_DIR", str(tmp_path / "state"))
    with pytest.raises(EndpointError, match="vllm is not on PATH"):
        launcher.launch(_cmd(free_port()))


def test_prepare_refuses_what_the_gpus_cannot_hold_unless_the_launch_forces_it():
    small = [GPU(index=i, name="NVIDIA H100 80GB HBM3", memory_gb=80, vendor="nvidia", kind="H100") for i in range(8)]
    with pytest.raises(UsageError, match="does not fit"):
        prepare("h200-tp8", Launch(), gpus=small)
    said: list[str] = []
    forced = prepare("h200-tp8", Launch(force=True), progress=lambda phase, msg: said.append(phase), gpus=small)
    assert said == ["gpus", "warning"]
    assert forced.argv == build_command(get_profile("h200-tp8"), "native").argv  # the profile's command, unchanged


def test_a_start_without_the_gpu_check_takes_the_window_of_the_profiles_own_machine():
    said: list[str] = []
    cmd = prepare("h200-tp8", Launch(check_gpus=False), progress=lambda phase, msg: said.append(msg))
    h200s = [GPU(index=i, name="NVIDIA H200", memory_gb=141, vendor="nvidia", kind="H200") for i in range(8)]
    assert cmd.argv == prepare("h200-tp8", Launch(), gpus=h200s).argv and "--max-model-len" in cmd.argv
    assert "the full 1048576-token window does not fit" in said[0]


def test_no_gpu_names_a_command_that_launches_anyway(capsys):
    from m3_agent.cli import main

    with pytest.raises(UsageError) as refused:
        prepare("h200-tp8", Launch(), gpus=[])
    advice = str(refused.value).split("`")[1]
    assert advice == "m3-agent serve start --profile h200-tp8 --skip-gpu-check"
    with pytest.raises(SystemExit) as done:  # the command it names takes those flags (shown as a dry run)
        main([*advice.split()[1:], "--dry-run"])
    assert done.value.code == 0 and "vllm serve" in capsys.readouterr().out


def test_ensure_endpoint_starts_once_then_reuses(fake_bin, cleanup_endpoints):
    o = Overrides(port=free_port(), host="127.0.0.1", served_model_name="minimax-m3")
    launch = Launch(overrides=o, check_gpus=False)
    events: list[str] = []
    url = ensure_endpoint(
        "h200-tp8", launch=launch, timeout_s=30, progress=lambda phase, msg: events.append(phase)
    )
    pid = launcher.load_state().pid
    assert "model listed" in events
    events.clear()
    again = ensure_endpoint(
        "h200-tp8", launch=launch, timeout_s=30, progress=lambda phase, msg: events.append(phase)
    )
    assert again == url and launcher.load_state().pid == pid and events == ["reuse"]
    with pytest.raises(EndpointError, match="runs profile h200-tp8, not b200"):
        ensure_endpoint("b200", launch=Launch(check_gpus=False))


def test_ensure_endpoint_uses_a_healthy_base_url_without_starting(fake_bin):
    with StandinServer({"turns": []}) as srv:
        assert ensure_endpoint("h200-tp8", base_url=srv.base_url, launch=Launch(check_gpus=False)) == srv.base_url
    assert launcher.load_state() is None


def test_cli_start_checks_gpus_and_caps_the_window_the_plan_allows(fake_nvidia_smi, cleanup_endpoints):
    port = free_port()
    r = _serve("start", "--profile", "h200-tp8", "--port", str(port), "--host", "127.0.0.1", "--timeout", "30")
    assert r.returncode == 0, r.stderr
    assert "gpus: 8x NVIDIA H200 (140.4 GB)" in r.stderr
    assert f"ready: http://127.0.0.1:{port}/v1" in r.stdout
    argv = launcher.load_state().argv
    window = int(argv[argv.index("--max-model-len") + 1])
    assert 262_144 < window < 1_048_576  # BF16 on 8x H200 cannot hold the full 1M window (see the planner)
    listed = [line.split("] ", 1)[1] for line in r.stderr.splitlines() if "model listed" in line]
    assert listed == [f"model listed: MiniMaxAI/MiniMax-M3 (max_model_len {window})"]  # once, not "model listed: model listed:"
    st = json.loads(_serve("status", "--json").stdout)
    assert st["max_model_len"] == window


def test_cli_start_refuses_without_gpus_and_when_the_plan_does_not_fit(fake_nvidia_smi, tmp_path):
    r = _serve("start", "--profile", "h200x2-fp8", "--port", str(free_port()))
    assert r.returncode == 2
    assert "does not fit" in r.stderr and "weights do not fit" in r.stderr
    fake_nvidia_smi.unlink()
    r = _serve("start", "--profile", "h200-tp8", "--port", str(free_port()))
    assert r.returncode == 2 and "no GPU found" in r.stderr and "--skip-gpu-check" in r.stderr
    assert launcher.load_state() is None


@pytest.mark.timeout(900)  # the session's sandbox image may have to be built first
def test_docker_runner_starts_a_named_container_and_stop_removes_it(docker_ready, sandbox_image, tmp_path, monkeypatch):
    monkeypatch.setenv("M3_AGENT_STATE_DIR", str(tmp_path / "state"))
    site = tmp_path / "site"
    (site / "v1").mkdir(parents=True)
    (site / "health").write_text("ok")
    (site / "v1" / "models").write_text(json.dumps({"data": [{"id": "minimax-m3", "max_model_len": 4096}]}))
    site.chmod(0o755)
    port = free_port()
    name = f"m3-agent-test-serve-{port}"
    # A stand-in for an engine image: the sandbox image's python answering /health and /v1/models.
    cmd = build_command(get_profile("b200"), "docker").model_copy(
        update={
            "argv": [
                "docker",
                "run",
                "-d",
                "--name",
                name,
                "--network",
                "host",
                "-v",
                f"{site}:/srv:ro",
                "-w",
                "/srv",
                sandbox_image,
                "python3",
                "-m",
                "http.server",
                str(port),
                "--bind",
                "127.0.0.1",
            ],
            "port": port,
            "container": name,
            "served_model_name": "minimax-m3",
        }
    )
    try:
        state = launcher.start(cmd, timeout_s=60)
        assert state.container == name and launcher.is_running(state)
        st = launcher.status()
        assert st.phase == "ready" and st.max_model_len == 4096
        stopped = _serve("stop", "--grace", "2")
        assert stopped.returncode == 0 and f"container {name}" in stopped.stdout
        gone = subprocess.run(["docker", "inspect", name], capture_output=True)
        assert gone.returncode != 0  # stopped and removed
        assert state.log_follower_pid is not None and _dead(state.log_follower_pid)
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def test_logs_follow_ends_when_the_server_ends(fake_bin, cleanup_endpoints):
    launcher.start(_cmd(free_port()), timeout_s=30)
    follower = subprocess.Popen(
        [sys.executable, "-m", "m3_agent.serving", "logs", "--follow", "-n", "2"],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    time.sleep(3)  # the follower is reading the live log by now
    assert follower.poll() is None
    launcher.stop(grace_s=5)
    out, _ = follower.communicate(timeout=20)
    assert follower.returncode == 0 and "Application startup complete" in out


def test_an_engine_that_cannot_be_executed_is_an_endpoint_error(fake_bin):
    (fake_bin / "vllm").write_text("#!/nonexistent/interpreter\n")  # executable, but exec fails
    with pytest.raises(EndpointError, match="cannot run vllm"):
        launcher.launch(_cmd(free_port()))


@pytest.mark.parametrize(
    "line,cause",
    [
        ("ValueError: No common block size for 16", "--block-size 128"),
        (
            "ValueError: The model's max seq len (1048576) is larger than the maximum number of tokens that can be "
            "stored in KV cache (550400)",
            "cannot hold --max-model-len",
        ),
        ("OSError: [Errno 98] Address already in use", "port is taken"),
        ("serve: error: argument --tool-call-parser: invalid choice: 'minimax_m3'", "no minimax_m3 parsers"),
        ("huggingface_hub.errors.GatedRepoError: 401 Client Error. Cannot access gated repo", "HF_TOKEN"),
        ("RuntimeError: No CUDA GPUs are available", "no usable GPU"),
        ("vllm: error: unrecognized arguments: --language-model-only", "rejected a flag"),
        ("torch.distributed.DistBackendError: NCCL error in: ...", "NCCL"),
    ],
)
def test_likely_cause_names_the_fix(line, cause):
    assert cause in launcher.likely_cause(["INFO starting", line])


def test_likely_cause_of_a_silent_sigkill_is_host_memory():
    assert "host RAM" in launcher.likely_cause(["Loading weights"], returncode=137)
    assert launcher.likely_cause(["nothing useful"]).startswith("unknown")
