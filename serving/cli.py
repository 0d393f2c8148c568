"""`m3-agent serve start | status | logs | stop | plan | bench | profiles`: a thin layer over the library."""

from __future__ import annotations

import time
from typing import Optional

import typer
from pydantic import ValidationError
from rich.console import Console

from m3_agent.errors import EndpointError, UsageError, first_validation_error
from m3_agent.serving import launcher, llamacpp
from m3_agent.agent.access import ENGINE_CAVEATS, KEY_ENV, LOOPBACK, ApiKey, choose_key, describe_access, key_value
from m3_agent.serving.bench import run_bench, table
from m3_agent.serving.endpoint import DEFAULT_TIMEOUT_S, Launch, plan_request, prepare, profile_plan, sized
from m3_agent.serving.gpus import auto_profile, detect_gpus, summary
from m3_agent.serving.loadgen import LoadConfig
from m3_agent.serving.multinode import eval_pool_step, ray_tensor_parallel, replica_host, replicas_behind_router
from m3_agent.serving.planner import BYTES_PER_PARAM, M3_PARAMS_B, Plan, PlanRequest, describe, gpu_memory_for, plan
from m3_agent.serving.profiles import ALL_PROFILES, SEEDS, Overrides, Profile, build_command, flag_value, get_profile

app = typer.Typer(no_args_is_help=True, help="Launch, plan and benchmark a self-hosted M3 endpoint.")
# markup off: printed text is paths, commands and log lines, whose brackets are not rich markup
out = Console(highlight=False, soft_wrap=True, markup=False)
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)

NameOpt = typer.Option(launcher.DEFAULT_NAME, "--name", help="Endpoint name (one state file per name).")


def _progress(phase: str, message: str) -> None:
    err.print(f"[{time.strftime('%H:%M:%S')}] {phase}: {message}")


def _check_choice(value: str | None, choices: tuple[str, ...], flag: str) -> None:
    if value is not None and value not in choices:
        raise UsageError(f"{flag} must be one of: {', '.join(choices)} (got {value!r})")


def _window(p: Profile) -> str:
    """The window `serve start` takes on the profile's own machine, as `serve plan` says."""
    if p.gpus == 0:  # a CPU profile: the window its command sets
        return f"{int(flag_value(p.args, '--n_ctx') or 0) // 1024}K"
    fit = profile_plan(p, build_command(p, "native", Overrides()))
    if not fit.fits:
        return "does not fit"
    return "1M" if fit.max_model_len >= 1_048_576 else f"{fit.max_model_len // 1024}K"


@app.command("profiles")
def profiles_command() -> None:
    """List the hardware profiles, the window each gets on its machine, and the seed each comes from."""
    row = "{:24} {:9} {:10} {:9} {:12} {}"
    out.print(row.format("profile", "engine", "GPUs", "precision", "window", "what  [from]"))
    for p in ALL_PROFILES:
        out.print(row.format(p.name, p.engine, f"{p.gpus}x {p.gpu}" if p.gpus else p.gpu, p.precision, _window(p),
                             f"{p.summary}  [{p.source}]"))
    out.print("window: what `serve start` gives the model on the profile's GPUs: the profile's --max-model-len, or the "
              "largest that fits (`m3-agent serve plan --profile NAME` shows why)")
    for number, guide in SEEDS.items():
        out.print(f"seed {number}: {guide}")


