"""How much context M3 can hold on a given set of GPUs: a memory model built from the seeds' figures.

    usable   = gpus * memory_per_gpu * gpu_memory_utilization
    weights  = params * bytes_per_param(precision)  (+ the vision encoder unless text-only)
    reserve  = gpus * reserve_per_gpu                (activations, CUDA graphs, communication buffers)
    kv_pool  = usable - weights - reserve
    max_len  = kv_pool / kv_bytes_per_token(kv_dtype), capped at the native window, down to a 128-block
    concurrency(L) = kv_pool / (L * kv_bytes_per_token)     (full-length sequences held at once)

Figures: 428B parameters and a 0.6B vision encoder (seeds 000, 003, 004); KV ~240 GB per 1M tokens at
16 bits, half that in fp8 (seed 001's table); native window 1,048,576 tokens, 524,288 on AMD without
YaRN (seed 002). Seed 001 itself assumes 229.9B parameters: `params_b=229.9` reproduces its tables.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, Field

from m3_agent.errors import UsageError

GB = 1024**3  # the seeds' "GB" match nvidia-smi's MiB / 1024 (an H200 shows ~141)
NATIVE_CONTEXT = 1_048_576
AMD_NATIVE_CONTEXT = 524_288
BLOCK = 128
M3_PARAMS_B = 428.0
ENCODER_PARAMS_B = 0.6
KV_GB_PER_1M_16BIT = 240.0
DEFAULT_UTILIZATION = 0.90
DEFAULT_RESERVE_GB = 4.0

BYTES_PER_PARAM = {
    "bf16": 2.0,
    "fp8": 1.0,
    "mxfp8": 1.0 + 1 / 32,  # an 8-bit scale shared by every 32 values
    "mxfp4": 0.5 + 1 / 32,
    "int4": 0.5,
}
KV_BYTES_FACTOR = {"auto": 1.0, "bf16": 1.0, "fp16": 1.0, "fp8": 0.5, "fp8_e4m3": 0.5, "fp8_e5m2": 0.5}

# Memory per GPU in GB as sold (nvidia-smi / rocm-smi report slightly less, in MiB).
GPU_MEMORY_GB = {
    "H100": 80,
    "H800": 80,
    "A100": 80,
    "H20": 96,
    "H200": 141,
    "GH200": 141,
    "B200": 180,
    "B300": 288,
    "MI300X": 192,
    "MI325X": 256,
    "MI350X": 288,
    "MI355X": 288,
}
STANDARD_WINDOWS = [32_768, 131_072, 262_144, 524_288, 1_048_576]


class PlanRequest(BaseModel):
    """What the planner is asked: the machine, the checkpoint, the KV dtype, optionally a window."""

    gpus: int = Field(gt=0)
    gpu_memory_gb: float = Field(gt=0)
    precision: Literal["bf16", "fp8", "mxfp8", "mxfp4", "int4"] = "bf16"
    kv_dtype: str = "auto"
    max_model_len: int | None = None
    request_tokens: int | None = Field(None, description="prompt + output of one typical request")
    gpu_memory_utilization: float = Field(DEFAULT_UTILIZATION, gt=0, le=1)
    reserve_gb_per_gpu: float = Field(DEFAULT_RESERVE_GB, ge=0)
    params_b: float = Field(M3_PARAMS_B, gt=0)
    text_only: bool = False
    native_context: int = NATIVE_CONTEXT


class WindowFit(BaseModel):
    """One context window: its KV cost and how many full-length sequences the pool holds."""

    tokens: int
    kv_gb: float
    fits: bool
    concurrency: float


class Plan(BaseModel):
    """The planner's answer; `fits` False comes with `reason`, a sentence saying what to change."""

    request: PlanRequest
    usable_gb: float
    weights_gb: float
    reserve_gb: float
    kv_pool_gb: float
    kv_bytes_per_token: float
    max_model_len: int
    concurrency: float = Field(description="full-length sequences at the chosen window")
    request_concurrency: float | None = None
    windows: list[WindowFit]
    fits: bool
    reason: str = ""


def kv_bytes_per_token(kv_dtype: str) -> float:
    """KV cache bytes per token across the whole model (seed 001: ~240 GB per 1M tokens at 16 bits)."""
    try:
        factor = KV_BYTES_FACTOR[kv_dtype.lower()]
    except KeyError:
        raise UsageError(f"unknown KV dtype {kv_dtype!r}; use one of: {', '.join(KV_BYTES_FACTOR)}") from None
    return KV_GB_PER_1M_16BIT * GB / NATIVE_CONTEXT * factor


def weights_gb(params_b: float, precision: str, *, text_only: bool = False) -> float:
    """GPU memory the weights take, the bf16 vision encoder included unless text-only."""
    encoder = 0.0 if text_only else ENCODER_PARAMS_B * BYTES_PER_PARAM["bf16"]
    return params_b * BYTES_PER_PARAM[precision] + encoder


