"""`m3-agent serve bench`: the seed 000 workload through `vllm bench serve` when it is installed,
else through the project's load generator, shown next to the seed's 8x B200 figures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Literal

from rich.table import Table

from m3_agent.errors import EndpointError, UsageError
from m3_agent.serving.loadgen import BenchResult, LoadConfig, run_load

Tool = Literal["auto", "vllm", "builtin"]

# Seed 000 (8x B200, CUDA 12.8, 8192 in / 2048 out, 32 concurrent, 512 prompts):
# (row label, BenchResult field, the SGLang run's figure, the vLLM run's figure).
SEED_B200 = [
    ("Output tok/s", "output_throughput", 1627.79, 1619.51),
    ("Total tok/s", "total_token_throughput", 8138.97, 8097.56),
    ("Mean TTFT (ms)", "mean_ttft_ms", 3890.10, 1440.30),
    ("P99 TTFT (ms)", "p99_ttft_ms", 6549.91, 7791.99),
    ("Mean TPOT (ms)", "mean_tpot_ms", 17.77, 19.06),
    ("P99 TPOT (ms)", "p99_tpot_ms", 19.52, 19.63),
    ("Mean ITL (ms)", "mean_itl_ms", 17.77, 19.06),
    ("P99 ITL (ms)", "p99_itl_ms", 17.60, 177.08),
]


def vllm_bench_argv(cfg: LoadConfig, *, result_dir: str, result_file: str, tokenizer: str | None = None,
                    served_model_name: str | None = None) -> list[str]:
    """The seed 000 `vllm bench serve` command for `cfg`, saving its JSON result."""
    options = {
        "--backend": "openai-chat",
        "--base-url": cfg.base_url.removesuffix("/").removesuffix("/v1"),
        "--endpoint": "/v1/chat/completions",
        "--model": tokenizer or cfg.model,  # vllm bench loads its tokenizer from this name
        "--served-model-name": served_model_name or cfg.model,
        "--dataset-name": "random",
        "--random-input-len": str(cfg.input_len),
        "--random-output-len": str(cfg.output_len),
        "--num-prompts": str(cfg.num_prompts),
        "--max-concurrency": str(cfg.concurrency),
        "--seed": str(cfg.seed),
        "--percentile-metrics": "ttft,tpot,itl",
        "--metric-percentiles": "50,99",
        "--result-dir": result_dir,
        "--result-filename": result_file,
    }
    return ["vllm", "bench", "serve", *(x for kv in options.items() for x in kv), "--save-result"]


def run_vllm_bench(cfg: LoadConfig, *, tokenizer: str | None = None) -> BenchResult:
    """Run `vllm bench serve` on `cfg` and read back its saved result."""
    with tempfile.TemporaryDirectory(prefix="m3-bench-") as tmp:
        argv = vllm_bench_argv(cfg, result_dir=tmp, result_file="result.json", tokenizer=tokenizer)
        try:
            env = {**os.environ, "OPENAI_API_KEY": cfg.api_key}
            r = subprocess.run(argv, capture_output=True, text=True, timeout=cfg.timeout_s + 120, env=env)
        except subprocess.TimeoutExpired:
            raise EndpointError(f"vllm bench serve did not finish within {cfg.timeout_s:g}s") from None
        path = Path(tmp) / "result.json"
        if r.returncode != 0 or not path.exists():
            last = (r.stderr or r.stdout).strip().splitlines()[-3:]
            raise EndpointError(f"vllm bench serve failed (exit {r.returncode}): {' | '.join(last)}")
        data = json.loads(path.read_text())
    return from_vllm_result(data)


def from_vllm_result(data: dict) -> BenchResult:
    """A BenchResult from the JSON `vllm bench serve --save-result` writes."""
    values = {k: data.get(k, 0) for k in BenchResult.model_fields if k not in ("tool", "failed", "first_error")}
    failed = int(data.get("num_prompts", values["completed"])) - int(values["completed"])
    errors = [e for e in data.get("errors") or [] if e]
    return BenchResult(
        tool="vllm bench serve", failed=max(0, failed), first_error=str(errors[0])[:300] if errors else "", **values
    )


def run_bench(cfg: LoadConfig, *, tool: Tool = "auto", tokenizer: str | None = None) -> BenchResult:
    """The workload through `vllm bench serve` (when installed, or when asked) or the built-in generator."""
    if tool == "vllm" or (tool == "auto" and shutil.which("vllm")):
        if shutil.which("vllm") is None:
            raise UsageError("--tool vllm needs vLLM installed (`vllm bench serve`); or use --tool builtin")
        return run_vllm_bench(cfg, tokenizer=tokenizer)
    return run_load(cfg)


def table(result: BenchResult, cfg: LoadConfig) -> Table:
    """The result next to the seed's 8x B200 figures (SGLang and vLLM runs)."""
    t = Table(
        title=f"{cfg.input_len} in / {cfg.output_len} out, {cfg.concurrency} concurrent, "
        f"{result.completed}/{cfg.num_prompts} prompts ({result.tool}, {result.duration:.1f}s)"
    )
    t.add_column("metric", no_wrap=True)
    t.add_column("this run", justify="right", no_wrap=True)
    t.add_column("B200 SGLang", justify="right", no_wrap=True)
    t.add_column("B200 vLLM", justify="right", no_wrap=True)
    t.caption = "B200 columns: seed 000's 8x B200 figures for the same workload"
    for label, key, sglang, vllm in SEED_B200:
        t.add_row(label, *(f"{x:,.2f}" for x in (getattr(result, key), sglang, vllm)))
    return t
