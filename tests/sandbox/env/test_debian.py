"""A Debian release's package names come from that release's own lists: the host's apt reads them, and fetches
another release's (the trixie image on a bookworm host) from the archive over real HTTP."""

from __future__ import annotations

import http.server
import threading

import pytest

from m3_agent.sandbox.env import debian
from m3_agent.sandbox.env.toolchain import TOOLCHAIN, build_recipe
from m3_agent.sandbox.image import Recipe
from tests.sandbox.env.test_toolchain import tree


@pytest.fixture
def fresh_lists(tmp_path, monkeypatch):
    """An empty cache, so another release's lists are fetched in the test; the names read again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    debian.package_names.cache_clear()
    debian._lists_of.cache_clear()
    yield tmp_path / "cache"
    debian.package_names.cache_clear()
    debian._lists_of.cache_clear()


def test_a_trixie_build_keeps_the_ci_packages_trixie_has_not_those_of_the_hosts_release(tmp_path, fresh_lists):
    """libatlas-base-dev is bookworm's and not trixie's (debootstrap of trixie stops at it); libpython3.13-dev is
    trixie's alone. Read from the host's bookworm lists, the trixie recipe kept the first and dropped the second."""
    root = tree(tmp_path / "repo", {".github/workflows/t.yml": "run: apt-get install -y libatlas-base-dev "
                                                               "libpython3.13-dev libzmq3-dev\n"})
    recipe, left_out = build_recipe(root, "trixie")
    assert recipe == Recipe("trixie", tuple(sorted({*TOOLCHAIN, "libpython3.13-dev", "libzmq3-dev"})))
    assert left_out == ["libatlas-base-dev"]
    assert list((fresh_lists / "m3-agent" / "debian-lists" / "trixie" / "lists").glob("*trixie*Packages*"))
    if debian.host_suite() == "bookworm":
        recipe, left_out = build_recipe(root, "bookworm")
        assert recipe == Recipe("bookworm", tuple(sorted({*TOOLCHAIN, "libatlas-base-dev", "libzmq3-dev"})))
        assert left_out == ["libpython3.13-dev"]


def test_a_mirror_that_has_no_such_release_leaves_every_ci_package_out_asked_once(tmp_path, fresh_lists, monkeypatch):
    """Debian's nodejs is asked of the same lists after the package names: the archive is not asked again."""
    asked: list[str] = []

    class NoArchive(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            asked.append(self.path)
            self.send_error(404)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoArchive)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv(debian.MIRROR_ENV, f"http://127.0.0.1:{server.server_port}/debian")
        assert debian.package_names("trixie") is None
        root = tree(tmp_path / "repo", {"ci/install.sh": "apt-get install -y libzmq3-dev\n"})
        assert build_recipe(root, "trixie") == (Recipe("trixie", tuple(sorted(TOOLCHAIN))), ["libzmq3-dev"])
        fetched = len(asked)
        assert debian.apt_cache("trixie", "madison", "nodejs") is None
        assert len(asked) == fetched
    finally:
        server.shutdown()
        server.server_close()
    assert any(path.startswith("/debian/dists/trixie/") for path in asked), asked
