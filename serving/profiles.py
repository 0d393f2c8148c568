"""Hardware profiles for serving MiniMax-M3, each transcribed flag by flag from a seed document.

A profile keeps the seed's flags in the seed's order. `build_command` renders it for a runner
(`native` or `docker`), applies the user's overrides in place, and appends only the flags the
project requires that the seed left out (listed in `Command.added`), so the printed command is
always "the seed command, plus these".
"""

from __future__ import annotations

import os
import shlex
from typing import Literal

from pydantic import BaseModel, Field

from m3_agent.errors import UsageError
from m3_agent.redact import redact
from m3_agent.agent.endpoint import is_loopback
from m3_agent.serving import llamacpp
from m3_agent.agent.access import ALL_INTERFACES, LOOPBACK, ApiKey

Engine = Literal["vllm", "sglang", "llama-cpp"]
Runner = Literal["native", "docker"]
Precision = Literal["bf16", "fp8", "mxfp8", "mxfp4", "int4"]

VLLM_IMAGE = "vllm/vllm-openai:minimax-m3"
VLLM_ROCM_IMAGE = "vllm/vllm-openai-rocm:minimax-m3"
SGLANG_IMAGE = "lmsysorg/sglang:dev-cu13-minimax-m3"
DEFAULT_MODEL = "MiniMaxAI/MiniMax-M3"

# seed 000: the docker run options used for both engines on NVIDIA.
NVIDIA_DOCKER_OPTIONS = shlex.split(
    "--gpus all --ipc=host -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface"
)
# seed 002: the device options of the ROCm image (the seed's `-it`/`--entrypoint /bin/bash` are for a shell).
AMD_DOCKER_OPTIONS = shlex.split(
    "--device /dev/kfd --device /dev/dri --group-add video --cap-add SYS_PTRACE --security-opt seccomp=unconfined "
    "--ipc=host --shm-size=16g -p 8000:8000 -v ~/.cache/huggingface:/root/.cache/huggingface"
)

_PARSERS = "--tool-call-parser minimax_m3 --reasoning-parser minimax_m3 --enable-auto-tool-choice"
_AMD_ATTN = "--attention-backend TRITON_ATTN --mm-encoder-tp-mode data --mm-encoder-attn-backend ROCM_AITER_FA"
_AMD_ENV = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}  # seed 002: "set the following before any of the serve commands"
_YARN_1M = (
    '{"text_config":{"rope_scaling":{"rope_type":"yarn","factor":2.0,"original_max_position_embeddings":524288}}}'
)
# Flags that only make sense with the vision encoder loaded (seed 002: exclusive with --language-model-only).
_ENCODER_FLAGS = {"--mm-encoder-tp-mode", "--mm-encoder-attn-backend", "--mm-processor-cache-type"}
_ENGINE_PORT = {"vllm": 8000, "sglang": 30000, "llama-cpp": 8000}
# vLLM reads its key from this variable (argv would show it in `ps`); SGLang takes only --api-key.
_KEY_ENV = {"vllm": "VLLM_API_KEY", "sglang": None, "llama-cpp": None}


class Profile(BaseModel):
    """One way to serve M3 on one kind of machine, as a seed document gives it."""

    name: str
    engine: Engine
    summary: str
    source: str = Field(description="the seed document and section the flags come from")
    platform: Literal["nvidia", "amd"] = "nvidia"
    gpu: str = Field(description="GPU kind the seed targets, a key of agent.serving.planner.GPU_MEMORY_GB; "
                     "CPU for a profile without GPUs")
    gpus: int = Field(description="GPUs the profile needs; 0: it runs on the CPU")
    precision: Precision = "bf16"
    model: str = DEFAULT_MODEL
    launcher: list[str] = Field(description="the program and sub-command that start the engine natively")
    model_flag: str | None = Field(
        None, description="how the native launcher takes the model; None: positional (vllm serve MODEL)"
    )
    seed_launcher: str | None = Field(
        None, description="the seed's own start, when it used an entry point the engine has since deprecated"
    )
    args: list[str] = Field(description="the seed's flags in the seed's order, the model excepted")
    env: dict[str, str] = Field(default_factory=dict)
    docker_image: str = VLLM_IMAGE
    docker_options: list[str] = Field(default_factory=lambda: list(NVIDIA_DOCKER_OPTIONS))
    docker_command: list[str] = Field(
        default_factory=list, description="what follows the image (empty: the image's own entrypoint)"
    )


