"""From a profile name to a healthy M3 base URL: check the machine, plan, launch, or reuse what runs.

`Served` is serving's part in endpoint resolution (`m3_agent.agent.access.resolve_endpoint`, which
`m3-agent fix` and `m3-agent eval run` call): with `--serve PROFILE` the base URL (ending in /v1) of a
server that lists its model (`ensure_endpoint`), and for any URL the key the serve state recorded
when `m3-agent serve start` launched the server there, and the window that launch gave it (for a
server whose /v1/models does not say it).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, Field

from m3_agent.agent.access import LOOPBACK, ApiKey, choose_key, key_value
from m3_agent.errors import EndpointError, UsageError
from m3_agent.serving import launcher, llamacpp
from m3_agent.serving.gpus import GPU, detect_gpus, summary
from m3_agent.serving.planner import AMD_NATIVE_CONTEXT, NATIVE_CONTEXT, Plan, PlanRequest, gpu_memory_for, plan
from m3_agent.serving.profiles import Command, Engine, Overrides, Profile, Runner, build_command, flag_value, get_profile

DEFAULT_TIMEOUT_S = 1800.0


def _same_server(a: str, b: str) -> bool:
    def norm(url: str) -> tuple:
        u = urllib.parse.urlsplit(url.rstrip("/"))
        host = "127.0.0.1" if u.hostname == "localhost" else u.hostname
        return u.scheme, host, u.port, u.path
    return norm(a) == norm(b)


def recorded_key(base_url: str) -> ApiKey | None:
    """The key of the running endpoint `m3-agent serve start` recorded at `base_url`, if it has one."""
    for state in launcher.recorded():
        if state.api_key is not None and _same_server(state.base_url, base_url) and launcher.is_running(state):
            path = launcher.state_path(state.name)
            return state.api_key.model_copy(update={"source": f"the serve state of endpoint {state.name!r} ({path})"})
    return None


# the flag that sets the window, per engine: vLLM, SGLang, llama-cpp-python
WINDOW_FLAGS = ("--max-model-len", "--context-length", "--n_ctx")


def recorded_window(base_url: str) -> int | None:
    """The context window `m3-agent serve start` gave the running server at `base_url` (its window flag),
    None when no launch is recorded there or it set none: llama-cpp-python's /v1/models does not say it."""
    for state in launcher.recorded():
        if _same_server(state.base_url, base_url) and launcher.is_running(state):
            value = next((v for v in (flag_value(state.argv, f) for f in WINDOW_FLAGS) if v), None)
            return int(value) if value and value.isdigit() and int(value) > 0 else None
    return None


def plan_request(profile: Profile, cmd: Command, gpu_count: int, gpu_memory_gb: float) -> PlanRequest:
    """The planner's question for a rendered command on a given machine."""
    args = cmd.argv
    length = flag_value(args, "--max-model-len") or flag_value(args, "--context-length")
    util = flag_value(args, "--gpu-memory-utilization") or flag_value(args, "--mem-fraction-static")
    kv = flag_value(args, "--kv-cache-dtype") or "auto"
    overrides = flag_value(args, "--hf-overrides") or ""
    native = AMD_NATIVE_CONTEXT if profile.platform == "amd" and "yarn" not in overrides else NATIVE_CONTEXT
    return PlanRequest(gpus=gpu_count, gpu_memory_gb=gpu_memory_gb, precision=profile.precision, kv_dtype=kv,
                       max_model_len=int(length) if length else None,
                       gpu_memory_utilization=float(util) if util else 0.9,
                       text_only="--language-model-only" in args, native_context=native)


def profile_plan(profile: Profile, cmd: Command) -> Plan:
    """The plan for `cmd` on the machine the profile is written for (its GPU count and kind)."""
    return plan(plan_request(profile, cmd, profile.gpus, gpu_memory_for(profile.gpu)))


def sized(profile: Profile, runner: Runner, o: Overrides, p: Plan) -> tuple[Command, str | None]:
    """The command with the window the plan chose, and why, when the profile and flags set none and the
    full window does not fit (vLLM refuses to start when one full-length sequence cannot fit its KV cache)."""
    if not p.fits or p.request.max_model_len is not None or p.max_model_len >= p.request.native_context:
        return build_command(profile, runner, o), None
    why = (f"the full {p.request.native_context}-token window does not fit; --max-model-len {p.max_model_len}, "
           f"the largest that does (`m3-agent serve plan --profile {profile.name}`)")
    return build_command(profile, runner, o.model_copy(update={"max_model_len": p.max_model_len})), why


def preflight(profile: Profile, cmd: Command, gpus: list[GPU]) -> Plan:
    """Refuse a launch this machine cannot hold; the plan says what would fit."""
    if not gpus:
        raise UsageError(
            f"{summary(gpus)}; profile {profile.name} needs {profile.gpus} GPUs: to launch it anyway, "
            f"`m3-agent serve start --profile {profile.name} --skip-gpu-check` (then --serve {profile.name} reuses it)"
        )
    if len(gpus) < profile.gpus:
        raise UsageError(f"profile {profile.name} needs {profile.gpus} GPUs, this machine has {summary(gpus)}")
    memory = min(g.memory_gb for g in gpus)
    p = plan(plan_request(profile, cmd, profile.gpus, memory))
    if not p.fits:
        raise UsageError(f"profile {profile.name} does not fit {summary(gpus)}: {p.reason} (--force launches anyway)")
    return p


