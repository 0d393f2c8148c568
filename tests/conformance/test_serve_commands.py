"""Every `m3-agent serve start --dry-run` command, parsed by the engine's own argument parser."""

from __future__ import annotations

import contextlib
import io
import shlex

import pytest

from m3_agent.cli import main
from m3_agent.serving.profiles import PROFILES

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
SGLANG_MODULE = "sglang.launch_server"


def _dry_run(*args: str) -> list[str]:
    """The command lines `m3-agent serve start --dry-run ARGS` prints (run in-process: 60-odd runs)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            main(["serve", "start", "--dry-run", *args])
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
            for line in _dry_run("--profile", p.name, "--engine", p.engine, flag, value):
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
