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


def test_tree_mode_alternates_the_warm_build_the_floor_and_another_install_and_says_the_load(sandbox_image, tmp_path):
    from tests.conftest import make_git_repo

    # A dependency-free tree: `env build` finds nothing to build, so the run costs no image.
    tree = make_git_repo(tmp_path / "plain", {"plain.py": "N = 1\n", "tests/test_plain.py": "def test_n():\n    pass\n"})
    r = subprocess.run([sys.executable, str(BENCH), "--tree", str(tree), "--runs", "2", "--before", sys.executable],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    (row,) = out["trees"]
    assert row["tree"] == "plain" and row["files"] == 2 and out["runs"] == 2
    assert row["warm_build_s"] > 0 and row["help_s"] > 0 and row["before_build_s"] > 0
    assert row["overhead_s"] == pytest.approx(row["warm_build_s"] - row["help_s"], abs=0.002)  # each rounded apart
    assert row["before_overhead_s"] == pytest.approx(row["before_build_s"] - row["help_s"], abs=0.002)
    assert row["target_met"] == (row["overhead_s"] <= out["target_s"]) and out["target_met"] == row["target_met"]
    assert out["load_start"] >= 0 and out["load_end"] >= 0
