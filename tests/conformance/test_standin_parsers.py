"""The stand-in serves raw M3 text exactly as vLLM's own minimax_m3 parsers parse it.

Each case of the fault catalogue is served by a live stand-in over HTTP (openai SDK, streaming and
not) and parsed by vLLM's composed reasoning + tool parser in the oracle venv; the two must agree.
"""

from __future__ import annotations

import json

import openai
import pytest

from m3_agent.standin.m3_faults import CASES, FaultCase
from m3_agent.standin.m3_output import render_tool_calls
from m3_agent.standin.server import StandinServer

HISTORY = [{"role": "user", "content": "fix it"}]


def _served(case: FaultCase, stream: bool) -> dict:
    """What the stand-in answers for the case's raw text, as reasoning / content / tool calls."""
    with StandinServer([{"raw": case.raw}]) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        kwargs = dict(model="MiniMaxAI/MiniMax-M3", messages=HISTORY, tools=case.tools or openai.NOT_GIVEN,
                      extra_body={"chat_template_kwargs": {"thinking_mode": case.thinking_mode}})  # fmt: skip
        if not stream:
            msg = client.chat.completions.create(**kwargs).choices[0].message
            calls = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in msg.tool_calls or []]
            return {"reasoning": (msg.model_extra or {}).get("reasoning"), "content": msg.content, "tool_calls": calls}
        reasoning, content, calls = "", "", {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                delta = choice.delta
                reasoning += (delta.model_extra or {}).get("reasoning") or ""
                content += delta.content or ""
                for call in delta.tool_calls or []:
                    slot = calls.setdefault(call.index, {"name": "", "arguments": ""})
                    slot["name"] += (call.function and call.function.name) or ""
                    slot["arguments"] += (call.function and call.function.arguments) or ""
        return {"reasoning": reasoning or None, "content": content or None,
                "tool_calls": [{"name": c["name"], "arguments": json.loads(c["arguments"])} for _, c in sorted(calls.items())]}  # fmt: skip


@pytest.fixture(scope="module")
def vllm_says(oracle) -> dict[str, dict]:
    """vLLM's parse of every catalogue case, whole and streamed (one oracle call for all)."""
    cases = [{"raw": c.raw, "tools": c.tools, "thinking_mode": c.thinking_mode, "chunk": 5} for c in CASES]
    answer = oracle.ask("parse_output", cases=cases)
    return {c.name: r for c, r in zip(CASES, answer["results"])}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_standin_serves_what_vllm_parses(case, vllm_says):
    expected = vllm_says[case.name]["whole"]
    assert _served(case, stream=False) == expected, case.expect


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_standin_streams_what_vllm_streams(case, vllm_says):
    vllm_stream = vllm_says[case.name]["stream"]
    expected = {**vllm_stream, "tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in vllm_stream["tool_calls"]]}
    assert _served(case, stream=True) == expected, case.expect


def test_streamed_tool_call_ids_have_vllms_form(vllm_says):
    ids = [i for r in vllm_says.values() for c in r["stream"]["tool_calls"] for i in c["ids"]]
    assert ids and all(i.startswith("chatcmpl-tool-") and len(i) == len("chatcmpl-tool-") + 16 for i in ids)
    with StandinServer([{"raw": CASES[0].raw}]) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        call = client.chat.completions.create(model="MiniMaxAI/MiniMax-M3", messages=HISTORY, tools=CASES[0].tools)
    (tc,) = call.choices[0].message.tool_calls
    assert tc.id.startswith("chatcmpl-tool-") and len(tc.id) == len(ids[0])


def test_parsed_script_turns_round_trip_through_vllm(oracle):
    """A script's parsed tool calls, written as M3 text, parse back to the same arguments in vLLM."""
    calls = [("file_read", {"path": "a.py", "start": 3, "end": 9}),
             ("file_edit", {"path": "b.py", "edits": [{"old": "x = 1", "new": "x = 2"}]}),
             ("bash", {"command": "pytest -q", "timeout": None})]  # fmt: skip
    answer = oracle.ask("parse_output", cases=[{"raw": render_tool_calls(calls), "tools": CASES[0].tools}])
    assert answer["results"][0]["whole"]["tool_calls"] == [{"name": n, "arguments": a} for n, a in calls]


def test_the_comparison_can_fail(vllm_says):
    """A stand-in that kept M2's habit (literal closer left in content) would disagree with vLLM."""
    case = next(c for c in CASES if c.name == "stray closer at the start")
    assert vllm_says[case.name]["whole"]["content"] != case.raw
