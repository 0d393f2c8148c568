"""The planner against the seeds' tables (seed 001's figures, seed 002's hardware notes, seed 000's workload)."""

from __future__ import annotations

import pytest

from m3_agent.errors import UsageError
from m3_agent.serving.planner import (
    NATIVE_CONTEXT,
    PlanRequest,
    describe,
    gpu_memory_for,
    kv_gb,
    plan,
    weights_gb,
)

SEED001_PARAMS = 229.9  # seed 001 sizes its tables for 229.9B parameters
SEED_ARITHMETIC = {"gpu_memory_utilization": 1.0, "reserve_gb_per_gpu": 0.0}  # seed 001: headroom = total - weights


@pytest.mark.parametrize("precision,expected", [("bf16", 460), ("fp8", 230), ("int4", 115)])
def test_weights_match_seed_001_vram_table(precision, expected):
    assert weights_gb(SEED001_PARAMS, precision, text_only=True) == pytest.approx(expected, abs=1)


@pytest.mark.parametrize(
    "tokens,fp16,fp8", [(32_768, 8, 4), (131_072, 30, 15), (524_288, 120, 60), (1_048_576, 240, 120)]
)
def test_kv_cache_matches_seed_001_table(tokens, fp16, fp8):
    assert kv_gb(tokens, "auto") == pytest.approx(fp16, rel=0.07)
    assert kv_gb(tokens, "fp8_e5m2") == pytest.approx(fp8, rel=0.07)


def _seed001(gpus: int, gpu: str, tokens: int, **kw) -> PlanRequest:
    return PlanRequest(
        gpus=gpus,
        gpu_memory_gb=gpu_memory_for(gpu),
        precision="fp8",
        kv_dtype="fp8",
        max_model_len=tokens,
        params_b=SEED001_PARAMS,
        text_only=True,
        **{**SEED_ARITHMETIC, **kw},
    )


def test_two_h200_fp8_headroom_is_seed_001s_52_gb():
    p = plan(_seed001(2, "H200", 32_768))
    assert p.kv_pool_gb == pytest.approx(52, abs=1)


@pytest.mark.parametrize(
    "tokens,fits",
    [(32_768, True), (131_072, True), (262_144, True), (300_000, True), (524_288, False), (1_048_576, False)],
)
def test_two_h200_fp8_context_budget_matches_seed_001(tokens, fits):
    p = plan(_seed001(2, "H200", tokens))
    assert p.fits is fits
    if not fits:
        assert "cap --max-model-len" in p.reason


def test_one_million_tokens_on_two_h200_is_refused_with_what_to_do():
    p = plan(
        PlanRequest(
            gpus=2,
            gpu_memory_gb=141,
            precision="fp8",
            kv_dtype="fp8",
            max_model_len=NATIVE_CONTEXT,
            params_b=SEED001_PARAMS,
        )
    )
    assert not p.fits
    assert "1M context needs 120 GB of fp8 KV cache" in p.reason
    assert p.max_model_len < 262_144  # the largest window that does fit, offered instead


def test_four_h200_fp8_hold_the_full_1m_window():
    assert plan(_seed001(4, "H200", NATIVE_CONTEXT)).fits
    assert plan(_seed001(4, "H200", NATIVE_CONTEXT, gpu_memory_utilization=0.9, reserve_gb_per_gpu=4)).fits


def test_four_h100_fp8_stop_at_512k():
    assert plan(_seed001(4, "H100", 524_288)).fits
    assert not plan(_seed001(4, "H100", NATIVE_CONTEXT)).fits


@pytest.mark.parametrize(
    "precision,gpu,smallest",
    [("bf16", "H200", 4), ("fp8", "H200", 2), ("int4", "H200", 1), ("int4", "H100", 2), ("fp8", "H100", 4)],
)
def test_minimum_gpu_configs_match_seed_001(precision, gpu, smallest):
    def fits(n: int) -> bool:
        return plan(PlanRequest(gpus=n, gpu_memory_gb=gpu_memory_for(gpu), precision=precision, max_model_len=32_768,
                                params_b=SEED001_PARAMS, text_only=True, **SEED_ARITHMETIC)).fits

    # the smallest power-of-two GPU count that holds the weights and a 32K window
    assert next(n for n in (1, 2, 4, 8, 16, 32, 64) if fits(n)) == smallest