class Command(BaseModel):
    """A rendered launch command: argv, environment, and what was added beyond the seed."""

    profile: str
    engine: Engine
    runner: Runner
    argv: list[str]
    env: dict[str, str]
    added: list[str] = Field(default_factory=list, description="flags the project requires that the seed lacks")
    port: int
    served_model_name: str
    container: str | None = None
    host: str = Field(LOOPBACK, description="the address the server listens on (docker: publishes on)")
    api_key: ApiKey | None = Field(None, description="the key the server requires; None: loopback only")
    key_env: str | None = Field(None, description="the variable the engine reads the key from (else argv)")

    def launch_env(self) -> dict[str, str]:
        """What the launched process's environment adds: the profile's, and the key's variable."""
        env = dict(self.env)
        if self.api_key is not None and self.key_env:
            env[self.key_env] = self.api_key.value.get_secret_value()
        return env

    def shell(self) -> str:
        """The command as one line a user can paste into a shell (environment first), the key masked."""
        env = self.launch_env()  # docker: only the key's variable, which `-e NAME` passes on
        line = " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [_quote(a) for a in self.argv])
        return redact(line, [self.api_key.value.get_secret_value() if self.api_key else None])


class Overrides(BaseModel):
    """What a user may change on top of a profile; each replaces the seed's value in place."""

    model: str | None = None
    served_model_name: str | None = None
    port: int | None = None
    host: str | None = Field(None, description="the address to listen on; None: 127.0.0.1 (loopback only)")
    api_key: ApiKey | None = Field(None, description="the key to require (access.choose_key); needed off loopback")
    max_model_len: int | None = None
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int | None = None
    text_only: bool = False
    extra_args: list[str] = Field(default_factory=list)


def _quote(arg: str) -> str:
    # Leave a leading "~/" bare so the shell still expands it, as in the seed.
    if arg.startswith("~/") and shlex.quote(arg[1:]) == arg[1:]:
        return arg
    return shlex.quote(arg)


def _vllm(name: str, summary: str, source: str, gpu: str, args: str, *, gpus: int = 8, **kw) -> Profile:
    return Profile(name=name, engine="vllm", summary=summary, source=source, gpu=gpu, gpus=gpus,
                   launcher=["vllm", "serve"], args=shlex.split(args), **kw)


def _amd(name: str, summary: str, source: str, args: str, *, env: dict[str, str] | None = None, **kw) -> Profile:
    return _vllm(name, summary, source, "MI355X", args, platform="amd", env={**_AMD_ENV, **(env or {})},
                 docker_image=VLLM_ROCM_IMAGE, docker_options=list(AMD_DOCKER_OPTIONS), **kw)


# seed 001 starts vLLM through this module, which vLLM marks deprecated; `vllm serve` runs the same server.
_OLD_VLLM_ENTRY = "python -m vllm.entrypoints.openai.api_server --model MODEL"


def _seed001(name: str, tp: int, summary: str) -> Profile:
    variant = "" if tp == 2 else " (its --tensor-parallel-size 4 variant)"
    return Profile(
        name=name, engine="vllm", summary=summary, gpu="H200", gpus=tp, precision="fp8",
        source=f"seed 001: Step 4, Launch the vLLM Server{variant}",
        launcher=["vllm", "serve"], seed_launcher=_OLD_VLLM_ENTRY,
        args=shlex.split(f"--served-model-name minimax-m3 --tensor-parallel-size {tp} --quantization fp8 "
                    "--enable-expert-parallel --max-model-len 131072 --kv-cache-dtype fp8_e5m2 "
                    "--gpu-memory-utilization 0.92 --enable-chunked-prefill --max-num-seqs 16 --port 8000"),
    )


# fmt: off
# What "seed NNN" in a profile's source names: the published deployment guides the profiles copy.
SEEDS: dict[str, str] = {
    "000": "Lambda's guide to deploying M3 with docker run (vLLM, SGLang); its 8x B200 figures are what "
           "`serve bench` compares with",
    "001": "a GPU-cloud self-hosting tutorial (2x / 4x H200 with FP8, memory and cost estimates)",
    "002": "the model's own deployment recipe (NVIDIA and AMD commands, quantized variants, sampling)",
    "003": "an article on M3 on NVIDIA with tensor parallel 8 and FlashInfer attention",
    "004": "NVIDIA's developer blog post on deploying M3 with vLLM and SGLang",
}

