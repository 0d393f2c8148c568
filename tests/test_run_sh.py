"""`bash run.sh test`: its background set-up steps (the llama.cpp server build, the oracle venv) overlap the
rest of the set-up and the suite, and a failure in one of them still fails the run with a clear line.

The checks run `run.sh test` itself, nested, on a few fast tests: the set-up it repeats is done already
(each step is idempotent), and the llama.cpp and oracle builds are made to fail at once through their
scripts' own `M3_LLAMA_BASE_PYTHON` and `M3_ORACLE_BASE_PYTHON` (a "python" that cannot make a venv), in
cache folders of the test's own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from m3_agent.sandbox.env import toolchain
from m3_agent.sandbox.image import SUITE, Recipe

ROOT = Path(__file__).resolve().parents[1]
FAST_TEST = "tests/serving/test_serve_cpu_tiny.py::test_python_constants_match_the_build_script_defaults"
REAL_TEST = "tests/realmodel/test_fix_real_model.py::test_serve_status_and_logs_see_the_cpu_tiny_server"

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]


def _run_sh_test(tmp_path: Path, *tests: str) -> subprocess.CompletedProcess:
    """`bash run.sh test TESTS` with llama.cpp and oracle builds that fail: their python cannot make a venv."""
    broken = tmp_path / "python-without-venv"
    broken.write_text("#!/bin/sh\necho 'no venv module in this python' >&2\nexit 1\n")
    broken.chmod(0o755)
    # Both builds fail, in caches of the test's own (so neither waits for the outer run's builds); TMPDIR:
    # the failed steps' logs, which run.sh keeps, stay in the test's folder.
    env = {**os.environ, "M3_LLAMA_CACHE": str(tmp_path / "llama"), "M3_LLAMA_BASE_PYTHON": str(broken),
           "M3_ORACLE_CACHE": str(tmp_path / "oracle"), "M3_ORACLE_BASE_PYTHON": str(broken),
           "TMPDIR": str(tmp_path)}
    for name in ("M3_LLAMA_BUILD_STATUS", "M3_LLAMA_BUILD_LOG"):
        env.pop(name, None)  # the outer run's, when this suite itself runs under run.sh
    return subprocess.run(["bash", "run.sh", "test", "--basetemp", str(tmp_path / "t"), *tests],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=280)


def test_failed_background_builds_fail_the_run_with_their_logs_though_the_tests_passed(docker_ready, tmp_path):
    r = _run_sh_test(tmp_path, FAST_TEST)
    assert "1 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.returncode == 4, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    for what in ("the conformance oracle venv", "the llama.cpp server venv"):
        error = [line for line in lines if line.startswith(f"m3-agent setup: error: could not build {what}")]
        assert len(error) == 1 and "(exit 1)" in error[0], r.stderr[-2000:]
        log = Path(error[0].split("its log, ")[1].split(", ends:")[0])
        assert log.is_file() and log.is_relative_to(tmp_path), error[0]  # a failed step's log is kept for reading
        tail = lines[lines.index(error[0]) + 1:]
        tail = tail[:next((i for i, line in enumerate(tail) if not line.startswith("  | ")), len(tail))]
        assert "  | no venv module in this python" in tail, r.stderr[-2000:]


def test_the_real_model_tier_fails_at_once_on_the_failed_build_instead_of_building_again(docker_ready, tmp_path):
    r = _run_sh_test(tmp_path, REAL_TEST, FAST_TEST)
    out = r.stdout
    assert r.returncode == 1, out[-3000:] + r.stderr[-2000:]
    assert "1 passed, 1 error" in out, out[-3000:]
    assert "the llama.cpp server build that run.sh started failed (exit 1)" in out
    assert "no venv module in this python" in out
    assert "building the cpu-tiny server failed" not in out  # `serve start` never tried a second build


def test_the_tiers_that_wait_for_background_builds_are_collected_last_whatever_the_order_asked():
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/realmodel",
                        "tests/conformance/test_endpoint_auth.py", "tests/serving/test_serve_cpu_tiny.py"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    tops = [test.split("/")[1] for test in ids]
    groups = [top for i, top in enumerate(tops) if i == 0 or tops[i - 1] != top]
    assert groups == ["serving", "conformance", "realmodel"], tops


def test_the_images_built_in_the_background_are_the_ones_environment_builds_ask_for(docker_ready, tmp_path):
    # run.sh's own step, against this engine, where they are built already (on a cold engine it builds them)
    script = f'source <(sed -n "/^prebuild_images()/,/^}}/p" {ROOT / "run.sh"}); prebuild_images'
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    compiling = tmp_path / "ext"
    compiling.mkdir()
    (compiling / "setup.py").write_text("from setuptools import Extension, setup\nsetup(ext_modules=[Extension('m', ['m.c'])])\n")
    assert toolchain.compiles(compiling)
    # a project that compiles (its CI installing nothing more), and one that needs a newer Debian's Python
    assert r.stdout.split() == [Recipe("trixie").image, toolchain.build_recipe(compiling, SUITE)[0].image]