class Launch(BaseModel):
    """How to launch a profile: its engine and runner, what to change on top of it, and the GPU checks."""

    engine: Engine | None = Field(None, description="vllm or sglang; None: the profile's own")
    runner: Runner = "native"
    overrides: Overrides = Field(default_factory=Overrides)
    check_gpus: bool = Field(True, description="check this machine's GPUs against the plan first")
    force: bool = Field(False, description="launch even when the plan says the profile does not fit")


def prepare(profile_name: str, launch: Launch | None = None, *, progress: launcher.Progress | None = None,
            gpus: list[GPU] | None = None) -> Command:
    """The command to launch for a profile on this machine, after the GPU and memory checks.

    `gpus` is what `detect_gpus()` found, when the caller already asked. When the profile sets no
    window and the full 1M window does not fit, the largest window that does is set (vLLM refuses
    to start when one full-length sequence cannot fit the KV cache).
    """
    say = progress or (lambda phase, msg: None)
    launch = launch or Launch()
    profile, runner, o = get_profile(profile_name, launch.engine), launch.runner, launch.overrides
    if o.api_key is None:  # a host other machines reach gets a key (None on loopback)
        o = o.model_copy(update={"api_key": choose_key(o.host or LOOPBACK)})
    if profile.engine == "llama-cpp":
        build_command(profile, runner, o)  # refuses what a CPU profile cannot take before a long build
        say("warning", llamacpp.TOY_NOTE)
        llamacpp.ensure_built(say)
        return build_command(profile, runner, o)  # no GPU to check
    cmd = build_command(profile, runner, o)
    if not launch.check_gpus:  # no GPUs to ask: the window is the one the profile's own machine takes
        p = profile_plan(profile, cmd)
    else:
        gpus = detect_gpus() if gpus is None else gpus
        say("gpus", summary(gpus))
        try:
            p = preflight(profile, cmd, gpus)
        except UsageError:
            if launch.force:
                say("warning", "the plan says this does not fit; launching anyway (--force)")
                return cmd
            raise
    cmd, why = sized(profile, runner, o, p)
    if why:
        say("plan", why)
    return cmd


def ensure_endpoint(
    profile: str,
    *,
    base_url: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: launcher.Progress | None = None,
    name: str = launcher.DEFAULT_NAME,
    launch: Launch | None = None,
    key: ApiKey | None = None,
) -> str:
    """A healthy base URL for `profile`: the one given, the one recorded under `name`, or a new launch.

    `key` (the configured one) is sent to `base_url` when no serve state records a key for it.
    Raises EndpointError when the server cannot be brought up (with its last log lines and the
    likely cause) and UsageError for a bad profile or a machine that cannot hold it.
    """
    say = progress or (lambda phase, msg: None)
    if base_url and launcher.probe(base_url, api_key=key_value(recorded_key(base_url) or key))[0] == "ready":
        say("reuse", f"healthy endpoint at {base_url}")
        return base_url
    state = launcher.load_state(name)
    if state is not None and launcher.is_running(state):
        if state.profile != profile:
            raise EndpointError(
                f"endpoint {name!r} runs profile {state.profile}, not {profile}: "
                f"`m3-agent serve stop --name {name}` it, or use --serve {state.profile}"
            )
        if launcher.probe(state.base_url, state.served_model_name, api_key=key_value(state.api_key))[0] != "ready":
            say("wait", f"endpoint {name!r} is still starting; waiting for it")
            launcher.wait_ready(state, timeout_s=timeout_s, progress=progress)
        else:
            say("reuse", f"healthy endpoint {name!r} at {state.base_url}")
        return state.base_url
    cmd = prepare(profile, launch, progress=progress)
    return launcher.start(cmd, name=name, timeout_s=timeout_s, progress=progress).base_url


@dataclass
class Served:
    """Serving's answers to endpoint resolution (`agent.access.Launcher`): the serve states' keys and, for
    `profile` (`--serve`), its server launched or reused; `notice` hears what serving does."""

    profile: str | None = None
    notice: Callable[[str], None] | None = None

    def ensure(self, base_url: str | None, key: ApiKey | None) -> str | None:
        """The profile's healthy base URL (`base_url` reused if it answers); `base_url` without a profile."""
        if not self.profile:
            return base_url
        notice = self.notice or (lambda message: None)
        return ensure_endpoint(self.profile, base_url=base_url, key=key,
                               progress=lambda phase, message: notice(
                                   f"serve: {'model listed: ' if phase == 'model listed' else ''}{message}"))

    recorded_key = staticmethod(recorded_key)
    recorded_window = staticmethod(recorded_window)