# The M3 profiles, each a seed's command.
PROFILES: list[Profile] = [
    _vllm("h200-tp8", "8x H200 / H20, tensor parallel 8 (BF16)", "seed 002: NVIDIA — TP8 (8x H200 / H20)", "H200",
          f"--tensor-parallel-size 8 --block-size 128 {_PARSERS}"),
    _vllm("h200-tp8-ep", "8x H200 / H20, TP8 + expert parallel (BF16)", "seed 002: TP8 + Expert Parallel", "H200",
          f"--tensor-parallel-size 8 --enable-expert-parallel --block-size 128 {_PARSERS}"),
    _vllm("h200-dp8-ep", "8x H200 / H20, DP8 + expert parallel (BF16)", "seed 002: DP8 + Expert Parallel", "H200",
          f"--data-parallel-size 8 --enable-expert-parallel --block-size 128 {_PARSERS}"),
    _vllm("mxfp8-tp8", "MXFP8 checkpoint, TP8 (about half the VRAM of BF16)", "seed 002: Quantized Variant (MXFP8)",
          "B200", f"--tensor-parallel-size 8 --block-size 128 {_PARSERS}",
          precision="mxfp8", model="MiniMaxAI/MiniMax-M3-MXFP8"),
    _vllm("blackwell-tp8-ep", "8x B200, TP8 + EP, FlashInfer encoder attention, shm processor cache",
          "seeds 003/004: Deploying with vLLM", "B200",
          "--tensor-parallel-size 8 --enable-expert-parallel --block-size 128 --mm-encoder-attn-backend FLASHINFER "
          "--mm-processor-cache-type shm --tool-call-parser minimax_m3 --enable-auto-tool-choice "
          "--reasoning-parser minimax_m3 --trust-remote-code"),
    _vllm("b200", "8x B200 (HGX), TP8, the seed 000 benchmark machine",
          "seed 000: Deploying MiniMax-M3 (vLLM docker run)", "B200",
          f"--served-model-name minimax-m3 --tensor-parallel-size 8 --trust-remote-code --block-size 128 {_PARSERS}"),
    Profile(name="b200", engine="sglang", summary="8x B200 (HGX), SGLang TP8 with fa4 attention (CUDA 12.8 only)",
            source="seed 000: Deploying MiniMax-M3 (SGLang docker run)", gpu="B200", gpus=8,
            launcher=["python3", "-m", "sglang.launch_server"], model_flag="--model-path",
            args=shlex.split("--served-model-name minimax-m3 --tp 8 --host 0.0.0.0 --port 8000 --trust-remote-code "
                        "--mem-fraction-static 0.65 --attention-backend fa4 --page-size 128 "
                        "--moe-runner-backend deep_gemm"),
            docker_image=SGLANG_IMAGE, docker_command=["python3", "-m", "sglang.launch_server"]),
    Profile(name="blackwell-mxfp8-tp8-ep", engine="sglang",
            summary="8 GPUs, SGLang TP8 + EP8 with MXFP8 quantization, flashinfer attention",
            source="seed 004: Deploying with SGLang", gpu="B200", gpus=8, precision="mxfp8",
            launcher=["python", "-m", "sglang.launch_server"], model_flag="--model-path",
            # seed 004's text is cut off after "minimax-m3-nom"; the parser name is minimax-m3 (M3-SERVING).
            args=shlex.split("--dtype bfloat16 --tp-size 8 --ep-size 8 --trust-remote-code --mem-fraction-static 0.8 "
                        "--enable-multimodal --quantization mxfp8 --attention-backend flashinfer "
                        "--mm-attention-backend flashinfer_cudnn --moe-runner-backend deep_gemm "
                        "--chunked-prefill-size 8192 --reasoning-parser minimax-m3 --tool-call-parser minimax-m3"),
            docker_image=SGLANG_IMAGE, docker_command=["python", "-m", "sglang.launch_server"]),
    _seed001("h200x2-fp8", 2, "2x H200, FP8 weights (on-the-fly), fp8 KV; the seed's 128K window"),
    _seed001("h200x4-fp8", 4, "4x H200, FP8 weights (on-the-fly), fp8 KV; room for 1M"),
    _amd("amd-tp8", "AMD MI300X / MI325X / MI355X, TP8 (text or vision)", "seed 002: AMD ROCm — TP8 (Text or Vision)",
         f"--tensor-parallel-size 8 --block-size 128 {_AMD_ATTN} {_PARSERS}"),
    _amd("amd-tp8-ep", "AMD MI300X / MI325X / MI355X, TP8 + expert parallel",
         "seed 002: AMD ROCm — TP8 + Expert Parallel",
         f"--tensor-parallel-size 8 --enable-expert-parallel --block-size 128 {_AMD_ATTN} {_PARSERS}"),
    _amd("amd-dp8-ep", "AMD MI300X / MI325X / MI355X, DP8 + expert parallel",
         "seed 002: AMD ROCm — DP8 + Expert Parallel",
         f"--data-parallel-size 8 --enable-expert-parallel --block-size 128 {_AMD_ATTN} {_PARSERS}"),
    _amd("amd-tp8-1m", "AMD, TP8 + fp8 KV at the full 1M window (YaRN past the native 512K)",
         "seed 002: AMD ROCm notes (1M context)",
         f"--block-size 128 --kv-cache-dtype fp8 --tensor-parallel-size 8 --max-model-len 1048576 {_AMD_ATTN} "
         f"--tool-call-parser minimax_m3 --enable-auto-tool-choice --reasoning-parser minimax_m3 "
         f"--hf-overrides {shlex.quote(_YARN_1M)}",
         env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}),
    _amd("mi355x-mxfp4", "AMD MI350X / MI355X (gfx950), MXFP4 checkpoint, TP4, AITER MoE, text only",
         "seed 002: Quantized Variant (MXFP4, AMD) — AITER MoE",
         f"--tensor-parallel-size 4 --block-size 128 --moe-backend aiter --attention-backend TRITON_ATTN "
         f"--language-model-only --no-enable-prefix-caching {_PARSERS}",
         env={"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_MOE": "1"}, gpus=4, precision="mxfp4",
         model="amd/MiniMax-M3-MXFP4"),
    _amd("mi355x-mxfp4-emulation", "AMD gfx950, MXFP4 checkpoint, TP8, emulated MoE (runs on current images)",
         "seed 002: Quantized Variant (MXFP4, AMD) — Emulation MoE",
         f"--tensor-parallel-size 8 --block-size 128 --moe-backend emulation --attention-backend TRITON_ATTN "
         f"{_PARSERS}",
         precision="mxfp4", model="amd/MiniMax-M3-MXFP4"),
]
# Not M3: a 135M model on the CPU, to watch the whole loop work before pointing it at M3 (issue 42).
# The launcher's python and the model file are the cached venv's (serving/llamacpp.py).
CPU_PROFILES: list[Profile] = [
    Profile(name="cpu-tiny", engine="llama-cpp", summary=f"CPU only: {llamacpp.MODEL_NAME} on llama-cpp-python, a toy "
            "to watch the loop work", source="no seed: issue 42 (a real model in "
            "the loop)", gpu="CPU", gpus=0, precision="int4", model=llamacpp.MODEL_NAME,
            launcher=["python", "-m", "llama_cpp.server"], model_flag="--model", env=dict(llamacpp.SERVER_ENV),
            args=["--model_alias", llamacpp.SERVED_NAME, *llamacpp.SERVER_ARGS, "--port", "8000"]),
]
# fmt: on
ALL_PROFILES: list[Profile] = PROFILES + CPU_PROFILES


