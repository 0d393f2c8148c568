"""Golden tests: every profile's command is the seed's command, flag by flag, plus only the required flags."""

from __future__ import annotations

import shlex

import pytest

from m3_agent.errors import UsageError
from m3_agent.serving.profiles import (
    PROFILES,
    REQUIRED_FLAGS,
    Overrides,
    build_command,
    flag_value,
    get_profile,
    profile_names,
)

# The seed commands, transcribed from the seed documents (file named in each key's comment).
YARN = (
    '\'{"text_config":{"rope_scaling":{"rope_type":"yarn","factor":2.0,"original_max_position_embeddings":524288}}}\''
)
NV_TAIL = "--tool-call-parser minimax_m3 --reasoning-parser minimax_m3 --enable-auto-tool-choice"
AMD_MID = "--attention-backend TRITON_ATTN --mm-encoder-tp-mode data --mm-encoder-attn-backend ROCM_AITER_FA"
AMD_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH=0"
SEED_001 = (
    "python -m vllm.entrypoints.openai.api_server --model ./minimax-m3 --served-model-name minimax-m3 "
    "--tensor-parallel-size {tp} --quantization fp8 --enable-expert-parallel --max-model-len 131072 "
    "--kv-cache-dtype fp8_e5m2 --gpu-memory-utilization 0.92 --enable-chunked-prefill --max-num-seqs 16 "
    "--port 8000"
)
SEED_NATIVE = {
    # seed 002 (vLLM recipe), NVIDIA
    (
        "h200-tp8",
        "vllm",
    ): f"vllm serve MiniMaxAI/MiniMax-M3 \\\n --tensor-parallel-size 8 \\\n --block-size 128 \\\n {NV_TAIL}",
    (
        "h200-tp8-ep",
        "vllm",
    ): f"vllm serve MiniMaxAI/MiniMax-M3 --tensor-parallel-size 8 --enable-expert-parallel --block-size 128 {NV_TAIL}",
    (
        "h200-dp8-ep",
        "vllm",
    ): f"vllm serve MiniMaxAI/MiniMax-M3 --data-parallel-size 8 --enable-expert-parallel --block-size 128 {NV_TAIL}",
    ("mxfp8-tp8", "vllm"): f"vllm serve MiniMaxAI/MiniMax-M3-MXFP8 --tensor-parallel-size 8 --block-size 128 {NV_TAIL}",
    # seed 002, AMD ROCm (the export applies to every AMD command)
    (
        "amd-tp8",
        "vllm",
    ): f"{AMD_ENV} vllm serve MiniMaxAI/MiniMax-M3 --tensor-parallel-size 8 --block-size 128 {AMD_MID} {NV_TAIL}",
    (
        "amd-tp8-ep",
        "vllm",
    ): f"{AMD_ENV} vllm serve MiniMaxAI/MiniMax-M3 --tensor-parallel-size 8 --enable-expert-parallel --block-size 128 {AMD_MID} {NV_TAIL}",
    (
        "amd-dp8-ep",
        "vllm",
    ): f"{AMD_ENV} vllm serve MiniMaxAI/MiniMax-M3 --data-parallel-size 8 --enable-expert-parallel --block-size 128 {AMD_MID} {NV_TAIL}",
    ("amd-tp8-1m", "vllm"): (
        f"{AMD_ENV} VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 vllm serve MiniMaxAI/MiniMax-M3 --block-size 128 "
        f"--kv-cache-dtype fp8 --tensor-parallel-size 8 --max-model-len 1048576 {AMD_MID} "
        f"--tool-call-parser minimax_m3 --enable-auto-tool-choice --reasoning-parser minimax_m3 "
        f"--hf-overrides {YARN}"
    ),
    ("mi355x-mxfp4", "vllm"): (
        f"{AMD_ENV} VLLM_ROCM_USE_AITER=1 VLLM_ROCM_USE_AITER_MOE=1 vllm serve amd/MiniMax-M3-MXFP4 "
        f"--tensor-parallel-size 4 --block-size 128 --moe-backend aiter --attention-backend TRITON_ATTN "
        f"--language-model-only --no-enable-prefix-caching {NV_TAIL}"
    ),
    ("mi355x-mxfp4-emulation", "vllm"): (
        f"{AMD_ENV} vllm serve amd/MiniMax-M3-MXFP4 --tensor-parallel-size 8 --block-size 128 "
        f"--moe-backend emulation --attention-backend TRITON_ATTN {NV_TAIL}"
    ),
    # seeds 003 / 004 (NVIDIA blog), vLLM
    ("blackwell-tp8-ep", "vllm"): (
        "vllm serve MiniMaxAI/MiniMax-M3 --tensor-parallel-size 8 --enable-expert-parallel "
        "--block-size 128 --mm-encoder-attn-backend FLASHINFER --mm-processor-cache-type shm "
        "--tool-call-parser minimax_m3 --enable-auto-tool-choice --reasoning-parser minimax_m3 "
        "--trust-remote-code"
    ),
    # seed 001 (2x H200 FP8; "For 4x ... set --tensor-parallel-size 4")
    ("h200x2-fp8", "vllm"): SEED_001.format(tp=2),
    ("h200x4-fp8", "vllm"): SEED_001.format(tp=4),
    # seed 004, SGLang; the seed's text is cut after "--tool-call-parser minimax-m3-nom" (see below)
    ("blackwell-mxfp8-tp8-ep", "sglang"): (
        "python -m sglang.launch_server --model-path MiniMaxAI/MiniMax-M3 --dtype bfloat16 "
        "--tp-size 8 --ep-size 8 --trust-remote-code --mem-fraction-static 0.8 "
        "--enable-multimodal --quantization mxfp8 --attention-backend flashinfer "
        "--mm-attention-backend flashinfer_cudnn --moe-runner-backend deep_gemm "
        "--chunked-prefill-size 8192 --reasoning-parser minimax-m3 "
        "--tool-call-parser minimax-m3-nom"
    ),
}
HF = "-v ~/.cache/huggingface:/root/.cache/huggingface"
SEED_DOCKER = {
    # seed 000 (Lambda, 8x B200)
    ("b200", "vllm"): (
        f"docker run -d --gpus all --ipc=host -p 8000:8000 {HF} vllm/vllm-openai:minimax-m3 "
        "--model MiniMaxAI/MiniMax-M3 --served-model-name minimax-m3 --tensor-parallel-size 8 "
        f"--trust-remote-code --block-size 128 {NV_TAIL}"
    ),
    ("b200", "sglang"): (
        f"docker run -d --gpus all --ipc=host -p 8000:8000 {HF} lmsysorg/sglang:dev-cu13-minimax-m3 "
        "python3 -m sglang.launch_server --model-path MiniMaxAI/MiniMax-M3 --served-model-name minimax-m3 "
        "--tp 8 --host 0.0.0.0 --port 8000 --trust-remote-code --mem-fraction-static 0.65 "
        "--attention-backend fa4 --page-size 128 --moe-runner-backend deep_gemm"
    ),
}
# Where the seed's text is damaged, the one token we use instead.
SEED_FIXES = {("blackwell-mxfp8-tp8-ep", "sglang"): {"minimax-m3-nom": "minimax-m3"}}
MODEL_IN_SEED = {("h200x2-fp8", "vllm"): "./minimax-m3", ("h200x4-fp8", "vllm"): "./minimax-m3"}
# Seed 001 starts vLLM through a module vLLM marks deprecated; the profile starts the same server with
# `vllm serve MODEL` and keeps every other flag of the seed, in order.
OLD_VLLM = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model"]


