"""The model client against the stand-in server, over real HTTP through the openai SDK."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from m3_agent.errors import EndpointAuthError, EndpointError, UsageError
from m3_agent.agent.model import (
    ContextOverflowError,
    ModelClient,
    ModelConfig,
    is_context_overflow,
    overflow_from,
    split_reasoning,
)
from m3_agent.agent.endpoint import EndpointClient, ServedModel, served_models
from m3_agent.standin.server import StandinServer

FAST_RETRY = dict(retry_initial_s=0.01, retry_max_wait_s=0.05, retry_attempts=4, retry_max_s=10)


def _client(srv: StandinServer, **kw) -> ModelClient:
    return ModelClient(ModelConfig(base_url=srv.base_url, **{**FAST_RETRY, **kw}))


def _user(text: str = "hello") -> list[dict]:
    return [{"role": "user", "content": text}]


def test_request_carries_model_card_sampling_and_thinking_mode():
    with StandinServer({"turns": [{"content": "hi"}]}) as srv:
        client = _client(srv)
        reply = client.complete(_user(), tools=[{"type": "function", "function": {"name": "submit", "parameters": {"type": "object", "properties": {}}}}], thinking_mode="disabled")
        body = srv.requests[0]
    assert reply.content == "hi"
    assert body["model"] == "MiniMaxAI/MiniMax-M3"  # discovered from /v1/models
    assert body["temperature"] == 1.0 and body["top_p"] == 0.95 and body["top_k"] == 40
    assert body["chat_template_kwargs"] == {"thinking_mode": "disabled"}
    assert body["tool_choice"] == "auto"
    assert body["max_tokens"] == 8192


def test_max_model_len_is_read_from_models_listing():
    with StandinServer({"max_model_len": 32768, "turns": []}) as srv:
        assert _client(srv).max_model_len() == 32768


class _Models(BaseHTTPRequestHandler):
    """A server whose /v1/models answer is the class attribute `answer` (as SGLang or a proxy might list)."""

    answer: object = {}
    status = 200

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        body = json.dumps(self.answer).encode()
        self.send_response(self.status if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def models_server():
    """Serve a given /v1/models answer over real HTTP: yields a function(answer, status) -> base_url."""
    servers = []

    def serve(answer: object, status: int = 200) -> str:
        handler = type("Handler", (_Models,), {"answer": answer, "status": status})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def test_models_are_read_with_ids_and_windows_from_the_stand_in():
    with StandinServer({"max_model_len": 65536, "turns": []}) as srv:
        assert EndpointClient(srv.base_url).models() == [ServedModel(id="MiniMaxAI/MiniMax-M3", max_model_len=65536)]
        assert EndpointClient(srv.base_url.removesuffix("/v1")).models() == EndpointClient(srv.base_url + "/").models()
        # The client discovers through the same parser: the same model and window.
        client = _client(srv)
        assert (client.model, client.max_model_len()) == ("MiniMaxAI/MiniMax-M3", 65536)


def test_served_models_keep_order_skip_bad_cards_and_missing_windows(models_server):
    answer = {"data": [{"id": "m3-a", "max_model_len": 4096}, {"object": "model"}, "junk",
                       {"id": "m3-b"}, {"id": "m3-c", "max_model_len": "big"}]}
    assert served_models(answer) == [ServedModel(id="m3-a", max_model_len=4096), ServedModel(id="m3-b"),
                                     ServedModel(id="m3-c")]
    assert served_models({"data": None}) == served_models([]) == []
    url = models_server(answer)
    assert [m.id for m in EndpointClient(url).models()] == ["m3-a", "m3-b", "m3-c"]
    client = _client_at(url, name="m3-b")
    assert client.max_model_len() is None  # SGLang-style card: no window, so no default budget


def _client_at(url: str, **kw) -> ModelClient:
    return ModelClient(ModelConfig(base_url=url, **{**FAST_RETRY, **kw}))


def test_models_listing_failures_are_endpoint_errors(models_server):
    with pytest.raises(EndpointAuthError, match=r"refused the request \(HTTP 401\): sent no key") as e:
        EndpointClient(models_server({"error": "no key"}, status=401)).models()
    assert e.value.exit_code == 8
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(EndpointError, match=f"127.0.0.1:{port}/v1/models failed"):
        EndpointClient(f"http://127.0.0.1:{port}/v1", timeout=2).models()


def test_a_refused_key_is_its_own_error_naming_the_key_masked():
    key, wrong = "m3-right-key-0123456789", "m3-wrong-key-9876543210"
    with StandinServer({"turns": [{"content": "hi"}]}, api_key=key) as srv:
        with pytest.raises(EndpointAuthError) as e:
            _client(srv, api_key=wrong).complete(_user())
        assert _client(srv, api_key=key).complete(_user()).content == "hi"
    message = str(e.value)
    assert e.value.exit_code == 8 and "\n" not in message
    assert "sent the key ****3210 (from model.api_key)" in message and wrong not in message
    assert srv.base_url in message and "M3_AGENT_MODEL__API_KEY" in message


def test_client_without_an_endpoint_is_a_usage_error():
    with pytest.raises(UsageError, match="no model endpoint"):
        ModelClient(ModelConfig())


def test_api_key_is_masked_in_json_unless_secrets_are_asked_for():
    config = ModelConfig(base_url="http://127.0.0.1:9/v1", api_key="sk-secret-key")
    assert "sk-secret-key" not in config.model_dump_json() and "sk-secret-key" not in repr(config)
    handed_on = ModelConfig.model_validate_json(config.model_dump_json(context={"secrets": True}))
    assert handed_on.api_key.get_secret_value() == "sk-secret-key"


def test_reasoning_and_tool_calls_are_read_back_and_returned_in_both_fields():
    turn = {"reasoning": "Look at a.py first.", "tool_calls": [{"name": "file_read", "arguments": {"path": "a.py"}}]}
    with StandinServer({"turns": [turn]}) as srv:
        reply = _client(srv).complete(_user(), thinking_mode="enabled")
    assert reply.reasoning == "Look at a.py first."
    assert reply.finish_reason == "tool_calls"
    assert reply.tool_calls[0].name == "file_read"
    assert reply.tool_calls[0].id.startswith("chatcmpl-tool-")
    assert reply.tool_calls[0].arguments == '{"path": "a.py"}' or '"a.py"' in reply.tool_calls[0].arguments
    msg = reply.as_message()
    assert msg["reasoning"] == msg["reasoning_content"] == "Look at a.py first."
    assert msg["tool_calls"][0]["function"]["name"] == "file_read"


def test_stray_think_close_is_stripped():
    script = {"stray_think_close": True, "turns": [{"content": "one"}, {"content": "two"}]}
    with StandinServer(script) as srv:
        client = _client(srv)
        first = client.complete(_user(), thinking_mode="adaptive")
        msgs = _user() + [first.as_message(), {"role": "user", "content": "again"}]
        second = client.complete(msgs, thinking_mode="adaptive")
    assert second.content == "two"
    assert "</mm:think>" not in second.content


def test_split_reasoning_lifts_raw_think_block():
    assert split_reasoning("<mm:think>plan</mm:think>answer", None) == ("answer", "plan")
    assert split_reasoning("</mm:think>\nanswer", None) == ("answer", None)
    assert split_reasoning("plain", "r") == ("plain", "r")


@pytest.mark.parametrize("fault", ["503", "500", "drop"])
def test_transient_faults_are_retried(fault):
    with StandinServer({"turns": [{"fault": fault}, {"fault": fault}, {"content": "recovered"}]}) as srv:
        reply = _client(srv).complete(_user())
        assert len(srv.requests) >= 3
    assert reply.content == "recovered"
    assert reply.attempts == 3


def test_warming_server_503_is_waited_out():
    with StandinServer({"loading_s": 1.5, "turns": [{"content": "ready"}]}) as srv:
        t = time.monotonic()
        client = ModelClient(ModelConfig(base_url=srv.base_url, name="MiniMaxAI/MiniMax-M3", retry_initial_s=0.2,
                                         retry_max_wait_s=0.4, retry_attempts=40, retry_max_s=30))
        reply = client.complete(_user())
    assert reply.content == "ready"
    assert reply.attempts >= 2  # it saw the 503s of a loading server and waited them out
    assert time.monotonic() - t >= 1.0


def test_retries_are_bounded_and_end_in_one_clear_error():
    with StandinServer({"on_exhausted": "error", "turns": [{"fault": "500", "repeat": 10}]}) as srv:
        with pytest.raises(EndpointError) as err:
            _client(srv, retry_attempts=3).complete(_user())
        assert len(srv.requests) == 3
    assert "after 3 attempts" in str(err.value)
    assert "\n" not in str(err.value)


def test_context_overflow_is_recognised_not_retried():
    with StandinServer({"max_model_len": 300, "turns": [{"content": "never"}]}) as srv:
        with pytest.raises(ContextOverflowError) as err:
            _client(srv, max_tokens=200).complete(_user("word " * 200))
        assert len(srv.requests) <= 1
    assert err.value.limit == 300
    assert err.value.input_tokens and err.value.input_tokens > 100


@pytest.mark.parametrize(("text", "prompt", "window"), [
    # vLLM 0.33 (renderers/params.py): the prompt alone over the window
    ("This model's maximum context length is 1024 tokens. However, your prompt contains 2000 input tokens, which "
     "exceeds this limit even without any output tokens. Please reduce the length of the input prompt.", 2000, 1024),
    ("This model's maximum context length is 1024 tokens. However, your prompt contains at least 1025 input tokens, "
     "which exceeds this limit even without any output tokens.", 1025, 1024),
    # vLLM 0.33: max_tokens over the window; a prompt over the character bound (no token count)
    ("max_tokens=8192 cannot be greater than max_model_len=4096. Please request fewer output tokens.", None, 4096),
    ("This model's maximum context length is 1024 tokens. However, your prompt contains 90000 characters (more than "
     "40960 characters, which is the upper bound for 1024 input tokens).", None, 1024),
    # vLLM before 0.11
    ("You passed 2000 input tokens and requested 100 output tokens. However, the model's context length is only "
     "1024 tokens, resulting in a maximum input length of 924 tokens.", 2000, 1024),
    # llama-cpp-python's server: "requested" is prompt + max_tokens; the prompt is the messages' share
    ("This model's maximum context length is 8192 tokens. However, you requested 16500 tokens (8308 in the messages, "
     "8192 in the completion). Please reduce the length of the messages or completion.", 8308, 8192),
    # SGLang: the input alone, then input + max_new_tokens
    ("The input (2000 tokens) is longer than the model's context length (1024 tokens).", 2000, 1024),
    ("Requested token count exceeds the model's maximum context length of 1024 tokens. You requested a total of "
     "1100 tokens: 1000 tokens from the input messages and 100 tokens for the completion.", 1000, 1024),
    # llama.cpp's own llama-server
    ("request (4476 tokens) exceeds the available context size (4096 tokens), try increasing it", 4476, 4096),
])
def test_overflow_texts_give_the_prompt_alone_and_the_window(text, prompt, window):
    assert is_context_overflow(400, text)
    error = overflow_from(text)
    assert (error.input_tokens, error.limit) == (prompt, window)


def test_other_errors_are_not_overflows():
    assert not is_context_overflow(500, "The input (2000 tokens) is longer than the model's context length (1024 tokens).")
    assert not is_context_overflow(400, "bad tool schema")


def test_unreachable_server_is_an_endpoint_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = ModelClient(ModelConfig(base_url=f"http://127.0.0.1:{port}/v1", **FAST_RETRY))
    with pytest.raises(EndpointError) as err:
        client.complete(_user())
    assert "connection refused" in str(err.value)


def test_usage_reports_cached_tokens_on_append_only_history():
    long_text = "The repository content line number {} is here.\n"
    with StandinServer({"turns": [{"content": "a"}, {"content": "b"}]}) as srv:
        client = _client(srv)
        msgs = _user("".join(long_text.format(i) for i in range(200)))
        first = client.complete(msgs)
        msgs = msgs + [first.as_message(), {"role": "user", "content": "continue"}]
        second = client.complete(msgs)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens > 0
    assert second.usage.cached_tokens % 128 == 0
    assert second.usage.cached_tokens < second.usage.prompt_tokens


SUBMIT_TOOL = [{"type": "function", "function": {"name": "submit", "parameters": {"type": "object", "properties": {}}}}]


def test_a_refused_required_tool_choice_is_raised_once_not_retried():
    """llama-cpp-python answers tool_choice "required" with 500: the client says so at once (no 8 retries)."""
    from m3_agent.agent.model import ToolChoiceRefused

    with StandinServer({"turns": [{"content": "ok"}], "quirks": {"tool_choice_required": "error_500"}}) as srv:
        client = _client(srv)
        with pytest.raises(ToolChoiceRefused, match="refused tool_choice 'required' .HTTP 500"):
            client.complete(_user(), tools=SUBMIT_TOOL, tool_choice="required")
        assert len(srv.requests) == 1
        assert client.complete(_user(), tools=SUBMIT_TOOL).content == "ok"  # "auto" by default
        assert srv.requests[-1]["tool_choice"] == "auto"


def test_a_500_to_an_auto_request_is_still_retried():
    with StandinServer([{"fault": "500"}, {"content": "second"}]) as srv:
        assert _client(srv).complete(_user(), tools=SUBMIT_TOOL).content == "second" and len(srv.requests) == 2


def test_a_rejected_thinking_parameter_is_raised_once_and_a_request_without_it_is_served():
    from m3_agent.agent.model import ThinkingRejected

    script = {"quirks": {"reject_fields": ["chat_template_kwargs"]}, "turns": [{"content": "plain"}]}
    with StandinServer(script) as srv:
        client = _client(srv)
        with pytest.raises(ThinkingRejected, match="rejected the thinking-mode parameter .HTTP 400: Unrecognized"):
            client.complete(_user(), thinking_mode="enabled")
        assert len(srv.requests) == 1
        assert client.complete(_user()).content == "plain" and "chat_template_kwargs" not in srv.requests[-1]


def test_max_tokens_of_a_request_overrides_the_setting():
    with StandinServer({"turns": [{"content": "a"}, {"content": "b"}]}) as srv:
        client = _client(srv, max_tokens=100)
        client.complete(_user())
        client.complete(_user(), max_tokens=25)
        assert [r["max_tokens"] for r in srv.requests] == [100, 25]
