"""Releases as of the commit: the cut-off date, and that it holds for every package source pip is configured with.

The integration test serves a package index of its own on loopback (PEP 691 JSON, with upload times)
and configures pip, as these machines do, with a local index and a find-links folder whose files carry
no upload time, each holding a newer release: the environment must still get the release of the
commit's day.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import docker
import pytest

from m3_agent.errors import EnvironmentBuildError
from m3_agent.sandbox import SandboxConfig
from m3_agent.sandbox.env.build import ensure_environment, request_for
from m3_agent.sandbox.env.catalogue import list_environments, prune_environments
from m3_agent.sandbox.env.pyenv import Target
from m3_agent.sandbox.env.releases import Sources, pip_configuration, release_cutoff
from m3_agent.sandbox.env.wheels import download
from tests.sandbox.env.package_index import Index, make_wheel, pip_configured

TARGET = Target("3.11.2", "x86_64", "2.36")
OLD, NEW = "2020-01-01T00:00:00Z", "2025-06-01T00:00:00Z"  # upload times around the commit's 2024 date
COMMIT_DATE = "2024-01-01T00:00:00+00:00"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com"}


def git(repo: Path, *args: str, date: str | None = None) -> str:
    env = {**os.environ, **GIT_ENV, **({"GIT_COMMITTER_DATE": date, "GIT_AUTHOR_DATE": date} if date else {})}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, env=env, capture_output=True,
                          text=True).stdout.strip()


def commit(repo: Path, files: dict[str, str], date: str) -> str:
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", f"at {date}", date=date)
    return git(repo, "rev-parse", "HEAD")


def test_the_cutoff_is_the_last_change_of_a_dependency_file_not_of_the_commit(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commit(repo, {"requirements.txt": "attrs\n"}, "2023-03-01T12:00:00+02:00")
    head = commit(repo, {"src/a.py": "x = 1\n"}, "2024-06-01T00:00:00+00:00")  # an ordinary commit
    assert release_cutoff("commit", history=(repo, head), files=["requirements.txt"]) == "2023-03-01T10:00:00Z"
    assert release_cutoff("today", history=(repo, head), files=["requirements.txt"]) is None
    assert release_cutoff("commit", history=None, files=["requirements.txt"]) is None  # no history: today


def test_sources_without_upload_times_are_left_out_under_a_cutoff():
    config = {"extra-index-url": "file:///srv/simple https://mirror.example/simple", "find-links": "/srv/wheels"}
    sources = Sources.for_cutoff("2024-01-01T00:00:00Z", config)
    assert sources.env == {"PIP_EXTRA_INDEX_URL": "https://mirror.example/simple", "PIP_FIND_LINKS": " "}
    assert sources.dropped == ("file:///srv/simple", "/srv/wheels")
    assert sources.pip_args() == ["--uploaded-prior-to", "2024-01-01T00:00:00Z"]
    assert Sources.for_cutoff(None, config) == Sources()  # today: pip's configuration as it is
    with pytest.raises(EnvironmentBuildError, match="releases = \"today\"") as e:
        Sources.for_cutoff("2024-01-01T00:00:00Z", {"index-url": "file:///srv/simple"})
    assert e.value.step == "choose the package sources"


@pytest.fixture(scope="module")
def configured_pip(tmp_path_factory):
    """pip configured with the test's dated index, a local index and a find-links folder (no upload times);
    yields the index. The tools every environment gets (pip, pytest) are served as old releases."""
    root = tmp_path_factory.mktemp("index")
    tools = root / "tools"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(tools), "--only-binary", ":all:",
                    "--python-version", "3.11", "pip", "pytest"], check=True, capture_output=True)
    served = {p.name: (p, OLD) for p in tools.glob("*.whl")}
    for version, when in (("1.0", OLD), ("2.0", NEW)):
        path = make_wheel(root, "m3probe", version)
        served[path.name] = (path, when)
    local = root / "local"
    (local / "simple" / "m3probe").mkdir(parents=True)
    newest = make_wheel(local, "m3probe", "3.0")  # in both undated sources: a local index and find-links
    (local / "simple" / "m3probe" / "index.html").write_text(f'<a href="../../{newest.name}">{newest.name}</a>\n')
    with Index(served) as index, pip_configured(f"index-url = {index.url}\n"
                                                f"extra-index-url = {(local / 'simple').as_uri()}\n"
                                                f"find-links = {local}\n", root):
        yield index


def test_without_a_cutoff_the_undated_sources_win_with_their_newer_release(configured_pip, tmp_path):
    """The trap is real: pip as configured takes 3.0 from the sources that carry no upload time."""
    assert pip_configuration()["index-url"] == configured_pip.url
    download(["m3probe"], into=tmp_path, target=TARGET, no_deps=True)
    assert [p.name for p in tmp_path.glob("m3probe-*")] == ["m3probe-3.0-py3-none-any.whl"]


@pytest.mark.docker
def test_an_environment_gets_the_releases_of_its_commit_from_every_source(configured_pip, tmp_path, sandbox_image):
    repo = tmp_path / "probe-releases"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commit(repo, {"requirements.txt": f"m3probe  # {os.getpid()}: this run's own key\n"}, COMMIT_DATE)
    head = commit(repo, {"src/probe.py": "x = 1\n"}, "2026-01-01T00:00:00+00:00")  # not a dependency change
    messages: list[str] = []
    request = request_for(None, SandboxConfig(), history=(repo, head), source=repo.name)
    env = ensure_environment(request, progress=messages.append)
    try:
        info = next(e for e in list_environments() if e.tag == env.tag)
        assert "m3probe==1.0" in info.packages
        assert any("releases before 2024-01-01T00:00:00Z" in m and "left out" in m for m in messages)
        client = docker.from_env()
        try:
            assert client.images.get(env.tag).labels["m3-agent.env.releases"] == "2024-01-01T00:00:00Z"
        finally:
            client.close()
    finally:
        prune_environments(keep=0, source=repo.name)
