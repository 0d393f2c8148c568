"""The key a launched endpoint requires, checked by the engines' own auth code.

vLLM: its real API server app (`vllm.entrypoints.launchers.app.build_app`) is built on CPU from the
arguments and environment `serve start` gives it, and requests go through a test client. SGLang: its
real app cannot be imported without its GPU stack (sglang.srt.entrypoints.http_server imports
torchvision), so its own API-key middleware is put on an app with the same routes, as http_server
adds it. The router of the --replicas plan runs for real, as a process, in front of a keyed stand-in.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request

from m3_agent.agent.access import ApiKey
from m3_agent.serving.multinode import replicas_behind_router
from m3_agent.serving.profiles import Overrides, build_command, get_profile
from m3_agent.standin.server import StandinServer

KEY = "m3-conformance-key-0123456789WXYZ"
KEYED = Overrides(host="0.0.0.0", api_key=ApiKey.model_validate({"value": KEY, "source": "flag --api-key"}))
GUARDED = [["GET", "/v1/models", None], ["GET", "/v1/models", "wrong"], ["GET", "/v1/models", KEY],
           ["POST", "/v1/chat/completions", None], ["POST", "/v1/chat/completions", KEY]]
OPEN_ON_VLLM = [["GET", "/health", None], ["GET", "/metrics", None], ["POST", "/tokenize", None],
                ["GET", "/version", None]]
CHAT = {"model": "MiniMaxAI/MiniMax-M3", "messages": [{"role": "user", "content": "hi"}]}


def test_vllms_app_requires_the_key_serve_start_passes_through_vllm_api_key(oracle):
    cmd = build_command(get_profile("h200-tp8"), "native", KEYED)
    assert cmd.argv[:2] == ["vllm", "serve"] and KEY not in cmd.argv
    answer = oracle.ask("vllm_auth", argv=cmd.argv[2:], env=cmd.launch_env(), requests=GUARDED + OPEN_ON_VLLM)
    assert answer["host"] == "0.0.0.0" and answer["api_key_flag"] is None  # the key came from VLLM_API_KEY
    statuses = [status for status, _ in answer["answers"]]
    guarded, unguarded = statuses[: len(GUARDED)], statuses[len(GUARDED):]
    assert [s == 401 for s in guarded] == [True, True, False, True, False], guarded
    # vLLM 0.33 guards /v1, /v2, /inference and /cohere only: these stay open to whoever reaches the port
    assert 401 not in unguarded, unguarded


def test_vllms_key_leaves_invocations_open_as_the_docs_say(oracle):
    """vllm issue #58144 (open): /invocations (SageMaker) dispatches a chat body to the chat handler with no
    key. With no engine here the handler fails on its missing state, which shows the request got there.
    When a vLLM release guards it, this test fails: update access.ENGINE_CAVEATS and the README."""
    cmd = build_command(get_profile("h200-tp8"), "native", KEYED)
    answer = oracle.ask("vllm_auth", argv=cmd.argv[2:], env=cmd.launch_env(),
                        requests=[["POST", "/invocations", None, CHAT], ["POST", "/v1/chat/completions", None, CHAT]])
    (status, body), (v1_status, _) = answer["answers"]
    assert v1_status == 401 and status != 401 and "openai_serving_chat" in body, (status, body)


def test_vllms_app_on_loopback_has_no_key_to_ask_for(oracle):
    """The check above can fail: without a key (the loopback default) vLLM lets every request through."""
    cmd = build_command(get_profile("h200-tp8"), "native")
    assert cmd.api_key is None
    answer = oracle.ask("vllm_auth", argv=cmd.argv[2:], env=cmd.launch_env(), requests=GUARDED[:1])
    assert answer["host"] == "127.0.0.1" and answer["answers"][0][0] != 401


def test_sglangs_middleware_requires_the_key_serve_start_passes_as_its_flag(oracle):
    cmd = build_command(get_profile("b200", "sglang"), "native", KEYED)
    start = cmd.argv.index("sglang.launch_server") + 1
    requests = GUARDED + [["POST", "/tokenize", None], ["GET", "/health", None], ["GET", "/metrics", None]]
    answer = oracle.ask("sglang_auth", argv=cmd.argv[start:], requests=requests)
    assert answer["host"] == "0.0.0.0" and answer["api_key"] == KEY
    assert answer["statuses"] == [401, 401, 200, 401, 200, 401, 200, 200], answer["statuses"]
    # why build_command refuses a key with --tokenizer-worker-num > 1
    assert answer["middleware_in_single_tokenizer_mode_only"] is True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, key: str | None) -> int:
    body = json.dumps({"model": "MiniMaxAI/MiniMax-M3", "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:  # not listening yet
        return 0


def _router_argv(worker: str, port: int) -> list[str]:
    """The plan's router command, with the stand-in as its worker, a free port and the key in clear."""
    step = replicas_behind_router(get_profile("h200-tp8"), 2, overrides=KEYED)[-1]
    argv = step.command.split()
    argv = argv[argv.index("sglang_router.launch_router") + 1:]
    argv[argv.index("--worker-urls") + 1: argv.index("--worker-urls") + 3] = [worker]
    argv[argv.index("--host") + 1], argv[argv.index("--port") + 1] = "127.0.0.1", str(port)
    argv[argv.index("--api-key") + 1] = KEY  # printed masked
    return argv


def test_the_router_of_the_replicas_plan_requires_the_key_and_sends_it_to_the_replicas(oracle, tmp_path):
    with StandinServer({"turns": [{"content": "routed", "repeat": 10}]}, api_key=KEY) as replica:
        port = _free_port()
        log = open(tmp_path / "router.log", "wb")
        router = subprocess.Popen([oracle.python, "-m", "sglang_router.launch_router",
                                   *_router_argv(replica.root_url, port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            deadline = time.monotonic() + 60
            while _post(url, KEY) != 200:
                assert router.poll() is None and time.monotonic() < deadline, (tmp_path / "router.log").read_text()
                time.sleep(0.5)
            assert _post(url, None) == 401 and _post(url, "wrong") == 401
            assert _post(replica.base_url + "/chat/completions", None) == 401  # the replica wants the key too
            assert len(replica.requests) >= 1  # what reached it came through the router, with the key
        finally:
            router.terminate()
            router.wait(timeout=30)
            log.close()