def kv_gb(tokens: int, kv_dtype: str) -> float:
    """KV cache for `tokens` tokens, in GB."""
    return tokens * kv_bytes_per_token(kv_dtype) / GB


def gpu_memory_for(name: str) -> float:
    """Memory per GPU for a known GPU name (case-insensitive, e.g. "h200")."""
    key = name.upper().replace("NVIDIA ", "").replace("AMD ", "").replace("INSTINCT ", "").strip()
    if key not in GPU_MEMORY_GB:
        raise UsageError(f"unknown GPU {name!r}; pass --gpu-memory GB, or one of: {', '.join(GPU_MEMORY_GB)}")
    return float(GPU_MEMORY_GB[key])


def _fmt_tokens(n: int) -> str:
    return f"{n // 1024}K" if n < NATIVE_CONTEXT else f"{n / NATIVE_CONTEXT:g}M"


def plan(req: PlanRequest) -> Plan:
    """The largest `--max-model-len` that fits and the concurrency it leaves; a reason when nothing fits."""
    per_token = kv_bytes_per_token(req.kv_dtype)
    usable = req.gpus * req.gpu_memory_gb * req.gpu_memory_utilization
    weights = weights_gb(req.params_b, req.precision, text_only=req.text_only)
    reserve = req.gpus * req.reserve_gb_per_gpu
    pool = usable - weights - reserve
    pool_tokens = max(0.0, pool * GB / per_token)
    largest = min(req.native_context, int(pool_tokens) // BLOCK * BLOCK)
    windows = [WindowFit(tokens=w, kv_gb=round(kv_gb(w, req.kv_dtype), 2), fits=w <= largest,
                         concurrency=round(pool_tokens / w, 2))
               for w in STANDARD_WINDOWS if w <= req.native_context]
    chosen = req.max_model_len or largest
    fits, reason = True, ""
    machine = f"{req.gpus}x {req.gpu_memory_gb:g} GB at utilization {req.gpu_memory_utilization:g}"
    if pool <= 0:
        fits = False
        reason = (
            f"the weights do not fit: {req.precision} weights need {weights:.0f} GB plus {reserve:.0f} GB "
            f"reserve, {machine} gives {usable:.0f} GB; use more GPUs or a smaller precision"
        )
    elif req.max_model_len and req.max_model_len > req.native_context:
        fits = False
        reason = f"{req.max_model_len} tokens is past the native window of {req.native_context}" + (
            "; on AMD use the YaRN profile amd-tp8-1m" if req.native_context < NATIVE_CONTEXT else ""
        )
    elif chosen > largest or largest < BLOCK:
        fits = False
        need = kv_gb(chosen, req.kv_dtype)
        hint = "; use --kv-dtype fp8" if KV_BYTES_FACTOR[req.kv_dtype.lower()] == 1.0 else ""
        reason = (
            f"{_fmt_tokens(chosen)} context needs {need:.0f} GB of {req.kv_dtype} KV cache, but only "
            f"{pool:.0f} GB is left after {weights:.0f} GB of weights on {machine}: cap --max-model-len "
            f"at {largest} or add GPUs{hint}"
        )
    request_conc = round(pool_tokens / req.request_tokens, 2) if req.request_tokens else None
    return Plan(request=req, usable_gb=round(usable, 2), weights_gb=round(weights, 2), reserve_gb=reserve,
                kv_pool_gb=round(pool, 2), kv_bytes_per_token=round(per_token, 1),
                max_model_len=chosen if fits else largest,
                concurrency=round(pool_tokens / chosen, 2) if fits and chosen else 0.0,
                request_concurrency=request_conc, windows=windows, fits=fits, reason=reason)


def describe(p: Plan) -> list[str]:
    """The plan as short lines for a terminal."""
    r = p.request
    lines = [
        f"machine: {r.gpus}x {r.gpu_memory_gb:g} GB, gpu-memory-utilization {r.gpu_memory_utilization:g} "
        f"-> {p.usable_gb:.0f} GB usable",
        f"weights: {r.params_b:g}B params x {BYTES_PER_PARAM[r.precision]:g} B ({r.precision})"
        f"{'' if r.text_only else ' + vision encoder'} = {p.weights_gb:.0f} GB; reserve {p.reserve_gb:.0f} GB",
        f"KV pool: {p.kv_pool_gb:.0f} GB at {p.kv_bytes_per_token / 1024:.0f} KiB/token ({r.kv_dtype})",
    ]
    for w in p.windows:
        mark = "fits" if w.fits else "too big"
        lines.append(f"  {_fmt_tokens(w.tokens):>5}: KV {w.kv_gb:7.1f} GB  {mark:7}  concurrency {w.concurrency:g}x")
    if p.fits:
        lines.append(f"--max-model-len {p.max_model_len}: {p.concurrency:g} full-length sequences at once")
        if p.request_concurrency is not None:
            lines.append(f"requests of {r.request_tokens} tokens: about {math.floor(p.request_concurrency)} at once")
    return lines
