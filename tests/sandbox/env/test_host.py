"""No code from the repository or from a package runs on the host: the host only downloads, and what reads
metadata or builds an sdist runs in the build container. On the real engine, with a package index of the
test's own serving a hostile sdist."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid

import docker
import pytest

from m3_agent.sandbox import SandboxConfig
from m3_agent.sandbox.env.build import ensure_environment, request_for
from m3_agent.sandbox.env.catalogue import list_environments, prune_environments
from tests.conftest import make_git_repo
from tests.sandbox.env.package_index import Index, make_sdist, pip_configured

pytestmark = pytest.mark.docker

OLD = "2020-01-01T00:00:00Z"
HOSTILE = """\
import os
mark = {mark!r}
os.makedirs(os.path.dirname(mark), exist_ok=True)
with open(mark, "w") as f:
    f.write("ran as uid %d" % os.getuid())
from setuptools import setup
setup(name={name!r}, version="1.0", {extra})
"""


@pytest.fixture(scope="module")
def hostile_index(tmp_path_factory):
    """pip configured with an index of the test's own: the tools a build needs, and `m3hostile`, published
    only as an sdist whose setup.py leaves a mark wherever it runs."""
    root = tmp_path_factory.mktemp("hostile-index")
    marks = root / "marks"
    tools = root / "tools"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(tools), "--only-binary", ":all:",
                    "--python-version", "3.11", "pip", "pytest", "setuptools", "wheel", "iniconfig"],
                   check=True, capture_output=True)
    served = {p.name: (p, OLD) for p in tools.glob("*.whl")}
    sdist = make_sdist(root, "m3hostile", "1.0",
                       HOSTILE.format(mark=str(marks / "sdist"), name="m3hostile", extra="py_modules=['m3hostile']"))
    served[sdist.name] = (sdist, OLD)
    with Index(served) as index, pip_configured(f"index-url = {index.url}\n", root):
        yield marks


def test_a_hostile_setup_py_and_its_sdist_dependency_leave_nothing_on_the_host(hostile_index, tmp_path,
                                                                               sandbox_image):
    marks = hostile_index
    name = f"hostile-{uuid.uuid4().hex[:8]}"
    repo = make_git_repo(tmp_path / name, {
        "setup.py": HOSTILE.format(mark=str(marks / "project"), name=name,
                                   extra="packages=['hostile'], install_requires=['iniconfig']"),
        "hostile/__init__.py": "",
        "requirements.txt": "-e .\nm3hostile\n",  # pip download -r of `-e .` would run setup.py where it runs
    })
    with contextlib.closing(docker.from_env()) as client:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        messages: list[str] = []
        env = ensure_environment(request_for(None, SandboxConfig(), history=(repo, head), source=name),
                                 progress=messages.append)
        try:
            assert env is not None and env.built
            assert not marks.exists(), f"code ran on the host: {sorted(p.name for p in marks.iterdir())}"
            packages = next(e for e in list_environments() if e.tag == env.tag).packages
            assert "m3hostile==1.0" in packages and any(p.startswith("iniconfig==") for p in packages)
            assert any("not read on the host (it builds code; the build container installs it): -e ." in m
                       for m in messages)
            # Both setup.py files did run: in the build container, whose file system the image keeps.
            box = client.containers.run(env.tag, ["cat", str(marks / "project"), str(marks / "sdist")],
                                        detach=True, network_mode="none")
            try:
                assert box.wait(timeout=60)["StatusCode"] == 0
                out = box.logs().decode()
            finally:
                box.remove(force=True)
            assert out.count("ran as uid 0") == 2, out
        finally:
            prune_environments(keep=0, source=name)
