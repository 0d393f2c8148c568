"""Every `m3-agent serve start --dry-run` command, parsed by the engine's own argument parser."""

from __future__ import annotations

import contextlib
import io
import shlex

import pytest

from m3_agent.cli import main
from m3_agent.serving.profiles import PROFILES, flag_value

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
SGLANG_MODULE = "sglang.launch_server"


def dry_run(*args: str) -> list[str]:
    """The command lines `m3-agent serve start --dry-run ARGS` prints (run in-process: 60-odd runs)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            main(["serve", "start", "--dry-run", "--force", *args])  # --force: profiles that do not fit print too
        except SystemExit as e:
            code = e.code or 0
    if code == 2 and "--nodes" in args and "data parallel" in stderr.getvalue():
        return []  # a data-parallel profile scales by replicas; the CLI refuses --nodes by design
    assert code == 0, f"serve start --dry-run {' '.join(args)} failed: {stderr.getvalue()}"
    return [line for line in stdout.getvalue().splitlines() if line.strip() and not line.startswith("#")]


def engine_argv(line: str) -> tuple[str, str, list[str]] | None:
    """(engine, form, argv) of one printed command (engine "helper" for ray, the router and the
    `m3-agent eval run` that uses the replicas, which tests/serving checks), or None."""
    words = shlex.split(line)
    while words and "=" in words[0] and not words[0].startswith("-"):
        words = words[1:]  # VAR=value prefixes
    if words[:1] in (["ray"], ["m3-agent"]) or "sglang_router.launch_router" in words:
        return "helper", words[0], words[1:]
    if words[:2] == ["vllm", "serve"]:
        return "vllm", "serve", words[2:]
    for i in range(len(words) - 2):
        if words[i].startswith("python") and words[i + 1] == "-m":
            module = words[i + 2]
            if module == VLLM_MODULE:
                return "vllm", "api_server", words[i + 3 :]
            if module == SGLANG_MODULE:
                return "sglang", "launch_server", words[i + 3 :]
    if words[:2] == ["docker", "run"]:
        image = next((w for w in words if w.startswith("vllm/vllm-openai")), None)
        if image is not None:  # the image's entry point is `vllm serve`
            return "vllm", "serve", words[words.index(image) + 1 :]
    return None


def _all_commands() -> list[tuple[str, str, str, list[str]]]:
    """(what, engine, form, argv) for every profile, engine, runner, and the multi-node forms."""
    found, unknown = [], []
    forms = [("native",), ("docker",)]
    for p in PROFILES:
        variants = [("--runner", r) for (r,) in forms] + [("--replicas", "2")]
        if p.engine == "vllm":
            variants.append(("--nodes", "2"))
        for flag, value in variants:
            what = f"{p.name}/{p.engine} {flag} {value}"
            for line in dry_run("--profile", p.name, "--engine", p.engine, flag, value):
                parsed = engine_argv(line)
                if parsed is None:
                    unknown.append(line)
                elif parsed[0] != "helper":
                    found.append((what, *parsed))
    assert not unknown, f"commands this test cannot attribute to an engine: {unknown}"
    return found


@pytest.fixture(scope="module")
def commands() -> list[tuple[str, str, str, list[str]]]:
    return _all_commands()


def test_every_profile_printed_engine_commands_of_both_engines(commands):
    engines = {engine for _, engine, _, _ in commands}
    assert engines == {"vllm", "sglang"}
    assert {what.split()[0] for what, *_ in commands} == {f"{p.name}/{p.engine}" for p in PROFILES}


def test_vllm_commands_parse_with_vllm_serve_parser(oracle, commands):
    vllm = [(what, form, argv) for what, engine, form, argv in commands if engine == "vllm"]
    answer = oracle.ask("vllm_args", argvs=[argv for _, _, argv in vllm], forms=[form for _, form, _ in vllm])
    failures = [f"{what}: {r['error']}" for (what, _, _), r in zip(vllm, answer["results"]) if r["error"]]
    assert not failures, "vLLM's own parser rejects:\n" + "\n".join(failures)
    for (what, _, _), r in zip(vllm, answer["results"]):
        v = r["values"]
        assert v["tool_call_parser"] in answer["tool_parsers"], what
        assert v["reasoning_parser"] in answer["reasoning_parsers"], what
        assert (v["model_tag"] or v["model"]).startswith(("MiniMaxAI/", "amd/")), what
        assert v["block_size"] == 128, f"{what}: M3's sparse attention needs --block-size 128"


def test_sglang_commands_parse_with_sglang_server_args(oracle, commands):
    """SGLang's --tool-call-parser / --reasoning-parser choices are its parser registries."""
    sglang = [(what, argv) for what, engine, _, argv in commands if engine == "sglang"]
    answer = oracle.ask("sglang_args", argvs=[argv for _, argv in sglang])
    failures = [f"{what}: {r['error']}" for (what, _), r in zip(sglang, answer["results"]) if r["error"]]
    assert not failures, "SGLang's ServerArgs rejects:\n" + "\n".join(failures)
    for (what, _), r in zip(sglang, answer["results"]):
        assert r["values"]["tool_call_parser"] == r["values"]["reasoning_parser"] == "minimax-m3", what
        assert r["values"]["page_size"] == 128, what


