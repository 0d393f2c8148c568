"""The stand-in's performance model: KV capacity, LRU eviction of cached blocks, prefill/decode rates, /metrics."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from m3_agent.errors import UsageError
from m3_agent.standin.kvsim import (
    B200X8_DECODE_TOK_S,
    B200X8_KV_TOKENS,
    B200X8_PREFILL_TOK_S,
    Performance,
    PrefixCache,
)
from m3_agent.standin.simclock import VirtualClock
from m3_agent.standin.server import StandinServer, load_script

MODEL = "MiniMaxAI/MiniMax-M3"


def h(i: int) -> bytes:
    return i.to_bytes(4, "big")


def samples(root_url: str) -> dict[str, list]:
    with urllib.request.urlopen(root_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}


# --- the cache alone ------------------------------------------------------------------------------

def test_eviction_takes_the_least_recently_freed_block_first():
    cache = PrefixCache(capacity=4)
    a, b = [h(1), h(2)], [h(3), h(4)]
    assert cache.allocate(a, 0) == 0
    cache.free(a, 0)
    assert cache.allocate(b, 0) == 0
    cache.free(b, 0)
    assert cache.hits(a) == 2 and cache.used == 4
    cache.allocate(a, 0)  # a is used again: now b's blocks are the oldest free ones
    cache.free(a, 0)
    cache.allocate([h(5), h(6)], 0)
    assert cache.hits(a) == 2 and cache.hits(b) == 0 and cache.evicted == 2


def test_a_request_frees_its_tail_first_so_shared_heads_survive():
    cache = PrefixCache(capacity=3)
    prompt = [h(1), h(2), h(3)]
    cache.allocate(prompt, 0)
    cache.free(prompt, 0)
    cache.allocate([h(9)], 0)  # one block needed: the tail goes, not the head
    assert cache.hits(prompt) == 2
    assert list(cache.blocks) == [h(2), h(1), h(9)]


def test_pinned_blocks_are_never_evicted_and_a_full_cache_refuses():
    cache = PrefixCache(capacity=4)
    assert cache.allocate([h(1), h(2)], 1) == 0  # two cached blocks and one anonymous, all pinned
    assert cache.allocate([h(3), h(4)], 0) is None  # 3 pinned + 2 new > 4
    assert cache.allocate([h(1), h(2), h(3)], 0) == 2  # the shared head costs nothing new
    assert cache.pinned == 4 and cache.evicted == 0
    cache.free([h(1), h(2)], 1)
    assert cache.allocate([h(5)], 0) == 0 and cache.used == 4  # a free block was evicted for it


# --- the model over HTTP --------------------------------------------------------------------------

def test_b200_calibration_comes_from_seed_000_and_the_planner():
    perf = Performance()
    assert perf.prefill_tokens_per_s == B200X8_PREFILL_TOK_S == pytest.approx(6478.05)
    assert perf.decode_tokens_per_s == B200X8_DECODE_TOK_S == pytest.approx(1000 / 19.06)
    assert 1_700_000 < B200X8_KV_TOKENS < 1_850_000  # ~407 GB of KV at 240 KB per token


def test_the_window_must_fit_the_kv_cache():
    with pytest.raises(UsageError, match="kv_capacity_tokens must hold max_model_len"):
        load_script({"max_model_len": 4096, "performance": {"kv_capacity_tokens": 2048}})


def _chat(client: openai.OpenAI, clock: VirtualClock, content: str, *, joined: bool = False):
    """One request as a participant of the virtual clock: its usage and the simulated seconds it took."""
    if not joined:
        clock.join()
    try:
        t = clock.now()
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
        return r.usage, clock.now() - t
    finally:
        clock.leave()


def test_request_time_follows_prefill_and_decode_rates():
    perf = {"kv_capacity_tokens": 1 << 20, "prefill_tokens_per_s": 1000, "decode_tokens_per_s": 100}
    clock = VirtualClock()
    with StandinServer({"performance": perf, "turns": [{"content": "ok " * 50, "repeat": 2}]}, clock=clock) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x")
        cold, cold_s = _chat(client, clock, "word " * 2500)
        warm, warm_s = _chat(client, clock, "word " * 2500)
    assert cold_s == pytest.approx(cold.prompt_tokens / 1000 + cold.completion_tokens / 100)
    cached = warm.prompt_tokens_details.cached_tokens
    assert cached > 4900 and warm_s == pytest.approx((warm.prompt_tokens - cached) / 1000 + warm.completion_tokens / 100)


def test_prefill_is_serialized_and_decode_runs_beside_it():
    perf = {"kv_capacity_tokens": 1 << 20, "prefill_tokens_per_s": 1000, "decode_tokens_per_s": 10}
    clock = VirtualClock()
    with StandinServer({"performance": perf, "turns": [{"content": "ok", "repeat": 3}]}, clock=clock) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x")
        prompts = [f"{i} " + f"w{i} " * 1000 for i in range(3)]  # distinct from the first token: no sharing
        out = []
        threads = [threading.Thread(target=lambda p=p: out.append(_chat(client, clock, p, joined=True))) for p in prompts]
        for _ in threads:
            clock.join()  # all three take part before any time passes: they arrive together
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    prefills = sorted(u.prompt_tokens / 1000 for u, _ in out)
    decode = out[0][0].completion_tokens / 10
    # all three arrive at t=0: the k-th waits for the prefills before it, decodes overlap
    assert clock.now() == pytest.approx(sum(prefills) + decode)
    assert sorted(s for _, s in out)[0] == pytest.approx(min(prefills) + decode, rel=0.01)


def test_the_scaled_clock_runs_hours_in_seconds():
    perf = {"prefill_tokens_per_s": 1, "decode_tokens_per_s": 1e9, "time_scale": 36_000}  # 1 token = 1 s
    with StandinServer({"performance": perf, "turns": [{"content": "ok"}]}) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x")
        client.models.list()  # connection and client warm-up outside the timed part
        t = time.monotonic()
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 1800}])
        real = time.monotonic() - t
    assert r.usage.prompt_tokens >= 3600  # an hour of prefill at 1 tok/s ...
    assert real >= r.usage.prompt_tokens / 36_000 - 0.01  # ... is at least prompt/scale real seconds


def test_requests_wait_for_kv_space_and_metrics_show_capacity_and_usage():
    # 16 blocks of 16 tokens; each prompt takes ~12 blocks for ~1 real second: the second must wait
    perf = {"kv_capacity_tokens": 256, "prefill_tokens_per_s": 200, "decode_tokens_per_s": 1e6, "time_scale": 1}
    script = {"max_model_len": 256, "block_size": 16, "performance": perf, "turns": [{"content": "ok", "repeat": 2}]}
    with StandinServer(script) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x")
        info = samples(srv.root_url)["vllm:cache_config_info"]
        assert info.labels["num_gpu_blocks"] == "16" and info.labels["block_size"] == "16"

        def call(tag: str) -> None:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"{tag} " + "x " * 90}])

        threads = [threading.Thread(target=call, args=(tag,)) for tag in "ab"]
        for th in threads:
            th.start()
            time.sleep(0.25)
        during = samples(srv.root_url)
        for th in threads:
            th.join()
        after = samples(srv.root_url)
    assert during["vllm:num_requests_running"].value == 1.0
    assert during["vllm:num_requests_waiting"].value == 1.0  # no room for its blocks beside the first's
    assert during["vllm:kv_cache_usage_perc"].value > 0.6
    assert after["vllm:num_requests_running"].value == 0.0 and after["vllm:num_requests_waiting"].value == 0.0
    assert after["vllm:prefix_cache_queries_total"].value > 300


def test_metrics_of_an_unbounded_standin_say_the_block_count_is_unknown():
    with StandinServer([]) as srv:
        m = samples(srv.root_url)
    assert m["vllm:cache_config_info"].labels["num_gpu_blocks"] == "None"
    assert m["vllm:kv_cache_usage_perc"].value == 0.0


# --- the seam: the wire double loads the performance model only for a script that has one ---------

LOADED = """
import sys
import openai
from m3_agent.standin.server import StandinServer
script = {{"turns": [{{"content": "ok"}}], **{perf}}}
with StandinServer(script) as srv:
    r = openai.OpenAI(base_url=srv.base_url, api_key="x").chat.completions.create(
        model="MiniMaxAI/MiniMax-M3", messages=[{{"role": "user", "content": "hi"}}])
    assert r.choices[0].message.content == "ok"
print(sorted(m for m in ("m3_agent.standin.kvsim", "m3_agent.serving.planner", "m3_agent.standin.simclock")
             if m in sys.modules))
"""


def test_without_a_performance_model_the_double_does_not_load_the_simulator():
    def loaded(perf: str) -> str:
        proc = subprocess.run([sys.executable, "-c", LOADED.format(perf=perf)], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert loaded("{}") == "[]"
    assert loaded('{"performance": {}}') == "['m3_agent.serving.planner', 'm3_agent.standin.kvsim', " \
                                             "'m3_agent.standin.simclock']"


def test_a_bad_performance_model_is_told_in_one_line_with_its_field():
    with pytest.raises(UsageError, match=r"at performance: .*prefill_tokens_per_s: Input should be greater than 0"):
        load_script({"performance": {"prefill_tokens_per_s": 0}})
