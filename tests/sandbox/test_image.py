"""Images: the sandbox image (idempotent, verified, recipe-hashed tag); a task's recipe image is in tests/sandbox/env."""

from __future__ import annotations

import io
import tarfile
import time
import uuid

import docker
import pytest
from typer.testing import CliRunner

from m3_agent.errors import SandboxUnavailable
from m3_agent.sandbox import DEFAULT_IMAGE, Sandbox, SandboxConfig, build_env_image, build_image, prune
from m3_agent.sandbox.cli import app
from m3_agent.sandbox.image import BASE_IMAGE, DEFAULT_RECIPE, RECIPE_LABEL, _debootstrap_base


@pytest.fixture
def client(docker_ready):
    c = docker.from_env()
    yield c
    c.close()


def remove_image(client, tag: str) -> None:
    try:
        client.images.remove(tag, force=True)
    except docker.errors.ImageNotFound:
        pass


@pytest.mark.docker
def test_build_returns_at_once_when_the_image_exists(sandbox_image, client):
    started = time.monotonic()
    assert build_image() == DEFAULT_IMAGE == sandbox_image
    assert time.monotonic() - started < 5
    assert DEFAULT_RECIPE.sandbox_hash.startswith(DEFAULT_IMAGE.rsplit(":", 1)[1])
    assert client.images.get(DEFAULT_IMAGE).labels[RECIPE_LABEL] == DEFAULT_RECIPE.sandbox_hash


@pytest.mark.docker
def test_the_image_has_what_the_contract_promises(no_leftovers):
    with Sandbox(SandboxConfig(image=no_leftovers)) as sb:
        r = sb.exec("python3 -m pytest --version && git --version && patch --version | head -1 && "
                    "timeout --version | head -1 && bash --version | head -1 && ps --version && id -un")
    assert r.exit_code == 0, r.stderr
    assert "pytest" in r.stdout + r.stderr and "git version" in r.stdout and "GNU patch" in r.stdout
    assert r.stdout.split()[-1] == "sandbox"


@pytest.mark.docker
def test_building_on_a_given_base_layers_and_verifies(sandbox_image, client):
    tag = f"m3-agent-sandbox-test:{uuid.uuid4().hex[:8]}"
    messages: list[str] = []
    try:
        assert build_image(tag, base=BASE_IMAGE, progress=messages.append) == tag
        assert any("verifying" in m for m in messages)
        out = client.containers.run(tag, ["id", "-u"], remove=True, network_mode="none")
        assert out.strip() == b"1000"
    finally:
        remove_image(client, tag)


@pytest.mark.docker
def test_a_base_that_cannot_build_is_a_clear_error(sandbox_image, client):
    empty = io.BytesIO()
    tarfile.open(fileobj=empty, mode="w").close()
    base = f"m3-agent-empty-test:{uuid.uuid4().hex[:8]}"
    client.api.import_image_from_data(empty.getvalue(), repository=base.split(":")[0], tag=base.split(":")[1])
    tag = f"m3-agent-sandbox-test:{uuid.uuid4().hex[:8]}"
    try:
        with pytest.raises(SandboxUnavailable, match="docker build of .* failed"):
            build_image(tag, base=base)
        with pytest.raises(docker.errors.ImageNotFound):
            client.images.get(tag)
    finally:
        remove_image(client, tag)
        base_id = client.images.get(base).id
        for leftover in client.images.list(all=True, filters={"dangling": True}):
            if leftover.attrs.get("Parent") == base_id:  # the build's cached step before the failing RUN
                remove_image(client, leftover.id)
        remove_image(client, base)


@pytest.mark.docker
def test_a_missing_base_is_a_clear_error(sandbox_image):
    with pytest.raises(SandboxUnavailable, match="neither present nor pullable"):
        build_image(f"m3-agent-sandbox-test:{uuid.uuid4().hex[:8]}", base="m3-agent-no-such-base:nope")


@pytest.mark.docker
def test_a_missing_image_says_how_to_build_it(docker_ready):
    with pytest.raises(SandboxUnavailable, match="m3-agent sandbox build"):
        Sandbox(SandboxConfig(image="m3-agent-sandbox:does-not-exist")).start()


