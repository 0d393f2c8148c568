"""A fake engine: an executable named `vllm` that serves the project's stand-in after a delay, requiring
the key it was given (as vLLM does), or crashes with a log line. tests/serving's fixtures put it on
PATH; tests elsewhere (`fix --serve`) install it with `install_fake_engine`.

FAKE_ENGINE_TURNS names a JSON file of stand-in turns to serve instead of endless filler text;
FAKE_ENGINE_QUIRKS a JSON object of the stand-in's quirks (e.g. no max_model_len in /v1/models).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

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
    from m3_agent.standin.server import StandinServer
    turns = [{{"content": "word " * 40, "repeat": 100000}}]
    if os.environ.get("FAKE_ENGINE_TURNS"):
        import json
        turns = json.load(open(os.environ["FAKE_ENGINE_TURNS"]))
    script = {{"model": served, "max_model_len": int(flag("--max-model-len", "1048576")),
              "loading_s": float(os.environ.get("FAKE_ENGINE_LOADING_S", "0.5")),
              "turns": turns}}
    if os.environ.get("FAKE_ENGINE_QUIRKS"):  # a server that is not vLLM (the stand-in's quirks table)
        import json
        script["quirks"] = json.loads(os.environ["FAKE_ENGINE_QUIRKS"])
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


def install_fake_engine(bin_dir: Path) -> Path:
    """Write the fake `vllm` into `bin_dir` (put that first on PATH); its path."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    engine = bin_dir / "vllm"
    engine.write_text(FAKE_ENGINE.format(python=sys.executable))
    engine.chmod(0o755)
    return engine
