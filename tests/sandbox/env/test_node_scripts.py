"""A JavaScript repository's own lifecycle scripts in the environment's build container, on the real Docker
engine: what real projects' `prepare` scripts need there (a git repository for their hook installers), and
the line a failed one leaves.

Every project gets a name no earlier run used, so its build is cold; its images are removed after.
"""

from __future__ import annotations

import json
import uuid

import pytest

from m3_agent.sandbox import Sandbox, SandboxConfig
from m3_agent.sandbox.env.build import environment_for
from m3_agent.sandbox.env.catalogue import prune_environments
from m3_agent.sandbox.image import DEFAULT_IMAGE
from tests.conftest import make_git_repo
from tests.fix.test_fix_sources import cli_main  # noqa: F401 - a fixture
from tests.sandbox.env.test_node_environment import assert_build_error, run_tests

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]


@pytest.fixture
def source(sandbox_image):
    name = f"nodescript_{uuid.uuid4().hex[:10]}"
    yield name
    prune_environments(keep=0, source=name)


def test_a_prepare_script_that_installs_git_hooks_runs_in_a_git_repository(source, tmp_path):
    # uuid's `prepare` is `lefthook install`, which fails outside a git repository: the build's copy has none.
    repo = make_git_repo(tmp_path / source, {
        "package.json": json.dumps({"name": source, "version": "1.0.0", "private": True, "scripts": {
            "prepare": "git rev-parse --git-dir > hooks-installed.txt", "test": "node --test"}}),
        "test/a.test.js": "const test = require('node:test');\ntest('runs', () => {});\n",
    })
    config, env = environment_for(repo, SandboxConfig(image=DEFAULT_IMAGE), source=source)
    assert env is not None and env.built
    with Sandbox(config, repo=repo) as sb:
        assert sb.read_file("hooks-installed.txt").strip() == b".git"  # written by the script in the build
        ran = run_tests(sb, "test/a.test.js")
        assert (ran.data["passed"], ran.data["failed"]) == (1, 0), ran.output
        assert sb.diff() == ""  # the build's own .git is gone: the workspace's git is the sandbox's


def test_a_failed_prepare_script_is_named_by_its_command(source, tmp_path, cli_main):
    repo = make_git_repo(tmp_path / source, {
        "package.json": json.dumps({"name": source, "version": "1.0.0", "private": True,
                                    "scripts": {"prepare": "exit 4", "test": "node --test"}})})
    assert_build_error(cli_main("env", "build", "--repo", str(repo)),
                       "at step 'install the packages offline (npm; their scripts run here)': error: command sh -c exit 4")


def test_a_yarn_berry_repository_is_refused_in_one_line_with_exit_7(source, tmp_path, cli_main):
    repo = make_git_repo(tmp_path / source, {
        "package.json": json.dumps({"name": source, "version": "1.0.0", "packageManager": "yarn@4.5.3",
                                    "scripts": {"test": "node --test"}}),
        ".yarnrc.yml": "nodeLinker: pnp\n", "yarn.lock": "__metadata:\n  version: 8\n"})
    assert_build_error(cli_main("env", "build", "--repo", str(repo)),
                       "Yarn 2+ (Berry, Plug'n'Play) is not supported yet: only yarn 1, npm and pnpm repositories")


def test_a_peer_dependency_conflict_npm_6_let_pass_resolves_as_npm_6_did(source, tmp_path):
    # mitt: eslint 7 beside plugins whose peer range wants 8; npm 7+ refuses the tree (ERESOLVE).
    repo = make_git_repo(tmp_path / source, {
        "package.json": json.dumps({"name": source, "version": "1.0.0", "private": True,
                                    "scripts": {"test": "node --test"},
                                    "dependencies": {"react": "^17.0.2", "react-dom": "^18.3.1"}}),
        "test/a.test.js": ("const test = require('node:test');\nconst assert = require('node:assert');\n"
                           "test('versions', () => {\n  assert.strictEqual(require('react/package.json').version[0], '1');\n"
                           "  assert.ok(require('react-dom/package.json').version.startsWith('18.'));\n});\n"),
    })
    said: list[str] = []
    config, env = environment_for(repo, SandboxConfig(image=DEFAULT_IMAGE), source=source, progress=said.append)
    assert env is not None and env.built
    assert any("ERESOLVE" in line and "--legacy-peer-deps" in line for line in said), said
    with Sandbox(config, repo=repo) as sb:
        ran = run_tests(sb, "test/a.test.js")
        assert (ran.data["passed"], ran.data["failed"]) == (1, 0), ran.output


def test_a_package_whose_install_script_downloads_a_browser_installs_without_it(source, tmp_path):
    # yargs-parser's devDependencies hold puppeteer, whose `node install.mjs` fetches Chrome: no network here.
    repo = make_git_repo(tmp_path / source, {
        "package.json": json.dumps({"name": source, "version": "1.0.0", "private": True,
                                    "scripts": {"test": "node --test"}, "devDependencies": {"puppeteer": "^24.6.1"}}),
        "test/a.test.js": ("const test = require('node:test');\nconst assert = require('node:assert');\n"
                           "test('puppeteer is installed', () => {\n"
                           "  assert.ok(require('puppeteer/package.json').version.startsWith('24.'));\n});\n"),
    })
    config, env = environment_for(repo, SandboxConfig(image=DEFAULT_IMAGE), source=source)
    assert env is not None and env.built
    with Sandbox(config, repo=repo) as sb:
        ran = run_tests(sb, "test/a.test.js")
        assert (ran.data["passed"], ran.data["failed"]) == (1, 0), ran.output
