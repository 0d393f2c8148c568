"""A fake engine on PATH: an executable named `vllm` that serves the project's stand-in after a delay
(requiring the key it was given, as vLLM does), or crashes with a log line, plus fake `nvidia-smi` /
`rocm-smi`. State files go to a tmp dir."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

FAKE_ENGINE = textwrap.dedent('''\
    #!{python}
    """Fake engine for tests: `vllm serve MODEL ... --port N` behaves like a loading vLLM server."""
    import os, signal, subprocess, sys, time
    args = sys.argv[1:]
    def flag(name, default=None):
        for i, a in enumerate(args):
            if a == name and i + 1 < len(args):
                return args[i + 1]
        return default
    mode = os.environ.get("FAKE_ENGINE_MODE", "healthy")
    print("INFO fake engine argv: " + " ".join(args), flush=True)
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = os.environ.get("FAKE_ENGINE_CHILD_PID_FILE")
    if child:  # a worker process in the same group, as vLLM's tensor-parallel workers are
        worker = subprocess.Popen([sys.executable, "-c", "import time, signal; "
                                   + ("signal.signal(signal.SIGTERM, signal.SIG_IGN); " if mode == "ignore-term" else "")
                                   + "time.sleep(600)"])
        open(child, "w").write(str(worker.pid))
    if os.environ.get("FAKE_ENGINE_LOG_KEY"):  # as SGLang does: its server_args line holds --api-key
        print(f"INFO server_args=ServerArgs(api_key={{os.environ.get('VLLM_API_KEY')!r}})", flush=True)
    time.sleep(float(os.environ.get("FAKE_ENGINE_REFUSE_S", "0.3")))  # connection refused meanwhile
    if mode == "crash":
        print("Loading safetensors checkpoint shards:  40% Completed | 2/5", flush=True)
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total "
              "capacity of 139.72 GiB", flush=True)
        sys.exit(1)
    positional = args[1] if len(args) > 1 and args[0] == "serve" and not args[1].startswith("--") else None
    served = flag("--served-model-name") or positional or flag("--model")
    from m3_agent.serving.standin import StandinServer
    script = {{"model": served, "max_model_len": int(flag("--max-model-len", "1048576")),
              "loading_s": float(os.environ.get("FAKE_ENGINE_LOADING_S", "0.5")),
              "turns": [{{"content": "word " * 40, "repeat": 100000}}]}}
    if mode == "never-ready":
        script["loading_s"] = 3600
    # vLLM's key: --api-key first, else VLLM_API_KEY (vllm/entrypoints/serve/middleware/register.py)
    key = flag("--api-key") or os.environ.get("VLLM_API_KEY")
    server = StandinServer(script, host=flag("--host", "127.0.0.1"), port=int(flag("--port", "8000")),
                           api_key=key).start()
    print("Loading safetensors checkpoint shards: 100% Completed", flush=True)
    print("INFO:     Application startup complete.", flush=True)
    while True:
        time.sleep(1)
''')

NVIDIA_SMI = '#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo "$i, NVIDIA H200, 143771"; done\n'


@pytest.fixture
def fake_bin(tmp_path, monkeypatch) -> Path:
    """A bin dir first on PATH holding a fake `vllm`; state files under tmp_path/state."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    engine = bin_dir / "vllm"
    engine.write_text(FAKE_ENGINE.format(python=sys.executable))
    engine.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("M3_AGENT_STATE_DIR", str(tmp_path / "state"))
    return bin_dir


@pytest.fixture
def fake_nvidia_smi(fake_bin) -> Path:
    """A `nvidia-smi` that reports 8x H200."""
    smi = fake_bin / "nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(0o755)
    return smi


@pytest.fixture
def cleanup_endpoints(fake_bin):
    """Stop whatever a test left recorded, so no process outlives it."""
    names: list[str] = ["default"]
    yield names
    from m3_agent.serving import launcher

    for name in names:
        launcher.stop(name, grace_s=1)
