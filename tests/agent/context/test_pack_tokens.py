"""Token counters: the server's /tokenize over real HTTP, a real tokenizer.json, the estimate; budgets."""

from __future__ import annotations

import socket

import pytest

from m3_agent.agent.context import (
    EstimateCounter,
    ServerCounter,
    TokenizerJsonCounter,
    budget_for_server,
    budget_for_window,
)
from m3_agent.errors import EndpointError, UsageError
from m3_agent.standin.server import TOKEN_RE, StandinServer

TEXTS = ["def f(x):\n    return x + 1\n", "", "日本語のテキスト ✓\n", "a" * 50, "x = [1, 2, 3]  # list\n" * 30]


@pytest.fixture
def server():
    with StandinServer({"model": "MiniMaxAI/MiniMax-M3", "max_model_len": 200_000, "turns": []}) as srv:
        yield srv


def test_server_counter_counts_through_tokenize_over_http(server):
    counter = ServerCounter(server.base_url)  # base_url ends in /v1; /tokenize is at the root
    assert counter.kind == "server" and counter.model == "MiniMaxAI/MiniMax-M3"
    assert counter.count_many(TEXTS) == [len(TOKEN_RE.findall(t)) for t in TEXTS]
    assert counter.count("hello world") == 3
    assert ServerCounter(server.root_url, model="MiniMaxAI/MiniMax-M3").count_many(TEXTS[:1]) == [len(TOKEN_RE.findall(TEXTS[0]))]


def test_server_counter_splits_huge_texts_into_requests(server, monkeypatch):
    from m3_agent.agent.context import tokens

    monkeypatch.setattr(tokens, "MAX_REQUEST_CHARS", 100)
    counter = ServerCounter(server.base_url)
    # Cut at line ends the pieces count exactly what the whole counts here; a cut inside a line can
    # only split a token, so the sum stays an upper bound.
    lines = "line of text\n" * 100
    assert counter.count(lines) == len(TOKEN_RE.findall(lines))
    one_line = "wordy " * 500
    assert counter.count(one_line) >= len(TOKEN_RE.findall(one_line))


def test_server_counter_raises_endpoint_error_when_nothing_listens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EndpointError):
        ServerCounter(f"http://127.0.0.1:{port}/v1", model="m")


def test_server_counter_rejects_an_unknown_model(server):
    with pytest.raises(EndpointError, match="404"):
        ServerCounter(server.base_url, model="no-such-model")


def test_budget_for_server_is_max_model_len_less_reserves(server):
    assert budget_for_server(server.base_url, output_reserve=10_000, growth_reserve=0.1) == 200_000 - 10_000 - 20_000
    assert budget_for_server(server.base_url, output_reserve=0, growth_reserve=5_000) == 195_000
    assert budget_for_window(1_048_576) == 1_048_576 - 32_768 - int(1_048_576 * 0.15)
    with pytest.raises(EndpointError):
        budget_for_server(server.base_url, model="other-model")


def test_tokenizer_json_counter_is_exact(tokenizer_json):
    from tokenizers import Tokenizer

    counter = TokenizerJsonCounter(tokenizer_json)
    reference = Tokenizer.from_file(str(tokenizer_json))
    assert counter.kind == "tokenizer.json"
    assert counter.count_many(TEXTS) == [len(reference.encode(t, add_special_tokens=False).ids) for t in TEXTS]
    assert counter.id == TokenizerJsonCounter(tokenizer_json).id  # the cache key follows the file's content


def test_tokenizer_json_errors_are_usage_errors(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match="cannot load tokenizer"):
        TokenizerJsonCounter(bad)
    with pytest.raises(UsageError):
        TokenizerJsonCounter(tmp_path / "missing.json")


def test_estimate_weighs_non_ascii_text_more():
    est = EstimateCounter()
    assert est.count("") == 0
    ascii_text = "abcdefghij" * 32
    cjk = "日本語のテキスト" * 40  # same number of characters
    assert len(ascii_text) == len(cjk)
    assert est.count(cjk) > 3 * est.count(ascii_text)
    assert est.count_many(["abc", "abcdefg"]) == [est.count("abc"), est.count("abcdefg")]


def test_estimate_calibrates_against_an_exact_counter(server):
    exact = ServerCounter(server.base_url)
    samples = ["x = foo(bar, baz)\n" * 50, "if a:\n    b = c\n" * 40]
    calibrated = EstimateCounter().calibrated(exact, samples)
    assert calibrated.scale != 1.0
    assert calibrated.id != EstimateCounter().id
    total = sum(exact.count_many(samples))
    assert abs(sum(calibrated.count_many(samples)) - total) <= 0.02 * total + 2