def profile_names() -> list[str]:
    """Every profile name, in catalog order, once."""
    return list(dict.fromkeys(p.name for p in ALL_PROFILES))


def get_profile(name: str, engine: Engine | None = None) -> Profile:
    """The profile called `name` for `engine` (the first engine listed when None)."""
    matches = [p for p in ALL_PROFILES if p.name == name]
    if not matches:
        raise UsageError(f"unknown profile {name!r}; choose one of: {', '.join(profile_names())}")
    if engine is None:
        return matches[0]
    for p in matches:
        if p.engine == engine:
            return p
    engines = ", ".join(p.engine for p in matches)
    raise UsageError(f"profile {name!r} has no {engine} form (it has: {engines}); pick another profile")


def _flag_index(args: list[str], flag: str) -> int | None:
    for i, a in enumerate(args):
        if a == flag or a.startswith(flag + "="):
            return i
    return None


def _has_value(args: list[str], i: int) -> bool:
    return "=" not in args[i] and i + 1 < len(args) and not args[i + 1].startswith("--")


def flag_value(args: list[str], flag: str) -> str | None:
    """The value given to `flag` in `args` (`--f v` or `--f=v`), None when absent."""
    i = _flag_index(args, flag)
    if i is None:
        return None
    if "=" in args[i]:
        return args[i].split("=", 1)[1]
    return args[i + 1] if _has_value(args, i) else ""


