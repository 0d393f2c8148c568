"""benchmarks/batch_throughput.py end to end on a small real git history: both arms, the JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "batch_throughput.py"
ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
       "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}


def test_both_arms_run_the_same_instances_and_the_last_line_is_json(tmp_path):
    repo = tmp_path / "proj"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True, env=ENV)
    for i in range(8):
        for j in range(20):
            (repo / f"mod_{j}.py").write_text("".join(f"def f_{j}_{k}(x):\n    return x + {k}\n" for k in range(50 + i)))
        subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, env=ENV)
        subprocess.run(["git", "-C", str(repo), "commit", "-qm", f"change {i}: grow every module"], check=True, env=ENV)
    r = subprocess.run([sys.executable, str(BENCH), str(repo), "--tasks", "4", "--stride", "1", "--turns", "2",
                        "--turns-spread", "0.5", "--workers", "2", "--budgeted-tasks", "0"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tasks"] == 4 and out["workers"] == 2
    arms = ("fixed_pool", "scheduler", "never_evicting")
    for arm in arms:
        assert out[arm]["sim_wall_s"] > 0 and 1 <= out[arm]["max_running"] <= 2
        assert out[arm]["prefill_computed_tokens"] > 0 and out[arm]["prefill_reused_tokens"] > 0
    # the same requests in every arm (each session as many turns in each): the same prompt tokens counted
    total = {arm: out[arm]["prefill_computed_tokens"] + out[arm]["prefill_reused_tokens"] for arm in arms}
    assert total["fixed_pool"] == total["scheduler"] == total["never_evicting"]
    assert out["speedup_vs_fixed_pool"] > 0 and out["first_request_cached_share_budgeted"] is None
    # the floor: nothing evicted, so it computes no more than either arm and is no slower than the pool
    assert out["never_evicting"]["prefill_computed_tokens"] <= min(out[a]["prefill_computed_tokens"] for a in arms[:2])
    assert out["speedup_ceiling"] >= 1.0
    assert out["speedup_ceiling"] == round(out["fixed_pool"]["sim_wall_s"] / out["never_evicting"]["sim_wall_s"], 3)
    assert "| fixed pool of 2 |" in r.stdout


def test_sessions_play_a_spread_of_turns_the_same_in_every_arm():
    sys.path.insert(0, str(BENCH.parent))
    try:
        from batch_throughput import turns_of
    finally:
        sys.path.remove(str(BENCH.parent))
    drawn = [turns_of(f"pytest-dev+pytest-{i:04d}", 30, 1 / 3) for i in range(600)]
    assert min(drawn) == 20 and max(drawn) == 40  # 30 less and more a third
    assert 29 <= sum(drawn) / len(drawn) <= 31 and len(set(drawn)) == 21
    assert drawn == [turns_of(f"pytest-dev+pytest-{i:04d}", 30, 1 / 3) for i in range(600)]  # one instance, one length
    assert {turns_of(f"x{i}", 30, 0.0) for i in range(50)} == {30}
