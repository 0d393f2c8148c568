"""The stand-in's context-length 400s are vLLM's own: same check, same text, same param."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from m3_agent.standin.server import StandinServer

MODEL = "MiniMaxAI/MiniMax-M3"
WINDOW = 1000


def _answer(srv: StandinServer, body: dict) -> dict | None:
    """The stand-in's error (message, param) for `body`, or None when it served it."""
    request = urllib.request.Request(srv.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30):
            return None
    except urllib.error.HTTPError as e:
        error = json.loads(e.read())["error"]
        assert e.code == 400 and error["code"] == 400 and error["type"] == "BadRequestError"
        return {"message": error["message"], "param": error["param"]}


CASES = [
    (600, {"max_tokens": 10}),  # the prompt alone over the window
    (10, {"max_tokens": WINDOW + 1}),  # max_tokens alone over it
    (10, {"max_completion_tokens": WINDOW + 5}),  # under the newer name
    (300, {"max_tokens": 900}),  # prompt + max_tokens over it: vLLM lowers max_tokens and serves
    (10, {"max_tokens": 10}),
]


def test_context_length_answers_are_vllm_s(oracle):
    ours, cases = [], []
    with StandinServer({"max_model_len": WINDOW, "turns": [{"content": "ok", "repeat": len(CASES)}]}) as srv:
        for words, limits in CASES:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * words}], **limits}
            tokenize = {"model": MODEL, "messages": body["messages"]}
            with urllib.request.urlopen(urllib.request.Request(
                    srv.root_url + "/tokenize", data=json.dumps(tokenize).encode(),
                    headers={"Content-Type": "application/json"}), timeout=30) as r:
                cases.append({"body": body, "window": WINDOW, "prompt": json.loads(r.read())["count"]})
            ours.append(_answer(srv, body))
    theirs = oracle.ask("context_errors", cases=cases)["answers"]
    assert ours == theirs
    assert [a is None for a in ours] == [False, False, False, True, True]  # the check can fail both ways