def set_flag(args: list[str], flag: str, value: str | None) -> bool:
    """Set `flag` in place (keeping its position) or append it; True when it was appended."""
    i = _flag_index(args, flag)
    if i is None:
        args.extend([flag] if value is None else [flag, value])
        return True
    if value is not None:
        if "=" in args[i]:
            args[i] = f"{flag}={value}"
        elif _has_value(args, i):
            args[i + 1] = value
        else:
            args.insert(i + 1, value)
    return False


def remove_flag(args: list[str], flag: str) -> None:
    """Drop `flag` and its value, if present."""
    i = _flag_index(args, flag)
    if i is not None:
        del args[i : i + (2 if _has_value(args, i) else 1)]


# Engine-specific spelling of the options a user can override.
_NAMES = {
    "vllm": {"tp": "--tensor-parallel-size", "len": "--max-model-len", "mem": "--gpu-memory-utilization",
             "name": "--served-model-name", "key": "--api-key"},
    "sglang": {"tp": "--tp-size", "len": "--context-length", "mem": "--mem-fraction-static",
               "name": "--served-model-name", "key": "--api-key"},
    "llama-cpp": {"len": "--n_ctx", "name": "--model_alias", "key": "--api_key"},
}
# The flags every M3 launch must carry (MSA block size, M3 parsers, tool choice, cached tokens).
REQUIRED_FLAGS: dict[str, list[tuple[str, str | None]]] = {
    "vllm": [
        ("--block-size", "128"),
        ("--tool-call-parser", "minimax_m3"),
        ("--reasoning-parser", "minimax_m3"),
        ("--enable-auto-tool-choice", None),
        ("--enable-prompt-tokens-details", None),
    ],
    "sglang": [
        ("--page-size", "128"),
        ("--reasoning-parser", "minimax-m3"),
        ("--tool-call-parser", "minimax-m3"),
        ("--enable-cache-report", None),
    ],
    "llama-cpp": [],  # not an M3 server: the profile carries all it needs
}


def _apply(profile: Profile, o: Overrides) -> tuple[list[str], list[str]]:
    """The profile's flags with overrides applied, and the required flags appended (also returned).

    `extra_args` are not here: they go last, after the bind address and the key (`build_command`).
    """
    args = list(profile.args)
    n = _NAMES[profile.engine]
    if profile.engine == "llama-cpp":
        _refuse_gpu_overrides(profile, o)
    # SGLang accepts both spellings of tensor parallel; keep whichever the seed used.
    tp_flag = "--tp" if profile.engine == "sglang" and _flag_index(args, "--tp") is not None else n.get("tp")
    port = None if o.port is None else str(o.port)
    memory = f"{o.gpu_memory_utilization:g}" if o.gpu_memory_utilization else None
    for flag, value in ((n["name"], o.served_model_name), ("--port", port),
                        (tp_flag, o.tensor_parallel_size), (n["len"], o.max_model_len),
                        ("--kv-cache-dtype", o.kv_cache_dtype), (n.get("mem"), memory)):
        if value:  # in this order: a flag the seed lacks is appended
            set_flag(args, flag, str(value))
    if o.text_only:
        for f in _ENCODER_FLAGS:
            remove_flag(args, f)
        if profile.engine == "vllm":
            set_flag(args, "--language-model-only", None)
        else:
            remove_flag(args, "--enable-multimodal")
    added: list[str] = []
    for flag, value in REQUIRED_FLAGS[profile.engine]:
        if set_flag(args, flag, value):
            added += [flag] if value is None else [flag, value]
    return args, added


def _refuse_gpu_overrides(profile: Profile, o: Overrides) -> None:
    """A CPU profile has no tensor parallel, GPU memory share, KV dtype or vision encoder to set."""
    given = [flag for flag, value in (("--tp", o.tensor_parallel_size), ("--gpu-memory-utilization",
             o.gpu_memory_utilization), ("--kv-cache-dtype", o.kv_cache_dtype), ("--text-only", o.text_only))
             if value]
    if given:
        raise UsageError(f"{given[0]} does not apply to {profile.name}: it runs llama.cpp on the CPU")


def container_name(profile: str, engine: Engine, port: int) -> str:
    """The docker container name the project gives a launch (how `stop` finds it again)."""
    return f"m3-agent-{profile}-{engine}-{port}"


