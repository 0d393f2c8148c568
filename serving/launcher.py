"""Start an M3 server, watch it come up, and find it again from another shell.

`start` launches the engine in its own process group (native) or as a named container (docker),
streams its output to a log file, and waits through the phases a real server goes through:
launching -> loading (connection refused, then 503) -> healthy (/health 200) -> model listed
(/v1/models names the served model). A state file (one per endpoint name) records the process
group or container, so `status`, `logs` and `stop` work from any shell.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, FieldSerializationInfo, field_serializer

from m3_agent.agent.endpoint import EndpointClient
from m3_agent.errors import EndpointError, UsageError
from m3_agent.redact import redact
from m3_agent.agent.access import ApiKey, client_host, key_value
from m3_agent.serving.profiles import Command

Phase = Literal["launching", "loading", "healthy", "ready", "failed", "exited", "stopped"]
Progress = Callable[[str, str], None]
DEFAULT_NAME = "default"
NO_HEALTH_ENGINES = {"llama-cpp"}  # llama-cpp-python's server: ready once /v1/models lists the model
LOG_TAIL = 20


class ServeState(BaseModel):
    """What `start` recorded about a launch: enough for another process to find and stop it."""

    name: str
    profile: str
    engine: str
    runner: Literal["native", "docker"]
    argv: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    pid: int | None = None
    pid_started: str | None = Field(None, description="the process start time, against pid reuse")
    container: str | None = None
    log_follower_pid: int | None = None
    log_path: str
    base_url: str
    served_model_name: str
    started_at: float
    host: str | None = Field(None, description="the address the server listens on; None: an older record")
    api_key: ApiKey | None = Field(None, description="the key it requires (clients read it from here)")

    def redacted(self, text: str) -> str:
        """`text` with this endpoint's key masked (SGLang writes its --api-key into its own log)."""
        return redact(text, [key_value(self.api_key)])

    @field_serializer("argv", when_used="json")
    def _argv(self, argv: list[str], info: FieldSerializationInfo) -> list[str]:
        # SGLang's key is an argument: in clear only in the state file itself
        return argv if (info.context or {}).get("secrets") else [self.redacted(a) for a in argv]


class EndpointStatus(BaseModel):
    """A live look at a recorded endpoint."""

    state: ServeState | None
    running: bool
    phase: Phase | None = None
    models: list[str] = Field(default_factory=list)
    max_model_len: int | None = None
    detail: str = ""