@app.command("start")
def start_command(
    profile: Optional[str] = typer.Option(
        None, "--profile", "-p", help="Hardware profile (`serve profiles`); default: picked from the GPUs found."
    ),
    engine: Optional[str] = typer.Option(None, "--engine", help="vllm, sglang or llama-cpp (default: the profile's first)."),
    runner: str = typer.Option("native", "--runner", help="native (engine installed here) or docker."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the exact command and exit."),
    nodes: int = typer.Option(1, "--nodes", help="With --dry-run: vLLM tensor parallel across N nodes on Ray."),
    replicas: int = typer.Option(1, "--replicas", help="With --dry-run: N single-node replicas behind a router."),
    model: Optional[str] = typer.Option(None, "--model", help="Checkpoint (repo id or local path)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name"),
    port: Optional[int] = typer.Option(None, "--port"),
    host: Optional[str] = typer.Option(None, "--host", help="Address the engine binds (default 127.0.0.1: this "
                                       "machine only; any other needs an API key)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help=f"Key the server requires (default when --host "
                                          f"lets others in: ${KEY_ENV}, else a new one, kept in the serve state)."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Context window (see `serve plan`)."),
    kv_cache_dtype: Optional[str] = typer.Option(None, "--kv-cache-dtype", help="e.g. fp8 (~1.5-2x the KV pool)."),
    gpu_memory_utilization: Optional[float] = typer.Option(None, "--gpu-memory-utilization"),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor parallel size."),
    text_only: bool = typer.Option(False, "--text-only", help="--language-model-only: skip the vision encoder."),
    extra_arg: list[str] = typer.Option([], "--extra-arg", help="One more engine argument (repeatable)."),
    name: str = NameOpt,
    timeout: float = typer.Option(DEFAULT_TIMEOUT_S, "--timeout", help="Seconds to wait for the model to be listed."),
    skip_gpu_check: bool = typer.Option(False, "--skip-gpu-check", help="Launch without nvidia-smi/rocm-smi checks."),
    force: bool = typer.Option(False, "--force", help="Launch (or with --dry-run print) even when the plan says it "
                               "does not fit."),
) -> None:
    """Launch M3 and wait until it lists its model; `--dry-run` prints the command instead."""
    _check_choice(engine, ("vllm", "sglang", "llama-cpp"), "--engine")
    _check_choice(runner, ("native", "docker"), "--runner")
    key = choose_key(host or LOOPBACK, api_key, shared=nodes > 1 or replicas > 1)
    o = Overrides(model=model, served_model_name=served_model_name, port=port, host=host, api_key=key,
                  max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype,
                  gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tp, text_only=text_only,
                  extra_args=extra_arg)
    profile, gpus = _pick_profile(profile)
    if dry_run:
        _dry_run(profile, engine, runner, o, nodes=nodes, replicas=replicas, force=force)
        return
    if nodes > 1 or replicas > 1:
        raise UsageError("--nodes and --replicas print multi-node commands: add --dry-run and run them per node")
    launch = Launch(engine=engine, runner=runner, overrides=o, check_gpus=not skip_gpu_check, force=force)
    cmd = prepare(profile, launch, progress=_progress, gpus=gpus)
    _progress("command", cmd.shell())
    _progress("access", describe_access(cmd.host, cmd.api_key))
    if cmd.api_key is not None:
        _progress("warning", ENGINE_CAVEATS[cmd.engine])
    _ready(launcher.start(cmd, name=name, timeout_s=timeout, progress=_progress))


def _ready(state: launcher.ServeState) -> None:
    """Where the started endpoint answers, and where its key is kept (never the key itself)."""
    name = state.name
    out.print(f"ready: {state.base_url} (model {state.served_model_name}); logs: m3-agent serve logs --name {name}")
    if state.api_key is not None:
        out.print(f"key: {state.api_key.shown}, kept in {launcher.state_path(name)} (mode 0600); `fix` and "
                  f"`eval run` on this machine send it by themselves")


def _pick_profile(profile: str | None) -> tuple[str, list | None]:
    """The profile asked for, or the one that fits this machine's GPUs (and the GPUs found)."""
    if profile is not None:
        return profile, None
    gpus = detect_gpus()
    picked = auto_profile(gpus)
    if picked is None:
        raise UsageError(f"no profile for this machine ({summary(gpus)}): pass --profile (see `m3-agent serve profiles`)")
    _progress("profile", f"{picked} for {summary(gpus)}")
    return picked, gpus


def _entry_point_note(p: Profile) -> str | None:
    """A comment for a profile whose seed starts the engine through an entry point since deprecated."""
    if not p.seed_launcher:
        return None
    engine = {"vllm": "vLLM", "sglang": "SGLang"}[p.engine]
    now = " ".join(p.launcher) + (" MODEL" if p.model_flag is None else f" {p.model_flag} MODEL")
    return (f"# {p.source.split(':')[0]} starts {engine} with `{p.seed_launcher}`, which {engine} marks deprecated; "
            f"the same server starts here as `{now}`, with the seed's flags unchanged")


def _access_notes(host: str, key: ApiKey | None, engine: str) -> list[str]:
    """The dry run's comment on who can reach the server, what the key leaves open, how to fill it in."""
    if engine == "llama-cpp":
        return [f"# {describe_access(host, None)}"]  # cpu-tiny is refused off loopback
    if key is None:
        return [f"# {describe_access(host, None)}; --host ADDR exposes it, with an API key"]
    notes = [f"# {describe_access(host, key)}; shown masked", f"# {ENGINE_CAVEATS[engine]}"]
    if key.source == "generated":
        notes.append(f"# a dry run keeps no key: set ${KEY_ENV} (or --api-key) to the key you will run with, "
                     "and print the commands again")
    else:
        notes.append(f"# put the key itself where {key.shown.split()[0]} stands, e.g. \"${KEY_ENV}\"")
    return notes


def _dry_run(profile: str, engine: str | None, runner: str, o: Overrides, *, nodes: int, replicas: int,
             force: bool) -> None:
    """Print what `serve start` would run on the profile's machine: its window, and no command the plan
    says cannot fit unless --force (then with the plan's reason)."""
    p = get_profile(profile, engine)  # type: ignore[arg-type]
    note = _entry_point_note(p) if runner == "native" or nodes > 1 or replicas > 1 else None
    if nodes > 1 or replicas > 1:
        steps = (
            ray_tensor_parallel(p, nodes, overrides=o)
            if nodes > 1
            else [*replicas_behind_router(p, replicas, overrides=o), eval_pool_step(p, replicas, overrides=o)]
        )
        host = replica_host(o) if replicas > 1 else o.host or LOOPBACK
        for line in ([note] if note else []) + _access_notes(host, o.api_key, p.engine):
            out.print(line)
        for step in steps:
            out.print(f"# {step.where}")
            out.print(step.command)
        return
    if p.gpus == 0:
        _cpu_dry_run(p, runner, o)
        return
    fit = profile_plan(p, build_command(p, runner, o))  # type: ignore[arg-type]
    if not fit.fits and not force:
        raise UsageError(f"profile {p.name} does not fit its {p.gpus}x {p.gpu}: {fit.reason}; `serve start` refuses "
                         f"it (--force prints it anyway; `m3-agent serve plan --profile {p.name}` shows the numbers)")
    cmd, why = sized(p, runner, o, fit)  # type: ignore[arg-type]
    out.print(f"# {p.name} ({p.engine}, {runner}): {p.summary}; from {p.source}")
    if not fit.fits:
        out.print(f"# warning: does not fit its {p.gpus}x {p.gpu}: {fit.reason}; started only with --force")
    if why:
        out.print(f"# on its {p.gpus}x {p.gpu}, {why}")
    if note:
        out.print(note)
    if cmd.added:
        out.print(f"# added to the seed's flags (required for M3): {' '.join(cmd.added)}")
    for line in _access_notes(cmd.host, cmd.api_key, cmd.engine):
        out.print(line)
    out.print(cmd.shell())


def _cpu_dry_run(p: Profile, runner: str, o: Overrides) -> None:
    """A CPU profile's command (no GPU to plan for), with what it is for and whether it is built."""
    cmd = build_command(p, runner, o)  # type: ignore[arg-type]
    out.print(f"# {p.name} ({p.engine}, {runner}): {p.summary}; from {p.source}")
    out.print(f"# {llamacpp.TOY_NOTE}")
    if not llamacpp.locate().built:
        out.print(f"# not built yet: `serve start` builds it first (about 10 minutes, once), or run: bash {llamacpp.SCRIPT}")
    for line in _access_notes(cmd.host, cmd.api_key, cmd.engine):
        out.print(line)
    out.print(cmd.shell())


@app.command("status")
def status_command(name: str = NameOpt, as_json: bool = typer.Option(False, "--json")) -> None:
    """Show the recorded endpoint: running or not, health, the model it lists. Exit 3 when not ready."""
    st = launcher.status(name)
    if as_json:
        out.print(st.model_dump_json(indent=2))  # the key masked (ApiKey, ServeState.argv)
    elif st.state is None:
        out.print(st.detail)
    else:
        s = st.state
        uptime = time.time() - s.started_at
        where = f"container {s.container}" if s.container else f"pid {s.pid}"
        out.print(f"{name}: {s.profile} ({s.engine}, {s.runner}, {where}), up {uptime:.0f}s")
        out.print(f"  base URL: {s.base_url}")
        out.print(f"  access: {describe_access(s.host, s.api_key)}")
        out.print(
            f"  phase: {st.phase}"
            + (f"; models: {', '.join(st.models)}" if st.models else "")
            + (f"; max_model_len {st.max_model_len}" if st.max_model_len else "")
        )
        if st.detail:
            out.print(f"  {st.detail}")
        out.print(f"  log: {s.log_path}")
    if st.phase != "ready":
        raise typer.Exit(3)


@app.command("logs")
def logs_command(
    name: str = NameOpt,
    lines: int = typer.Option(50, "--lines", "-n"),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the server ends."),
) -> None:
    """Print the endpoint's log (the engine's output since `start`)."""
    state = launcher.load_state(name)
    if state is None:
        raise UsageError(f"no endpoint {name!r} recorded; start one with `m3-agent serve start`")
    for line in launcher.tail(state.log_path, lines):
        out.print(state.redacted(line))
    if follow:
        launcher.follow(
            state.log_path,
            until=lambda: not launcher.is_running(state),
            emit=lambda line: out.print(state.redacted(line)),
        )


@app.command("stop")
def stop_command(
    name: str = NameOpt, grace: float = typer.Option(20.0, "--grace", help="Seconds between SIGTERM and SIGKILL.")
) -> None:
    """Stop the endpoint: its whole process group, or its container."""
    state = launcher.stop(name, grace_s=grace)
    if state is None:
        out.print(f"no endpoint {name!r} recorded; nothing to stop")
        return
    what = f"container {state.container}" if state.container else f"process group {state.pid}"
    out.print(f"stopped {name}: {state.profile} ({what})")


def _plan(req: dict) -> Plan:
    """The plan for the flags given; a bad number is a usage error naming the field and the rule."""
    try:
        return plan(PlanRequest(**req))
    except ValidationError as e:
        raise UsageError("bad plan input: {}: {}".format(*first_validation_error(e))) from None
    except ValueError as e:
        raise UsageError(f"bad plan input: {e}".splitlines()[0]) from None


@app.command("plan")
def plan_command(
    profile: Optional[str] = typer.Option(
        None, "--profile", "-p", help="Take GPUs, precision and flags from a profile."
    ),
    engine: Optional[str] = typer.Option(None, "--engine"),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPU count."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU kind, e.g. H200, B200, MI355X."),
    gpu_memory: Optional[float] = typer.Option(None, "--gpu-memory", help="GB per GPU (instead of --gpu)."),
    detect: bool = typer.Option(False, "--detect", help="Use this machine's GPUs (nvidia-smi / rocm-smi)."),
    precision: Optional[str] = typer.Option(None, "--precision", help="bf16, fp8, mxfp8, mxfp4 or int4."),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="auto (16-bit) or fp8."),
    max_model_len: Optional[int] = typer.Option(
        None, "--max-model-len", help="Check this window instead of the largest."
    ),
    input_len: Optional[int] = typer.Option(
        None, "--input-len", help="Typical prompt tokens (for request concurrency)."
    ),
    output_len: int = typer.Option(0, "--output-len"),
    utilization: Optional[float] = typer.Option(None, "--gpu-memory-utilization"),
    reserve_gb: float = typer.Option(4.0, "--reserve-gb", help="Per-GPU reserve for activations and graphs."),
    params_b: float = typer.Option(M3_PARAMS_B, "--params-b", help="Total parameters, billions."),
    text_only: bool = typer.Option(False, "--text-only"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The largest --max-model-len that fits and the concurrency it leaves; exit 2 when it cannot fit."""
    _check_choice(precision, tuple(BYTES_PER_PARAM), "--precision")
    # the machine: a profile's (with the flags below), this one's (--detect), or the GPUs given; the flags win
    req: dict = {}
    if profile:
        p = get_profile(profile, engine)  # type: ignore[arg-type]
        if p.gpus == 0:
            raise UsageError(f"{p.name} runs on the CPU: there is no GPU memory to plan")
        o = Overrides(max_model_len=max_model_len, kv_cache_dtype=kv_dtype, text_only=text_only)
        req = plan_request(p, build_command(p, "native", o), p.gpus, gpu_memory_for(p.gpu)).model_dump()
    if detect:
        found = detect_gpus()
        if not found:
            raise UsageError(summary(found))
        req.update(gpus=len(found), gpu_memory_gb=min(g.memory_gb for g in found))
    if gpu is not None:
        req["gpu_memory_gb"] = gpu_memory_for(gpu)
    given = {"gpus": gpus, "gpu_memory_gb": gpu_memory, "precision": precision, "kv_dtype": kv_dtype,
             "max_model_len": max_model_len, "gpu_memory_utilization": utilization}
    req.update({key: value for key, value in given.items() if value is not None})
    if "gpus" not in req or "gpu_memory_gb" not in req:
        raise UsageError("say which machine: --profile, --detect, or --gpus N with --gpu KIND or --gpu-memory GB")
    req.update(reserve_gb_per_gpu=reserve_gb, params_b=params_b, text_only=text_only or req.get("text_only", False))
    if input_len:
        req["request_tokens"] = input_len + output_len
    result = _plan(req)
    if as_json:
        out.print(result.model_dump_json(indent=2))
    else:
        for line in describe(result):
            out.print(line)
    if not result.fits:
        raise UsageError(f"does not fit: {result.reason}")


@app.command("bench")
def bench_command(
    base_url: Optional[str] = typer.Option(None, "--base-url", help="Endpoint (default: the recorded one)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar=KEY_ENV,
                                          help="Key for --base-url (the recorded endpoint's own is used for it)."),
    name: str = NameOpt,
    model: Optional[str] = typer.Option(None, "--model", help="Served model name (default: the endpoint's)."),
    input_len: int = typer.Option(8192, "--input-len"),
    output_len: int = typer.Option(2048, "--output-len"),
    concurrency: int = typer.Option(32, "--concurrency"),
    num_prompts: int = typer.Option(512, "--num-prompts"),
    tool: str = typer.Option("auto", "--tool", help="auto (vllm bench serve when installed), vllm, or builtin."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="For vllm bench: tokenizer repo or path."),
    timeout: float = typer.Option(3600.0, "--timeout", help="Bound on the whole run, seconds."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON only."),
) -> None:
    """Benchmark an endpoint with the seed 000 workload (Lambda's deployment guide) next to its 8x B200 figures."""
    _check_choice(tool, ("auto", "vllm", "builtin"), "--tool")
    if base_url is None:
        state = launcher.load_state(name)
        if state is None:
            raise UsageError("no endpoint recorded: pass --base-url, or start one with `m3-agent serve start`")
        base_url, model = state.base_url, model or state.served_model_name
        api_key = key_value(state.api_key) or api_key
    if model is None:
        phase, models, _ = launcher.probe(base_url, api_key=api_key)
        if phase == "loading":
            raise EndpointError(f"no model server is ready at {base_url} (nothing answers, or it is still loading): "
                                "check --base-url, or `m3-agent serve status`")
        if not models:
            raise UsageError(f"{base_url} lists no model: pass --model")
        model = models[0]
    try:
        cfg = LoadConfig(base_url=base_url, api_key=api_key or "EMPTY", model=model, input_len=input_len,
                         output_len=output_len, concurrency=concurrency, num_prompts=num_prompts, timeout_s=timeout)
    except ValueError as e:
        raise UsageError(f"bad bench input: {e}".splitlines()[0]) from None
    result = run_bench(cfg, tool=tool, tokenizer=tokenizer)  # type: ignore[arg-type]
    if as_json:
        out.print(result.model_dump_json())
        return
    out.print(table(result, cfg))
    if result.failed:
        err.print(f"{result.failed} request(s) failed; first: {result.first_error}")