def test_no_engine_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    for call in (lambda: Sandbox().start(), build_image, prune):
        with pytest.raises(SandboxUnavailable, match="Docker engine unreachable.*start the Docker engine"):
            call()


def test_the_offline_path_needs_debootstrap(monkeypatch, docker_ready):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="install debootstrap"):
        _debootstrap_base(docker.from_env(), None)


@pytest.mark.docker
def test_cli_build_prints_the_tag(sandbox_image):
    result = CliRunner().invoke(app, ["build"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == DEFAULT_IMAGE


@pytest.mark.docker
def test_an_image_without_python_fails_to_start_with_the_reason(no_leftovers, client):
    tag = build_env_image(setup=["rm -f /usr/bin/python3*"], base=no_leftovers)
    try:
        with pytest.raises(SandboxUnavailable, match="did not come up.*python3: not found"):
            Sandbox(SandboxConfig(image=tag)).start()
    finally:
        remove_image(client, tag)


def test_image_builds_wait_for_each_other():
    import threading

    from m3_agent.sandbox.image import build_lock

    order: list[str] = []
    held = threading.Event()

    def first() -> None:
        with build_lock(None):
            held.set()
            time.sleep(0.3)
            order.append("first done")

    t = threading.Thread(target=first)
    t.start()
    held.wait(5)
    messages: list[str] = []
    with build_lock(messages.append):
        order.append("second in")
    t.join()
    assert order == ["first done", "second in"]
    assert messages == ["another process is building the image; waiting for it"]


def test_builds_of_different_environments_do_not_wait_for_each_other():
    """An environment build waits only for another build of the same key, not for another repository's
    environment (a 5-minute compiled build blocked every other one)."""
    import threading

    from m3_agent.sandbox.image import build_lock

    held, release = threading.Event(), threading.Event()

    def other() -> None:
        with build_lock(None, "other-key"):
            held.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    held.wait(5)
    messages: list[str] = []
    try:
        with build_lock(messages.append, "this-key"):
            assert messages == []  # in at once
    finally:
        release.set()
        t.join()


def _labelled_image(client, base: str, tag: str, labels: dict[str, str]) -> str:
    """A one-layer image on `base` with these labels (no network, nothing to download)."""
    image, _ = client.images.build(fileobj=io.BytesIO(f"FROM {base}\n".encode()), tag=tag, labels=labels, rm=True)
    return tag


@pytest.mark.docker
def test_prune_images_removes_older_recipes_and_keeps_the_current_and_the_used(sandbox_image, client):
    from m3_agent.sandbox.image import IMAGE_LABEL, prune_images

    suffix = uuid.uuid4().hex[:8]
    old = _labelled_image(client, sandbox_image, f"m3-agent-sandbox:old-{suffix}",
                          {IMAGE_LABEL: "sandbox", RECIPE_LABEL: "0" * 64})
    used = _labelled_image(client, sandbox_image, f"m3-agent-sandbox:used-{suffix}",
                           {IMAGE_LABEL: "sandbox", RECIPE_LABEL: "1" * 64})
    foreign = _labelled_image(client, sandbox_image, f"someone-else:{suffix}", {"m3-agent.image": "custom"})
    holder = client.containers.create(used, ["true"], network_mode="none")
    try:
        result = CliRunner().invoke(app, ["prune", "--images"])
        assert result.exit_code == 0, result.output
        assert old in result.stdout.split()
        assert not image_exists_tag(client, old)
        assert image_exists_tag(client, used)  # a container still uses it
        assert image_exists_tag(client, sandbox_image) and image_exists_tag(client, foreign)
        holder.remove()
        assert used in prune_images()
        assert not image_exists_tag(client, used)
    finally:
        try:
            holder.remove(force=True)
        except docker.errors.NotFound:
            pass
        for tag in (old, used, foreign):
            remove_image(client, tag)


def image_exists_tag(client, tag: str) -> bool:
    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False
