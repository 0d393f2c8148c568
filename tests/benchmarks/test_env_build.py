"""benchmarks/env_build.py end to end with one round: a real cold build, a warm fix, the baseline, the JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from m3_agent.sandbox.env.catalogue import list_environments

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "env_build.py"

pytestmark = pytest.mark.docker


def bench_images() -> set[str]:
    return {e.tag for e in list_environments() if e.source.startswith("envbench-")}


def test_one_round_measures_a_cold_build_and_a_warm_lookup_and_leaves_no_image(sandbox_image):
    before = bench_images()
    r = subprocess.run([sys.executable, str(BENCH), "--runs", "1", "--lookups", "3"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["runs"] == 1 and out["target_s"] == 0.5
    assert out["target_met"] == (out["warm_overhead_s"] <= out["target_s"])
    # the cold fix really built: its setup took longer than a whole warm fix's overhead could explain
    assert out["build_s"] > 1.0 and out["cold_s"] > out["warm_overhead_s"]
    assert out["cold_fix_s"] > out["warm_fix_s"] > 0 and out["baseline_fix_s"] > 0
    assert 0 < out["warm_lookup_ms"] < 500  # the image found by its key, well inside the target
    assert bench_images() <= before  # the environment image it built is removed