def _current_entry_point(seed_argv: list[str]) -> list[str]:
    if seed_argv[: len(OLD_VLLM)] == OLD_VLLM:
        return ["vllm", "serve", *seed_argv[len(OLD_VLLM) :]]
    return seed_argv


def _split(text: str) -> tuple[dict[str, str], list[str]]:
    tokens = shlex.split(text.replace("\\\n", " "))  # backslash-newline: the shell's line continuation
    env = {}
    while tokens and "=" in tokens[0] and not tokens[0].startswith("-"):
        k, v = tokens.pop(0).split("=", 1)
        env[k] = v
    return env, tokens


def _without(argv: list[str], flag: str) -> tuple[list[str], str | None]:
    """`argv` without `flag` and its value, and that value (None when absent)."""
    if flag not in argv:
        return list(argv), None
    i = argv.index(flag)
    return argv[:i] + argv[i + 2 :], argv[i + 1]


def _expected_added(seed_argv: list[str], engine: str) -> list[str]:
    added = []
    for flag, value in REQUIRED_FLAGS[engine]:
        if flag not in seed_argv:
            added += [flag] if value is None else [flag, value]
    return added


@pytest.mark.parametrize("key", sorted(SEED_NATIVE))
def test_native_command_is_the_seed_command_flag_by_flag(key):
    env, seed_argv = _split(SEED_NATIVE[key])
    fixes = SEED_FIXES.get(key, {})
    seed_argv = _current_entry_point([fixes.get(t, t) for t in seed_argv])
    cmd = build_command(get_profile(*key), "native", Overrides(model=MODEL_IN_SEED.get(key)))
    assert cmd.env == env
    argv, host = _without(cmd.argv, "--host")
    assert host == "127.0.0.1" and cmd.api_key is None  # loopback only, whatever the seed bound
    assert argv[: len(seed_argv)] == _without(seed_argv, "--host")[0]
    assert argv[len(seed_argv) :] == cmd.added == _expected_added(seed_argv, key[1])


@pytest.mark.parametrize("key", sorted(SEED_DOCKER))
def test_docker_command_is_the_seed_command_flag_by_flag(key):
    _, seed_argv = _split(SEED_DOCKER[key])
    cmd = build_command(get_profile(*key), "docker")
    argv = list(cmd.argv)
    i = argv.index("--name")
    assert argv[i + 1] == cmd.container
    del argv[i : i + 2]  # the container name is how stop finds it again
    # published on the host's loopback only; inside its own network the engine listens everywhere
    seed_argv[seed_argv.index("-p") + 1] = "127.0.0.1:8000:8000"
    argv, host = _without(argv, "--host")
    assert host == "0.0.0.0"
    assert argv[: len(seed_argv) - 2 * ("--host" in seed_argv)] == _without(seed_argv, "--host")[0]
    assert argv[len(seed_argv) - 2 * ("--host" in seed_argv) :] == cmd.added == _expected_added(seed_argv, key[1])


