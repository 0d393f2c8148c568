"""tap 18+'s plugins that a project's tap config names and its lock lacks (`sandbox.env.tapplugins`): found on
the host, and the release chosen for the locked @tapjs/core, as tap's own `tap plugin add` chooses it."""

from __future__ import annotations

import json
import uuid

import pytest

from m3_agent.sandbox import Sandbox, SandboxConfig
from m3_agent.sandbox.env import nodeenv
from m3_agent.sandbox.env.build import environment_for
from m3_agent.sandbox.env.catalogue import prune_environments
from m3_agent.sandbox.env.tapplugins import configured_plugins, locked_core, missing_plugins, plugin_release, split
from m3_agent.sandbox.image import DEFAULT_IMAGE
from m3_agent.tools.test_runner import TestRunner, TestRunnerArgs
from tests.conftest import make_git_repo
from tests.sandbox.env.test_node_environment import locked
from tests.sandbox.env.tree import write

NPM_LOCK = json.dumps({"lockfileVersion": 3, "packages": {
    "": {"devDependencies": {"tap": "^21.7.2"}}, "node_modules/tap": {"version": "21.7.2"},
    "node_modules/@tapjs/core": {"version": "4.5.6"}, "node_modules/@tapjs/mock": {"version": "4.5.6"}}})
RELEASES = [{"version": "3.3.4", "peerDependencies": {"@tapjs/core": "4.5.2"}},
            {"version": "3.3.10", "peerDependencies": {"@tapjs/core": "4.5.8"}},
            {"version": "3.3.11", "peerDependencies": {"@tapjs/core": "4.5.9"}},
            {"version": "3.3.12", "peerDependencies": {"@tapjs/core": "4.6.0"}}]


def test_a_plugin_the_taprc_names_and_the_lock_lacks_is_missing(tmp_path):
    # lru-cache's .taprc: @tapjs/clock is in neither its package.json nor its lock.
    write(tmp_path, {"package.json": "{}", "package-lock.json": NPM_LOCK,
                     ".taprc": "node-arg:\n  - --expose-gc\nplugin:\n  - \"@tapjs/clock\"\n  - \"!@tapjs/mock\"\n"
                               "  - ./local-plugin.ts\n  - \"@tapjs/mock\"\n"})
    assert configured_plugins(tmp_path) == ["@tapjs/clock", "@tapjs/mock"]  # no exclusion, no local path
    assert missing_plugins(tmp_path, NPM_LOCK) == ["@tapjs/clock"]  # the lock installs @tapjs/mock
    assert ".taprc" in nodeenv.key_files(tmp_path)  # a plugin added to it builds anew


def test_package_json_tap_plugins_count_and_tap_before_18_has_none(tmp_path):
    write(tmp_path, {"package.json": json.dumps({"tap": {"plugin": ["@tapjs/clock@^3"]}})})
    assert missing_plugins(tmp_path, NPM_LOCK) == ["@tapjs/clock@^3"]
    assert split("@tapjs/clock@^3") == ("@tapjs/clock", "^3") and split("tap-plugin") == ("tap-plugin", "")
    old_tap = json.dumps({"packages": {"node_modules/tap": {"version": "16.3.0"}}})  # no @tapjs/core: no plugins
    assert missing_plugins(tmp_path, old_tap) == []


def test_the_core_version_is_read_from_yarn_and_pnpm_locks_too():
    yarn = '"@tapjs/core@4.5.6":\n  version "4.5.6"\n  resolved "https://r/x.tgz"\n'
    pnpm = "packages:\n\n  '@tapjs/core@4.5.6(@types/node@24.0.0)':\n    resolution: {integrity: sha512-x}\n"
    assert locked_core(NPM_LOCK) == locked_core(yarn) == locked_core(pnpm) == "4.5.6"
    assert locked_core("lockfileVersion: '9.0'\n") is None


def test_the_release_made_for_the_locked_core_is_taken_else_the_newest_of_its_minor():
    assert plugin_release(RELEASES, "4.5.8") == "3.3.10"  # tap's choice: its peer is the installed core
    # This machine's registry has no release for core 4.5.6: the newest for a 4.5 core, never 4.6's.
    assert plugin_release(RELEASES, "4.5.6") == "3.3.11"
    assert plugin_release(RELEASES, "4.5.6", wanted="<3.3.11") == "3.3.10"  # the config's own range holds
    assert plugin_release(RELEASES, "5.0.0") is None


CLOCK_TEST = """import t from "tap";
t.test("the clock plugin is built in", async (t) => {
  t.clock.enter();
  let fired = false;
  setTimeout(() => { fired = true; }, 1000);
  t.clock.advance(1000);
  t.equal(fired, true, "a mocked second passed");
  t.clock.exit();
});
"""


@pytest.mark.docker
@pytest.mark.timeout(1800)
def test_a_plugin_only_the_taprc_names_is_built_into_tap_and_its_test_runs_offline(sandbox_image, tmp_path):
    source = f"tapplugins_{uuid.uuid4().hex[:10]}"
    repo = locked(make_git_repo(tmp_path / source, {
        "package.json": json.dumps({"name": source, "version": "1.0.0", "private": True, "type": "module",
                                    "scripts": {"test": "tap"}, "devDependencies": {"tap": "^21.0.0"}}),
        ".taprc": "plugin:\n  - \"@tapjs/clock\"\n", "test/clock.test.js": CLOCK_TEST}))
    assert '"node_modules/@tapjs/clock"' not in (repo / "package-lock.json").read_text()  # only the .taprc has it
    said: list[str] = []
    try:
        config, env = environment_for(repo, SandboxConfig(image=DEFAULT_IMAGE), source=source, progress=said.append)
        assert env is not None and env.built
        assert any(line.startswith("build tap with its configured plugins (@tapjs/clock@") for line in said), said
        with Sandbox(config, repo=repo) as sb:
            ran = TestRunner().run(TestRunnerArgs(test_file="test/clock.test.js"), sb)
            assert sb.exec("git status --porcelain").stdout.strip() == ""  # the linked plugins stay out of git
        assert ran.data["framework"] == "tap" and (ran.data["passed"], ran.data["failed"]) == (1, 0), ran.output
    finally:
        prune_environments(keep=0, source=source)
