"""The project's own load generator: streaming chat requests through the openai SDK.

It measures what `vllm bench serve` measures, the same way: TTFT is the time to the first
streamed token, ITL every gap between streamed chunks, TPOT a request's (latency - TTFT) /
(output tokens - 1); throughputs divide token totals (from `usage`, streamed with
`stream_options.include_usage`) by the wall time of the whole run.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from m3_agent.agent.endpoint import EndpointClient, proxy_for
from m3_agent.errors import EndpointError

if TYPE_CHECKING:
    import openai

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qui", "dor", "bel", "fen", "gar"]


class LoadConfig(BaseModel):
    """One benchmark run: the seed 000 workload by default (8192 in / 2048 out, 32 at once, 512 prompts)."""

    base_url: str
    model: str
    input_len: int = Field(8192, gt=0)
    output_len: int = Field(2048, gt=0)
    concurrency: int = Field(32, gt=0)
    num_prompts: int = Field(512, gt=0)
    timeout_s: float = Field(3600, gt=0, description="the whole run; unfinished requests count as failed")
    request_timeout_s: float = Field(600, gt=0)
    seed: int = 0
    api_key: str = "EMPTY"


class BenchResult(BaseModel):
    """Metrics under the names `vllm bench serve --save-result` writes."""

    tool: str
    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    p99_itl_ms: float
    first_error: str = ""


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n))


def _count_tokens(base_url: str, model: str, text: str, api_key: str) -> int | None:
    """Prompt tokens of one user message per the server's /tokenize (vLLM and the stand-in have it)."""
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    try:
        return int(EndpointClient(base_url, api_key=api_key, timeout=30).json("POST", "/tokenize", body)["count"])
    except (EndpointError, ValueError, KeyError, TypeError):
        return None


def make_prompts(cfg: LoadConfig) -> list[str]:
    """`num_prompts` distinct random prompts of about `input_len` tokens each (calibrated by /tokenize)."""
    rng = random.Random(cfg.seed)
    probe_words = min(cfg.input_len, 512)
    counted = _count_tokens(cfg.base_url, cfg.model, _words(random.Random(cfg.seed - 1), probe_words), cfg.api_key)
    per_word = counted / probe_words if counted else 1.0
    n = max(1, round(cfg.input_len / per_word))
    return [_words(rng, n) for _ in range(cfg.num_prompts)]


@dataclass(slots=True)
class _Sample:
    """One request's measurements, in seconds and tokens; `error` is empty when it succeeded."""

    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


async def _one(client: openai.AsyncOpenAI, cfg: LoadConfig, prompt: str) -> _Sample:
    import openai  # the SDK takes seconds to import: only the bench pays for it

    s = _Sample()
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        # Raw SSE lines, parsed with json: building the SDK's chunk models costs more CPU than the
        # stream itself and would inflate TTFT and ITL under load.
        async with client.chat.completions.with_streaming_response.create(
            model=cfg.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=cfg.output_len,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0.0,
            extra_body={"ignore_eos": True},  # vLLM: generate exactly output_len tokens, as its bench does
        ) as response:
            async for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    continue  # read to the end of the body: the connection then goes back to the pool
                now = time.perf_counter()
                chunk = json.loads(data)
                if chunk.get("usage"):
                    s.input_tokens = chunk["usage"].get("prompt_tokens") or 0
                    s.output_tokens = chunk["usage"].get("completion_tokens") or 0
                for choice in chunk.get("choices") or ():
                    d = choice.get("delta") or {}
                    if d.get("content") or d.get("reasoning") or d.get("reasoning_content") or d.get("tool_calls"):
                        chunks += 1
                        if s.ttft is None:
                            s.ttft = now - start
                        else:
                            s.itl.append(now - last)
                        last = now
    except (openai.OpenAIError, OSError, ValueError) as e:
        cause = f" ({e.__cause__!r})" if e.__cause__ else ""
        s.error = f"{type(e).__name__}: {e}{cause}"[:300]
    s.latency = time.perf_counter() - start
    if not s.error and s.ttft is None:
        s.error = "no token was streamed"
    if not s.output_tokens:
        s.output_tokens = chunks
    return s


async def _run(cfg: LoadConfig, prompts: list[str]) -> tuple[list[_Sample], float]:
    import openai

    client = openai.AsyncOpenAI(
        base_url=cfg.base_url, api_key=cfg.api_key, max_retries=0, timeout=cfg.request_timeout_s,
        http_client=openai.DefaultAsyncHttpxClient(proxy=proxy_for(cfg.base_url), trust_env=False),
    )
    gate = asyncio.Semaphore(cfg.concurrency)

    async def bounded(p: str) -> _Sample:
        async with gate:
            return await _one(client, cfg, p)

    start = time.perf_counter()
    tasks = [asyncio.create_task(bounded(p)) for p in prompts]
    done, pending = await asyncio.wait(tasks, timeout=cfg.timeout_s)
    for t in pending:
        t.cancel()
    duration = time.perf_counter() - start
    await client.close()
    samples = [t.result() for t in done if not t.cancelled() and t.exception() is None]
    cut = f"not finished within the run's {cfg.timeout_s:g}s"
    samples += [_Sample(error=cut) for _ in range(len(prompts) - len(samples))]
    return samples, duration


def summarize(samples: list[_Sample], duration: float, tool: str) -> BenchResult:
    """Aggregate per-request samples into `vllm bench serve`'s metrics."""
    ok = [s for s in samples if not s.error]
    ms = 1000.0
    ttft = [s.ttft * ms for s in ok if s.ttft is not None]
    tpot = [(s.latency - s.ttft) / (s.output_tokens - 1) * ms for s in ok if s.ttft is not None and s.output_tokens > 1]
    itl = [g * ms for s in ok for g in s.itl]
    tin = sum(s.input_tokens for s in ok)
    tout = sum(s.output_tokens for s in ok)
    d = max(duration, 1e-9)
    stats: dict[str, float] = {}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        xs = xs or [0.0]
        stats[f"mean_{name}_ms"] = statistics.fmean(xs)
        stats[f"median_{name}_ms"] = statistics.median(xs)
        # numpy's default percentile, linear between ranks; `quantiles` wants two points
        stats[f"p99_{name}_ms"] = statistics.quantiles(xs, n=100, method="inclusive")[98] if xs[1:] else xs[0]
    return BenchResult(
        tool=tool,
        completed=len(ok),
        failed=len(samples) - len(ok),
        duration=duration,
        total_input_tokens=tin,
        total_output_tokens=tout,
        request_throughput=len(ok) / d,
        output_throughput=tout / d,
        total_token_throughput=(tin + tout) / d,
        first_error=next((s.error for s in samples if s.error), ""),
        **stats,
    )


def run_load(cfg: LoadConfig) -> BenchResult:
    """Run the workload against `cfg.base_url` and return its metrics."""
    prompts = make_prompts(cfg)
    samples, duration = asyncio.run(_run(cfg, prompts))
    return summarize(samples, duration, "m3-agent loadgen")
