"""A JavaScript monorepo (npm workspaces) on the real Docker engine: one environment for the root and its
packages, each package's tests run by its own runner (Mocha, AVA, tap) from its own directory, a package
that depends on another workspace package finds it, and a failing test comes back by name.

One build serves every runner: builds on one host wait for each other, and each takes minutes here.
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
from tests.sandbox.env.test_node_environment import locked, run_tests

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]

SHARED = "exports.double = (n) => n + n;\nexports.half = (n) => n / 3;\n"  # half() is wrong
MOCHA_TEST = """const assert = require("assert");
const { double, half } = require("@demo/shared");
describe("shared", () => {
  it("doubles", () => { assert.strictEqual(double(4), 8); });
  it("halves", () => { assert.strictEqual(half(8), 4); });
});
"""
AVA_TEST = """const test = require("ava");
const { double, half } = require("@demo/shared");
test("doubles", (t) => { t.is(double(3), 6); });
test("halves", (t) => { t.is(half(6), 3); });
"""
TAP_TEST = """const t = require("tap");
const { double, half } = require("@demo/shared");
t.test("numbers", async (t) => {
  t.equal(double(5), 10, "doubles");
  t.equal(half(10), 5, "halves");
});
"""


def monorepo(name: str) -> dict[str, str]:
    """npm workspaces: `shared` and three packages that test it, with Mocha, AVA and tap."""
    def package(pkg: str, test: str, dev: dict) -> str:
        return json.dumps({"name": f"@demo/{pkg}", "version": "1.0.0", "private": True, "scripts": {"test": test},
                           "dependencies": {"@demo/shared": "1.0.0"}, "devDependencies": dev})
    return {
        "package.json": json.dumps({"name": name, "version": "1.0.0", "private": True, "workspaces": ["packages/*"],
                                    "scripts": {"test": "npm test --workspaces"}}),
        "packages/shared/package.json": json.dumps({"name": "@demo/shared", "version": "1.0.0", "main": "index.js"}),
        "packages/shared/index.js": SHARED,
        "packages/m/package.json": package("m", "mocha test/", {"mocha": "^10.7.0"}),
        "packages/m/test/shared.spec.js": MOCHA_TEST,
        "packages/a/package.json": package("a", "ava", {"ava": "^6.1.0"}),
        "packages/a/test/shared.js": AVA_TEST,
        "packages/t/package.json": package("t", "tap --disable-coverage", {"tap": "^21.0.0"}),
        "packages/t/test/shared.js": TAP_TEST,
    }


@pytest.fixture
def source(sandbox_image):
    name = f"nodemono_{uuid.uuid4().hex[:10]}"
    yield name
    prune_environments(keep=0, source=name)


def test_a_workspaces_monorepo_runs_mocha_ava_and_tap_from_each_package(source, tmp_path):
    repo = locked(make_git_repo(tmp_path / source, monorepo(source)))
    config, env = environment_for(repo, SandboxConfig(image=DEFAULT_IMAGE), source=source)
    assert env is not None and env.built
    with Sandbox(config, repo=repo) as sb:
        # The workspace package is linked in where each package's node_modules resolves it.
        linked = sb.exec("cd packages/m && node -e \"console.log(require.resolve('@demo/shared'))\"")
        assert linked.exit_code == 0 and linked.stdout.strip() == "/workspace/packages/shared/index.js", linked
        mocha = run_tests(sb, "packages/m/test/shared.spec.js")
        assert mocha.data["framework"] == "mocha" and (mocha.data["passed"], mocha.data["failed"]) == (1, 1), mocha.output
        assert [t["id"] for t in mocha.data["failing"]] == ["packages/m/test/shared.spec.js::shared > halves"]
        ava = run_tests(sb, "packages/a/test/shared.js")
        assert ava.data["framework"] == "ava" and (ava.data["passed"], ava.data["failed"]) == (1, 1), ava.output
        assert [t["id"] for t in ava.data["failing"]] == ["packages/a/test/shared.js::halves"]
        tap = run_tests(sb, "packages/t/test/shared.js")
        assert tap.data["framework"] == "tap" and (tap.data["passed"], tap.data["failed"]) == (1, 1), tap.output
        assert [t["id"] for t in tap.data["failing"]] == ["packages/t/test/shared.js::numbers > halves"]
        sb.write_file("packages/shared/index.js", SHARED.replace("n / 3", "n / 2"))
        for test_file in ("packages/m/test/shared.spec.js", "packages/a/test/shared.js", "packages/t/test/shared.js"):
            green = run_tests(sb, test_file)
            assert green.data["failed"] == 0 and green.data["passed"] >= 2 and green.data["problem"] is None, \
                green.output
        assert "node_modules" not in sb.diff()