def test_every_profile_has_a_golden_seed_command():
    keys = {(p.name, p.engine) for p in PROFILES}
    assert keys == set(SEED_NATIVE) | set(SEED_DOCKER)


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: f"{p.name}-{p.engine}")
@pytest.mark.parametrize("runner", ["native", "docker"])
def test_required_flags_are_always_present(profile, runner):
    argv = build_command(profile, runner).argv
    if profile.engine == "vllm":
        assert flag_value(argv, "--block-size") == "128"
        assert flag_value(argv, "--tool-call-parser") == "minimax_m3"
        assert flag_value(argv, "--reasoning-parser") == "minimax_m3"
        assert "--enable-auto-tool-choice" in argv and "--enable-prompt-tokens-details" in argv
    else:
        assert flag_value(argv, "--page-size") == "128"
        assert flag_value(argv, "--tool-call-parser") == "minimax-m3"
        assert flag_value(argv, "--reasoning-parser") == "minimax-m3"
        assert "--enable-cache-report" in argv


def test_overrides_replace_the_seed_value_in_place():
    p = get_profile("h200x2-fp8")
    cmd = build_command(p, "native", Overrides(max_model_len=262144, port=9001, kv_cache_dtype="fp8"))
    base = build_command(p, "native")
    assert len(cmd.argv) == len(base.argv)
    assert cmd.argv.index("--max-model-len") == base.argv.index("--max-model-len")
    assert flag_value(cmd.argv, "--max-model-len") == "262144"
    assert flag_value(cmd.argv, "--kv-cache-dtype") == "fp8"
    assert cmd.port == 9001


def test_sglang_overrides_use_sglang_spellings():
    cmd = build_command(
        get_profile("b200", "sglang"),
        "native",
        Overrides(max_model_len=131072, gpu_memory_utilization=0.7, tensor_parallel_size=4),
    )
    assert flag_value(cmd.argv, "--context-length") == "131072"
    assert flag_value(cmd.argv, "--mem-fraction-static") == "0.7"
    assert flag_value(cmd.argv, "--tp") == "4" and "--tp-size" not in cmd.argv


def test_text_only_adds_language_model_only_and_drops_encoder_parallel():
    cmd = build_command(get_profile("blackwell-tp8-ep"), "native", Overrides(text_only=True))
    assert "--language-model-only" in cmd.argv
    assert "--mm-encoder-attn-backend" not in cmd.argv and "--mm-processor-cache-type" not in cmd.argv
    amd = build_command(get_profile("amd-tp8"), "native", Overrides(text_only=True))
    assert "--mm-encoder-tp-mode" not in amd.argv and "--language-model-only" in amd.argv


def test_docker_publishes_the_engine_port_and_passes_env():
    cmd = build_command(get_profile("amd-tp8-1m"), "docker", Overrides(port=8123))
    argv = cmd.argv
    assert argv[argv.index("-p") + 1] == "127.0.0.1:8123:8123"
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in argv and "VLLM_USE_BREAKABLE_CUDAGRAPH=0" in argv
    assert argv[argv.index("--device") + 1] == "/dev/kfd"
    assert "vllm/vllm-openai-rocm:minimax-m3" in argv
    assert cmd.env == {}


def test_shell_form_keeps_the_home_volume_expandable():
    line = build_command(get_profile("b200"), "docker").shell()
    assert " -v ~/.cache/huggingface:/root/.cache/huggingface " in line
    assert shlex.split(line) == build_command(get_profile("b200"), "docker").argv


def test_unknown_profile_and_engine_are_usage_errors():
    with pytest.raises(UsageError, match="unknown profile"):
        get_profile("h100-tp16")
    with pytest.raises(UsageError, match="no sglang form"):
        get_profile("h200-tp8", "sglang")
    assert "b200" in profile_names() and profile_names().count("b200") == 1


@pytest.mark.parametrize("key", sorted(k for k in SEED_NATIVE if _split(SEED_NATIVE[k])[1][:4] == OLD_VLLM))
def test_a_seed_on_the_deprecated_vllm_module_is_recorded_and_started_with_vllm_serve(key):
    profile = get_profile(*key)
    assert profile.seed_launcher == "python -m vllm.entrypoints.openai.api_server --model MODEL"
    argv = build_command(profile, "native").argv
    assert argv[:3] == ["vllm", "serve", profile.model] and "--model" not in argv


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: f"{p.name}-{p.engine}")
def test_native_vllm_takes_the_model_as_vllm_serve_does(profile):
    argv = build_command(profile, "native", Overrides(model="/models/m3")).argv
    if profile.engine == "vllm":
        assert argv[:3] == ["vllm", "serve", "/models/m3"] and "--model" not in argv
    else:
        assert argv[argv.index("--model-path") + 1] == "/models/m3"
