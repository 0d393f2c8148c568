"""`m3-agent serve` dry runs, multi-node forms and plans, through the typer app."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from typer.testing import CliRunner

from m3_agent.errors import UsageError
from m3_agent.serving.cli import app
from m3_agent.serving.planner import PlanRequest, plan
from m3_agent.serving.multinode import ray_tensor_parallel, replicas_behind_router
from m3_agent.serving.profiles import PROFILES, Overrides, build_command, flag_value, get_profile

runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args))


def test_dry_run_prints_the_exact_command_and_what_was_added():
    res = _run("start", "--profile", "h200x4-fp8", "--dry-run")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith("# h200x4-fp8 (vllm, native)") and "seed 001" in lines[0]
    assert lines[1] == (
        "# seed 001 starts vLLM with `python -m vllm.entrypoints.openai.api_server --model MODEL`, which vLLM marks "
        "deprecated; the same server starts here as `vllm serve MODEL`, with the seed's flags unchanged"
    )
    assert lines[2] == (
        "# added to the seed's flags (required for M3): --block-size 128 --tool-call-parser minimax_m3 "
        "--reasoning-parser minimax_m3 --enable-auto-tool-choice --enable-prompt-tokens-details"
    )
    assert lines[3].startswith("# loopback only (127.0.0.1): no other machine can reach it, so no key; "
                               "--host ADDR exposes it")
    assert shlex.split(lines[4]) == build_command(get_profile("h200x4-fp8"), "native").argv


def test_dry_run_refuses_a_profile_that_does_not_fit_its_machine_and_forced_warns_with_the_reason():
    res = _run("start", "--profile", "h200x2-fp8", "--dry-run")
    assert res.exit_code == 1 and isinstance(res.exception, UsageError) and res.output == ""
    said = str(res.exception)
    assert said.startswith("profile h200x2-fp8 does not fit its 2x H200: the weights do not fit") and "--force" in said
    forced = _run("start", "--profile", "h200x2-fp8", "--dry-run", "--force")
    assert forced.exit_code == 0, forced.output
    warning = [line for line in forced.output.splitlines() if line.startswith("# warning: does not fit its 2x H200")]
    assert warning and "the weights do not fit" in warning[0]
    assert _commands(forced.output) == [build_command(get_profile("h200x2-fp8"), "native").argv]


def test_dry_run_prints_the_window_a_start_on_the_profiles_gpus_chooses():
    from m3_agent.serving.endpoint import prepare
    from m3_agent.serving.gpus import GPU
    from m3_agent.serving.planner import PlanRequest, plan

    res = _run("start", "--profile", "h200-tp8", "--dry-run")
    assert res.exit_code == 0, res.output
    [argv] = _commands(res.output)
    largest = plan(PlanRequest(gpus=8, gpu_memory_gb=141, precision="bf16")).max_model_len
    assert flag_value(argv, "--max-model-len") == str(largest) and largest < 1_048_576
    assert f"--max-model-len {largest}, the largest that does" in res.output
    h200s = [GPU(index=i, name="NVIDIA H200", memory_gb=141, vendor="nvidia") for i in range(8)]
    assert prepare("h200-tp8", gpus=h200s).argv == argv  # what a real start runs on 8x H200
    assert "--max-model-len" not in _commands(_run("start", "-p", "h200-tp8", "--kv-cache-dtype", "fp8",
                                                   "--dry-run").output)[0]  # fp8 KV: the full window fits


SGLANG_LAUNCHERS = (["python", "-m", "sglang.launch_server"], ["python3", "-m", "sglang.launch_server"])


def _commands(output: str) -> list[list[str]]:
    """The printed commands (comments dropped), each without its leading VAR=value environment."""
    commands = []
    for line in output.splitlines():
        if line and not line.startswith("#"):
            argv = shlex.split(line)
            while "=" in argv[0] and not argv[0].startswith("-"):
                argv.pop(0)
            commands.append(argv)
    return commands


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: f"{p.name}-{p.engine}")
def test_dry_run_of_every_profile_starts_with_vllm_serve_or_sglangs_launcher(profile):
    res = _run("start", "-p", profile.name, "--engine", profile.engine, "--dry-run", "--force")
    assert res.exit_code == 0, res.output
    [argv] = _commands(res.output)
    if profile.engine == "vllm":
        assert argv[:3] == ["vllm", "serve", profile.model] and "--model" not in argv
    else:
        assert argv[:3] in SGLANG_LAUNCHERS and argv[argv.index("--model-path") + 1] == profile.model
    notes = [line for line in res.output.splitlines() if "vllm.entrypoints" in line]
    assert all(line.startswith("# seed ") and "deprecated" in line for line in notes), notes
    assert len(notes) == (1 if profile.source.startswith("seed 001") else 0)


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: f"{p.name}-{p.engine}")
def test_docker_dry_run_never_uses_the_deprecated_vllm_module(profile):
    res = _run("start", "-p", profile.name, "--engine", profile.engine, "--runner", "docker", "--dry-run", "--force")
    assert res.exit_code == 0, res.output
    [argv] = _commands(res.output)
    after_image = argv[argv.index(profile.docker_image) + 1 :]
    assert not any("vllm.entrypoints" in a for a in argv)
    if profile.engine == "vllm":  # the image's own entrypoint is `vllm serve`
        assert after_image[:2] == ["--model", profile.model]
    else:
        assert after_image[:3] in SGLANG_LAUNCHERS


def test_dry_run_docker_and_overrides():
    res = _run(
        "start",
        "-p",
        "b200",
        "--engine",
        "sglang",
        "--runner",
        "docker",
        "--dry-run",
        "--port",
        "30001",
        "--max-model-len",
        "131072",  # what SGLang's share of 8x B200 holds (`serve plan`): the dry run refuses more, as a start does
        "--text-only",
    )
    assert res.exit_code == 0, res.output
    argv = shlex.split(res.output.splitlines()[-1])
    assert argv[:3] == ["docker", "run", "-d"] and "lmsysorg/sglang:dev-cu13-minimax-m3" in argv
    assert flag_value(argv, "--port") == "30001" and argv[argv.index("-p") + 1] == "127.0.0.1:30001:30001"
    assert flag_value(argv, "--context-length") == "131072"


def test_bad_choices_are_one_line_usage_errors():
    res = _run("start", "-p", "h200-tp8", "--runner", "podman", "--dry-run")
    assert res.exit_code != 0 and "--runner must be one of: native, docker" in str(res.exception)
    res = _run("start", "-p", "nope", "--dry-run")
    assert "unknown profile 'nope'" in str(res.exception)


def test_ray_form_spans_the_nodes_with_tensor_parallel():
    steps = ray_tensor_parallel(get_profile("h200-tp8"), 2, head="10.0.0.1")
    assert [s.where for s in steps][:2] == ["head node", "worker node 1"]
    assert steps[0].command == "ray start --head --port=6379"
    assert steps[1].command == "ray start --address=10.0.0.1:6379"
    argv = shlex.split(steps[-1].command)
    assert flag_value(argv, "--tensor-parallel-size") == "16"
    assert flag_value(argv, "--distributed-executor-backend") == "ray"
    assert flag_value(argv, "--block-size") == "128"


def test_ray_form_keeps_amd_environment_on_every_node():
    steps = ray_tensor_parallel(get_profile("amd-tp8-1m"), 2)
    assert all(s.command.startswith("VLLM_USE_BREAKABLE_CUDAGRAPH=0 VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 ") for s in steps)


def test_replicas_form_puts_a_router_in_front():
    steps = replicas_behind_router(get_profile("h200-tp8-ep"), 3, overrides=Overrides(port=8000))
    assert len(steps) == 4
    for s in steps[:3]:
        assert flag_value(shlex.split(s.command), "--host") == "0.0.0.0"
    router = shlex.split(steps[-1].command)
    assert router[:3] == ["python", "-m", "sglang_router.launch_router"]
    assert router[router.index("--worker-urls") + 1 : router.index("--worker-urls") + 4] == [
        "http://<NODE_1_IP>:8000",
        "http://<NODE_2_IP>:8000",
        "http://<NODE_3_IP>:8000",
    ]


def test_replicas_dry_run_prints_the_eval_run_using_them_as_a_pool():
    res = _run("start", "-p", "h200-tp8-ep", "--dry-run", "--replicas", "2", "--port", "8000")
    assert res.exit_code == 0, res.output
    last = res.output.strip().splitlines()[-1]
    assert re.match(r"M3_AGENT_MODEL__API_KEY=\*\*\*\*\S{4} m3-agent eval run --tasks TASKS --executor ray "
                    r"--ray-address <HEAD_IP>:6379 ", last)
    assert last.endswith("--base-url http://<NODE_1_IP>:8000/v1 --base-url http://<NODE_2_IP>:8000/v1")


def test_multinode_refusals():
    res = _run("start", "-p", "h200-dp8-ep", "--dry-run", "--nodes", "2")
    assert "data parallel: scale it with --replicas" in str(res.exception)
    res = _run("start", "-p", "b200", "--engine", "sglang", "--dry-run", "--nodes", "2")
    assert "for vLLM" in str(res.exception)
    res = _run("start", "-p", "h200-tp8", "--nodes", "2")
    assert "add --dry-run" in str(res.exception)


def test_cli_dry_run_nodes_prints_each_step():
    res = _run("start", "-p", "h200-tp8", "--dry-run", "--nodes", "2")
    assert res.exit_code == 0
    assert "# head node\nray start --head --port=6379\n# worker node 1\n" in res.output
    assert "--tensor-parallel-size 16" in res.output


def test_plan_from_a_profile_uses_its_flags():
    res = _run("plan", "--profile", "h200x2-fp8", "--params-b", "229.9", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["request"]["gpus"] == 2 and data["request"]["kv_dtype"] == "fp8_e5m2"
    assert data["request"]["gpu_memory_utilization"] == 0.92 and data["request"]["max_model_len"] == 131072
    assert data["fits"] is True


def test_plan_refuses_1m_on_two_h200_with_exit_2():
    res = _run(
        "plan",
        "--gpus",
        "2",
        "--gpu",
        "H200",
        "--precision",
        "fp8",
        "--kv-dtype",
        "fp8",
        "--max-model-len",
        "1048576",
        "--params-b",
        "229.9",
    )
    assert res.exit_code != 0
    assert "does not fit: 1M context needs 120 GB of fp8 KV cache" in str(res.exception)
    assert getattr(res.exception, "exit_code", None) == 2


def test_plan_table_lists_windows_and_request_concurrency():
    res = _run("plan", "--gpus", "8", "--gpu", "b200", "--input-len", "8192", "--output-len", "2048")
    assert res.exit_code == 0, res.output
    assert "1M: KV   240.0 GB  fits" in res.output
    assert "requests of 10240 tokens: about" in res.output


def test_plan_needs_a_machine():
    res = _run("plan", "--precision", "fp8")
    assert "say which machine" in str(res.exception)


def test_profiles_lists_every_profile_with_its_seed():
    res = _run("profiles")
    assert res.exit_code == 0
    assert "mi355x-mxfp4" in res.output and "seed 002" in res.output and "seed 000" in res.output


def test_profiles_has_a_header_the_window_plan_gives_and_says_what_the_seeds_are():
    lines = _run("profiles").output.splitlines()
    assert lines[0].split() == ["profile", "engine", "GPUs", "precision", "window", "what", "[from]"]
    rows = {line.split()[0]: line for line in lines[1:len(PROFILES) + 1]}
    assert " does not fit " in rows["h200x2-fp8"] and " 1M " in rows["mxfp8-tp8"]
    assert f" {plan(PlanRequest(gpus=8, gpu_memory_gb=141, precision='bf16')).max_model_len // 1024}K " in rows["h200-tp8"]
    assert [line.split(":")[0] for line in lines if line.startswith("seed ")] == [f"seed 00{n}" for n in range(5)]


def test_start_without_profile_picks_one_for_the_gpus_found(fake_nvidia_smi):
    res = _run("start", "--dry-run")
    assert res.exit_code == 0, res.output
    assert "# h200-tp8 (vllm, native)" in res.output


def test_plan_detect_reads_this_machines_gpus(fake_nvidia_smi):
    res = _run("plan", "--detect", "--kv-dtype", "fp8", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["request"]["gpus"] == 8 and data["request"]["gpu_memory_gb"] == 140.4
    assert data["fits"] and data["max_model_len"] == 1_048_576


KEY = "m3-team-key-0123456789WXYZ"


def _engine_line(output: str) -> list[str]:
    [argv] = [shlex.split(line) for line in output.splitlines() if line and not line.startswith("#")]
    return argv


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: f"{p.name}-{p.engine}")
@pytest.mark.parametrize("form", ["native", "docker"])
def test_every_dry_run_listens_on_loopback_or_shows_the_key_masked(profile, form):
    args = ["start", "-p", profile.name, "--engine", profile.engine, "--runner", form, "--dry-run", "--force"]
    private = runner.invoke(app, args, env={"M3_AGENT_MODEL__API_KEY": KEY})
    assert private.exit_code == 0, private.output
    argv = _engine_line(private.output)
    if form == "native":
        assert flag_value(argv, "--host") == "127.0.0.1"
    else:  # the engine listens in the container's own network; the host publishes on loopback only
        assert argv[argv.index("-p") + 1].startswith("127.0.0.1:") and flag_value(argv, "--host") == "0.0.0.0"
    assert "--api-key" not in argv and not any("API_KEY" in a for a in argv)  # loopback: no key at all

    exposed = runner.invoke(app, [*args, "--host", "0.0.0.0"], env={"M3_AGENT_MODEL__API_KEY": KEY})
    assert exposed.exit_code == 0, exposed.output
    assert KEY not in exposed.output and "requests need the key ****WXYZ (env M3_AGENT_MODEL__API_KEY)" in exposed.output
    argv = _engine_line(exposed.output)
    if profile.engine == "vllm":
        assert "VLLM_API_KEY=****WXYZ" in argv[: argv.index("vllm") if form == "native" else 1]
        assert "--api-key" not in argv
    else:
        assert flag_value(argv, "--api-key") == "****WXYZ"


def test_a_reachable_host_gets_a_new_key_when_none_is_given_and_the_dry_run_says_it_keeps_none():
    res = runner.invoke(app, ["start", "-p", "h200-tp8", "--dry-run", "--host", "10.1.2.3"], env={"M3_AGENT_MODEL__API_KEY": ""})
    assert res.exit_code == 0, res.output
    assert "(generated)" in res.output and "a dry run keeps no key" in res.output
    assert "/invocations, which runs the model, stays open (vllm issue #58144)" in res.output
    assert re.fullmatch(r"VLLM_API_KEY=\*\*\*\*\S{4}", _engine_line(res.output)[0])
    flag = runner.invoke(app, ["start", "-p", "h200-tp8", "--dry-run", "--host", "10.1.2.3", "--api-key", KEY])
    assert KEY not in flag.output and "****WXYZ (flag --api-key)" in flag.output


@pytest.mark.parametrize("plan", [("--replicas", "2"), ("--nodes", "2")])
def test_multi_node_plans_carry_a_key_on_every_server_shown_masked(plan):
    res = runner.invoke(app, ["start", "-p", "h200-tp8", "--dry-run", *plan], env={"M3_AGENT_MODEL__API_KEY": KEY})
    assert res.exit_code == 0, res.output
    assert KEY not in res.output
    servers = [line for line in res.output.splitlines() if "vllm serve " in line]
    assert servers and all(line.startswith("VLLM_API_KEY=****WXYZ vllm serve ") for line in servers)
    if plan[0] == "--replicas":
        router = next(shlex.split(line) for line in res.output.splitlines() if "sglang_router" in line)
        assert flag_value(router, "--api-key") == "****WXYZ"
        assert res.output.strip().splitlines()[-1].startswith("M3_AGENT_MODEL__API_KEY=****WXYZ m3-agent eval run")


def test_a_bad_plan_number_names_the_field_and_the_rule():
    res = _run("plan", "--gpus", "0", "--gpu", "H200")
    assert str(res.exception) == "bad plan input: gpus: Input should be greater than 0"


def test_bench_against_a_dead_url_says_nothing_answers_not_that_it_lists_no_model():
    import socket

    from m3_agent.errors import EndpointError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    res = _run("bench", "--base-url", dead)
    assert isinstance(res.exception, EndpointError) and res.exception.exit_code == 3
    assert str(res.exception).startswith(f"no model server is ready at {dead}")
