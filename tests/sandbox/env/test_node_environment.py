"""JavaScript and TypeScript repositories on the real Docker engine: Node and the packages of the lock file,
fetched on the host from the npm registry and installed in the build container with no network; then the
project's own runner through test_runner, and `fix` with the stand-in turning a failing test green.

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
from m3_agent.sandbox.env.catalogue import list_environments, prune_environments
from m3_agent.sandbox.image import DEFAULT_IMAGE
from m3_agent.sandbox.env.nodeenv import NODE_BIN, NODE_MODULES
from m3_agent.tools.test_runner import TestRunner, TestRunnerArgs
from tests.conftest import make_git_repo
from tests.fix.test_fix_environment import fix_json
from tests.fix.test_fix_sources import cli_main, fix_cli  # noqa: F401, F811 - fixtures

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]  # builds on one host wait for each other

CALC_TEST = """const { add } = require("../src/calc");
describe("add", () => {
  test("adds two numbers", () => { expect(add(2, 3)).toBe(5); });
  test("adds zero", () => { expect(add(2, 0)).toBe(2); });
});
"""


def javascript_project(name: str) -> dict[str, str]:
    """A CommonJS library tested with Jest (its test script lints first); add() subtracts."""
    return {
        "package.json": json.dumps({"name": name, "version": "1.0.0", "private": True,
                                    "scripts": {"test": "eslint . && jest"}, "devDependencies": {"jest": "^29.7.0"}}),
        "src/calc.js": "function add(a, b) {\n  return a - b;\n}\nmodule.exports = { add };\n",
        "test/calc.test.js": CALC_TEST,
    }


def typescript_project(name: str) -> dict[str, str]:
    """An ES module library in TypeScript tested with Vitest after `tsc --noEmit`; its postinstall script
    writes a marker where it runs."""
    return {
        "package.json": json.dumps({
            "name": name, "version": "1.0.0", "private": True, "type": "module",
            "scripts": {"test": "tsc --noEmit && vitest run",
                        "postinstall": "node -e \"require('fs').writeFileSync('install-marker.txt', process.cwd())\""},
            "devDependencies": {"vitest": "^3.2.0", "typescript": "^5.6.0"}}),
        "tsconfig.json": json.dumps({"compilerOptions": {"target": "ES2022", "module": "ESNext", "strict": True,
                                                         "moduleResolution": "Bundler", "noEmit": True}}),
        # vite bundles a TypeScript config into node_modules/.vite-temp first (magic-string has one)
        "vitest.config.ts": 'import { defineConfig } from "vitest/config";\nexport default defineConfig({ test: {} });\n',
        "src/math.ts": "export function mul(a: number, b: number): number {\n  return a + b;\n}\n",
        "test/math.test.ts": ('import { describe, expect, it } from "vitest";\nimport { mul } from "../src/math";\n'
                              'describe("mul", () => {\n  it("multiplies", () => { expect(mul(3, 4)).toBe(12); });\n'
                              '  it("two twos", () => { expect(mul(2, 2)).toBe(4); });\n});\n'),
    }


def locked(repo: Path) -> Path:
    """The repository with the package-lock.json npm resolves for it (the registry, on the host), committed."""
    subprocess.run(["npm", "install", "--package-lock-only", "--ignore-scripts", "--no-audit", "--no-fund"],
                   cwd=repo, check=True, capture_output=True, timeout=600)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "lock"],
                   check=True)
    return repo


@pytest.fixture
def source(sandbox_image):
    name = f"nodeenv_{uuid.uuid4().hex[:10]}"
    yield name
    prune_environments(keep=0, source=name)


def assert_build_error(result: tuple[int, str, str], text: str) -> None:
    """`env build` exited 7 with one error line (after its progress lines; rich may wrap it) naming `text`."""
    code, _, err = result
    flat = " ".join(err.split())
    assert code == 7 and flat.count("m3-agent: error: ") == 1 and "Traceback" not in err, err
    assert text in flat.split("m3-agent: error: ")[1], err


def run_tests(sb: Sandbox, test_file: str, framework: str = "auto"):
    return TestRunner().run(TestRunnerArgs(test_file=test_file, framework=framework), sb)


def test_a_javascript_project_is_built_offline_and_a_fix_turns_its_failing_test_green(source, tmp_path, fix_cli):
    repo = locked(make_git_repo(tmp_path / source, javascript_project(source)))
    test = {"tool_calls": [{"name": "test_runner", "arguments": {"test_file": "test/calc.test.js"}}]}
    probe = {"tool_calls": [{"name": "bash", "arguments": {
        "command": "command -v node npm jest; node --version; readlink node_modules; git status --porcelain"}}]}
    edit = {"tool_calls": [{"name": "file_edit", "arguments": {
        "path": "src/calc.js", "old_str": "return a - b", "new_str": "return a + b"}}]}
    submit = {"tool_calls": [{"name": "submit", "arguments": {"summary": "add() subtracted; it adds now."}}]}
    code, result, tools, _ = fix_json(fix_cli, repo, "add() is wrong", [test, probe, edit, test, submit])
    assert code == 0 and result["status"] == "resolved", result
    first, seen, last = tools[0], tools[1], tools[3]
    # eslint is not installed and never ran: the script's lint step is not the tests.
    assert first.startswith("jest test/calc.test.js: 1 passed, 1 failed, 0 errors"), first
    assert "FAILED test/calc.test.js::add > adds two numbers: " in first and "Expected: 5" in first
    assert f"{NODE_BIN}/node" in seen and f"{NODE_BIN}/npm" in seen and "node_modules/.bin/jest" in seen, seen
    assert f"{NODE_MODULES}/./node_modules" in seen and "??" not in seen, seen  # linked in, not in git's view
    assert last.startswith("jest test/calc.test.js: 2 passed, 0 failed, 0 errors"), last
    assert "+  return a + b;" in result["patch"] and "node_modules" not in result["patch"]


def test_a_typescript_project_runs_vitest_and_its_install_script_ran_only_in_the_container(source, tmp_path):
    repo = locked(make_git_repo(tmp_path / source, typescript_project(source)))
    config, env = environment_for(repo, SandboxConfig(image=DEFAULT_IMAGE), source=source)
    assert env is not None and env.built
    assert not (repo / "install-marker.txt").exists() and not (repo / "node_modules").exists()  # nothing on the host
    with Sandbox(config, repo=repo) as sb:
        # The script's postinstall ran in the build container, in its copy of the repository.
        assert sb.read_file("install-marker.txt") == b"/workspace"
        whole = run_tests(sb, "")
        assert whole.data["framework"] == "vitest" and (whole.data["passed"], whole.data["failed"]) == (1, 1)
        assert [t["id"] for t in whole.data["failing"]] == ["test/math.test.ts::mul > multiplies"]
        one = run_tests(sb, "test/math.test.ts::mul > two twos")
        assert (one.data["passed"], one.data["failed"], one.data["skipped"]) == (1, 0, 1), one.output
        sb.write_file("src/math.ts", "export function mul(a: number, b: number): number {\n  return a * b;\n}\n")
        green = run_tests(sb, "test/math.test.ts")
        assert (green.data["passed"], green.data["failed"], green.data["problem"]) == (2, 0, None), green.output
        assert sb.diff().count("diff --git") == 1 and "node_modules" not in sb.diff()
    again, env2 = environment_for(repo, SandboxConfig(image=DEFAULT_IMAGE), source=source)
    assert env2 is not None and not env2.built and env2.tag == env.tag and env2.seconds < 1.0


def test_a_lock_file_that_cannot_be_satisfied_fails_in_one_line_with_exit_7(source, tmp_path, cli_main):
    repo = make_git_repo(tmp_path / source, {
        "package.json": json.dumps({"name": source, "version": "1.0.0", "devDependencies": {"is-number": "^7.0.0"}}),
        "package-lock.json": json.dumps({"name": source, "version": "1.0.0", "lockfileVersion": 3, "requires": True,
                                         "packages": {"": {"name": source, "version": "1.0.0"}}}),
    })
    result = cli_main("env", "build", "--repo", str(repo))
    assert_build_error(result, "environment build failed at step 'fetch the packages (npm)': `npm ci` can only "
                               "install packages when your package.json and package-lock.json")
    assert [e for e in list_environments() if e.source == source] == []


def test_a_node_version_no_release_satisfies_fails_in_one_line_with_exit_7(source, tmp_path, cli_main):
    repo = make_git_repo(tmp_path / source, {
        "package.json": json.dumps({"name": source, "engines": {"node": ">=99"}, "scripts": {"test": "node --test"}})})
    assert_build_error(cli_main("env", "build", "--repo", str(repo)),
                       "at step 'resolve the Node version': no Node release satisfies '>=99' (package.json engines.node)")


def test_a_python_project_whose_javascript_install_fails_keeps_its_python_environment(source, tmp_path):
    # Django-like: a Python project whose package.json holds JavaScript tooling that cannot install offline.
    repo = make_git_repo(tmp_path / source, {
        "pyproject.toml": (f'[project]\nname = "{source}"\nversion = "1.0"\n\n[build-system]\n'
                           'requires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'),
        f"{source}/__init__.py": "VALUE = 42\n",
        "package.json": json.dumps({"name": source, "version": "1.0.0", "private": True,
                                    "scripts": {"postinstall": "node -e \"process.exit(3)\""}}),
    })
    said: list[str] = []
    config, env = environment_for(repo, SandboxConfig(image=DEFAULT_IMAGE), source=source, progress=said.append)
    assert env is not None and env.built
    assert any(line.startswith("notice: node: left out, the Python environment is built without it") for line in said)
    [info] = [e for e in list_environments() if e.source == source]
    [note] = [p for p in info.packages if p.startswith("node")]  # the note, not the Node that was left out
    assert note.startswith("node: left out") and "npm" not in info.packages
    with Sandbox(config, repo=repo) as sb:
        ran = sb.exec(f"python -c 'import {source}; print({source}.VALUE)'")
        assert ran.exit_code == 0 and ran.stdout.strip() == "42", ran


def test_a_javascript_project_whose_install_script_fails_still_fails_the_build(source, tmp_path, cli_main):
    repo = make_git_repo(tmp_path / source, {
        "package.json": json.dumps({"name": source, "version": "1.0.0", "private": True,
                                    "scripts": {"postinstall": "node -e \"process.exit(3)\"", "test": "node --test"}})})
    assert_build_error(cli_main("env", "build", "--repo", str(repo)),
                       "environment build failed at step 'install the packages offline")
    assert [e for e in list_environments() if e.source == source] == []