def _access(profile: Profile, runner: Runner, o: Overrides, args: list[str]) -> str:
    """Bind the server where `o` says (loopback by default) and give it the key; the host it listens on.

    In a container the engine listens on every interface of the container's own network; the host
    side is then limited by where `docker run -p` publishes the port.
    """
    host = o.host or LOOPBACK
    if profile.engine == "llama-cpp" and not is_loopback(host):
        raise UsageError(f"{profile.name} listens on loopback only: it is for trying the loop on this machine")
    given = [f for f in ("--host", "--api-key", _NAMES[profile.engine]["key"]) if _flag_index(o.extra_args, f) is not None]
    if given:
        raise UsageError(f"pass {given[0]} as an option of its own, not through --extra-arg: "
                         "m3-agent decides the bind address and the key together")
    if not is_loopback(host) and o.api_key is None:
        raise UsageError(f"--host {host} lets other machines reach the server: it needs an API key "
                         "(access.choose_key: --api-key, M3_AGENT_MODEL__API_KEY, or a new one)")
    workers = flag_value(args + o.extra_args, "--tokenizer-worker-num")
    if profile.engine == "sglang" and o.api_key is not None and workers not in (None, "1"):
        # SGLang 0.5.23's http_server adds its API-key middleware in single-tokenizer mode only
        raise UsageError(f"SGLang checks --api-key only with one tokenizer worker, not --tokenizer-worker-num "
                         f"{workers}: drop it, or keep the server on loopback")
    set_flag(args, "--host", host if runner == "native" else ALL_INTERFACES)
    if o.api_key is not None and _KEY_ENV[profile.engine] is None:
        set_flag(args, _NAMES[profile.engine]["key"], o.api_key.value.get_secret_value())
    return host


def _docker_argv(profile: Profile, o: Overrides, args: list[str], port: int, host: str) -> list[str]:
    """`docker run` for the profile's image: published on `host` only, the key passed by name."""
    options = list(profile.docker_options)
    pi = options.index("-p")  # the container listens on the engine's port: publish it there, on `host` only
    options[pi + 1] = f"{host}:{port}:{port}"
    env_opts = [x for k, v in profile.env.items() for x in ("-e", f"{k}={v}")]
    if os.environ.get("HF_TOKEN"):
        env_opts += ["-e", "HF_TOKEN"]  # passes the caller's token through without printing it
    key_env = _KEY_ENV[profile.engine]
    if o.api_key is not None and key_env:
        env_opts += ["-e", key_env]  # the value comes from the docker client's environment, not argv
    # The vLLM image's entrypoint is `vllm serve`; seed 000's docker run gives it the model as `--model`.
    model_flag = profile.model_flag or ("--model" if profile.engine == "vllm" else "--model-path")
    name = container_name(profile.name, profile.engine, port)
    return ["docker", "run", "-d", "--name", name, *options, *env_opts, profile.docker_image,
            *profile.docker_command, model_flag, o.model or profile.model, *args]


def build_command(profile: Profile, runner: Runner = "native", overrides: Overrides | None = None) -> Command:
    """Render `profile` for `runner`: the seed's flags (overridden in place) plus the required ones.

    The server listens on 127.0.0.1 unless `overrides.host` says otherwise; a host other machines
    can reach needs `overrides.api_key`, which the engine gets through its own variable or flag.
    """
    o = overrides or Overrides()
    args, added = _apply(profile, o)
    host = _access(profile, runner, o, args)
    args += o.extra_args
    launcher, model = profile.launcher, o.model or profile.model
    if profile.engine == "llama-cpp":
        if runner != "native":
            raise UsageError(f"{profile.name} runs natively only (llama-cpp-python in a cached venv): drop --runner")
        server = llamacpp.locate()
        launcher, model = [server.python, *profile.launcher[1:]], o.model or server.model
    served = flag_value(args, _NAMES[profile.engine]["name"]) or model
    port = int(flag_value(args, "--port") or _ENGINE_PORT[profile.engine])
    common = dict(profile=profile.name, engine=profile.engine, runner=runner, added=added, port=port,
                  served_model_name=served, host=host, api_key=o.api_key,
                  key_env=_KEY_ENV[profile.engine] if o.api_key else None)
    if runner == "native":
        model_part = [model] if profile.model_flag is None else [profile.model_flag, model]
        return Command(argv=[*launcher, *model_part, *args], env=dict(profile.env), **common)
    return Command(argv=_docker_argv(profile, o, args, port, host), env={},
                   container=container_name(profile.name, profile.engine, port), **common)
