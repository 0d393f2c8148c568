"""`serve bench` against the stand-in over real HTTP, and the `vllm bench serve` path with a fake `vllm`."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from m3_agent.serving.bench import SEED_B200, from_vllm_result, run_bench, vllm_bench_argv
from m3_agent.serving.cli import app
from m3_agent.serving.loadgen import LoadConfig, _Sample, run_load, summarize
from m3_agent.standin.server import StandinServer

pytestmark = pytest.mark.timeout(120)
REPLY = "alpha beta gamma delta " * 10  # 80 toy tokens, streamed in pieces of 3


def _script(delay_s: float = 0.0) -> dict:
    return {"model": "minimax-m3", "turns": [{"content": REPLY, "delay_s": delay_s, "repeat": 1000}]}


def test_load_generator_measures_the_stand_in(fake_bin):
    with StandinServer(_script(delay_s=0.15)) as srv:
        cfg = LoadConfig(
            base_url=srv.base_url, model="minimax-m3", input_len=200, output_len=64, concurrency=4, num_prompts=8
        )
        r = run_load(cfg)
        bodies = srv.requests
    assert r.completed == 8 and r.failed == 0
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["max_tokens"] == 64 for b in bodies)
    assert len({b["messages"][0]["content"] for b in bodies}) == 8  # distinct prompts: no prefix-cache shortcut
    per_request_in = r.total_input_tokens / 8
    assert 180 <= per_request_in <= 220  # calibrated through /tokenize to the requested length
    assert r.total_output_tokens == 8 * 80
    assert r.mean_ttft_ms >= 150 and r.p99_ttft_ms >= r.median_ttft_ms  # the scripted delay is before the 1st token
    assert r.output_throughput == pytest.approx(r.total_output_tokens / r.duration)
    assert r.total_token_throughput == pytest.approx((r.total_input_tokens + r.total_output_tokens) / r.duration)
    # Two rounds of 4 at >= 150 ms each: the concurrency bound is respected.
    assert r.duration >= 0.3
    assert r.mean_itl_ms > 0 and r.mean_tpot_ms > 0


def test_failed_requests_are_counted_with_the_first_error(fake_bin):
    with StandinServer(
        {"model": "minimax-m3", "turns": [{"fault": "500", "repeat": 3}, {"content": "ok", "repeat": 9}]}
    ) as srv:
        r = run_load(
            LoadConfig(
                base_url=srv.base_url, model="minimax-m3", input_len=20, output_len=8, concurrency=1, num_prompts=5
            )
        )
    assert r.completed == 2 and r.failed == 3
    assert "InternalServerError" in r.first_error


def test_a_run_is_bounded_in_time():
    with StandinServer(_script(delay_s=5)) as srv:
        r = run_load(
            LoadConfig(
                base_url=srv.base_url,
                model="minimax-m3",
                input_len=20,
                output_len=8,
                concurrency=2,
                num_prompts=4,
                timeout_s=0.5,
            )
        )
    assert r.completed == 0 and r.failed == 4 and "not finished" in r.first_error
    assert r.duration < 2


def test_metrics_follow_vllm_bench_definitions():
    a, b = _Sample(), _Sample()
    a.ttft, a.latency, a.itl, a.input_tokens, a.output_tokens = 0.1, 1.1, [0.2, 0.3], 10, 11
    b.ttft, b.latency, b.itl, b.input_tokens, b.output_tokens = 0.3, 0.3, [], 10, 1
    r = summarize([a, b], duration=2.0, tool="t")
    assert r.mean_ttft_ms == pytest.approx(200) and r.median_ttft_ms == pytest.approx(200)
    assert r.mean_tpot_ms == pytest.approx(100)  # (1.1 - 0.1) / (11 - 1); b has one token: no TPOT
    assert r.mean_itl_ms == pytest.approx(250)
    assert r.output_throughput == pytest.approx(6) and r.total_token_throughput == pytest.approx(16)
    assert r.p99_itl_ms == pytest.approx(299) and r.p99_tpot_ms == pytest.approx(100)  # numpy's p99 of 2 and 1 values
    assert summarize([b], duration=1.0, tool="t").p99_tpot_ms == 0.0


FAKE_VLLM_BENCH = """#!{python}
import json, sys
args = sys.argv[1:]
open({argv_file!r}, "w").write(json.dumps(args))
d = args[args.index("--result-dir") + 1]; f = args[args.index("--result-filename") + 1]
json.dump({{"completed": 510, "num_prompts": 512, "duration": 640.5, "total_input_tokens": 4177920,
           "total_output_tokens": 1044480, "request_throughput": 0.8, "output_throughput": 1630.7,
           "total_token_throughput": 8152.3, "mean_ttft_ms": 1500.0, "median_ttft_ms": 1400.0, "p99_ttft_ms": 7000.0,
           "mean_tpot_ms": 19.0, "median_tpot_ms": 18.9, "p99_tpot_ms": 19.6, "mean_itl_ms": 19.0,
           "median_itl_ms": 18.0, "p99_itl_ms": 170.0, "errors": ["", "timeout"]}}, open(d + "/" + f, "w"))