def test_the_checks_can_fail(oracle):
    """A made-up flag is refused by vLLM's parser; a parser name vLLM lacks is not in its registry."""
    argv = ["MiniMaxAI/MiniMax-M3", "--block-size", "128", "--tool-call-parser", "minimax_m9", "--enable-auto-tool-choice"]
    answer = oracle.ask("vllm_args", argvs=[argv + ["--no-such-flag", "1"], argv], forms=["serve", "api_server"])
    assert "--no-such-flag" in answer["results"][0]["error"]
    assert answer["results"][1]["values"]["tool_call_parser"] not in answer["tool_parsers"]
    wrong = oracle.ask("sglang_args", argvs=[["--model-path", "MiniMaxAI/MiniMax-M3", "--tool-call-parser", "minimax_m3"]])
    assert "minimax_m3" in wrong["results"][0]["error"]  # vLLM's spelling is not SGLang's


KEY = "m3-conformance-key-0123456789WXYZ"


def _env_words(line: str) -> dict[str, str]:
    """The VAR=value words a printed command starts with."""
    env = {}
    for word in shlex.split(line):
        if "=" not in word or word.startswith("-"):
            break
        env.update([word.split("=", 1)])
    return env


def _access_forms() -> list[tuple[str, str, str, list[str], dict[str, str], bool]]:
    """(what, engine, form, argv, env, exposed) of every profile and runner, as printed by default and with
    --host 0.0.0.0 --api-key KEY."""
    rows = []
    for p in PROFILES:
        for runner in ("native", "docker"):
            for exposed in (False, True):
                extra = ["--host", "0.0.0.0", "--api-key", KEY] if exposed else []
                [line] = dry_run("--profile", p.name, "--engine", p.engine, "--runner", runner, *extra)
                engine, form, argv = engine_argv(line)
                if runner == "docker":  # where the host side publishes the container's port
                    words = shlex.split(line)
                    assert words[words.index("-p") + 1].startswith("0.0.0.0:" if exposed else "127.0.0.1:"), line
                rows.append((f"{p.name}/{p.engine} {runner}{' exposed' if exposed else ''}", engine, form, argv,
                             _env_words(line), exposed))
    return rows


def test_the_engines_parse_the_bind_address_and_the_key_serve_start_prints(oracle):
    """Loopback by default on every profile; asked for another host, the key reaches each engine its way
    (vLLM: VLLM_API_KEY, not its --api-key; SGLang: --api-key), masked in what is printed."""
    rows = _access_forms()
    vllm = [r for r in rows if r[1] == "vllm"]
    sglang = [r for r in rows if r[1] == "sglang"]
    v_answer = oracle.ask("vllm_args", argvs=[r[3] for r in vllm], forms=[r[2] for r in vllm])
    s_answer = oracle.ask("sglang_args", argvs=[r[3] for r in sglang])
    for (what, engine, _, argv, env, exposed), result in [*zip(vllm, v_answer["results"]),
                                                          *zip(sglang, s_answer["results"])]:
        assert result["error"] is None, f"{what}: {result['error']}"
        inside_docker = " docker" in what
        assert result["values"]["host"] == ("0.0.0.0" if exposed or inside_docker else "127.0.0.1"), what
        if engine == "vllm":
            assert result["values"]["api_key"] is None, what  # never in argv, where `ps` shows it
            assert env.get("VLLM_API_KEY") == ("****WXYZ" if exposed else None), what
        else:
            assert result["values"]["api_key"] == ("****WXYZ" if exposed else None), what
        assert KEY not in " ".join(argv) + " ".join(env.values()), what


def test_the_router_parses_the_replicas_plan_with_its_key(oracle):
    lines = dry_run("--profile", "h200-tp8", "--replicas", "2", "--api-key", KEY)
    router = next(shlex.split(line) for line in lines if "sglang_router.launch_router" in line)
    servers = [engine_argv(line)[2] for line in lines if line.startswith("VLLM_API_KEY=****WXYZ vllm serve ")]
    assert len(servers) == 2 and all(flag_value(argv, "--host") == "0.0.0.0" for argv in servers)
    answer = oracle.ask("router_args", argvs=[router[router.index("sglang_router.launch_router") + 1:]])
    [result] = answer["results"]
    assert result["error"] is None, result["error"]
    assert result["values"]["api_key"] == "****WXYZ" and result["values"]["host"] == "0.0.0.0"
    assert result["values"]["worker_urls"] == ["http://<NODE_1_IP>:8000", "http://<NODE_2_IP>:8000"]
    assert result["values"]["policy"] == "cache_aware"
