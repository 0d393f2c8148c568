"""SandboxConfig: hardened defaults and input validation."""

import subprocess
import sys

import pytest
from pydantic import ValidationError

from m3_agent.sandbox import DEFAULT_IMAGE, SandboxConfig


def test_defaults_are_the_hardened_ones():
    cfg = SandboxConfig()
    assert cfg.image == DEFAULT_IMAGE
    assert cfg.network == "none"
    assert cfg.user == "1000:1000"
    assert cfg.read_only is True
    assert cfg.mount == "copy"
    assert cfg.pids_limit <= 1024
    assert cfg.env == {}


@pytest.mark.parametrize("field,value", [("memory", "lots"), ("workspace_size", "-1g"), ("pids_limit", 0),
                                         ("cpus", 0), ("mount", "overlay"), ("output_limit", 10)])
def test_bad_values_are_rejected(field, value):
    with pytest.raises(ValidationError):
        SandboxConfig(**{field: value})


def test_unknown_fields_are_rejected():
    with pytest.raises(ValidationError):
        SandboxConfig(privileged=True)


def test_sizes_are_normalised():
    assert SandboxConfig(memory="512M").memory == "512m"


@pytest.mark.parametrize("user", ["0", "0:1000", "root", "1000:sandbox", ""])
def test_commands_never_run_as_root_and_the_user_is_numeric(user):
    with pytest.raises(ValidationError):
        SandboxConfig(user=user)
    assert SandboxConfig(user="1001").user == "1001" and SandboxConfig(user="1001:50").user == "1001:50"


@pytest.mark.docker
def test_a_runtime_the_engine_lacks_is_a_clear_sandbox_error(git_repo, sandbox_image):
    from m3_agent.errors import SandboxUnavailable
    from m3_agent.sandbox import Sandbox

    repo = git_repo({"a.py": "A = 1\n"})
    with pytest.raises(SandboxUnavailable, match="runtime.*runsc-missing"):
        with Sandbox(SandboxConfig(runtime="runsc-missing"), repo=repo):
            pass
    assert SandboxConfig().runtime is None  # the engine's default runtime unless asked


def test_the_settings_and_pack_load_no_docker_sdk(tmp_path):
    # `m3-agent pack` reads the settings, whose sandbox section must not pay for the Docker SDK's import.
    code = ("import sys; import m3_agent.settings, m3_agent.pack_cli; "
            "sys.exit(1 if 'docker' in sys.modules or 'm3_agent.sandbox.image' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=tmp_path).returncode == 0