"""


def test_vllm_bench_serve_is_used_when_installed(fake_bin, tmp_path):
    argv_file = tmp_path / "argv.json"
    vllm = fake_bin / "vllm"
    vllm.write_text(FAKE_VLLM_BENCH.format(python=sys.executable, argv_file=str(argv_file)))
    cfg = LoadConfig(base_url="http://127.0.0.1:9/v1", model="minimax-m3")
    r = run_bench(cfg, tool="auto", tokenizer="MiniMaxAI/MiniMax-M3")
    args = json.loads(argv_file.read_text())
    assert args[:2] == ["bench", "serve"]
    expected = vllm_bench_argv(cfg, result_dir="D", result_file="F", tokenizer="MiniMaxAI/MiniMax-M3")[1:]
    for flag in (
        "--backend",
        "--endpoint",
        "--dataset-name",
        "--random-input-len",
        "--random-output-len",
        "--num-prompts",
        "--max-concurrency",
        "--model",
        "--served-model-name",
        "--base-url",
    ):
        assert args[args.index(flag) + 1] == expected[expected.index(flag) + 1]
    # seed 000's workload, flag for flag
    assert (
        args[args.index("--random-input-len") + 1] == "8192" and args[args.index("--random-output-len") + 1] == "2048"
    )
    assert args[args.index("--num-prompts") + 1] == "512" and args[args.index("--max-concurrency") + 1] == "32"
    assert args[args.index("--base-url") + 1] == "http://127.0.0.1:9"
    assert r.tool == "vllm bench serve" and r.completed == 510 and r.failed == 2 and r.first_error == "timeout"
    assert r.output_throughput == 1630.7 and r.p99_itl_ms == 170.0


def test_vllm_result_without_some_keys_still_parses():
    r = from_vllm_result({"completed": 3, "duration": 1.0, "output_throughput": 5.0})
    assert r.completed == 3 and r.output_throughput == 5.0 and r.mean_ttft_ms == 0


def _bench_cli(base_url: str, *extra: str):
    """`serve bench` in-process on a tiny workload with the built-in generator."""
    return CliRunner().invoke(app, ["bench", "--base-url", base_url, "--tool", "builtin", *extra])


def test_cli_bench_prints_a_table_next_to_the_seed_b200_figures():
    with StandinServer(_script()) as srv:
        res = _bench_cli(srv.base_url, *"--input-len 40 --output-len 16 --concurrency 2 --num-prompts 4".split())
    assert res.exit_code == 0, res.output
    assert "Output tok/s" in res.output and "Total tok/s" in res.output and "P99 ITL (ms)" in res.output
    seed = {key: (sglang, vllm) for _, key, sglang, vllm in SEED_B200}
    assert f"{seed['output_throughput'][0]:,.2f}" in res.output  # the SGLang run's
    assert f"{seed['mean_ttft_ms'][1]:,.2f}" in res.output  # the vLLM run's
    assert "4/4 prompts" in res.output


def test_cli_bench_json_uses_the_served_model_name():
    with StandinServer(_script()) as srv:
        res = _bench_cli(srv.base_url, *"--input-len 20 --output-len 8 --concurrency 1 --num-prompts 2 --json".split())
        models = {b["model"] for b in srv.requests}
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["completed"] == 2 and data["tool"] == "m3-agent loadgen"
    assert models == {"minimax-m3"}  # taken from /v1/models when --model is not given