def state_dir() -> Path:
    """Where state files and logs live: $M3_AGENT_STATE_DIR, else $XDG_STATE_HOME/m3-agent/serve."""
    if os.environ.get("M3_AGENT_STATE_DIR"):
        return Path(os.environ["M3_AGENT_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "m3-agent" / "serve"


def state_path(name: str) -> Path:
    """The state file of endpoint `name` (it holds the endpoint's key: mode 0600)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name.startswith("."):
        raise UsageError(f"bad endpoint name {name!r}: use letters, digits, '.', '_' or '-'")
    return state_dir() / f"{name}.json"


def load_state(name: str = DEFAULT_NAME) -> ServeState | None:
    """The recorded launch called `name`, None when there is none."""
    path = state_path(name)
    if not path.exists():
        return None
    try:
        return ServeState.model_validate_json(path.read_text())
    except ValueError as e:
        raise UsageError(f"state file {path} is damaged ({e}); delete it and start again") from None


def recorded() -> list[ServeState]:
    """Every launch recorded in the state folder (damaged files skipped), by name."""
    found = []
    for path in sorted(state_dir().glob("*.json")) if state_dir().is_dir() else []:
        try:
            found.append(ServeState.model_validate_json(path.read_text()))
        except (OSError, ValueError):
            continue
    return found


def private_file(path: Path) -> int:
    """Open `path` for writing, emptied, readable by this user only (0600, also when it existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def _save_state(state: ServeState) -> None:
    path = state_path(state.name)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with os.fdopen(private_file(tmp), "w") as f:  # it holds the endpoint's key
        f.write(state.model_dump_json(indent=2, context={"secrets": True}))
    tmp.replace(path)  # atomic: a reader never sees half a file


def _proc_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the parenthesised command name (the state first); None: not found."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _proc_started(pid: int) -> str | None:
    fields = _proc_stat(pid)
    return fields[19] if fields else None  # field 22: the start time


def _pid_alive(pid: int, started: str | None = None) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # reap our own child so it does not linger as a zombie
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if (_proc_stat(pid) or [""])[0] == "Z":
        return False
    return started is None or _proc_started(pid) in (None, started)


def _group_alive(pgid: int) -> bool:
    """True while a live (not zombie) process is in the group."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc.iterdir():
        fields = _proc_stat(entry.name) if entry.name.isdigit() else None
        if fields and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _docker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    if shutil.which("docker") is None:
        raise EndpointError("docker is not installed or not on PATH: install it, or use --runner native")
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def _container_running(name: str) -> bool:
    r = _docker("inspect", "-f", "{{.State.Running}}", name)
    return r.returncode == 0 and r.stdout.strip() == "true"


def is_running(state: ServeState) -> bool:
    """True while the engine process (or its container) is alive."""
    if state.runner == "docker":
        return bool(state.container) and _container_running(state.container)
    return state.pid is not None and _pid_alive(state.pid, state.pid_started)


def probe(
    base_url: str, served_model_name: str | None = None, timeout_s: float = 3.0, *, api_key: str | None = None
) -> tuple[Phase, list[str], int | None]:
    """One look at a server: loading (refused or 503), healthy, or ready (the model is listed).

    /health answers without a key on vLLM and SGLang; /v1/models needs `api_key` when the server has one.
    A server without /health (llama-cpp-python's) is ready once /v1/models lists the model.
    """
    endpoint = EndpointClient(base_url, api_key=api_key, timeout=timeout_s)
    health = endpoint.health()
    if health is False:
        return "loading", [], None
    try:
        served = endpoint.models()
    except EndpointError:
        served = []
    if health is None and not served:
        return "loading", [], None  # no /health: until it lists a model, the server is still coming up
    models = [m.id for m in served]
    max_len = next((m.max_model_len for m in served if m.max_model_len), None)
    listed = bool(models) if served_model_name is None else served_model_name in models
    return ("ready" if listed else "healthy"), models, max_len


def tail(path: str | Path, lines: int = LOG_TAIL) -> list[str]:
    """The last `lines` lines of a log file (empty when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


# (pattern in the log, the likely cause and what to do), most specific first.
_CAUSES: list[tuple[str, str]] = [
    (r"No common block size|block.size.*mismatch",
     "KV block size: MSA needs --block-size 128 (vLLM) / --page-size 128 (SGLang)"),
    (r"larger than the maximum number of tokens that can be stored in KV cache"
     r"|No available memory for the cache blocks|KV cache is needed|insufficient.*KV cache",
     "the KV cache cannot hold --max-model-len: lower it or add --kv-cache-dtype fp8 (see `m3-agent serve plan`)"),
    (r"out of memory|OutOfMemoryError|CUDA error: out of memory|HIP out of memory",
     "GPU memory: lower --max-model-len, use --kv-cache-dtype fp8 or a smaller precision, or add GPUs "
     "(see `m3-agent serve plan`)"),
    (r"Address already in use|address already in use|bind.*in use",
     "the port is taken: pass --port, or stop the server already on it"),
    (r"invalid choice: '?minimax[_-]m3|(tool|reasoning).?parser.*minimax[_-]m3.*(not|invalid|unknown)"
     r"|KeyError: '?minimax[_-]m3",
     "this engine version has no minimax_m3 parsers: use the minimax-m3 docker image or a newer release"),
    (r"does not recognize this architecture|model type `?minimax_m3|MiniMaxM3.*not supported",
     "this engine version does not know MiniMax-M3: use the minimax-m3 docker image or a newer release"),
    (r"unrecognized arguments|error: argument|No such option",
     "the engine rejected a flag: its version is older than the flags M3 needs; use the minimax-m3 image"),
    (r"401|403|gated repo|Access to model .* is restricted|Repository Not Found|HF_TOKEN",
     "Hugging Face access: export HF_TOKEN and accept the model's license, or pass a local --model path"),
    (r"No CUDA GPUs are available|Found no NVIDIA driver|no ROCm-capable device|CUDA driver version is insufficient"
     r"|could not select device driver",
     "no usable GPU: check nvidia-smi / rocm-smi, the driver, and (docker) the NVIDIA container toolkit"),
    (r"fa4|FlashAttention-4|illegal memory access|cudaErrorIllegalAddress",
     "an attention kernel faulted: on CUDA 13 SGLang's fa4 faults (seed 000); use the vLLM engine"),
    (r"NCCL error|NCCL WARN|ncclSystemError|ncclInternalError",
     "GPU communication (NCCL): check every GPU is visible, --ipc=host and enough shared memory"),
    (r"No space left on device", "the disk is full: free space for the weights (~860 GB in BF16)"),
    (r"command not found|No module named '?(vllm|sglang)",
     "the engine is not installed here: install it, or use --runner docker"),
]


def likely_cause(lines: list[str], returncode: int | None = None) -> str:
    """The most likely reason a launch failed, from its last log lines and exit code."""
    text = "\n".join(lines)
    for pattern, cause in _CAUSES:
        if re.search(pattern, text):
            return cause
    if returncode in (-signal.SIGKILL, 137):
        return "the process was killed (SIGKILL): host RAM may have run out while loading weights"
    return "unknown: read the log lines above"


def _failure(state: ServeState, what: str, returncode: int | None = None) -> EndpointError:
    lines = [state.redacted(line) for line in tail(state.log_path)]
    shown = "\n".join(f"  | {line}" for line in lines) or "  | (the log is empty)"
    return EndpointError(
        f"{what}\nlast log lines ({state.log_path}):\n{shown}\nlikely cause: {likely_cause(lines, returncode)}"
    )


def _launch_native(cmd: Command, log_path: Path) -> tuple[int, str | None]:
    exe = cmd.argv[0]
    found = shutil.which(exe)
    if found is None:
        raise EndpointError(f"{exe} is not on PATH: install {cmd.engine} here, or use --runner docker")
    env = {**os.environ, **cmd.launch_env()}
    with open(log_path, "ab") as log:
        log.write(f"$ {cmd.shell()}\n".encode())
    try:
        # The program found above, not a second PATH search that would skip it when it cannot run.
        pid = _spawn([found, *cmd.argv[1:]], log_path, env)
    except OSError as e:
        raise EndpointError(f"cannot run {exe}: {e.strerror or e}") from None
    return pid, _proc_started(pid)


def _spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> int:
    """Start `argv` detached, its output appended to `log_path`; its pid.

    A new session makes it a process-group leader: stop ends the group, workers included.
    """
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True).pid


def _launch_docker(cmd: Command, log_path: Path) -> int:
    name = cmd.container or ""
    if _docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip() == "false":
        _docker("rm", name)  # a stopped leftover of an earlier launch would block the name
    argv = [os.path.expanduser(a) if a.startswith("~/") else a for a in cmd.argv]  # the seed's -v ~/.cache/...
    # the docker client's environment carries the key to `-e VLLM_API_KEY`: argv never holds it
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, env={**os.environ, **cmd.launch_env()})
    with open(log_path, "ab") as log:
        log.write(f"$ {cmd.shell()}\n{r.stdout}{r.stderr}".encode())
    if r.returncode != 0:
        raise EndpointError(
            f"docker run failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
        )
    return _spawn(["docker", "logs", "-f", name], log_path)


def launch(cmd: Command, *, name: str = DEFAULT_NAME) -> ServeState:
    """Start `cmd` detached and record it (its key too, mode 0600); does not wait (see `wait_ready`)."""
    existing = load_state(name)
    if existing and is_running(existing):
        raise UsageError(
            f"endpoint {name!r} is already running ({existing.profile}, {existing.base_url}); "
            f"`m3-agent serve stop` it first, or pass --name"
        )
    directory = state_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    log_path = directory / f"{name}.log"
    os.close(private_file(log_path))  # SGLang logs its server args, the key among them
    state = ServeState(name=name, profile=cmd.profile, engine=cmd.engine, runner=cmd.runner, argv=cmd.argv,
                       env=cmd.env, container=cmd.container, log_path=str(log_path),
                       base_url=f"http://{client_host(cmd.host)}:{cmd.port}/v1",
                       served_model_name=cmd.served_model_name, started_at=time.time(), host=cmd.host,
                       api_key=cmd.api_key)
    if cmd.runner == "native":
        state.pid, state.pid_started = _launch_native(cmd, log_path)
    else:
        state.log_follower_pid = _launch_docker(cmd, log_path)
    _save_state(state)
    return state


def wait_ready(
    state: ServeState, *, timeout_s: float, progress: Progress | None = None, poll_s: float = 0.5
) -> ServeState:
    """Wait until the server lists its model; on exit or timeout raise with the last log lines."""
    say = progress or (lambda phase, msg: None)
    deadline = time.monotonic() + timeout_s
    shown: Phase | None = None
    last_line = ""
    health = state.engine not in NO_HEALTH_ENGINES
    say("launching", f"{state.engine} ({state.runner}), log: {state.log_path}")
    while True:
        if not is_running(state):
            code = _exit_code(state)
            with_code = f" (exit code {code})" if code is not None else ""
            raise _failure(state, f"the {state.engine} server exited during start-up{with_code}", code)
        phase, models, max_len = probe(state.base_url, state.served_model_name, api_key=key_value(state.api_key))
        if phase == "ready" and shown == "loading" and health:
            say("healthy", "/health answers 200")  # both came up between two polls
        if phase != shown:
            shown = phase
            detail = {
                "loading": f"waiting for {'/health' if health else 'the model in /v1/models'} (weights loading)",
                "healthy": "/health answers 200; waiting for the model in /v1/models",
                "ready": ", ".join(models) + (f" (max_model_len {max_len})" if max_len else ""),  # after "model listed: "
            }[phase]
            say("model listed" if phase == "ready" else phase, detail)
        if phase == "ready":
            return state
        lines = [state.redacted(line) for line in tail(state.log_path, 1)]
        if phase == "loading" and lines and lines[-1] != last_line:
            last_line = lines[-1]
            say("log", last_line[:160])
        if time.monotonic() >= deadline:
            raise _failure(
                state,
                f"not ready after {timeout_s:g}s; the server keeps running "
                f"(`m3-agent serve status`, `m3-agent serve stop --name {state.name}`)",
            )
        time.sleep(poll_s)


def _exit_code(state: ServeState) -> int | None:
    if state.runner == "docker" and state.container:
        r = _docker("inspect", "-f", "{{.State.ExitCode}}", state.container)
        return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().lstrip("-").isdigit() else None
    return None


def start(cmd: Command, *, name: str = DEFAULT_NAME, timeout_s: float = 1800,
          progress: Progress | None = None) -> ServeState:
    """Launch `cmd` and wait for it; on a crash the leftovers are stopped, on a timeout it keeps running."""
    state = launch(cmd, name=name)
    try:
        return wait_ready(state, timeout_s=timeout_s, progress=progress)
    except EndpointError:
        if not is_running(state):
            stop(name, grace_s=2)  # reap workers and the log follower the crashed leader left behind
        raise


def status(name: str = DEFAULT_NAME) -> EndpointStatus:
    """The recorded endpoint, whether it runs, and what its HTTP side answers."""
    state = load_state(name)
    if state is None:
        return EndpointStatus(state=None, running=False, detail=f"no endpoint {name!r} recorded in {state_dir()}")
    if not is_running(state):
        return EndpointStatus(
            state=state,
            running=False,
            phase="exited",
            detail=f"the server is not running; last log line: {state.redacted(' '.join(tail(state.log_path, 1)))}",
        )
    phase, models, max_len = probe(state.base_url, state.served_model_name, api_key=key_value(state.api_key))
    return EndpointStatus(state=state, running=True, phase=phase, models=models, max_model_len=max_len)


def _end_group(pid: int, grace_s: float) -> None:
    """SIGTERM the process group, and SIGKILL it when it outlives `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            _pid_alive(pid)  # reaps the leader when it is our own child
            if not _group_alive(pid):
                return
            time.sleep(0.1)


def stop(name: str = DEFAULT_NAME, *, grace_s: float = 20) -> ServeState | None:
    """End the whole process group (SIGTERM, then SIGKILL after `grace_s`) or the container; forget it."""
    state = load_state(name)
    if state is None:
        return None
    if state.runner == "docker" and state.container:
        _docker("stop", "-t", str(int(grace_s)), state.container, timeout=grace_s + 60)
        _docker("rm", "-f", state.container)
    elif state.pid is not None and (state.pid_started is None or _proc_started(state.pid) in (None, state.pid_started)):
        _end_group(state.pid, grace_s)
    if state.log_follower_pid:
        _end_group(state.log_follower_pid, 2)
    state_path(name).unlink(missing_ok=True)
    return state


def follow(path: str | Path, *, until: Callable[[], bool], emit: Callable[[str], None], poll_s: float = 0.5) -> None:
    """Print lines appended to `path` until `until()` is true (the server ended) or Ctrl-C."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        while True:
            chunk = f.read()
            if chunk:
                for line in chunk.decode("utf-8", "replace").splitlines():
                    emit(line)
            elif until():
                return
            else:
                time.sleep(poll_s)
