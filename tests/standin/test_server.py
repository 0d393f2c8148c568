"""The M3 stand-in over real HTTP: the openai SDK and raw stdlib HTTP against a live server on loopback."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from m3_agent.errors import UsageError
from m3_agent.standin.server import EXHAUSTED_TEXT, STANDIN_HEADER, TOKEN_RE, Script, StandinServer, load_script

MODEL = "MiniMaxAI/MiniMax-M3"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "scripts"
# vLLM 0.33's texts (vllm/renderers/params.py): a prompt over the window; max_tokens over it
OVERFLOW_RE = re.compile(
    r"^This model's maximum context length is (\d+) tokens\. However, your prompt contains (\d+) input tokens, "
    r"which exceeds this limit even without any output tokens\. Please reduce the length of the input prompt\. "
    r"\(parameter=input_tokens, value=\2\)$"
)
MAX_TOKENS_RE = re.compile(r"^max_tokens=(\d+) cannot be greater than max_model_len=(\d+)\. Please request fewer "
                           r"output tokens\. \(parameter=max_tokens, value=\1\)$")


@dataclass
class Raw:
    """A raw HTTP answer (stdlib client: the test sees exactly what the server sent)."""

    status_code: int
    headers: dict[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode()

    def json(self):
        return json.loads(self.content)


def http(method: str, url: str, json_body=None, content: bytes | None = None, timeout: float = 10) -> Raw:
    data = json.dumps(json_body).encode() if json_body is not None else content
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Raw(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
    except urllib.error.HTTPError as e:
        return Raw(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


def get(url: str, **kw) -> Raw:
    return http("GET", url, **kw)


def post(url: str, json=None, content: bytes | None = None) -> Raw:  # noqa: A002 - mirrors common client APIs
    return http("POST", url, json_body=json, content=content)


def client(srv: StandinServer, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=retries, timeout=10)


def ask(srv: StandinServer, messages=None, retries: int = 0, **kw):
    messages = messages or [{"role": "user", "content": "Fix the bug in a.py"}]
    return client(srv, retries).chat.completions.create(model=MODEL, messages=messages, **kw)


def sse_payloads(srv: StandinServer, body: dict) -> list[str]:
    """The raw `data:` payloads of a streamed response."""
    r = post(srv.base_url + "/chat/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    out = []
    for line in r.text.split("\n"):
        if line.startswith("data: "):
            out.append(line[len("data: "):])
        else:
            assert line == ""
    return out


READ_TOOL = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "Read a file",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "start": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
                "end": {"type": ["integer", "null"]},
            },
            "required": ["path"],
        },
    },
}


# chat completions, non-streaming -----------------------------------------------------------------


def test_tool_call_turn_has_vllm_fields():
    script = [{"reasoning": "Look at a.py first.", "tool_calls": [{"name": "read", "arguments": {"path": "a.py"}}]}]
    with StandinServer(script) as srv:
        r = ask(srv, tools=[READ_TOOL])
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.role == "assistant" and msg.content is None
    assert msg.model_extra["reasoning"] == "Look at a.py first."
    assert "reasoning_content" not in msg.model_extra  # removed from vLLM (PR #33402)
    (call,) = msg.tool_calls
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", call.id) and call.type == "function"
    assert call.function.name == "read" and isinstance(call.function.arguments, str)
    assert json.loads(call.function.arguments) == {"path": "a.py"}
    u = r.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is None  # vLLM leaves the details null when nothing was cached


def test_raw_body_keys_and_test_double_header():
    with StandinServer([{"content": "Hello."}]) as srv:
        r = post(srv.base_url + "/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and "test double" in r.headers[STANDIN_HEADER.lower()]
    body = r.json()
    assert set(body) >= {"id", "object", "created", "model", "choices", "usage", "prompt_logprobs", "kv_transfer_params"}
    choice = body["choices"][0]
    assert choice["stop_reason"] is None and choice["finish_reason"] == "stop" and choice["logprobs"] is None
    assert "tool_calls" not in choice["message"]  # vLLM drops an empty tool_calls list
    assert choice["message"]["content"] == "Hello." and choice["message"]["reasoning"] is None
    assert body["usage"]["completion_tokens"] == len(TOKEN_RE.findall("Hello."))


def test_reasoning_content_alias_is_opt_in():
    with StandinServer({"reasoning_content_alias": True, "turns": [{"reasoning": "hmm", "content": "ok"}]}) as srv:
        msg = ask(srv).choices[0].message
    assert msg.model_extra["reasoning"] == "hmm" and msg.model_extra["reasoning_content"] == "hmm"


def test_turns_are_served_in_order_with_repeat_and_finish_reason_override():
    script = [{"content": "one", "repeat": 2}, {"content": "two", "finish_reason": "length"}]
    with StandinServer(script) as srv:
        got = [ask(srv).choices[0] for _ in range(3)]
        assert srv.turns_served == 3 and len(srv.requests) == 3
    assert [c.message.content for c in got] == ["one", "one", "two"]
    assert [c.finish_reason for c in got] == ["stop", "stop", "length"]


def test_requests_are_recorded_verbatim_in_order():
    with StandinServer([{"content": "a"}, {"content": "b"}]) as srv:
        ask(srv, [{"role": "user", "content": "first"}], temperature=1.0, top_p=0.95, extra_body={"top_k": 40})
        ask(srv, [{"role": "user", "content": "second"}])
        reqs = srv.requests
    assert [r["messages"][0]["content"] for r in reqs] == ["first", "second"]
    assert reqs[0]["temperature"] == 1.0 and reqs[0]["top_p"] == 0.95 and reqs[0]["top_k"] == 40


def test_a_server_told_to_keep_no_requests_serves_them_and_keeps_none():
    with StandinServer([{"content": "a"}, {"content": "b"}], keep_requests=False) as srv:
        got = [ask(srv, [{"role": "user", "content": text}]) for text in ("first", "second")]
        assert srv.requests == []
    assert [c.choices[0].message.content for c in got] == ["a", "b"]


def test_delay_s_holds_the_reply():
    with StandinServer([{"content": "slow", "delay_s": 0.3}]) as srv:
        t0 = time.monotonic()
        ask(srv)
        assert time.monotonic() - t0 >= 0.3


# streaming --------------------------------------------------------------------------------------


def test_stream_chunks_match_vllm_shape():
    script = [{"reasoning": "I should read the file and then edit it.", "content": "Reading now.",
               "tool_calls": [{"name": "read", "arguments": {"path": "pkg/a.py", "start": 1}},
                              {"name": "read", "arguments": {"path": "b.py"}}]}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True,
            "stream_options": {"include_usage": True}}
    with StandinServer(script) as srv:
        payloads = sse_payloads(srv, body)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == script[0]["reasoning"]
    assert "".join(d.get("content", "") for d in deltas) == "Reading now."
    assert sum(1 for d in deltas if "reasoning" in d) > 1  # streamed in pieces, not one lump
    heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [(h["index"], h["function"]["name"]) for h in heads] == [(0, "read"), (1, "read")]
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", h["id"]) and h["type"] == "function" for h in heads)
    args = {0: "", 1: ""}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            args[tc["index"]] += tc["function"].get("arguments", "")
    assert json.loads(args[0]) == {"path": "pkg/a.py", "start": 1} and json.loads(args[1]) == {"path": "b.py"}
    last_choice = chunks[-2]["choices"][0]
    assert last_choice["finish_reason"] == "tool_calls" and last_choice["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["prompt_tokens"] > 0
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + usage_chunk["usage"]["completion_tokens"]
    assert all("usage" not in c for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage_chunk():
    with StandinServer([{"content": "hi there"}]) as srv:
        payloads = sse_payloads(srv, {"messages": [{"role": "user", "content": "x"}], "stream": True})
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["choices"] for c in chunks) and all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_stream_through_the_sdk_accumulates_the_same_reply():
    script = [{"reasoning": "plan", "tool_calls": [{"name": "edit", "arguments": {"path": "a.py", "text": "x = 1\n"}}]}]
    with StandinServer(script) as srv:
        stream = ask(srv, stream=True, stream_options={"include_usage": True})
        reasoning, name, arguments, finish, usage = "", None, "", None, None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for ch in chunk.choices:
                reasoning += (ch.delta.model_extra or {}).get("reasoning") or ""
                for tc in ch.delta.tool_calls or []:
                    name = tc.function.name or name
                    arguments += tc.function.arguments or ""
                finish = ch.finish_reason or finish
    assert reasoning == "plan" and name == "edit" and finish == "tool_calls"
    assert json.loads(arguments) == {"path": "a.py", "text": "x = 1\n"}
    assert usage.completion_tokens == sum(len(TOKEN_RE.findall(part)) for part in ("plan", "edit", arguments))


# an API key, as vLLM's --api-key / VLLM_API_KEY ---------------------------------------------------


def test_a_key_guards_the_v1_routes_as_vllm_does_and_leaves_the_others_open():
    key = "m3-test-key-0123456789"
    with StandinServer([{"content": "keyed"}], api_key=key) as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            req = urllib.request.Request(srv.base_url + "/models", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 401 and json.loads(e.value.read()) == {"error": "Unauthorized"}
        with pytest.raises(openai.AuthenticationError):
            ask(srv)
        assert srv.requests == [] and srv.turns_served == 0  # refused before any route
        sdk = openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=10)
        reply = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "keyed"
        # vLLM 0.33 guards /v1, /v2, /inference and /cohere only
        assert get(srv.root_url + "/health").status_code == 200
        assert get(srv.root_url + "/metrics").status_code == 200
        assert post(srv.root_url + "/tokenize", json={"prompt": "x"}).status_code == 200


# faults -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fault", "exc", "status"), [("500", openai.InternalServerError, 500), ("503", openai.APIStatusError, 503)])
def test_server_error_faults_give_vllm_error_bodies(fault, exc, status):
    with StandinServer([{"fault": fault}, {"content": "after"}]) as srv:
        with pytest.raises(exc) as info:
            ask(srv)
        assert info.value.status_code == status
        err = info.value.body
        assert err["code"] == status and err["type"].endswith("Error") and "test double" in err["message"]
        assert ask(srv).choices[0].message.content == "after"  # the fault turn was consumed


def test_faults_apply_to_streamed_requests_too():
    turns = [{"fault": "500"}, {"content": "cut me off here please", "fault": "truncate"}]
    with StandinServer(turns) as srv:
        with pytest.raises(openai.InternalServerError):
            ask(srv, stream=True)
        chunks = list(ask(srv, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "cut me off " and chunks[-1].choices[0].finish_reason == "length"


def test_retrying_client_gets_the_turn_after_a_fault():
    with StandinServer([{"fault": "503"}, {"fault": "500"}, {"content": "third time"}]) as srv:
        r = ask(srv, retries=3)
        assert r.choices[0].message.content == "third time" and srv.turns_served == 3 and len(srv.requests) == 3


def test_drop_closes_the_connection():
    with StandinServer([{"fault": "drop"}, {"content": "fine"}]) as srv:
        with pytest.raises(openai.APIConnectionError):
            ask(srv)
        assert ask(srv).choices[0].message.content == "fine"


def test_malformed_arguments_are_not_json():
    with StandinServer([{"tool_calls": [{"name": "read", "arguments": {"path": "a.py"}}], "fault": "malformed_arguments"}]) as srv:
        call = ask(srv).choices[0].message.tool_calls[0]
    assert call.function.arguments.startswith('{"path": "a.py"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)


def test_arguments_raw_is_sent_verbatim():
    raw = "{'path': 'a.py'"  # python-ish and unterminated, as a model might write
    with StandinServer([{"tool_calls": [{"name": "read", "arguments_raw": raw}]}]) as srv:
        assert ask(srv).choices[0].message.tool_calls[0].function.arguments == raw


def test_truncate_cuts_content_and_arguments_with_finish_length():
    content = "This is a long explanation of the fix that will be cut."
    turn = {"content": content, "tool_calls": [{"name": "write", "arguments": {"path": "a.py", "text": "def f():\n    return 1\n"}}],
            "fault": "truncate"}
    with StandinServer([turn]) as srv:
        choice = ask(srv).choices[0]
    assert choice.finish_reason == "length"
    assert content.startswith(choice.message.content) and len(choice.message.content) < len(content)
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.tool_calls[0].function.arguments)


def test_context_overflow_fault_uses_real_counts():
    msgs = [{"role": "user", "content": "hello there"}]
    with StandinServer({"max_model_len": 5000, "turns": [{"fault": "context_overflow"}, {"content": "ok"}]}) as srv:
        count = post(srv.root_url + "/tokenize", json={"messages": msgs}).json()["count"]
        with pytest.raises(openai.BadRequestError) as info:
            ask(srv, msgs, max_tokens=100)
        assert srv.turns_served == 1
    err = info.value.body
    assert err["type"] == "BadRequestError" and err["param"] == "input_tokens" and err["code"] == 400
    limit, n = map(int, OVERFLOW_RE.match(err["message"]).groups())
    assert (limit, n) == (5000, count)


def test_context_overflow_is_checked_before_the_script():
    long_text = "word " * 600
    with StandinServer({"max_model_len": 1000, "turns": [{"content": "never consumed", "repeat": 2}]}) as srv:
        with pytest.raises(openai.BadRequestError) as info:
            ask(srv, [{"role": "user", "content": long_text}], max_completion_tokens=10)
        assert srv.turns_served == 0 and len(srv.requests) == 1
        limit, n = map(int, OVERFLOW_RE.match(info.value.body["message"]).groups())
        assert n > 1000 and limit == 1000
        with pytest.raises(openai.BadRequestError) as info:
            ask(srv, max_tokens=1001)  # max_tokens alone over the window
        assert tuple(map(int, MAX_TOKENS_RE.match(info.value.body["message"]).groups())) == (1001, 1000)
        assert info.value.body["param"] == "max_tokens" and srv.turns_served == 0
        # prompt + max_tokens over the window: vLLM 0.33 clamps max_tokens and answers
        short = [{"role": "user", "content": "word " * 300}]
        assert ask(srv, short, max_tokens=900).choices[0].message.content == "never consumed"


def test_literal_parameter_close_truncates_string_argument():
    text = "before </parameter> after"
    turn = {"tool_calls": [{"name": "write", "arguments": {"path": "a.py", "text": text}}], "fault": "literal_parameter_close"}
    with StandinServer([turn]) as srv:
        args = json.loads(ask(srv).choices[0].message.tool_calls[0].function.arguments)
    assert args == {"path": "a.py", "text": "before "}


def test_null_nullable_nulls_the_nullable_parameters():
    turn = {"tool_calls": [{"name": "read", "arguments": {"path": "a.py", "start": 3, "end": 9}}], "fault": "null_nullable"}
    with StandinServer([turn]) as srv:
        args = json.loads(ask(srv, tools=[READ_TOOL]).choices[0].message.tool_calls[0].function.arguments)
    assert args == {"path": "a.py", "start": None, "end": None}


@pytest.mark.parametrize(("on_exhausted", "expect_error"), [("final", False), ("error", True)])
def test_exhausted_script(on_exhausted, expect_error):
    with StandinServer({"on_exhausted": on_exhausted, "turns": [{"content": "only"}]}) as srv:
        ask(srv)
        if expect_error:
            with pytest.raises(openai.InternalServerError):
                ask(srv)
        else:
            choice = ask(srv).choices[0]
            assert choice.message.content == EXHAUSTED_TEXT and choice.finish_reason == "stop"
        assert srv.turns_served == 1


# loading, thinking modes ------------------------------------------------------------------------


def test_loading_answers_503_then_200():
    with StandinServer({"loading_s": 0.6, "turns": [{"content": "up"}]}) as srv:
        assert get(srv.root_url + "/health").status_code == 503
        with pytest.raises(openai.APIStatusError) as info:
            ask(srv)
        assert info.value.status_code == 503 and srv.turns_served == 0
        time.sleep(0.7)
        health = get(srv.root_url + "/health")
        assert health.status_code == 200
        assert ask(srv).choices[0].message.content == "up"


@pytest.mark.parametrize(("mode", "expect_reasoning"), [("enabled", True), ("adaptive", True), ("disabled", False), (None, True)])
def test_thinking_modes(mode, expect_reasoning):
    extra = {"chat_template_kwargs": {"thinking_mode": mode}} if mode else {}
    with StandinServer([{"reasoning": "deep thought", "content": "42"}]) as srv:
        msg = ask(srv, extra_body=extra).choices[0].message
        assert srv.thinking_modes == [mode or "adaptive"]
    assert msg.model_extra["reasoning"] == ("deep thought" if expect_reasoning else None)
    assert msg.content == "42"


def test_unknown_thinking_mode_is_rejected():
    with StandinServer([{"content": "x"}]) as srv:
        with pytest.raises(openai.BadRequestError, match="thinking_mode"):
            ask(srv, extra_body={"chat_template_kwargs": {"thinking_mode": "maybe"}})


def test_stray_think_close_on_multi_turn_without_enabled_is_dropped_like_vllm():
    history = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "step"},
               {"role": "user", "content": "more"}]
    with StandinServer({"stray_think_close": True, "turns": [{"content": "a", "repeat": 4}]}) as srv:
        first = ask(srv).choices[0].message.content
        adaptive = ask(srv, history).choices[0].message.content
        disabled = ask(srv, history, extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}}).choices[0].message.content
        enabled = ask(srv, history, extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}}).choices[0].message.content
    assert first == "a" and enabled == "a"
    # the model writes "</mm:think>\n\n"; vLLM 0.33's reasoning parser drops the leading closer only
    assert adaptive == disabled == "\n\na"


def test_stray_think_close_per_turn_overrides_script():
    history = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    with StandinServer({"stray_think_close": True, "turns": [{"content": "a", "stray_think_close": False}]}) as srv:
        assert ask(srv, history).choices[0].message.content == "a"


# token counting and prefix cache ----------------------------------------------------------------


def _tokenize(srv, messages, **kw):
    r = post(srv.root_url + "/tokenize", json={"model": MODEL, "messages": messages, **kw})
    assert r.status_code == 200
    return r.json()


def test_tokenize_count_equals_usage_prompt_tokens():
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Fix it, please: a.py line 3!"},
            {"role": "assistant", "content": None, "reasoning": "look",
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "read", "arguments": "{\"path\": \"a.py\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "x = 1\n"}]
    kwargs = {"chat_template_kwargs": {"thinking_mode": "enabled"}}
    with StandinServer([{"content": "ok"}]) as srv:
        tok = _tokenize(srv, msgs, tools=[READ_TOOL], **kwargs)
        r = ask(srv, msgs, tools=[READ_TOOL], extra_body=kwargs)
        plain = _tokenize(srv, msgs)
    assert tok["count"] == r.usage.prompt_tokens == len(tok["tokens"])
    assert tok["max_model_len"] == 1_048_576
    assert plain["count"] < tok["count"]  # the tools and the thinking prefix are counted


def test_reasoning_field_is_counted_but_reasoning_content_is_not():
    base = [{"role": "user", "content": "u"}]
    with StandinServer([]) as srv:
        with_reasoning = _tokenize(srv, base + [{"role": "assistant", "content": "c", "reasoning": "long thought here"}])["count"]
        with_alias_only = _tokenize(srv, base + [{"role": "assistant", "content": "c", "reasoning_content": "long thought here"}])["count"]
        before_user = _tokenize(srv, base + [{"role": "assistant", "content": "c", "reasoning": "long thought here"},
                                             {"role": "user", "content": "u"}])["count"]
        plain_before_user = _tokenize(srv, base + [{"role": "assistant", "content": "c"}, {"role": "user", "content": "u"}])["count"]
    assert with_reasoning > with_alias_only  # vLLM reads `reasoning` only (vllm issue #38488)
    assert before_user == plain_before_user  # reasoning before the last user message is not rendered


def test_tokenize_prompt_and_detokenize_round_trip():
    with StandinServer([]) as srv:
        tok = post(srv.root_url + "/tokenize", json={"prompt": "def f(x):\n    return x  # ok"}).json()
        back = post(srv.root_url + "/detokenize", json={"tokens": tok["tokens"]})
        bad = post(srv.root_url + "/detokenize", json={"tokens": [10**9]})
    assert tok["count"] == len(TOKEN_RE.findall("def f(x):\n    return x  # ok"))
    assert back.json() == {"prompt": "def f(x):\n    return x  # ok"}
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400


def _expected_cached(ids_before: list[list[int]], ids: list[int], bs: int) -> int:
    """Independent reference: the longest common prefix with any earlier prompt, in whole blocks."""
    best = 0
    for prev in ids_before:
        lcp = 0
        while lcp < min(len(prev), len(ids)) and prev[lcp] == ids[lcp]:
            lcp += 1
        best = max(best, min(lcp // bs, (len(prev) - 1) // bs, (len(ids) - 1) // bs))
    return best * bs


@pytest.mark.parametrize("block_size", [16, 128])
def test_cached_tokens_on_a_growing_conversation(block_size):
    system = {"role": "system", "content": "You are a coding agent. " + "Rules follow. " * 80}
    msgs = [system, {"role": "user", "content": "Fix the failing test in pkg/mod.py"}]
    turns = [{"reasoning": f"step {i}", "tool_calls": [{"name": "read", "arguments": {"path": f"f{i}.py"}}]} for i in range(3)]
    with StandinServer({"block_size": block_size, "turns": [*turns, {"content": "done"}]}) as srv:
        seen: list[list[int]] = []
        for i in range(4):
            ids = _tokenize(srv, msgs, tools=[READ_TOOL])["tokens"]
            r = ask(srv, msgs, tools=[READ_TOOL])
            cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
            assert r.usage.prompt_tokens == len(ids)
            assert cached == _expected_cached(seen, ids, block_size)
            assert cached % block_size == 0 and cached < r.usage.prompt_tokens
            if i > 0:
                assert cached >= len(seen[-1]) - 2 * block_size  # nearly all of the previous prompt
            seen.append(ids)
            m = r.choices[0].message
            msgs = msgs + [{"role": "assistant", "content": m.content, "reasoning": m.model_extra["reasoning"],
                            "tool_calls": [tc.model_dump() for tc in m.tool_calls or []]}]
            msgs += [{"role": "tool", "tool_call_id": tc.id, "content": "file text " * 20} for tc in m.tool_calls or []]
        other = ask(srv, [{"role": "user", "content": "A completely different question about cats."}])
    assert seen and other.usage.prompt_tokens_details is None


def test_identical_prompt_of_whole_blocks_recomputes_its_last_block():
    bs = 16
    with StandinServer({"block_size": bs, "turns": [{"content": "x", "repeat": 40}]}) as srv:
        msgs = next(m for k in range(1, 40)
                    if _tokenize(srv, m := [{"role": "user", "content": "word " * k}])["count"] % bs == 0)
        n = _tokenize(srv, msgs)["count"]
        first, second = ask(srv, msgs), ask(srv, msgs)
        longer = [{"role": "user", "content": msgs[0]["content"] + "more"}]
        third = ask(srv, longer)
        expected_third = _expected_cached([_tokenize(srv, msgs)["tokens"]], _tokenize(srv, longer)["tokens"], bs)
    assert first.usage.prompt_tokens_details is None
    assert second.usage.prompt_tokens == n and second.usage.prompt_tokens_details.cached_tokens == n - bs
    assert third.usage.prompt_tokens_details.cached_tokens == expected_third > 0


def test_metrics_counters_move():
    def scrape(srv) -> dict[str, float]:
        text = get(srv.root_url + "/metrics").text
        out = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and "{" in line:
                name = line.split("{", 1)[0]
                if name == "vllm:request_success_total":
                    name += ":" + re.search(r'finished_reason="(\w+)"', line).group(1)
                out[name] = float(line.rsplit(" ", 1)[1])
        return out

    msgs = [{"role": "user", "content": "hello " * 300}]
    turns = [{"content": "a b c"}, {"tool_calls": [{"name": "read", "arguments": {"path": "a.py"}}]}]
    with StandinServer({"block_size": 16, "turns": turns}) as srv:
        before = scrape(srv)
        r1 = ask(srv, msgs)
        r2 = ask(srv, msgs)
        after = scrape(srv)
    assert before["vllm:prefix_cache_queries_total"] == 0 and before["vllm:prompt_tokens_total"] == 0
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert after["vllm:prefix_cache_queries_total"] == r1.usage.prompt_tokens + r2.usage.prompt_tokens
    assert after["vllm:prefix_cache_hits_total"] == cached > 0
    assert after["vllm:prompt_tokens_total"] == r1.usage.prompt_tokens + r2.usage.prompt_tokens
    assert after["vllm:generation_tokens_total"] == r1.usage.completion_tokens + r2.usage.completion_tokens
    assert after["vllm:request_success_total:stop"] == 2  # the engine ends a tool-call reply with stop too
    assert after["vllm:request_success_total:length"] == 0


# models, routes, errors -------------------------------------------------------------------------


def test_models_lists_max_model_len_and_says_test_double():
    with StandinServer({"max_model_len": 262144, "turns": []}) as srv:
        (card,) = client(srv).models.list().data
    assert card.id == MODEL and card.object == "model" and card.created > 0
    assert "test double" in card.owned_by
    assert card.model_extra["root"] == MODEL and card.model_extra["max_model_len"] == 262144


def test_unknown_route_bad_json_and_wrong_model():
    with StandinServer([{"content": "x"}]) as srv:
        missing = get(srv.root_url + "/v2/nothing")
        bad = post(srv.base_url + "/chat/completions", content=b"{not json")
        no_messages = post(srv.base_url + "/chat/completions", json={"model": MODEL})
        bad_tools = post(srv.base_url + "/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": "read"})
        with pytest.raises(openai.NotFoundError) as wrong_model:
            client(srv).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
        assert srv.turns_served == 0
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
    assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"
    assert bad_tools.status_code == 400 and bad_tools.json()["error"]["param"] == "tools"
    assert wrong_model.value.body["param"] == "model"


# conversations and concurrency ------------------------------------------------------------------


def test_conversations_route_by_first_user_message():
    script = {"conversations": [{"match": "task-A", "turns": [{"content": "A1"}, {"content": "A2"}]},
                                {"match": "task-B", "turns": [{"content": "B1"}, {"content": "B2"}]}]}
    a = [{"role": "system", "content": "sys task-B"}, {"role": "user", "content": "Solve task-A"}]
    b = [{"role": "user", "content": "Solve task-B"}, {"role": "user", "content": "task-A mentioned later"}]
    with StandinServer(script) as srv:
        got = [ask(srv, m).choices[0].message.content for m in (a, b, b, a)]
        with pytest.raises(openai.BadRequestError) as info:
            ask(srv, [{"role": "user", "content": "task-C"}])
    assert got == ["A1", "B1", "B2", "A2"]
    assert "no stand-in conversation matched" in info.value.body["message"].lower()
    assert "test double" in info.value.body["message"]


def test_unmatched_requests_fall_back_to_top_level_turns():
    script = {"conversations": [{"match": "special", "turns": [{"content": "S"}]}], "turns": [{"content": "T"}]}
    with StandinServer(script) as srv:
        assert ask(srv, [{"role": "user", "content": "ordinary"}]).choices[0].message.content == "T"
        assert ask(srv, [{"role": "user", "content": "special"}]).choices[0].message.content == "S"


def test_parallel_conversations_each_get_their_own_turns():
    n_conv, n_turns = 6, 5
    script = {"conversations": [{"match": f"[conv {c}]", "turns": [{"content": f"{c}:{t}", "delay_s": 0.01} for t in range(n_turns)]}
                                for c in range(n_conv)]}
    results: dict[int, list[str]] = {}

    def run(c: int) -> None:
        cl = client(srv)
        results[c] = [cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"[conv {c}] go"}])
                      .choices[0].message.content for _ in range(n_turns)]

    with StandinServer(script) as srv:
        threads = [threading.Thread(target=run, args=(c,)) for c in range(n_conv)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert srv.turns_served == n_conv * n_turns and len(srv.requests) == n_conv * n_turns
    assert results == {c: [f"{c}:{t}" for t in range(n_turns)] for c in range(n_conv)}


# script loading, lifecycle, CLI -----------------------------------------------------------------


def test_load_script_forms_and_errors(tmp_path):
    assert load_script([{"content": "x"}]).turns[0].content == "x"
    assert isinstance(load_script({"turns": []}), Script)
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"block_size": 64, "turns": [{"content": "y"}]}))
    assert load_script(f).block_size == 64 and load_script(str(f)).turns[0].content == "y"
    bad_cases = {
        "missing.json": None,
        "notjson.json": "{nope",
        "typo.json": json.dumps({"turns": [{"contnet": "x"}]}),
        "fault.json": json.dumps([{"fault": "explode"}]),
        "both.json": json.dumps([{"tool_calls": [{"name": "a", "arguments": {}, "arguments_raw": "{}"}]}]),
        "scalar.json": "3",
        "binary.json": b"\x9e\xff\x00",
    }
    for name, text in bad_cases.items():
        p = tmp_path / name
        if isinstance(text, bytes):
            p.write_bytes(text)
        elif text is not None:
            p.write_text(text)
        with pytest.raises(UsageError) as info:
            load_script(p)
        assert "\n" not in str(info.value) and name in str(info.value)


def test_example_scripts_load():
    files = sorted(EXAMPLES.glob("*.json"))
    assert files, "examples/scripts/ holds at least one script"
    for f in files:
        assert load_script(f).turns or load_script(f).conversations


def test_example_scripts_call_only_the_agents_tools_with_arguments_they_take():
    from m3_agent.tools import default_tools

    tools = {t.name: t for t in default_tools()}
    for f in sorted(EXAMPLES.glob("*.json")):
        script = load_script(f)
        turns = [*script.turns, *(t for c in script.conversations for t in c.turns)]
        calls = [c for t in turns for c in t.model_dump().get("tool_calls") or []]
        assert calls, f"{f.name} calls no tool"
        for call in calls:
            assert call["name"] in tools, f"{f.name}: {call['name']!r} is not one of the agent's tools {sorted(tools)}"
            if call.get("arguments") is not None:  # arguments_raw is broken on purpose
                tools[call["name"]].Args.model_validate(call["arguments"])


def test_stop_frees_the_port_and_is_idempotent():
    srv = StandinServer([{"content": "x"}]).start()
    port = srv.port
    assert srv.base_url == f"http://127.0.0.1:{port}/v1" and port > 0
    srv.stop()
    srv.stop()
    with pytest.raises(urllib.error.URLError):
        get(f"http://127.0.0.1:{port}/health", timeout=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serves_until_terminated(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"turns": [{"reasoning": "r", "content": "from the CLI"}]}))
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "m3_agent.cli", "standin", "--script", str(script), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except OSError:  # not listening yet
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "timeout"
            time.sleep(0.1)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}]).choices[0].message.content == "from the CLI"
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert f"http://127.0.0.1:{port}/v1" in out and "TEST DOUBLE" in out and "stopped" in out


def test_cli_bad_script_is_a_one_line_usage_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "m3_agent.cli", "standin", "--script", str(tmp_path / "none.json"), "--port", "0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "cannot read stand-in script" in r.stderr and "Traceback" not in r.stderr


def test_help_says_test_double():
    r = subprocess.run([sys.executable, "-m", "m3_agent.cli", "standin", "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "TEST DOUBLE" in r.stdout


# raw M3 output ----------------------------------------------------------------------------------

RAW_CALL = ('<mm:think>Check the file.</mm:think>Reading.]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name="read">\n'
            ']<]minimax[>[<path>a.py]<]minimax[>[</path>\n]<]minimax[>[<start>3]<]minimax[>[</start>\n'
            ']<]minimax[>[</invoke>\n]<]minimax[>[</tool_call>')  # fmt: skip


def test_raw_turn_is_parsed_into_reasoning_content_and_typed_arguments():
    with StandinServer([{"raw": RAW_CALL}]) as srv:
        r = ask(srv, tools=[READ_TOOL])
    msg = r.choices[0].message
    assert msg.model_extra["reasoning"] == "Check the file." and msg.content == "Reading."
    (call,) = msg.tool_calls
    assert call.function.name == "read" and json.loads(call.function.arguments) == {"path": "a.py", "start": 3}
    assert r.choices[0].finish_reason == "tool_calls"


def test_raw_tool_syntax_stays_content_when_the_request_has_no_tools():
    with StandinServer([{"raw": RAW_CALL}]) as srv:
        msg = ask(srv).choices[0].message
    assert not msg.tool_calls and msg.content.startswith("Reading.]<]minimax[>[<tool_call>")


def test_raw_turn_takes_no_parsed_fields():
    with pytest.raises(UsageError, match="raw"):
        load_script([{"raw": "hi", "content": "hi"}])


# quirks of servers that are not vLLM -------------------------------------------------------------

SUBMIT_TOOL = [{"type": "function", "function": {"name": "submit", "parameters": {"type": "object", "properties": {}}}}]


def test_a_required_tool_choice_is_served_by_default_and_refused_with_500_as_a_quirk():
    with StandinServer([{"content": "text anyway"}]) as srv:
        assert ask(srv, tools=SUBMIT_TOOL, tool_choice="required").choices[0].message.content == "text anyway"
    with StandinServer({"turns": [{"content": "after"}], "quirks": {"tool_choice_required": "error_500"}}) as srv:
        with pytest.raises(openai.InternalServerError) as info:
            ask(srv, tools=SUBMIT_TOOL, tool_choice="required")
        assert "tool_choice" in info.value.body["message"] and srv.turns_served == 0  # no turn consumed
        assert ask(srv, tools=SUBMIT_TOOL, tool_choice="auto").choices[0].message.content == "after"


def test_a_tool_choice_without_tools_is_400_as_vllm_answers_it():
    with StandinServer([{"content": "x"}]) as srv:
        with pytest.raises(openai.BadRequestError) as info:
            ask(srv, tool_choice="required")
    assert info.value.body["message"] == "When using `tool_choice`, `tools` must be set."
    assert info.value.body["param"] == "tool_choice"


@pytest.mark.parametrize(("server", "prompt_words", "max_tokens", "expected"), [
    ("sglang", 600, 10, r"^The input \((\d+) tokens\) is longer than the model's context length \(1000 tokens\)\.$"),
    ("sglang", 300, 900, r"^Requested token count exceeds the model's maximum context length of 1000 tokens\. You "
                         r"requested a total of \d+ tokens: (\d+) tokens from the input messages and 900 tokens for "
                         r"the completion\. Please reduce the number of tokens in the input messages or the completion "
                         r"to fit within the limit\.$"),
    ("llama_cpp", 600, 900, r"^This model's maximum context length is 1000 tokens\. However, you requested \d+ tokens "
                            r"\((\d+) in the messages, 900 in the completion\)\. Please reduce the length of the "
                            r"messages or completion\.$"),
])
def test_context_errors_in_sglang_s_and_llama_cpp_s_wording(server, prompt_words, max_tokens, expected):
    script = {"max_model_len": 1000, "quirks": {"context_errors": server}, "turns": [{"content": "x"}]}
    messages = [{"role": "user", "content": "word " * prompt_words}]
    with StandinServer(script) as srv:
        count = post(srv.root_url + "/tokenize", json={"messages": messages}).json()["count"]
        with pytest.raises(openai.BadRequestError) as info:
            ask(srv, messages, max_tokens=max_tokens)
        assert srv.turns_served == 0
    message = info.value.body["message"]
    assert int(re.match(expected, message).group(1)) == count
    if server == "sglang":  # SGLang's ErrorResponse is the body itself, not under "error"
        assert info.value.response.json()["object"] == "error" and "error" not in info.value.response.json()
    else:
        assert info.value.response.json()["error"]["code"] == 400


def test_llama_cpp_takes_a_prompt_under_the_window_whatever_max_tokens_asks():
    script = {"max_model_len": 1000, "quirks": {"context_errors": "llama_cpp"}, "turns": [{"content": "fits"}]}
    with StandinServer(script) as srv:
        assert ask(srv, max_tokens=5000).choices[0].message.content == "fits"


def test_models_without_max_model_len_and_fields_rejected_by_name():
    script = {"quirks": {"list_max_model_len": False, "reject_fields": ["chat_template_kwargs"]},
              "turns": [{"content": "plain"}]}
    with StandinServer(script) as srv:
        card = get(srv.base_url + "/models").json()["data"][0]
        assert "max_model_len" not in card and card["id"] == MODEL
        with pytest.raises(openai.BadRequestError) as info:
            ask(srv, extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}})
        assert info.value.body["message"] == "Unrecognized request argument supplied: chat_template_kwargs"
        assert info.value.body["param"] == "chat_template_kwargs" and srv.turns_served == 0
        assert ask(srv).choices[0].message.content == "plain"