def test_eight_h200_bf16_is_a_tight_fit_for_m3():
    p = plan(PlanRequest(gpus=8, gpu_memory_gb=141))  # seed 002: "a tight single-node BF16 fit"
    assert p.fits and p.weights_gb > 0.8 * p.usable_gb
    assert p.max_model_len < NATIVE_CONTEXT  # bf16 KV cannot hold the full window ...
    assert plan(PlanRequest(gpus=8, gpu_memory_gb=141, kv_dtype="fp8")).max_model_len == NATIVE_CONTEXT  # fp8 can


def test_fp8_kv_doubles_the_window():
    bf16 = plan(PlanRequest(gpus=8, gpu_memory_gb=141))
    fp8 = plan(PlanRequest(gpus=8, gpu_memory_gb=141, kv_dtype="fp8", max_model_len=bf16.max_model_len))
    assert fp8.concurrency == pytest.approx(2 * bf16.concurrency, rel=0.01)


def test_seed_000_workload_fits_32_concurrent_on_b200():
    p = plan(PlanRequest(gpus=8, gpu_memory_gb=gpu_memory_for("B200"), request_tokens=8192 + 2048))
    assert p.fits and p.max_model_len == NATIVE_CONTEXT
    assert p.request_concurrency >= 32


def test_amd_bf16_needs_tp8_while_mxfp8_and_mxfp4_run_from_tp4():
    mi300x, mi355x = gpu_memory_for("MI300X"), gpu_memory_for("mi355x")
    assert not plan(PlanRequest(gpus=4, gpu_memory_gb=mi300x, precision="bf16", max_model_len=32_768)).fits
    assert plan(PlanRequest(gpus=8, gpu_memory_gb=mi300x, precision="bf16", max_model_len=32_768)).fits
    assert plan(PlanRequest(gpus=4, gpu_memory_gb=mi355x, precision="mxfp8", max_model_len=131_072)).fits
    assert plan(PlanRequest(gpus=4, gpu_memory_gb=mi355x, precision="mxfp4", max_model_len=131_072)).fits


def test_m3_fp8_weights_alone_overflow_two_h200():
    p = plan(PlanRequest(gpus=2, gpu_memory_gb=141, precision="fp8", kv_dtype="fp8"))
    assert not p.fits and p.reason.startswith("the weights do not fit")


def test_window_past_native_context_is_refused():
    p = plan(PlanRequest(gpus=8, gpu_memory_gb=288, max_model_len=2 * NATIVE_CONTEXT))
    assert not p.fits and "native window" in p.reason


def test_largest_window_is_a_whole_number_of_128_token_blocks_and_fits():
    p = plan(PlanRequest(gpus=8, gpu_memory_gb=141, gpu_memory_utilization=0.85))
    assert p.max_model_len % 128 == 0
    assert kv_gb(p.max_model_len, "auto") <= p.kv_pool_gb
    assert kv_gb(p.max_model_len + 128, "auto") > p.kv_pool_gb


def test_describe_names_the_window_and_concurrency():
    lines = describe(plan(PlanRequest(gpus=8, gpu_memory_gb=180, max_model_len=131_072, request_tokens=10_240)))
    assert any(line.startswith("--max-model-len 131072:") for line in lines)
    assert any("requests of 10240 tokens" in line for line in lines)


def test_unknown_gpu_and_kv_dtype_are_usage_errors():
    with pytest.raises(UsageError, match="unknown GPU"):
        gpu_memory_for("RTX 4090")
    with pytest.raises(UsageError, match="unknown KV dtype"):
        plan(PlanRequest(gpus=1, gpu_memory_gb=80, kv_dtype="int2"))
